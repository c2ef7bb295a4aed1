"""Rollouts ahead of training: the batch flow of ``placement.mode=rollout_apart``.

The sampler ranks only sample and judge, the trainer ranks only train. With
``rollout.max_staleness = K`` the samplers make the batch of step ``s + K`` while the trainers
train step ``s``; with ``K = 0`` they make step ``s``'s batch first and the trainers wait for it
(synchronous). Every rank runs the same loop; per step (:meth:`RolloutsAhead.take`, collective
over the world):

1. every rank draws its prompts for each batch made in this step (``produced_through + 1 ..
   min(s + K, total)``: one batch, or ``K + 1`` at the first step of a fresh run) and routes them to
   the samplers, so the data is the same as in the colocated modes for the same seed;
2. the samplers make the batches needed now (``<= s``): generate, judge, score, refill (DAPO);
3. step ``s``'s scored groups move to the trainers that own them;
4. the samplers make the batches ahead (``> s``) while the trainers train (the loop goes on to
   training on trainer ranks, to the weight push on sampler ranks).

After training the trainers push the new weights (:mod:`yatt.placement.push`) and the samplers
load them: weights reach an engine only between generation calls, and a batch made with the
weights of step ``v`` (the policy after ``v`` updates) is trained at a step ``s`` with
``s - 1 - v <= K`` (its staleness, reported as ``staleness_mean`` / ``staleness_max``; a larger
one is an error). The batches not yet trained (the in-flight rollouts) are part of the
checkpoint (:meth:`state_dict`), so a resumed run trains exactly the samples it would have.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable

from yatt.placement.plan import Roles, route

log = logging.getLogger("yatt")


class RolloutsAhead:
    """The batches the samplers made and the trainers have not taken yet.

    Args:
        roles: a ``rollout_apart`` :class:`~yatt.placement.plan.Roles`. rank: this rank.
        max_staleness: ``K`` (``rollout.max_staleness``). total_steps: the run's last step (no batch
            is made past it).
    Attributes:
        produced_through: the last step whose batch was made (the same on every rank).
        version: samplers: the step whose weights their engine holds (0: the initial policy).
        queue: samplers: ``step -> (list of (SampleGroup, rewards), (sum, count) metrics)``.
    """

    def __init__(self, roles: Roles, rank: int, max_staleness: int, total_steps: int) -> None:
        self.roles, self.rank, self.k, self.total = roles, rank, max_staleness, total_steps
        self.produced_through, self.version = 0, 0
        self.queue: dict[int, tuple[list, dict]] = {}

    @property
    def samples(self) -> bool:
        return self.rank in self.roles.samplers

    def take(self, step: int, draw: Callable[[], list], produce: Callable[[int, list], tuple[list, list, dict]]
             ) -> tuple[list, list[list[float]], dict[str, tuple[float, float]]]:
        """Step ``step``'s groups on the trainers that own them (collective over the world).

        Args:
            step: the step being trained. draw: ``() -> rows``, this rank's next prompts (one call per
                batch made in this step). produce: samplers: ``(batch step, [(gid, origin, row)]) ->
                (groups, rewards, (sum, count) metrics)``, the scored batch of these prompts.
        Returns:
            (this rank's groups sorted by gid, their rewards, (sum, count) metrics): on trainers the
            groups they train and ``staleness_mean`` / ``staleness_max``; on samplers no groups and the
            metrics of the batch the step trains (reward, accuracy, lengths, judge counters), which
            describe the step's samples wherever they were made; ``idle_s`` on both.
        Raises:
            RuntimeError: a group older than ``max_staleness`` updates (a broken invariant).
        """
        todo = list(range(self.produced_through + 1, min(step + self.k, self.total) + 1))
        prompts = self._route_prompts(todo, draw)
        for b in (b for b in todo if b <= step and self.samples):
            self._make(b, prompts[b], produce)
        out, sums = defaultdict(list), {}
        if self.samples:
            made, sums = self.queue.pop(step)
            for group, rewards in made:
                out[group.owner].append((group, rewards))
        t0 = time.perf_counter()
        got = sorted(route(out, self.roles.world), key=lambda x: x[0].gid)
        sums = {**sums, "idle_s": (0.0 if self.samples else time.perf_counter() - t0, 1.0)}
        for b in (b for b in todo if b > step and self.samples):  # while the trainers train
            self._make(b, prompts[b], produce)
        self.produced_through = todo[-1] if todo else self.produced_through
        if got:
            stale = [step - 1 - g.version for g, _ in got]
            if max(stale) > self.k or min(stale) < 0:
                raise RuntimeError(f"step {step}: samples of policy versions {sorted({g.version for g, _ in got})} "
                                   f"break rollout.max_staleness={self.k}")
            sums.update(staleness_mean=(float(sum(stale)), float(len(stale))), staleness_max=(float(max(stale)), 1.0))
        return [g for g, _ in got], [r for _, r in got], sums

    def _route_prompts(self, todo: list[int], draw) -> dict[int, list]:
        """Every rank's prompts of the batches ``todo`` on the samplers that roll them out: ``step ->
        [(gid, origin, row)]`` (empty on trainers)."""
        outgoing = defaultdict(list)
        for b in todo:
            rows = draw()
            for i, row in enumerate(rows):
                gid = self.rank * len(rows) + i
                outgoing[self.roles.sampler_of(gid)].append((b, gid, self.rank, row))
        mine = defaultdict(list)
        for b, gid, origin, row in route(outgoing, self.roles.world):
            mine[b].append((gid, origin, row))
        return mine

    def _make(self, b: int, prompts: list, produce) -> None:
        groups, rewards, sums = produce(b, prompts)
        for g in groups:
            g.version = self.version
        self.queue[b] = (list(zip(groups, rewards)), sums)

    def state_dict(self) -> dict:
        """The in-flight rollouts (samplers) and the batch count (every rank), for checkpoints."""
        return {"produced_through": self.produced_through, "version": self.version, "queue": self.queue}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (collective: every rank, at the same point of the resume);
        rank 0 logs the in-flight batches the samplers got back and the policies that made them."""
        import torch.distributed as dist

        self.produced_through, self.version, self.queue = state["produced_through"], state["version"], state["queue"]
        first = self.roles.samplers[0]
        box = [(sorted(self.queue), sorted({g.version for made, _ in self.queue.values() for g, _ in made}))
               if self.rank == first else None]
        dist.broadcast_object_list(box, src=first)
        steps, versions = box[0]
        if self.rank == 0 and steps:
            log.info("resume: %d in-flight batch(es) (steps %s, made by the policy of step(s) %s) restored from the "
                     "checkpoint; they are trained as they would have been", len(steps), steps, versions)
