"""Asynchronous checkpoint writes: snapshot to host memory, write in a background thread,
commit when every rank is done.

The training thread only pays for the snapshot: each tensor is copied into a host buffer that
is allocated once and reused by every later save (pinned on CUDA, copied without blocking).
A daemon thread then ``torch.save``\\ s this rank's files into ``step_N.tmp/`` and fsyncs
them. The thread runs no collective; completion is agreed in :meth:`Checkpointer.poll` (one
all-reduce of a small int tensor, called by every rank at the end of every step), after
which rank 0 commits the folder (:func:`yatt.checkpoint.files.commit`) and applies retention.

Why ``torch.save`` per rank and not torch.distributed.checkpoint (DCP) or Megatron's
``dist_checkpointing``: resume reloads into the same TP x PP layout, so no resharding is
needed at load time; DCP's in-place load needs a template whose optimizer state already
exists (it does not before the first step), and both libraries' async paths coordinate with
collectives off the training thread, beside the loop's own. Writes here are plain files in
PyTorch's own format, one per model shard, per optimizer shard and per rank.
"""
from __future__ import annotations

import copy
import errno
import logging
import os
import shutil
import threading
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from yatt.checkpoint import files
from yatt.dist import local_ranks

log = logging.getLogger("yatt")


class HostSnapshot:
    """Copies nested state (dicts, lists, tuples of tensors and plain values) into host
    buffers that persist across calls, so a repeated snapshot of the same state allocates nothing.

    Tensors of the same path, shape and dtype reuse one buffer; other values are deep-copied.
    On CUDA the buffers are pinned and the copies are asynchronous: call :meth:`ready` (e.g. in
    the writer thread) before reading them.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._event = None
        self.bytes = 0  # tensor bytes of the last snapshot

    def take(self, state):
        """The host copy of ``state`` (same structure)."""
        self.bytes = 0
        out = self._copy(state, ())
        if torch.cuda.is_available():
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def held_bytes(self) -> int:
        """Bytes of the host buffers kept for later snapshots."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def ready(self) -> None:
        """Block until the copies of the last :meth:`take` have landed (no-op on CPU)."""
        if self._event is not None:
            self._event.synchronize()

    def _copy(self, obj, path: tuple):
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                self._buffers[path] = buf
            buf.copy_(t, non_blocking=t.is_cuda)
            self.bytes += buf.numel() * buf.element_size()
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, (*path, i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)


