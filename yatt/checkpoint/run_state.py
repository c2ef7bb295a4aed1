"""The step loop's checkpoints: what a rank saves, resuming from it, save points, rollback.

A checkpoint holds everything that makes step ``k + 1`` of a resumed run equal to step
``k + 1`` of an uninterrupted one: the policy shard (model, optimizer, LR scheduler) and the
critic's when PPO trains one (files keyed by role), every
rank's RNG states (Python, NumPy, torch, CUDA), its controller shard's data position and
bad-row counters, the stability guard's history, the dynamic sampler's counter and the
placement's split search. Rollout seeds are derived from (seed, step, rank, round), so they
need no state. The frozen reference model is not saved: it is rebuilt from the base model.

A checkpoint also resumes on another number of ranks (another DP size; :meth:`RunCheckpoints.resume`):
the data shards continue through :func:`~yatt.controller.shard.resharded_state` and the per-rank
states are dealt to the new ranks. With the same TP and PP the model and optimizer files (per TP x
PP shard) load as they are; with another TP or PP each rank rebuilds its shards from them
(:mod:`yatt.checkpoint.relayout`).
"""
from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from yatt.checkpoint import files
from yatt.checkpoint.saver import Checkpointer, CheckpointWriteError, load_part
from yatt.checkpoint.triggers import SaveTriggers

log = logging.getLogger("yatt")


