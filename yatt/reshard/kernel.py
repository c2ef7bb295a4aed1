"""Run copy plans on tensors with the ``yatt._C`` block-copy kernels (CPU threads or one CUDA launch).

A :class:`CopyProgram` binds element-level plans (:func:`yatt.reshard.plan.copy_blocks`) to
buffer *slots* instead of addresses: it is compiled and bounds-checked once from the slots'
sizes, then run on any tensors of those sizes. On the CPU a run computes the blocks' absolute
addresses (vectorised) and calls the threaded kernel; on CUDA the blocks are cut once into
tasks of at most :data:`TASK_BYTES` (:func:`plan_tasks`), kept resident on the device, and a run
passes only the slots' base addresses to one stream-ordered launch. The kernels take raw
addresses; this module is the only place where tensors become addresses.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from yatt import _C

Ref = tuple[int, int]  # (slot, element offset): where a flattened shard or target starts
TASK_BYTES = 32 << 10  # most bytes of one CUDA task (one thread block); a multiple of 16
MAX_SLOT_ARGS = 256  # slots whose bases go by value in the CUDA launch (csrc/copy_blocks.h kMaxSlotArgs)
TASK_FIELDS = ("src_slot", "src_off", "src_stride", "dst_slot", "dst_off", "dst_stride", "rows", "row_bytes")


def _check_bounds(off, stride, rows, cols, numel, what: str) -> None:
    end = off + (rows - 1) * stride + cols
    bad = (off < 0) | (cols < 0) | (rows < 0) | ((rows > 1) & (stride < cols)) | ((rows > 0) & (end > numel))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ValueError(f"copy block {k} runs outside its {what} slot")


def plan_tasks(src_slot: np.ndarray, dst_slot: np.ndarray, table: np.ndarray, itemsize: int,
               task_bytes: int = TASK_BYTES) -> np.ndarray:
    """Cut a compiled plan into CUDA tasks (vectorised): what one thread block copies.

    Args:
        src_slot, dst_slot: [m] int64, the slot of each block's source and destination.
        table: [m, 6] int64 (src_off, src_stride, dst_off, dst_stride, rows, cols), in elements,
            relative to the slots (:attr:`CopyProgram.table`).
        itemsize: bytes per element.
        task_bytes: most bytes of one task: a positive multiple of 16 below 2^31.
    Returns:
        [n, 8] int64 with columns :data:`TASK_FIELDS`, offsets, strides and row bytes in bytes.
        Blocks that copy nothing are dropped; every other block becomes tasks that tile it, in
        block order. A block of one row, or whose rows are contiguous on both sides, is one run,
        cut into pieces of equal size rounded up to 16 bytes (the last one shorter); other blocks
        into groups of whole rows (as equal as possible), and rows longer than ``task_bytes`` into
        column pieces as runs are. Every task has ``rows >= 1``, ``row_bytes >= 1`` and
        ``rows * row_bytes <= task_bytes``; a one-row task's strides are its row bytes.
    Raises:
        ValueError: ``task_bytes`` is not a positive multiple of 16 below 2^31.
    """
    if task_bytes <= 0 or task_bytes % 16 or task_bytes >= 1 << 31:
        raise ValueError(f"task_bytes must be a positive multiple of 16 below 2^31, got {task_bytes}")
    table = np.asarray(table, dtype=np.int64).reshape(-1, 6)
    keep = (table[:, 4] > 0) & (table[:, 5] > 0)
    table, src_slot, dst_slot = table[keep], np.asarray(src_slot)[keep], np.asarray(dst_slot)[keep]
    so, ss, do, ds, rows, w = (table * itemsize).T
    rows = table[:, 4]
    flat = (rows == 1) | ((ss == w) & (ds == w))
    w = np.where(flat, rows * w, w)
    rows = np.where(flat, 1, rows)
    ss, ds = np.where(flat, w, ss), np.where(flat, w, ds)
    groups = -(-rows // np.maximum(task_bytes // w, 1))  # row groups per block (1 row if w > task_bytes)
    per_group = -(-rows // groups)  # rows per group, balanced: <= task_bytes // w
    pieces = -(-w // task_bytes)  # column pieces per row (1 if w <= task_bytes)
    piece = -(-(-(-w // pieces)) // 16) * 16  # their bytes: <= task_bytes, a multiple of 16
    pieces = -(-w // piece)
    count = groups * pieces
    block = np.repeat(np.arange(len(w)), count)
    q = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    group, part = np.divmod(q, pieces[block])
    row0, col = group * per_group[block], part * piece[block]
    task_rows, task_w = np.minimum(per_group[block], rows[block] - row0), np.minimum(piece[block], w[block] - col)
    one = task_rows == 1
    return np.stack([src_slot[block], so[block] + row0 * ss[block] + col, np.where(one, task_w, ss[block]),
                     dst_slot[block], do[block] + row0 * ds[block] + col, np.where(one, task_w, ds[block]),
                     task_rows, task_w], axis=1).astype(np.int64, copy=False).reshape(-1, 8)


class CopyProgram:
    """Element-level copy plans bound to slots; compiled once, run many times.

    Args:
        slot_numels: element count of each slot (a contiguous tensor given to :meth:`run`).
        jobs: (source shard refs, target ref, blocks): shard ``r`` of the plan starts at
            ``source refs[r]``, the target at ``target ref``; ``blocks`` as in
            :func:`yatt.reshard.plan.copy_blocks` ([n, 7] int64, elements).
    Raises:
        ValueError: a block reads or writes outside its slot, or names a missing shard.

    On CUDA the program keeps, per element size, its task table (:meth:`tasks`, about 64 bytes
    per 32 KiB moved) and, per device, a copy of it on that device, for as long as it lives.
    """

    def __init__(self, slot_numels: Sequence[int], jobs: Sequence[tuple[Sequence[Ref], Ref, np.ndarray]]):
        self.slot_numels = np.asarray(slot_numels, dtype=np.int64)
        self._tasks: dict[int, np.ndarray] = {}  # element size -> task table (host)
        self._device_tasks: dict[tuple[torch.device, int], torch.Tensor] = {}  # resident copies
        if not jobs:
            self.src_slot = self.dst_slot = np.zeros(0, dtype=np.int64)
            self.table = np.zeros((0, 6), dtype=np.int64)
            return
        counts = np.array([len(b) for _, _, b in jobs])
        job = np.repeat(np.arange(len(jobs)), counts)
        shard, so, ss, do, ds, rows, cols = np.concatenate([b for _, _, b in jobs]).T
        nshards = np.array([len(refs) for refs, _, _ in jobs])[job]
        if ((shard < 0) | (shard >= nshards)).any():
            raise ValueError("copy block names a source shard that its job does not have")
        base = np.concatenate([[0], np.cumsum([len(refs) for refs, _, _ in jobs])[:-1]])[job] + shard
        src_refs = np.array([ref for refs, _, _ in jobs for ref in refs], dtype=np.int64).reshape(-1, 2)
        dst_refs = np.array([ref for _, ref, _ in jobs], dtype=np.int64).reshape(-1, 2)[job]
        self.src_slot, src_off = src_refs[base, 0], src_refs[base, 1] + so
        self.dst_slot, dst_off = dst_refs[:, 0], dst_refs[:, 1] + do
        _check_bounds(src_off, ss, rows, cols, self.slot_numels[self.src_slot], "source")
        _check_bounds(dst_off, ds, rows, cols, self.slot_numels[self.dst_slot], "destination")
        self.table = np.stack([src_off, ss, dst_off, ds, rows, cols], axis=1)  # elements, relative

    def tasks(self, itemsize: int) -> np.ndarray:
        """The CUDA task table for elements of ``itemsize`` bytes (:func:`plan_tasks`; cached, read-only)."""
        if itemsize not in self._tasks:
            tasks = plan_tasks(self.src_slot, self.dst_slot, self.table, itemsize)
            tasks.flags.writeable = False
            self._tasks[itemsize] = tasks
        return self._tasks[itemsize]

    def run(self, slots: Sequence[torch.Tensor], threads: int = 0) -> None:
        """Copy between ``slots`` (contiguous, one dtype and device, sizes as compiled).

        CPU: ``threads`` C++ threads (0: ``torch.get_num_threads()``); returns when done.

        CUDA: one launch queued on the current stream of the slots' device; returns once
        queued, without synchronising. Work queued later on that stream sees the copy; another
        stream must first wait for it (``torch.cuda.Event.record`` here, ``wait_event`` there, or
        ``Stream.wait_stream``), and slots freed before the copy has run must only be reused
        through torch's allocator on this stream (or ``Tensor.record_stream``). The first run
        on a device uploads the task table (synchronously, once); later runs pass only the slots'
        addresses, by value for up to :data:`MAX_SLOT_ARGS` slots. A program with more slots
        uploads their addresses on every run (a small pinned, stream-ordered copy).

        Raises:
            ValueError: wrong slot count, size, dtype, device or a non-contiguous slot;
            RuntimeError: CUDA tensors and a ``yatt._C`` built without CUDA, or a failed launch.
        """
        if len(slots) != len(self.slot_numels):
            raise ValueError(f"copy program has {len(self.slot_numels)} slots, got {len(slots)} tensors")
        if not len(self.table):
            return
        first = slots[0]
        for k, t in enumerate(slots):
            if t.dtype != first.dtype or t.device != first.device or not t.is_contiguous() \
                    or t.numel() != self.slot_numels[k]:
                raise ValueError(f"slot {k}: need a contiguous {first.dtype} tensor on {first.device} "
                                 f"of {self.slot_numels[k]} elements, got {t.dtype} {tuple(t.shape)} on {t.device}")
        size = first.element_size()
        ptrs = np.array([t.data_ptr() for t in slots], dtype=np.int64)
        if first.device.type == "cuda":
            self._run_cuda(first.device, size, ptrs)
        elif first.device.type == "cpu":
            table = self.table * size
            table[:, 0] += ptrs[self.src_slot]
            table[:, 2] += ptrs[self.dst_slot]
            table[:, 4] = self.table[:, 4]  # rows are a count, not bytes
            _C.copy_blocks_cpu(table, threads or torch.get_num_threads())
        else:
            raise ValueError(f"copy_blocks: unsupported device {first.device}")

    def _run_cuda(self, device: torch.device, size: int, ptrs: np.ndarray) -> None:
        if not getattr(_C, "with_cuda", False):
            raise RuntimeError("yatt._C was built without CUDA (YATT_WITH_CUDA=1 pip install -e .)")
        tasks = self._device_tasks.get((device, size))
        with torch.cuda.device(device):
            if tasks is None:
                tasks = self._device_tasks[device, size] = torch.from_numpy(self.tasks(size).copy()).to(device)
            if not len(tasks):
                return
            device_bases = None
            if len(ptrs) > _C.copy_tasks_max_slots:
                device_bases = torch.from_numpy(ptrs).pin_memory().to(device, non_blocking=True)
            _C.copy_tasks_cuda(tasks.data_ptr(), len(tasks), ptrs, torch.cuda.current_stream().cuda_stream,
                               0 if device_bases is None else device_bases.data_ptr())


def run_copies(jobs: Sequence[tuple[Sequence[torch.Tensor], torch.Tensor, np.ndarray]], threads: int = 0) -> None:
    """Compile and run plans on tensors in one kernel call: (source shards, target, blocks) jobs.

    Every tensor is its own slot (flattened); see :class:`CopyProgram` for errors.
    """
    slots: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def ref(t: torch.Tensor) -> Ref:
        if id(t) not in index:
            index[id(t)] = len(slots)
            slots.append(t)
        return index[id(t)], 0

    program_jobs = [([ref(s) for s in srcs], ref(dst), blocks) for srcs, dst, blocks in jobs]
    CopyProgram([t.numel() for t in slots], program_jobs).run(slots, threads)
