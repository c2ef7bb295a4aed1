"""This rank's part of the placement plan: engine lifetimes and the rollout + GenRM phase.

The step loop calls, per step, :meth:`Placement.rollout_and_score` (returns the sample groups
this rank trains on) and, after training, :meth:`Placement.sync`. Which engines live when:

- ``colocate``: the rollout engine lives on every rank; with a GenRM reward it is shut down
  while the judge engine runs and rebuilt before the weight push (CPU has no vLLM sleep mode;
  on GPU the same points would be ``sleep``/``wake_up``).
- ``partial_colocate``: at the start of each rollout phase samplers build the rollout engine
  (and get the current weights) while GenRM ranks build the judge; both are shut down before
  training, which owns all ranks.
- ``disaggregated``: samplers keep the rollout engine and GenRM ranks the judge for the run.

Engine construction and shutdown are collective (see :mod:`yatt.rollout.vllm_engine`), so
every rank builds or shuts down *some* engine at the same points.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

from yatt.placement.plan import Roles, plan_roles, route
from yatt.placement.search import SplitSearch
from yatt.placement.stream import StreamReceiver, StreamSender


@dataclass
class SampleGroup:
    """The ``n`` responses to one prompt, on their way from sampler to GenRM rank to trainer.

    gid: global prompt index of the step (``origin * prompts_per_rank + i``). origin: the rank
    that drew the prompt; owner: the rank that trains on it. texts: decoded responses.
    genrm: per-response judge scores in [0, 1] once judged (None before, or without GenRM);
    unparsable / timed_out: judgements of this group counted as such.
    """

    gid: int
    origin: int
    owner: int
    row: object  # yatt.assets.data.PromptRow
    completions: list
    texts: list[str]
    genrm: list[float] | None = None
    unparsable: int = 0
    timed_out: int = 0

    @property
    def tokens(self) -> int:
        """Judge-load proxy: prompt tokens once per response plus the response tokens."""
        return sum(len(self.row.prompt_ids) + len(c.token_ids) for c in self.completions)


class Placement:
    """Engines and rank groups of this rank for ``cfg.placement``.

    Args:
        cfg: the full config. rank, world: this rank and the world size.
        build_rollout: ``() -> VLLMEngine`` of the policy (collective, see module docstring).
        scorer: :class:`~yatt.reward.scorer.StepScorer` (its ``make_judge`` builds the judge).
        decode: ``token_ids -> str`` of the policy tokenizer.
    Raises:
        ValueError: a split mode without a GenRM reward, or a bad ``genrm_ranks``.
    """

    def __init__(self, cfg, rank: int, world: int, build_rollout, scorer, decode) -> None:
        p = cfg.placement
        if p.mode != "colocate" and not scorer.uses_genrm:
            raise ValueError(f"placement.mode={p.mode} needs a GenRM reward (reward.type is {cfg.reward.type!r})")
        self.cfg, self.rank, self.world = cfg, rank, world
        self.build_rollout, self.scorer, self.decode = build_rollout, scorer, decode
        self.search = SplitSearch(1, world - 1, repeats=p.auto_repeats) if p.genrm_ranks == "auto" else None
        self.roles = plan_roles(p.mode, world, self.search.next() if self.search else p.genrm_ranks)
        self.engine = None  # this rank's rollout engine
        self.judge = None  # this rank's GenRMJudge (holds the judge engine)
        self.train_group = None  # None: Megatron's data-parallel group (every rank trains)
        if p.mode == "disaggregated":
            import torch.distributed as dist

            self.train_group = dist.new_group(list(self.roles.trainers))  # collective
        self._comms: tuple | None = None  # (roles, local comm, intercomm) of the current split

    @property
    def trains(self) -> bool:
        return self.rank in self.roles.trainers

    @property
    def eval_ranks(self) -> tuple[int, ...]:
        """Ranks that hold a rollout engine at evaluation time (they share the eval set)."""
        return self.roles.samplers if self.roles.mode == "disaggregated" else tuple(range(self.world))

    def start(self) -> None:
        """Build the engines that live across steps (collective)."""
        if self.roles.mode == "colocate":
            self.engine = self.build_rollout()
        elif self.roles.mode == "disaggregated":
            self._build_split_engines(seed=self.cfg.seed)

    def close(self) -> None:
        for engine in (self.engine, self.judge.engine if self.judge else None):
            if engine is not None:
                engine.shutdown()
        self.engine = self.judge = None

    # ------------------------------------------------------------------ the rollout + GenRM phase
    def rollout_and_score(self, rows: list, spec, actor, timer) -> tuple[list[SampleGroup], dict]:
        """Roll out this step's prompts, judge them, and return the groups this rank trains on.

        Args:
            rows: the prompts this rank drew (``prompts_per_rank``). spec: SamplingSpec with the
                step seed. actor: this rank's MegatronPolicy (partial_colocate pushes its
                weights into the freshly built engine), or None. timer: the step's PhaseTimer.
        Returns:
            (groups sorted by ``gid``, (sum, count) metric pairs: idle time ``idle_s`` and, on
            GenRM ranks of a split mode, the queue metrics ``genrm_queue_*``).
        """
        gids = [self.rank * len(rows) + i for i in range(len(rows))]
        if not self.roles.split:
            return self._colocated(rows, gids, spec, timer), {"idle_s": (0.0, 1.0)}
        if self.roles.mode == "partial_colocate":
            with timer("engines"):
                self._build_split_engines(seed=spec.seed)
            with timer("sync"):  # every rank trains here, so every rank has the new weights
                self._push(actor)
        with timer("rollout_genrm"):
            groups, sums = self._streamed(rows, gids, spec, timer)
        if self.roles.mode == "partial_colocate":  # training owns every rank
            with timer("engines"):
                self.close()
        return sorted(groups, key=lambda g: g.gid), sums

    def _colocated(self, rows, gids, spec, timer) -> list[SampleGroup]:
        with timer("rollout"):
            completions = self.engine.generate([r.prompt_ids for r in rows], spec)
        groups = [SampleGroup(gid, self.rank, self.rank, row, comps, [self.decode(c.token_ids) for c in comps])
                  for gid, row, comps in zip(gids, rows, completions)]
        if self.scorer.uses_genrm:  # the rollout engine gives its memory to the judge
            with timer("engines"):
                self.engine.shutdown()
                self.engine = None
                self.judge = self.scorer.make_judge(seed=spec.seed)
            with timer("genrm"):
                self.scorer.judge_groups(self.judge, groups)
            with timer("engines"):
                self.judge.engine.shutdown()
                self.judge = None
        timer.times["time_rollout_genrm_s"] = timer.times["time_rollout_s"] + timer.times.get("time_genrm_s", 0.0)
        return groups

    def _streamed(self, rows, gids, spec, timer) -> tuple[list[SampleGroup], dict]:
        roles = self.roles
        outgoing = defaultdict(list)
        for gid, row in zip(gids, rows):
            outgoing[roles.sampler_of(gid)].append((gid, self.rank, row))
        mine = route(outgoing, self.world)  # the prompts this rank rolls out (none on GenRM ranks)
        inter = self.intercomm()
        idle, sums, scored = 0.0, {}, []
        if self.rank in roles.samplers:
            sender = StreamSender(inter)
            with timer("rollout"):
                for i, comps in self.engine.generate_stream([r.prompt_ids for _, _, r in mine], spec):
                    gid, origin, row = mine[i]
                    group = SampleGroup(gid, origin, roles.owner_of(gid, origin), row, comps,
                                        [self.decode(c.token_ids) for c in comps])
                    sender.send(group, group.tokens)
            idle += sender.close()
        else:
            receiver = StreamReceiver(inter, tokens_of=lambda g: g.tokens)
            for batch in receiver:
                with timer("genrm"):
                    self.scorer.judge_groups(self.judge, batch)
                receiver.scored(batch)
                scored.extend(batch)
            q = receiver.stats
            idle += q.idle_s
            sums = {"genrm_queue_tokens_max": (q.max_tokens, 1.0), "genrm_queue_groups_max": (q.max_groups, 1.0),
                    "genrm_queue_tokens_mean": (sum(q.samples), len(q.samples))}
        t0 = time.perf_counter()
        back = defaultdict(list)
        for g in scored:
            back[g.owner].append(g)
        groups = route(back, self.world)  # every scored group to the rank that trains on it
        sums["idle_s"] = (idle + time.perf_counter() - t0, 1.0)
        return groups, sums

    # ------------------------------------------------------------------ weights and engines
    def sync(self, actor, timer) -> None:
        """After training: new weights into the rollout engines that outlive the step."""
        if self.roles.mode == "colocate":
            if self.engine is None:
                with timer("engines"):
                    self.engine = self.build_rollout()
            with timer("sync"):
                self._push(actor)
        elif self.roles.mode == "disaggregated" and self.trains:
            with timer("sync"):
                self._push(actor)

    def end_step(self, record: dict) -> None:
        """Feed the step's (globally reduced) rollout + GenRM time to the split search."""
        if self.search is None:
            return
        self.search.record(len(self.roles.judges), record["time_rollout_genrm_s"])
        k = self.search.next()
        if k != len(self.roles.judges):
            self.roles = plan_roles(self.roles.mode, self.world, k)

    @contextlib.contextmanager
    def eval_engine(self, actor):
        """A rollout engine with the current weights on ``eval_ranks`` (None elsewhere)."""
        if self.roles.mode != "partial_colocate":
            yield self.engine
            return
        self.engine = self.build_rollout()  # collective: every rank evaluates its share
        try:
            self._push(actor)
            yield self.engine
        finally:
            self.engine.shutdown()
            self.engine = None

    def _push(self, actor) -> None:
        weights = actor.export_hf_weights()  # collective over TP: every trainer consumes it
        if self.engine is not None:
            self.engine.update_weights(weights)
        else:
            for _ in weights:
                pass

    def _build_split_engines(self, seed: int) -> None:
        if self.rank in self.roles.samplers:
            self.engine = self.build_rollout()
        else:
            self.judge = self.scorer.make_judge(seed=seed)

    def intercomm(self):
        """Sampler/GenRM communicators of the current split (``MPI_Comm_split`` + intercomm)."""
        from mpi4py import MPI

        if self._comms is None or self._comms[0] != self.roles:
            if self._comms is not None:
                self._comms[2].Free()
                self._comms[1].Free()
            world, sampler = MPI.COMM_WORLD, self.rank in self.roles.samplers
            local = world.Split(color=0 if sampler else 1, key=self.rank)
            leader = self.roles.judges[0] if sampler else self.roles.samplers[0]
            self._comms = (self.roles, local, local.Create_intercomm(0, world, leader, tag=7101))
        return self._comms[2]


def roles_for(cfg, world: int) -> Roles:
    """The first step's roles of ``cfg.placement`` (for checks before any model loads)."""
    p = cfg.placement
    return plan_roles(p.mode, world, 1 if p.genrm_ranks == "auto" else p.genrm_ranks)