class _Summing:
    """A binary file that keeps the size and CRC-32 of what is written through it."""

    def __init__(self, f) -> None:
        self.f, self.bytes, self.crc32 = f, 0, 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.bytes, self.crc32 = self.bytes + view.nbytes, zlib.crc32(view, self.crc32)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in a nested dict/list/tuple."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _save(obj, path: Path) -> dict:
    """``torch.save`` to ``path``, fsynced; returns ``{"bytes", "crc32"}`` of what was written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        out = _Summing(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": out.bytes, "crc32": out.crc32}


class CheckpointWriteError(RuntimeError):
    """A checkpoint the run must have (the final one, or a signal's) could not be written."""


def _why(e: BaseException, root: Path, needed: int) -> str:
    """A failed write's cause in words: a full disk is named as such (torch's zip writer reports it
    as ``unexpected pos``), with the bytes needed and free."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    full = getattr(e, "errno", None) == errno.ENOSPC or (free is not None and free < (64 << 20))
    if full:
        return (f"no space left on the device of {root} (ENOSPC): this rank's part needs {needed / 2**30:.2f} GiB, "
                f"{(free or 0) / 2**30:.2f} GiB free (cause: {str(e).splitlines()[0][:200]})")
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


class Checkpointer:
    """This rank's side of the run's checkpoints (see :mod:`yatt.checkpoint.files` for the layout).

    Collective: every rank of ``group`` constructs it and calls :meth:`save`, :meth:`poll` and
    :meth:`wait` at the same points of the step loop.

    Args:
        root: checkpoint root folder (shared by all ranks: a shared filesystem on clusters).
        rank: global rank (names the per-rank file).
        model_key: ``tp{t}_pp{p}`` of this rank's model shard, or None when this rank writes no
            model/optimizer files (DP ranks > 0 hold copies of DP rank 0's; ranks that only judge).
        async_save: write in a background thread (False: :meth:`save` returns after the commit).
        keep_last, keep_every: retention (:func:`yatt.checkpoint.files.to_delete`).
        group: process group of all ranks (None: the default group).
    Attributes:
        committed: the last checkpoint folder committed by this run (None before the first).
        failures: saves that failed, on any rank (their ``.tmp`` folder is removed; training goes on).
        last_failure: the cause of the last failed save, in words (``None`` once one succeeds).
    """

    def __init__(self, root: str | Path, rank: int, model_key: str | None, async_save: bool = True,
                 keep_last: int = 2, keep_every: int = 0, group=None) -> None:
        self.root, self.rank, self.model_key = Path(root), rank, model_key
        self.async_save, self.keep_last, self.keep_every, self.group = async_save, keep_last, keep_every, group
        self.snapshot = HostSnapshot()
        self._warned_memory = False
        self.committed: Path | None = None
        self.failures = 0
        self.last_failure: str | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None  # this rank's write failed: why
        self._written: dict[str, dict] = {}  # relative path -> {"bytes", "crc32"} of this rank's files
        self._pending: tuple[int, dict] | None = None  # (step, meta) written but not committed
        if rank == 0:
            for p in files.remove_unfinished(self.root):
                log.warning("checkpoint: removed %s (unfinished, left by an interrupted run)", p)
            self.root.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            dist.barrier(group=group)

    def save(self, step: int, model: dict | None, optim: dict | None, rank_state: dict, meta: dict,
             roles: dict[str, tuple[dict, dict]] | None = None) -> None:
        """Snapshot this rank's state for ``step`` and start writing it (collective).

        Args:
            model, optim: this rank's model (the actor's) shard state dict and ``{"optimizer",
                "scheduler"}`` states, or None (written only when ``model_key`` is set; None there:
                no actor, e.g. a reward model trained alone).
            roles: other trained models' ``(model, optim)`` states by role (``{"critic": ...}``),
                written as ``model/<role>_<model_key>.pt`` and ``optim/<role>_<model_key>.pt``.
            rank_state: small per-rank state (RNG, data position, counters), any picklable.
            meta: run facts for ``meta.json`` (rank 0's is written).
        Blocks only for a previous save still being written, and for the host copy. A save for
        which the disk has too little free space is not started (it fails at the next poll).
        """
        self.wait()
        tmp = files.step_dir(self.root, step, tmp=True)
        jobs = [(copy.deepcopy(rank_state), tmp / "rank" / f"{self.rank:05d}.pt")]
        needed, state = 1 << 20, None
        if self.model_key is not None:
            trained = {**({"actor": (model, optim)} if model is not None else {}), **(roles or {})}
            keys = {files.role_key(r, self.model_key): v for r, v in trained.items()}
            state = {k: {"model": m, "optim": o} for k, (m, o) in keys.items()}
        state_bytes = _tensor_bytes(state) if state is not None else 0
        sync = not self.async_save or self._copy_misfits(state_bytes, step)
        if state is not None:
            if not sync:  # training goes on while the thread writes: it writes a host copy
                state = self.snapshot.take(state)
                needed += self.snapshot.bytes
            else:  # save() returns after the write, so the live tensors are written: no copy held in memory
                needed += state_bytes
            for key, parts in state.items():
                jobs += [(parts["model"], tmp / "model" / f"{key}.pt"), (parts["optim"], tmp / "optim" / f"{key}.pt")]
        self._pending, self._error, self._written = (step, meta), None, {}
        free = shutil.disk_usage(self.root).free
        if free < needed:  # checked before writing: a full disk must not cost the last good checkpoint
            self._error = _why(OSError(errno.ENOSPC, "not started: too little free space"), self.root, needed)
            self._thread = None
        else:
            self._thread = threading.Thread(target=self._write, args=(jobs, tmp, needed), name=f"yatt-ckpt-{step}",
                                            daemon=True)
            self._thread.start()
        if sync:
            self.wait()

    def _copy_misfits(self, state_bytes: int, step: int) -> bool:
        """Whether some rank's host copy of its ``state_bytes`` of tensors, for an asynchronous
        save, does not fit in its machine's available memory (collective: every rank then writes
        synchronously, since :meth:`wait` is collective). A rank counts this job's other ranks on its machine as making theirs at
        the same time and keeps 10% of the memory free; the copy's buffers persist, so only what
        they do not hold yet counts. A rank whose copy does not fit logs it, once."""
        import psutil

        new = state_bytes - self.snapshot.held_bytes()
        vm = psutil.virtual_memory()
        misfit = new > 0 and new * local_ranks() > vm.available - vm.total // 10
        if misfit and not self._warned_memory:
            log.warning("checkpoint of step %d: its host copy for writing in the background (%.2f GiB on this rank, "
                        "%d rank(s) on this machine) does not fit in the %.2f GiB of memory left; it is written "
                        "synchronously (training waits for the write), and so is any later save that does not fit",
                        step, new / 2**30, local_ranks(), vm.available / 2**30)
            self._warned_memory = True
        flag = torch.tensor([int(misfit)], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _write(self, jobs, tmp: Path, needed: int) -> None:
        try:
            self.snapshot.ready()
            for obj, path in jobs:
                self._written[path.relative_to(tmp).as_posix()] = _save(obj, path)
        except BaseException as e:  # reported to every rank by the next poll()
            self._error = _why(e, self.root, needed)

    def poll(self) -> Path | None:
        """Commit the pending checkpoint if every rank has written its part (collective, cheap:
        one all-reduce of one int). Returns the folder committed now, else None."""
        if self._pending is None:
            return None
        done = self._thread is None or not self._thread.is_alive()
        mine = -1 if done and self._error is not None else int(done)
        flag = torch.tensor([mine], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if flag.item() == 0:
            return None  # some rank is still writing
        step, meta = self._pending
        self._pending = None
        errors, manifest = [self._error], dict(self._written)  # a copy: a failed save may have writers still busy
        if dist.is_initialized():  # once per save: every rank's cause, or every rank's files for meta.json
            every = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, (self._error, manifest), group=self.group)
            errors = [e for e, _ in every]
            manifest = {k: v for _, written in every for k, v in written.items()}
        if flag.item() < 0:
            self.failures += 1
            self.last_failure = next(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
            last = self.committed or files.find_latest(self.root)
            log.error("checkpoint of step %d failed (%s); its partial files are removed; the last good checkpoint "
                      "is %s; training goes on", step, self.last_failure, last or "none")
            if self.rank == 0:
                shutil.rmtree(files.step_dir(self.root, step, tmp=True), ignore_errors=True)
            return None
        self.last_failure = None
        folder = files.step_dir(self.root, step)
        if self.rank == 0:
            files.commit(self.root, step, meta, manifest)
            for s in files.prune(self.root, self.keep_last, self.keep_every):
                log.info("checkpoint: removed step %d (retention)", s)
            log.info("checkpoint: step %d saved to %s", step, folder)
        self.committed = folder
        return folder

    def wait(self) -> Path | None:
        """Finish and commit the pending checkpoint, if any (collective; rank 0 has committed
        when it returns on any rank). Returns the committed folder or None."""
        if self._pending is None:
            return None
        if self._thread is not None:
            self._thread.join()
        folder = self.poll()
        if dist.is_initialized():
            dist.barrier(group=self.group)
        return folder


def load_part(folder: str | Path, kind: str, key: str) -> dict:
    """One file of a complete checkpoint: ``kind`` is ``model``, ``optim`` or ``rank``; ``key``
    a model key (``tp0_pp0``) or a rank (``00003``). Memory-mapped, CPU tensors, read with
    ``weights_only=True`` (the project's own types allowed, nothing else).

    Raises:
        FileNotFoundError: the checkpoint has no such part (e.g. saved with another layout).
    """
    path = Path(folder) / kind / f"{key}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint part {path} is missing (was it saved with another world size or TP/PP?)")
    from yatt.assets.data import PromptRow
    from yatt.placement.plan import Roles
    from yatt.placement.runner import SampleGroup  # rollout_apart: the in-flight rollouts
    from yatt.rollout.vllm_engine import Completion

    # weights_only: tensors, containers, numbers, strings and these project types; no code from the file runs
    with torch.serialization.safe_globals([Roles, SampleGroup, Completion, PromptRow]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
