"""This rank's part of the placement plan: engine lifetimes and the rollout + GenRM phase.

The step loop calls, per step, :meth:`Placement.rollout_and_score` (returns the sample groups
this rank trains on) and, after training, :meth:`Placement.sync`; each returns the phase times it
measured, which the loop adds to the step's, and :meth:`Placement.end_step` takes the step's
reduced rollout + GenRM time for the split search. Which engines live when:

- ``colocate``: with a GenRM reward the rollout engine is released while the judge runs, the
  judge is released before training, and the rollout engine comes back for the weight push.
- ``partial_colocate``: at the start of each rollout phase samplers wake the rollout engine
  (and get the current weights) while GenRM ranks wake the judge; both are released before
  training, which owns all ranks.
- ``disaggregated``: samplers keep the rollout engine and GenRM ranks the judge for the run.
- ``rollout_apart``: samplers keep the rollout engine and the judge for the run, and take the
  trainers' weights after every step (:mod:`yatt.placement.ahead`, :mod:`yatt.placement.push`).
  With ``placement.trainer_judge_share`` the trainers keep a judge too and judge that share of
  each batch's groups (the samplers leave them unjudged) before their logprobs.

On CPU (``placement.keep_engines``) colocated engines stay resident instead of being released
when memory allows: ``auto`` decides after the first step, which releases and measures
(:mod:`yatt.placement.residency`); the choice is logged and reported as ``engines_resident``.
Builds and teardowns stay collective: they happen at the same points on every rank (with
partial colocation every rank holds its role's engine, and a new split or an evaluation
releases them all first).

"Release" and "wake" are :class:`~yatt.placement.slots.EngineSlot` calls: vLLM sleep mode on
GPU (then every rank builds all the engines it may need once, at start: building is
collective), engine teardown and rebuild on CPU, at the same points on every rank. On GPU the
rollout engine also sleeps while its rank trains.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from yatt.controller.metrics import PhaseTimer
from yatt.placement.ahead import RolloutsAhead
from yatt.placement.plan import Roles, plan_roles, route
from yatt.placement.push import WeightInbox, pairs_of, send_weights
from yatt.placement.residency import RESERVE_FRACTION, engines_fit, gather_reports
from yatt.placement.search import SplitSearch
from yatt.placement.slots import EngineSlot
from yatt.placement.stream import StreamReceiver, StreamSender
from yatt.rollout.episodes import answer_ids, make_generate

log = logging.getLogger("yatt")


@dataclass
class SampleGroup:
    """The ``n`` responses to one prompt, on their way from sampler to GenRM rank to trainer.

    gid: global prompt index of the step (``origin * prompts_per_rank + i``). origin: the rank
    that drew the prompt; owner: the rank that trains on it. texts: decoded responses (of an
    episode, its last model turn).
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
    version: int = 0  # rollout_apart: the step whose weights generated it (0: the initial policy)

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
        gpu: release engines by vLLM sleep mode (default: when CUDA is available); False: by
            teardown and rebuild (CPU).
        policy_path: the policy's local folder (``rollout_apart`` trainers join the process groups
            its engine creates on the samplers, :func:`~yatt.rollout.vllm_engine.join_engine_groups`).
        generate: ``(engine, rows, spec) -> out[i][k]`` Completions
            (:func:`yatt.rollout.episodes.make_generate`; default: one response per sample).
    Raises:
        ValueError: a split mode without a GenRM reward, or a bad ``genrm_ranks``.
    """

    def __init__(self, cfg, rank: int, world: int, build_rollout, scorer, decode, gpu: bool | None = None,
                 policy_path=None, generate=None) -> None:
        p = cfg.placement
        if p.mode in ("partial_colocate", "disaggregated") and not scorer.uses_judge:
            raise ValueError(f"placement.mode={p.mode} needs a judge (a genrm or reward_model reward source)")
        self.cfg, self.rank, self.world = cfg, rank, world
        self.scorer, self.decode = scorer, decode
        # (engine, rows, spec) -> completions per row: one response, or multi-turn episodes (rollout.env)
        self.generate = generate or make_generate(None, None)
        self.policy_path = policy_path  # the rollout engine's model (rollout_apart trainers join its groups)
        self.search = SplitSearch(1, world - 1, repeats=p.auto_repeats) if p.genrm_ranks == "auto" else None
        self.roles = plan_roles(p.mode, world, self.search.next() if self.search else p.genrm_ranks, p.rollout_ranks)
        if gpu is None:
            import torch

            gpu = torch.cuda.is_available()
        self.gpu = gpu  # engines sleep instead of being torn down
        self.rollout = EngineSlot(build_rollout)  # this rank's policy engine
        judge_seed = cfg.seed * 7919 + rank
        # GenRMJudge + its engine; colocated (rollout.tp > 1 is colocate only) on the rollout engine's ranks
        self.judge = EngineSlot(lambda: scorer.make_judge(seed=judge_seed, tp=cfg.rollout.tp))
        # keep released engines resident (CPU): True, False, or None = decide after the first step
        self.keep = False if gpu else {"always": True, "never": False, "auto": None}[p.keep_engines]
        self.train_group = None  # None: Megatron's data-parallel group (every rank trains)
        self.sampler_group = None  # rollout_apart: the samplers (dynamic sampling agrees over them)
        if p.mode in ("disaggregated", "rollout_apart"):
            import torch.distributed as dist

            self.train_group = dist.new_group(list(self.roles.trainers))  # collective
            if self.roles.apart:
                self.sampler_group = dist.new_group(list(self.roles.samplers))
        self.ahead = (RolloutsAhead(self.roles, rank, cfg.rollout.max_staleness, cfg.trainer.total_steps)
                      if self.roles.apart else None)
        # rollout_apart: the share of each batch's groups the trainers judge (the samplers judge the rest)
        self.judge_share = p.trainer_judge_share if self.roles.apart and scorer.uses_judge else 0.0
        self.idle_s = 0.0  # this step's waits for the other group outside the step's phases (pop_idle)
        self._comms: tuple | None = None  # (roles, local comm, intercomm) of the current split

    @property
    def trains(self) -> bool:
        return self.rank in self.roles.trainers

    @property
    def eval_ranks(self) -> tuple[int, ...]:
        """Ranks that hold a rollout engine at evaluation time (they share the eval set)."""
        return self.roles.samplers if self.roles.mode in ("disaggregated", "rollout_apart") else tuple(range(self.world))

    def start(self) -> None:
        """Build the engines this rank needs at the start (collective)."""
        mode, uses_judge = self.roles.mode, self.scorer.uses_judge
        if mode == "disaggregated":  # one engine per rank, for the whole run
            (self.rollout if self.rank in self.roles.samplers else self.judge).build_now()
            return
        if mode == "rollout_apart":  # samplers hold both engines for the run; trainers none
            if not self.trains:
                self.rollout.build_now()
                if uses_judge:
                    self.judge.build_now()
            else:
                from yatt.rollout.vllm_engine import join_engine_groups

                join_engine_groups(self.policy_path)  # the samplers' first build: process groups over the world
                if self.judge_share:
                    self.judge.build_now()  # while the samplers build theirs
            return
        if self.gpu:  # every engine this rank may need, once; slept until its phase
            self.rollout.build_now()
            if uses_judge:
                self.judge.build_now()
                self.judge.sleep()
            if mode == "partial_colocate":
                self.rollout.sleep()
        elif mode == "colocate":
            self.rollout.build_now()

    def state_dict(self) -> dict:
        """The split search and current split (``genrm_ranks: auto``) and the in-flight rollouts
        (``rollout_apart``), for checkpoints."""
        return {"search": self.search, "roles": self.roles,
                **({"ahead": self.ahead.state_dict()} if self.ahead is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.search, self.roles = state["search"], state["roles"]
        if self.ahead is not None:
            self.ahead.load_state_dict(state["ahead"])

    def close(self) -> None:
        self.rollout.close()
        self.judge.close()
        if self.roles.apart and self.trains:  # the samplers' closes destroyed vLLM's groups there
            from yatt.rollout.vllm_engine import leave_engine_groups

            leave_engine_groups()

    @property
    def releases(self) -> bool:
        """This placement releases engines between phases on CPU (what residency would save)."""
        return not self.gpu and (self.roles.mode == "partial_colocate"
                                 or (self.roles.mode == "colocate" and self.scorer.uses_judge))

    def released_bytes(self) -> int:
        """Resident memory (bytes, as measured at their builds) of the engines this rank would keep
        but has released right now: what keeping them would add at this moment."""
        if self.keep is not None or not self.releases:
            return 0
        kept = (self.rollout, self.judge) if self.roles.mode == "colocate" else (
            self.rollout if self.rank in self.roles.samplers else self.judge,)
        return sum(slot.built_bytes for slot in kept if not slot.awake)

    def _release(self, *slots: EngineSlot) -> None:
        """Release ``slots`` for the next phase, unless engines stay resident."""
        if not self.keep:
            for slot in slots:
                slot.sleep()

    def _release_all(self) -> None:
        """Tear down every resident engine (collective: with partial colocation each rank holds one)."""
        if self.keep:
            self.rollout.sleep()
            self.judge.sleep()

    # ------------------------------------------------------------------ the rollout + GenRM phase
    def rollout_and_score(self, rows: list, spec, actor, on_phase=None) -> tuple[list[SampleGroup], dict, PhaseTimer]:
        """Roll out this step's prompts, judge them, and return the groups this rank trains on.

        Args:
            rows: the prompts this rank drew (``prompts_per_rank``). spec: SamplingSpec with the
                step seed. actor: this rank's MegatronPolicy (partial_colocate pushes its
                weights into the freshly built engine), or None. on_phase: called with each
                phase's name as it starts (the watchdog's current phase), or None.
        Returns:
            (groups sorted by ``gid``, (sum, count) metric pairs: idle time ``idle_s`` and, on
            GenRM ranks of a split mode, the queue metrics ``genrm_queue_*``; what it measured:
            a :class:`PhaseTimer` of the phases rollout, genrm, rollout_genrm, engines, sync).
        """
        timer = PhaseTimer(on_enter=on_phase, released_bytes=self.released_bytes)
        gids = [self.rank * len(rows) + i for i in range(len(rows))]
        resident = {"engines_resident": (float(bool(self.keep)), 1.0)} if self.releases else {}
        if not self.roles.split:
            groups = self._colocated(rows, gids, spec, timer)
            if self.gpu:
                with timer("engines"):
                    self.rollout.sleep()
            return groups, {"idle_s": (0.0, 1.0), **resident}, timer
        if self.roles.mode == "partial_colocate":
            with timer("engines"):  # CPU: samplers build the policy engine while GenRM ranks build the judge
                (self.rollout if self.rank in self.roles.samplers else self.judge).wake()
            with timer("sync"):  # every rank trains here, so every rank has the new weights
                self._push(actor)
        with timer("rollout_genrm"):
            groups, sums = self._streamed(rows, gids, spec, timer)
        with timer("engines"):  # training owns the memory
            if self.roles.mode == "partial_colocate":
                self._release(self.rollout, self.judge)
            elif self.gpu and self.trains:
                self.rollout.sleep()
        return sorted(groups, key=lambda g: g.gid), {**sums, **resident}, timer

    def _colocated(self, rows, gids, spec, timer) -> list[SampleGroup]:
        with timer("rollout"):
            completions = self.generate(self.rollout.wake(), rows, spec)
        groups = [self._group(gid, self.rank, self.rank, row, comps) for gid, row, comps in zip(gids, rows, completions)]
        if self.scorer.uses_judge:  # the rollout engine gives its memory to the judge
            with timer("engines"):
                self._release(self.rollout)
                self.judge.wake()
            self.judge_here(groups, spec.seed, timer)
            with timer("engines"):
                self._release(self.judge)
        timer.times["time_rollout_genrm_s"] = timer.times["time_rollout_s"] + timer.times.get("time_genrm_s", 0.0)
        return groups

    def sample_here(self, prompts: list, spec, timer: PhaseTimer) -> tuple[list[SampleGroup], int]:
        """``rollout_apart`` samplers: roll out ``prompts`` (``(gid, origin, row)``) on this rank's
        engine and, with a judge reward, judge them here, all but the last ``trainer_judge_share``
        of them (their ``genrm`` stays None: their trainers judge them, :meth:`judge_here`).

        Returns:
            (groups in the order given, each owned by the trainer that trains on it; how many of the
            first ones are ready to score here: all of them without a judge).
        """
        with timer("rollout"):
            completions = self.generate(self.rollout.engine, [r for _, _, r in prompts], spec)
        groups = [self._group(gid, origin, self.roles.owner_of(gid, origin), row, comps)
                  for (gid, origin, row), comps in zip(prompts, completions)]
        here = len(groups) - round(self.judge_share * len(groups))
        if self.scorer.uses_judge and here:
            self.judge_here(groups[:here], spec.seed, timer)
        return groups, here

    def judge_here(self, groups: list[SampleGroup], seed: int, timer: PhaseTimer) -> None:
        """Judge ``groups`` on this rank's (awake) judge, seeded with ``seed``, timed as phase
        genrm; ``rollout_apart`` trainers call it on the groups the samplers left unjudged
        (``trainer_judge_share``)."""
        judge = self.judge.obj
        judge.seed = seed
        with timer("genrm"):
            self.scorer.judge_groups(judge, groups)

    def _group(self, gid: int, origin: int, owner: int, row, completions) -> SampleGroup:
        return SampleGroup(gid, origin, owner, row, completions, [self.decode(answer_ids(c)) for c in completions])

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
                rows_here = [r for _, _, r in mine]
                stream = (self.rollout.engine.generate_stream([r.prompt_ids for r in rows_here], spec)
                          if self.cfg.rollout.env is None else  # episodes: every group at the end
                          enumerate(self.generate(self.rollout.engine, rows_here, spec)))
                for i, comps in stream:
                    gid, origin, row = mine[i]
                    group = self._group(gid, origin, roles.owner_of(gid, origin), row, comps)
                    sender.send(group, group.tokens)
            idle += sender.close()
        else:
            receiver = StreamReceiver(inter, tokens_of=lambda g: g.tokens)
            for batch in receiver:
                self.judge_here(batch, spec.seed, timer)
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
    def sync(self, actor, on_phase=None, version: int = 0) -> PhaseTimer:
        """After training: the new weights into the rollout engines that serve the next step
        (partial_colocate pushes at the next phase start instead, into freshly woken engines;
        rollout_apart: from the trainers to the samplers, whose engines then hold the weights of
        step ``version``). Returns what it measured (phases engines and sync; ``on_phase`` as in
        :meth:`rollout_and_score`)."""
        timer = PhaseTimer(on_enter=on_phase, released_bytes=self.released_bytes)
        if self.roles.apart:
            self._push_apart(actor, timer, version)
            return timer
        if self.roles.mode == "partial_colocate" or not self.trains or actor is None:  # None: no policy (stage rm)
            return timer
        with timer("engines"):  # CPU colocated GenRM: rebuilt here; GPU: woken
            self.rollout.wake()
        with timer("sync"):
            self._push(actor)
        return timer

    def end_step(self, rollout_genrm_s: float, avail_min: float = float("inf")) -> None:
        """Feed the step's rollout + GenRM time (reduced over the ranks: the slowest's) to the split
        search and, after the first step of ``keep_engines: auto``, decide whether engines stay
        resident from ``avail_min``: the machine's lowest available memory (bytes) over the step
        as this rank saw it, less its own released engines at each moment (:meth:`released_bytes`,
        sampled by the step's timers). Collective."""
        if self.keep is None and self.releases:
            engines = self.rollout.built_bytes + self.judge.built_bytes  # what it built (at most what it keeps)
            self.keep, account = engines_fit(gather_reports(engines, avail_min))
            log.info("placement: engines %s (%s; %d%% kept free)",
                     "stay resident from the next step" if self.keep else "are released between phases",
                     account, round(100 * RESERVE_FRACTION))
        if self.search is None:
            return
        self.search.record(len(self.roles.judges), rollout_genrm_s)
        k = self.search.next()
        if k != len(self.roles.judges):
            self._release_all()  # each rank builds its new role's engine at the next phase start
            self.roles = plan_roles(self.roles.mode, self.world, k)

    @contextlib.contextmanager
    def eval_engine(self, actor):
        """A rollout engine with the current weights on ``eval_ranks`` (None elsewhere)."""
        if self.roles.mode != "partial_colocate":
            yield self.rollout.engine if self.rollout.awake else None
            return
        self._release_all()  # then every rank builds the same engine here
        self.rollout.wake()  # every rank evaluates its share (CPU: a collective build)
        try:
            self._push(actor)
            yield self.rollout.engine
        finally:
            self.rollout.sleep()

    def _push(self, actor) -> None:
        bucket = int(self.cfg.trainer.sync_bucket_mb * (1 << 20))
        # rollout TP k: each rank's own shard of the engine (TP rank r % k), written from the trainer layout
        shard = (self.cfg.rollout.tp, self.rank % self.cfg.rollout.tp)
        weights = actor.export_hf_weights(bucket, shard=shard)  # collective over TP: every trainer consumes it
        if self.rollout.awake:
            self.rollout.engine.update_weights(weights, shards=True)
        else:
            for _ in weights:
                pass

    def _push_apart(self, actor, timer: PhaseTimer, version: int) -> None:
        """``rollout_apart``: trainers send their weights to their samplers (:mod:`yatt.placement.push`);
        a sampler waits for the push (idle time), then loads it bucket by bucket as it arrives."""
        dests, source = pairs_of(self.roles, self.rank)
        bucket = int(self.cfg.trainer.sync_bucket_mb * (1 << 20))
        if self.trains:
            with timer("sync"):
                _, waited = send_weights(actor.export_hf_weights(bucket), dests, bucket)
            timer.times["time_sync_s"] -= waited  # the wait for the samplers to finish sampling is idle
            self.idle_s += waited
            return
        inbox = WeightInbox(source)
        inbox.wait()
        self.idle_s += inbox.wait_s
        with timer("sync"):
            self.rollout.engine.update_weights(inbox)
        self.ahead.version = version

    def pop_idle(self) -> float:
        """Seconds this rank waited for the other group since the last call (outside the phases)."""
        idle, self.idle_s = self.idle_s, 0.0
        return idle

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
    return plan_roles(p.mode, world, 1 if p.genrm_ranks == "auto" else p.genrm_ranks, p.rollout_ranks)
