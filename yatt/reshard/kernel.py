"""Run copy plans on tensors with the ``yatt._C`` block-copy kernels (CPU threads or one CUDA launch).

The kernels take raw addresses; this module is where tensors become addresses, so every block
is bounds-checked against its tensors here before any byte moves.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from yatt import _C


def _ptrs(tensors: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("copy_blocks needs contiguous tensors")
    return (np.array([t.data_ptr() for t in tensors], dtype=np.int64),
            np.array([t.numel() for t in tensors], dtype=np.int64))


def _check_bounds(off, stride, rows, cols, numel, what: str) -> None:
    end = off + (rows - 1) * stride + cols
    bad = (off < 0) | (cols < 0) | (rows < 0) | ((rows > 1) & (stride < cols)) | ((rows > 0) & (end > numel))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ValueError(f"copy block {k} runs outside its {what} tensor")


def address_table(jobs: Sequence[tuple[Sequence[torch.Tensor], torch.Tensor, np.ndarray]]) -> np.ndarray:
    """Byte-address copy table for the kernels from element-level plans.

    Args:
        jobs: (source shards, destination, blocks) triples; blocks as in
            :func:`yatt.reshard.plan.copy_blocks` ([n, 7] int64, elements). All tensors
            contiguous, one dtype, one device.
    Returns:
        int64 [N, 6]: src address, src stride, dst address, dst stride (bytes), rows, row bytes.
    Raises:
        ValueError: mixed dtypes or devices, a non-contiguous tensor, or a block out of bounds.
    """
    if not jobs:
        return np.zeros((0, 6), dtype=np.int64)
    first = jobs[0][1]
    size, tables = first.element_size(), []
    for srcs, dst, blocks in jobs:
        for t in (*srcs, dst):
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"copy_blocks needs one dtype and device, got {t.dtype}/{t.device} "
                                 f"and {first.dtype}/{first.device}")
        src_ptr, src_numel = _ptrs(srcs)
        (dst_ptr,), (dst_numel,) = _ptrs([dst])
        s, so, ss, do, ds, rows, cols = blocks.T
        _check_bounds(so, ss, rows, cols, src_numel[s], "source")
        _check_bounds(do, ds, rows, cols, dst_numel, "destination")
        tables.append(np.stack([src_ptr[s] + so * size, ss * size, dst_ptr + do * size, ds * size,
                                rows, cols * size], axis=1))
    return np.concatenate(tables)


def run_copies(jobs: Sequence[tuple[Sequence[torch.Tensor], torch.Tensor, np.ndarray]], threads: int = 0) -> None:
    """Execute element-level plans (see :func:`address_table`) with one kernel call.

    CPU tensors: ``threads`` C++ threads (0: ``torch.get_num_threads()``). CUDA tensors: one
    launch on the current stream; returns when it is done.

    Raises:
        ValueError: see :func:`address_table`; RuntimeError: CUDA tensors without a CUDA build.
    """
    table = address_table(jobs)
    if not len(table):
        return
    device = jobs[0][1].device
    if device.type == "cuda":
        if not getattr(_C, "with_cuda", False):
            raise RuntimeError("yatt._C was built without CUDA (YATT_WITH_CUDA=1 pip install -e .)")
        with torch.cuda.device(device):
            _C.copy_blocks_cuda(table, torch.cuda.current_stream().cuda_stream)
    elif device.type == "cpu":
        _C.copy_blocks_cpu(table, threads or torch.get_num_threads())
    else:
        raise ValueError(f"copy_blocks: unsupported device {device}")
