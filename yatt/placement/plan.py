"""Placement as a plan: which rank groups run which phase of a step.

=================  ==========================  ======================  ==================
mode               rollout + GenRM phase       logprob + train         weight sync
=================  ==========================  ======================  ==================
colocate           all ranks, one after other  all ranks               all ranks
partial_colocate   samplers || GenRM ranks     all ranks               samplers (rebuild)
disaggregated      samplers || GenRM ranks     samplers (= trainers)   samplers
rollout_apart      samplers (they judge too)   trainers                trainers -> samplers
=================  ==========================  ======================  ==================

``||``: at the same time, finished groups streamed (see :mod:`yatt.placement.stream`).
GenRM ranks are the last ``k`` ranks of the world. With ``rollout_apart`` the last ``k`` ranks
only sample and judge and the others only train, at the same time when ``rollout.max_staleness``
lets the samplers run ahead (:mod:`yatt.placement.ahead`). Every rank draws its own prompts in every
mode (the same data for the same seed); :func:`route` moves them to the samplers and the
scored groups to the ranks that train on them.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("colocate", "partial_colocate", "disaggregated", "rollout_apart")


@dataclass(frozen=True)
class Roles:
    """Rank groups of one step. ``samplers``/``judges``/``trainers``: sorted world ranks."""

    mode: str
    world: int
    samplers: tuple[int, ...]
    judges: tuple[int, ...]
    trainers: tuple[int, ...]

    @property
    def split(self) -> bool:
        """True when samplers and GenRM ranks are disjoint groups working at the same time."""
        return self.mode in ("partial_colocate", "disaggregated")

    @property
    def apart(self) -> bool:
        """True when the samplers do not train (``rollout_apart``): batches move from one group to the
        other and the trainers push their weights to the samplers."""
        return self.mode == "rollout_apart"

    def sampler_of(self, gid: int) -> int:
        """The sampler rank that rolls out global prompt ``gid`` (round robin)."""
        return self.samplers[gid % len(self.samplers)]

    def owner_of(self, gid: int, origin: int) -> int:
        """The rank that trains on prompt ``gid`` drawn by ``origin``: itself if it trains."""
        return origin if origin in self.trainers else self.trainers[gid % len(self.trainers)]

    def describe(self) -> str:
        return (f"placement {self.mode}: samplers {list(self.samplers)}, GenRM {list(self.judges)}, "
                f"trainers {list(self.trainers)}")


def plan_roles(mode: str, world: int, genrm_ranks: int = 1, rollout_ranks: int = 1) -> Roles:
    """Rank groups for ``mode`` on ``world`` ranks with ``genrm_ranks`` GenRM ranks (split modes)
    or ``rollout_ranks`` sampler ranks (``rollout_apart``).

    Raises:
        ValueError: unknown mode, or a split mode with ``genrm_ranks`` (``rollout_apart``:
            ``rollout_ranks``) outside ``[1, world - 1]``.
    """
    everyone = tuple(range(world))
    if mode == "colocate":
        return Roles(mode, world, everyone, everyone, everyone)
    if mode not in MODES:
        raise ValueError(f"placement.mode must be one of {MODES}, got {mode!r}")
    if mode == "rollout_apart":
        if not 1 <= rollout_ranks <= world - 1:
            raise ValueError(f"placement.mode=rollout_apart needs 1 <= placement.rollout_ranks <= world - 1 = "
                             f"{world - 1}, got {rollout_ranks}")
        cut = world - rollout_ranks  # trainers first: rank 0 trains and writes the step records
        return Roles(mode, world, everyone[cut:], everyone[cut:], everyone[:cut])
    if not 1 <= genrm_ranks <= world - 1:
        raise ValueError(f"placement.mode={mode} needs 1 <= placement.genrm_ranks <= world - 1 = {world - 1}, "
                         f"got {genrm_ranks}")
    samplers, judges = everyone[: world - genrm_ranks], everyone[world - genrm_ranks:]
    return Roles(mode, world, samplers, judges, everyone if mode == "partial_colocate" else samplers)


def route(outgoing: dict[int, list], world: int, comm=None) -> list:
    """All-to-all of picklable items: ``outgoing[dest]`` go to rank ``dest``.

    Collective over ``comm`` (default MPI ``COMM_WORLD``). Returns the items this rank
    received, ordered by source rank, each source's items in the order sent.
    """
    if world == 1:
        return list(outgoing.get(0, []))
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    received = comm.alltoall([outgoing.get(dest, []) for dest in range(world)])
    return [item for part in received for item in part]