def rng_state() -> dict:
    """This process's RNG states (Python, NumPy, torch CPU and, when present, CUDA), as tensors,
    tuples and numbers only (a checkpoint's rank file loads with ``weights_only=True``)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (CUDA states only where CUDA is present)."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_resume(resume: str, root: str | Path) -> Path | None:
    """The checkpoint to resume from, verified (:func:`yatt.checkpoint.files.verify`): ``"none"``
    -> None; ``"auto"`` -> the newest complete one under ``root`` that verifies (a damaged newer
    one is named and skipped, loudly), or None; anything else is a path (a step folder or a root
    with ``latest``), which must verify.

    Raises:
        FileNotFoundError: an explicit path holds no complete checkpoint.
        CheckpointDamaged: an explicit path's checkpoint does not verify (the message names the
            file); or ``"auto"`` found checkpoints and none verifies.
    """
    if resume == "none":
        return None
    if resume == "auto":
        folder = files.newest_verified(root)
        if folder is None and files.find_latest(root) is not None:
            raise CheckpointDamaged(f"resume=auto: no checkpoint under {root} verifies (see above); move the damaged "
                                    "ones away to start fresh, or set resume=none")
        return folder
    folder = files.resolve(resume)
    problems = files.verify(folder)
    if problems:
        raise CheckpointDamaged(f"config key 'resume': checkpoint {folder} does not verify: {'; '.join(problems)}")
    return folder


class CheckpointDamaged(RuntimeError):
    """The checkpoint to resume from does not match what was recorded when it was written."""


class RunCheckpoints:
    """Checkpoints of one run of :func:`yatt.loop.run` on this rank (collective methods).

    Args:
        cfg: the run config (``checkpoint``, ``resume``, ``trainer.guard.action``).
        rank: global rank.
        actor: this rank's trained policy (None on ranks that do not train, and in stage rm,
            which trains the critic alone).
        dp_rank: this rank's data-parallel index among the trainers (DP rank 0 writes the
            model and optimizer files of its TP x PP shard).
        parts: ``name -> object with state_dict()/load_state_dict()`` saved per rank (the
            controller shard, the guard, ...); None entries are skipped.
        meta: run facts for ``meta.json`` (base model path, sizes, config).
        critic: this rank's critic (:class:`~yatt.trainer.critic.MegatronCritic`) or None; its
            shard is saved, resumed and rolled back beside the actor's (files ``critic_tp{t}_pp{p}``).
    """

    def __init__(self, cfg, rank: int, actor, dp_rank: int, parts: dict, meta: dict, critic=None) -> None:
        c = cfg.checkpoint
        self.cfg, self.rank, self.actor, self.critic, self.meta = cfg, rank, actor, critic, meta
        self.parts = {k: v for k, v in parts.items() if v is not None}
        self.root = files.checkpoint_root(cfg)
        self.model_key = None
        if actor is not None or critic is not None:
            from megatron.core import parallel_state as mpu

            key = f"tp{mpu.get_tensor_model_parallel_rank()}_pp{mpu.get_pipeline_model_parallel_rank()}"
            self.load_key = key
            self.model_key = key if dp_rank == 0 else None
        self.saver = Checkpointer(self.root, rank, self.model_key, async_save=c.async_save,
                                  keep_last=c.keep_last, keep_every=c.keep_every)
        self.triggers = SaveTriggers(c.every_steps, c.every_minutes, tuple(c.on_signals))
        self.resumed_from: Path | None = None
        self.rollbacks = 0

    # ------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Load the checkpoint ``cfg.resume`` names (collective); returns its step (0: fresh start).

        A checkpoint of another world size resumes through :meth:`_resized_parts`, one of another TP
        or PP through :mod:`yatt.checkpoint.relayout`.

        Raises:
            ValueError: the checkpoint was saved with another TP or PP and has no ``param_names``.
            CheckpointDamaged: it does not verify (on every rank; rank 0 checked it).
        """
        folder = error = None
        if self.rank == 0:
            try:
                folder = resolve_resume(self.cfg.resume, self.root)
            except CheckpointDamaged as e:
                error = str(e)
        if dist.is_initialized():
            box = [(folder, error)]
            dist.broadcast_object_list(box, src=0)
            folder, error = box[0]
        if error is not None:
            raise CheckpointDamaged(error)
        if folder is None:
            return 0
        meta = files.read_meta(folder)
        have = {k: self.meta[k] for k in ("world", "tp", "pp")}
        saved = {k: meta.get(k) for k in have}
        if (saved["tp"], saved["pp"]) != (have["tp"], have["pp"]) and self.rank == 0:
            log.warning("resume: checkpoint %s was saved with TP %d, PP %d and this job has TP %d, PP %d: each rank "
                        "rebuilds its model and optimizer shards from the saved ones (the same values); matmuls and "
                        "reductions over TP ranks now sum in another order, so the run is not bit-equal to one that "
                        "kept the layout", folder, saved["tp"], saved["pp"], have["tp"], have["pp"])
        self._load_policy(folder)
        if saved["world"] == have["world"]:
            state = load_part(folder, "rank", f"{self.rank:05d}")
            set_rng_state(state["rng"])
            parts = state["parts"]
        else:
            parts = self._resized_parts(folder, saved["world"])
        for name, part in self.parts.items():
            if name in parts:
                part.load_state_dict(parts[name])
            elif name != "placement" or saved["world"] == have["world"]:  # e.g. dynamic sampling switched on
                log.warning("checkpoint %s has no %r state; it starts fresh", folder, name)
        self.resumed_from = folder
        log.info("resumed from %s (step %d)", folder, meta["step"])
        return int(meta["step"])

    def _resized_parts(self, folder: Path, old_world: int) -> dict:
        """The per-rank states of a checkpoint saved on ``old_world`` ranks, dealt to this rank of
        this job's world: the data shard continues every old shard's rows
        (:func:`~yatt.controller.shard.resharded_state`); rank 0 takes the sum of the old ranks' row
        counters; rank ``r`` takes old rank ``r``'s RNG states (a rank beyond the old world keeps
        its fresh ones) and the other states of old rank ``min(r, old_world - 1)``; the placement
        starts fresh (its split is the new world's)."""
        from yatt.controller.shard import resharded_state

        world = self.meta["world"]
        old = [load_part(folder, "rank", f"{r:05d}") for r in range(old_world)]
        if self.rank == 0:
            per_rank = self.cfg.trainer.prompts_per_rank
            log.warning("resume: checkpoint %s was saved on %d ranks and this job has %d (TP %d, PP %d): "
                        "the rows its data shards had left in their epoch are drawn first, then the new ranks' "
                        "shards; the global batch is %d prompts per step (it was %d: set trainer.prompts_per_rank to "
                        "keep it), and the sums over data-parallel ranks run in another order, so the run is not "
                        "bit-equal to one that kept %d ranks", folder, old_world, world, self.meta["tp"],
                        self.meta["pp"], per_rank * world, per_rank * old_world, old_world)
        if self.rank < old_world:
            set_rng_state(old[self.rank]["rng"])
        parts = {k: v for k, v in old[min(self.rank, old_world - 1)]["parts"].items() if k != "placement"}
        if "shard" in self.parts:
            parts["shard"] = resharded_state([o["parts"]["shard"] for o in old], self.rank, world,
                                             self.parts["shard"].seed)
        if "data_stats" in self.parts:
            parts["data_stats"] = _summed_stats([o["parts"]["data_stats"] for o in old]) if self.rank == 0 else {}
        return parts

    def _load_policy(self, folder: Path) -> None:
        """Load the actor's (and the critic's) model, optimizer and LR schedule from ``folder``;
        saved with another TP or PP, this rank's shards are rebuilt (:mod:`yatt.checkpoint.relayout`)."""
        meta = files.read_meta(folder)
        for role, model in (("actor", self.actor), ("critic", self.critic)):
            if model is None:
                continue
            if (meta.get("tp"), meta.get("pp")) == (self.meta["tp"], self.meta["pp"]):
                key = files.role_key(role, self.load_key)
                state, optim = load_part(folder, "model", key), load_part(folder, "optim", key)
            else:
                state, optim = _relaid(folder, role, model, meta["tp"], meta["pp"])
            model.load_model_state_dict(state, f"checkpoint {folder} ({role})")
            model.optimizer.load_state_dict(optim["optimizer"])
            model.scheduler.num_steps = 0  # Megatron's load_state_dict steps forward by the saved count
            model.scheduler.load_state_dict(optim["scheduler"])

    # ------------------------------------------------------------------ save points
    def save(self, step: int) -> None:
        """Snapshot this rank's state for ``step`` and write it in the background (collective)."""
        model = optim = None
        roles = {}
        if self.model_key is not None:
            if self.actor is not None:
                model, optim = _model_state(self.actor)
            if self.critic is not None:
                roles["critic"] = _model_state(self.critic)
        rank_state = {"rng": rng_state(), "parts": {k: v.state_dict() for k, v in self.parts.items()}}
        self.saver.save(step, model, optim, rank_state, self.meta, roles)
        self.triggers.saved()

    def step_end(self, step: int) -> str | None:
        """At the end of a step that is not the last: commit a finished write, save if a save
        point is due (collective). Returns the name of the signal that asks the run to stop
        (SIGTERM/SIGUSR1 on some rank; the checkpoint of ``step`` is then committed), else None."""
        self.saver.poll()
        due, stop = self.triggers.check(step)
        if due:
            self.save(step)
        if stop is not None:
            self.saver.wait()
            self._must_have_saved(step, f"the checkpoint {stop} asked for")
        return stop

    def begin_final(self, step: int) -> None:
        """After the last step, before the final eval: start the final save
        (``checkpoint.save_final``; collective), so that its write overlaps the eval. The state
        is the one after the step, as at every other save point (an eval changes none of it)."""
        if self.cfg.checkpoint.save_final:
            self.save(step)

    def finish(self, step: int) -> None:
        """After the final eval: the final save (:meth:`begin_final`) and every write committed.

        Raises:
            CheckpointWriteError: the final checkpoint could not be written (the message says
                why and which checkpoint is the last good one).
        """
        self.saver.wait()
        self.triggers.close()
        if self.cfg.checkpoint.save_final:
            self._must_have_saved(step, "the final checkpoint")

    def _must_have_saved(self, step: int, what: str) -> None:
        """Raise when the save of ``step`` (the run's last) failed; every rank agrees (poll)."""
        if self.saver.committed == files.step_dir(self.root, step):
            return
        last = self.saver.committed or self.resumed_from or files.find_latest(self.root)
        raise CheckpointWriteError(f"{what} (step {step}) could not be written: {self.saver.last_failure}; the last "
                                   f"good checkpoint is {last or 'none (nothing of this run is kept)'}")

    # ------------------------------------------------------------------ rollback
    def rollback(self) -> bool:
        """Reload the policy (model, optimizer, scheduler; the critic's too) of the newest committed checkpoint.
        Not collective (only trainers call it; they decide alike, from the same grad norm); a
        write still in flight is not waited for. Data position, RNG and counters go on.
        Returns False when there is none yet (the caller's skip stands)."""
        folder = self.saver.committed or self.resumed_from
        if folder is None:
            log.warning("guard: no checkpoint to roll back to yet; the update is only skipped")
            return False
        self._load_policy(folder)
        self.rollbacks += 1
        log.warning("guard: rolled the policy back to %s", folder)
        return True


