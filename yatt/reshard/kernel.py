"""Run copy plans on tensors with the ``yatt._C`` block-copy kernels (CPU threads or one CUDA launch).

A :class:`CopyProgram` binds element-level plans (:func:`yatt.reshard.plan.copy_blocks`) to
buffer *slots* instead of addresses: it is compiled and bounds-checked once from the slots'
sizes, then run on any tensors of those sizes with one vectorised address computation and one
kernel call. The kernels take raw addresses; this module is the only place where tensors become
addresses.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from yatt import _C

Ref = tuple[int, int]  # (slot, element offset): where a flattened shard or target starts


def _check_bounds(off, stride, rows, cols, numel, what: str) -> None:
    end = off + (rows - 1) * stride + cols
    bad = (off < 0) | (cols < 0) | (rows < 0) | ((rows > 1) & (stride < cols)) | ((rows > 0) & (end > numel))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ValueError(f"copy block {k} runs outside its {what} slot")


class CopyProgram:
    """Element-level copy plans bound to slots; compiled once, run many times.

    Args:
        slot_numels: element count of each slot (a contiguous tensor given to :meth:`run`).
        jobs: (source shard refs, target ref, blocks): shard ``r`` of the plan starts at
            ``source refs[r]``, the target at ``target ref``; ``blocks`` as in
            :func:`yatt.reshard.plan.copy_blocks` ([n, 7] int64, elements).
    Raises:
        ValueError: a block reads or writes outside its slot, or names a missing shard.
    """

    def __init__(self, slot_numels: Sequence[int], jobs: Sequence[tuple[Sequence[Ref], Ref, np.ndarray]]):
        self.slot_numels = np.asarray(slot_numels, dtype=np.int64)
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

    def run(self, slots: Sequence[torch.Tensor], threads: int = 0) -> None:
        """Copy between ``slots`` (contiguous, one dtype and device, sizes as compiled).

        CPU: ``threads`` C++ threads (0: ``torch.get_num_threads()``); CUDA: one launch on the
        current stream, returns when done.

        Raises:
            ValueError: wrong slot count, size, dtype, device or a non-contiguous slot;
            RuntimeError: CUDA tensors and a ``yatt._C`` built without CUDA.
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
        table = self.table * size
        table[:, 0] += ptrs[self.src_slot]
        table[:, 2] += ptrs[self.dst_slot]
        table[:, 4] = self.table[:, 4]  # rows are a count, not bytes
        if first.device.type == "cuda":
            if not getattr(_C, "with_cuda", False):
                raise RuntimeError("yatt._C was built without CUDA (YATT_WITH_CUDA=1 pip install -e .)")
            with torch.cuda.device(first.device):
                _C.copy_blocks_cuda(table, torch.cuda.current_stream().cuda_stream)
        elif first.device.type == "cpu":
            _C.copy_blocks_cpu(table, threads or torch.get_num_threads())
        else:
            raise ValueError(f"copy_blocks: unsupported device {first.device}")


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
