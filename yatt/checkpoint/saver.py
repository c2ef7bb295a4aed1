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
import logging
import os
import shutil
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from yatt.checkpoint import files

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


def _save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


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
        failures: writes that failed (their ``.tmp`` folder is removed; training goes on).
    """

    def __init__(self, root: str | Path, rank: int, model_key: str | None, async_save: bool = True,
                 keep_last: int = 2, keep_every: int = 0, group=None) -> None:
        self.root, self.rank, self.model_key = Path(root), rank, model_key
        self.async_save, self.keep_last, self.keep_every, self.group = async_save, keep_last, keep_every, group
        self.snapshot = HostSnapshot()
        self.committed: Path | None = None
        self.failures = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: tuple[int, dict] | None = None  # (step, meta) written but not committed
        if rank == 0:
            for p in files.remove_unfinished(self.root):
                log.warning("checkpoint: removed %s (unfinished, left by an interrupted run)", p)
            self.root.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            dist.barrier(group=group)

    def save(self, step: int, model: dict | None, optim: dict | None, rank_state: dict, meta: dict) -> None:
        """Snapshot this rank's state for ``step`` and start writing it (collective).

        Args:
            model, optim: this rank's model shard state dict and ``{"optimizer", "scheduler"}``
                states, or None (written only when ``model_key`` is set).
            rank_state: small per-rank state (RNG, data position, counters), any picklable.
            meta: run facts for ``meta.json`` (rank 0's is written).
        Blocks only for a previous save still being written, and for the host copy.
        """
        self.wait()
        tmp = files.step_dir(self.root, step, tmp=True)
        jobs = [(copy.deepcopy(rank_state), tmp / "rank" / f"{self.rank:05d}.pt")]
        if self.model_key is not None:
            host = self.snapshot.take({"model": model, "optim": optim})
            jobs += [(host["model"], tmp / "model" / f"{self.model_key}.pt"),
                     (host["optim"], tmp / "optim" / f"{self.model_key}.pt")]
        self._pending, self._error = (step, meta), None
        self._thread = threading.Thread(target=self._write, args=(jobs,), name=f"yatt-ckpt-{step}", daemon=True)
        self._thread.start()
        if not self.async_save:
            self.wait()

    def _write(self, jobs) -> None:
        try:
            self.snapshot.ready()
            for obj, path in jobs:
                _save(obj, path)
        except BaseException as e:  # reported to every rank by the next poll()
            self._error = e

    def poll(self) -> Path | None:
        """Commit the pending checkpoint if every rank has written its part (collective, cheap:
        one all-reduce of one int). Returns the folder committed now, else None."""
        if self._pending is None:
            return None
        mine = -1 if self._error is not None else int(self._thread is not None and not self._thread.is_alive())
        flag = torch.tensor([mine], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if flag.item() == 0:
            return None  # some rank is still writing
        step, meta = self._pending
        self._pending = None
        if flag.item() < 0:
            self.failures += 1
            log.error("checkpoint of step %d failed on some rank (here: %r); it is dropped, training goes on",
                      step, self._error)
            if self.rank == 0:
                shutil.rmtree(files.step_dir(self.root, step, tmp=True), ignore_errors=True)
            return None
        folder = files.step_dir(self.root, step)
        if self.rank == 0:
            files.commit(self.root, step, meta)
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
    a model key (``tp0_pp0``) or a rank (``00003``). Memory-mapped, CPU tensors.

    Raises:
        FileNotFoundError: the checkpoint has no such part (e.g. saved with another layout).
    """
    path = Path(folder) / kind / f"{key}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint part {path} is missing (was it saved with another world size or TP/PP?)")
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