def _relaid(folder: Path, role: str, model, tp: int, pp: int) -> tuple[dict, dict]:
    """``model``'s shards of ``role`` from checkpoint ``folder`` saved with ``tp`` and ``pp``."""
    from megatron.core import parallel_state as mpu

    from yatt.checkpoint.relayout import SavedShards, relaid_states

    saved = SavedShards(folder, role, dataclasses.replace(model.layout, tp=tp), pp, model.head)
    return relaid_states(saved, model, mpu.get_tensor_model_parallel_rank())


def _model_state(model) -> tuple[dict, dict]:
    """(model shard state dict, ``{"optimizer", "scheduler", "param_names"}``) of a trained model:
    ``param_names`` names the parameter behind each optimizer state index
    (:meth:`~yatt.trainer.actor.MegatronPolicy.optimizer_param_names`)."""
    return model.model_state_dict(), {"optimizer": model.optimizer.state_dict(),
                                       "scheduler": model.scheduler.state_dict(),
                                       "param_names": model.optimizer_param_names()}


def _summed_stats(states: list[dict]) -> dict:
    """Row counters of several ranks (:class:`StatsPart` states) added up: ints summed, dicts of
    ints summed per key; per-file counters of the running epoch left out (judged afresh)."""
    out: dict = {}
    for state in states:
        for k, v in state.items():
            if isinstance(v, bool) or k == "files":
                continue
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
            elif isinstance(v, dict):
                into = out.setdefault(k, {})
                for key, n in v.items():
                    into[key] = into.get(key, 0) + n
            elif isinstance(v, set):
                out[k] = out.get(k, set()) | v
    return out


@dataclasses.dataclass
class StatsPart:
    """Adapter: a dataclass of counters (``LoadStats``) as a checkpoint part."""

    stats: object

    def state_dict(self) -> dict:
        return dataclasses.asdict(self.stats)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            current = getattr(self.stats, k, None)
            if isinstance(current, dict) and isinstance(v, dict):
                current.update(v)  # counters added since the checkpoint was written stay at 0
            else:
                setattr(self.stats, k, v)
