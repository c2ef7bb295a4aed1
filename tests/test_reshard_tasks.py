"""CUDA task tables of the resharding copy programs, checked on the CPU (no GPU needed).

:func:`yatt.reshard.kernel.plan_tasks` cuts a compiled plan into the tasks that the CUDA kernel
runs, one thread block each. Random plans (flat runs, strided blocks with short and very long
rows, contiguous multi-row blocks, misaligned offsets and odd row bytes, more slots than go by
value, empty programs) are executed task by task, by a plain numpy executor and, where nvcc is
installed, by the kernel's own per-thread code compiled for the host (``csrc/copy_blocks.cu``'s
``copy_task``, thread by thread), and compared with the CPU kernel on the original blocks.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from yatt.reshard.kernel import MAX_SLOT_ARGS, TASK_BYTES, TASK_FIELDS, CopyProgram, plan_tasks

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}


def _random_program(seed: int, itemsize: int, task_elems: int, sources: int = 3):
    """A random program: ``sources`` source slots, one destination slot (slot 0) in which every
    block writes its own region, so no destination overlaps another or a source."""
    rng = np.random.default_rng(seed)
    src_numel = [int(rng.integers(1, 6 * task_elems)) for _ in range(sources)]
    jobs, pos = [], 0
    for _ in range(int(rng.integers(1, 40))):
        slot = int(rng.integers(sources))
        n = src_numel[slot]
        kind = rng.choice(["flat", "short", "long", "contig", "one_side", "empty"])
        if kind == "flat":
            rows, cols = 1, int(rng.integers(1, n + 1))
        elif kind == "empty":  # no rows, or rows of nothing
            rows, cols = (0, int(rng.integers(1, n + 1))) if rng.integers(2) else (int(rng.integers(1, 3)), 0)
        else:
            cols = int(rng.integers(task_elems + 1, 3 * task_elems)) if kind == "long" else int(rng.integers(1, 40))
            cols = min(cols, n)
            rows = int(rng.integers(2, max(3, n // max(cols, 1))))
        ss = cols if kind in ("contig", "one_side", "empty") else cols + int(rng.integers(0, 9))
        ds = cols if kind in ("contig", "empty") else cols + int(rng.integers(0, 9))
        rows = max(0, min(rows, (n - cols) // max(ss, 1) + 1)) if cols else rows
        so = int(rng.integers(0, n - ((rows - 1) * ss + cols) + 1)) if rows and cols else 0
        do = pos + int(rng.integers(0, 8))
        jobs.append(([(1 + slot, 0)], (0, 0), np.array([[0, so, ss, do, ds, rows, cols]])))
        pos = do + (max(rows - 1, 0) * ds + cols if rows else 0)
    return CopyProgram([pos + 3, *src_numel], jobs)


def _slots(program: CopyProgram, itemsize: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    slots = [torch.randint(0, 256, (int(n) * itemsize,), dtype=torch.uint8, generator=g).view(DTYPES[itemsize])
             for n in program.slot_numels]
    slots[0].view(torch.uint8).zero_()
    return slots


def _execute(tasks: np.ndarray, slots: list[torch.Tensor], offset: int = 0) -> None:
    """Reference executor: every task as a strided numpy view of its slots' bytes."""
    mem = [t.view(torch.uint8).numpy()[offset:] for t in slots]
    for src, so, ss, dst, do, ds, rows, w in tasks.tolist():
        if rows == 1:
            mem[dst][do:do + w] = mem[src][so:so + w]
        else:
            view = np.lib.stride_tricks.as_strided
            view(mem[dst][do:], (rows, w), (ds, 1))[:] = view(mem[src][so:], (rows, w), (ss, 1))


def _check_tasks(tasks: np.ndarray, task_bytes: int) -> None:
    rows, w = tasks[:, 6], tasks[:, 7]
    assert tasks.dtype == np.int64 and tasks.shape[1] == len(TASK_FIELDS)
    assert (rows >= 1).all() and (w >= 1).all() and (rows * w <= task_bytes).all()
    one = rows == 1
    assert (tasks[one, 2] == w[one]).all() and (tasks[one, 5] == w[one]).all()
    assert ((tasks[~one, 2] >= w[~one]) & (tasks[~one, 5] >= w[~one])).all()


@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("task_bytes", [16, 64, 4096, TASK_BYTES, 65536])
@pytest.mark.parametrize("seed", range(6))
def test_tasks_copy_what_the_cpu_kernel_copies(seed, task_bytes, itemsize):
    program = _random_program(seed, itemsize, max(task_bytes // itemsize, 4))
    tasks = plan_tasks(program.src_slot, program.dst_slot, program.table, itemsize, task_bytes)
    _check_tasks(tasks, task_bytes)
    assert tasks[:, [6, 7]].prod(axis=1).sum() == (program.table[:, 4] * program.table[:, 5]).sum() * itemsize
    want = _slots(program, itemsize, seed)
    got = [t.clone() for t in want]
    program.run(want, threads=2)
    _execute(tasks, got)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_task_shapes():
    """Runs cut into balanced 16-byte multiples, strided blocks into groups of whole rows."""
    table = np.array([[0, 1, 0, 1, 1, 100_000],  # one run of 200,000 bytes: 4 pieces of 50,000
                      [0, 4, 0, 2, 20_000, 2],  # 20,000 rows of 4 bytes, contiguous at the target only
                      [0, 7, 0, 5, 6, 5],  # 6 rows of 10 bytes, strided on both sides
                      [3, 3, 5, 3, 5, 3],  # contiguous rows: one run of 30 bytes
                      [0, 40_000, 0, 40_000, 3, 33_000],  # long strided rows: 2 pieces each
                      [0, 0, 0, 0, 0, 5], [0, 5, 0, 5, 4, 0]])  # nothing to copy
    tasks = plan_tasks(np.arange(7), np.arange(7) + 10, table, 2, task_bytes=65536)
    assert tasks.tolist() == [
        [0, 0, 50_000, 10, 0, 50_000, 1, 50_000], [0, 50_000, 50_000, 10, 50_000, 50_000, 1, 50_000],
        [0, 100_000, 50_000, 10, 100_000, 50_000, 1, 50_000], [0, 150_000, 50_000, 10, 150_000, 50_000, 1, 50_000],
        [1, 0, 8, 11, 0, 4, 10_000, 4], [1, 80_000, 8, 11, 40_000, 4, 10_000, 4],
        [2, 0, 14, 12, 0, 10, 6, 10],
        [3, 6, 30, 13, 10, 30, 1, 30],
        [4, 0, 33_008, 14, 0, 33_008, 1, 33_008], [4, 33_008, 32_992, 14, 33_008, 32_992, 1, 32_992],
        [4, 80_000, 33_008, 14, 80_000, 33_008, 1, 33_008], [4, 113_008, 32_992, 14, 113_008, 32_992, 1, 32_992],
        [4, 160_000, 33_008, 14, 160_000, 33_008, 1, 33_008], [4, 193_008, 32_992, 14, 193_008, 32_992, 1, 32_992]]
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_tasks(np.arange(7), np.arange(7), table, 2, task_bytes=100)


def test_many_slots_and_empty_programs():
    n = MAX_SLOT_ARGS + 44  # more sources than go by value: every block reads its own slot
    jobs = [([(1 + k, 0)], (0, 0), np.array([[0, k % 3, 3, 10 * k, 7, 2, 3]])) for k in range(n)]
    program = CopyProgram([10 * n, *[9] * n], jobs)
    tasks = program.tasks(4)
    assert len(tasks) == n and set(tasks[:, 0]) == set(range(1, n + 1)) and not tasks.flags.writeable
    want = [torch.zeros(10 * n), *(torch.randn(9) for _ in range(n))]
    got = [t.clone() for t in want]
    program.run(want)
    _execute(tasks, got)
    assert torch.equal(got[0], want[0])
    assert CopyProgram([4, 4], []).tasks(2).shape == (0, 8)
    empty = CopyProgram([4, 4], [([(1, 0)], (0, 0), np.array([[0, 0, 0, 0, 0, 0, 4], [0, 0, 0, 0, 0, 3, 0]]))])
    assert empty.tasks(2).shape == (0, 8)
    empty.run([torch.zeros(4), torch.ones(4)])


# A host program around the kernel's per-thread code: every task's 256 threads run one after the
# other (a thread stores only what it loaded, and no destination overlaps a source).
_EMULATOR = r"""
#include "copy_blocks.cu"
extern "C" void emulate(const int64_t* tasks, int64_t n, const int64_t* bases) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t* f = tasks + t * yatt::kTaskFields;
    for (uint32_t tid = 0; tid < yatt::cuda_copy::kThreads; ++tid)
      yatt::cuda_copy::copy_task(bases[f[0]] + f[1], f[2], bases[f[3]] + f[4], f[5], f[6], f[7], tid);
  }
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """csrc/copy_blocks.cu compiled by nvcc (device code for sm_90, as the CMake build does) with
    its per-thread code linked into a host library: (ctypes library, ptxas report). About 5 s on
    2 cores."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    out = tmp_path_factory.mktemp("emulator")
    (out / "emulate.cu").write_text(_EMULATOR)
    proc = subprocess.run([nvcc, "-std=c++17", "-O2", "-arch=sm_90", "-DYATT_WITH_CUDA", "-Xptxas", "-v",
                           "-Xcompiler", "-fPIC,-fno-strict-aliasing", "-shared", f"-I{ROOT / 'csrc'}",
                           str(out / "emulate.cu"), "-o", str(out / "emulate.so")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(out / "emulate.so"))
    lib.emulate.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib, proc.stderr + proc.stdout


@pytest.mark.gpu
def test_cuda_kernel_compiles_without_local_memory(emulator):
    """Both kernels (bases by value, bases in device memory) compile for sm_90 with no stack frame
    and no spills: the by-value slot bases are indexed in the parameter bank, not copied to local
    memory."""
    report = emulator[1]
    assert len(re.findall(r"Compiling entry function '\S*copy_tasks_kernel", report)) == 2, report
    assert re.findall(r"Used (\d+) registers", report), report
    assert not re.search(r"[1-9]\d* bytes (stack frame|spill)", report), report


@pytest.mark.gpu
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("task_bytes", [16, 64, 4096, TASK_BYTES, 65536])
@pytest.mark.parametrize("seed", range(4))
def test_cuda_kernel_code_on_the_host(emulator, seed, task_bytes, itemsize):
    """The kernel's own index arithmetic, element widths and tails (every alignment: uint8 slots
    at odd addresses) match the CPU kernel."""
    program = _random_program(100 + seed, itemsize, max(task_bytes // itemsize, 4))
    tasks = plan_tasks(program.src_slot, program.dst_slot, program.table, itemsize, task_bytes)
    want = _slots(program, itemsize, seed)
    got = [t.clone() for t in want]
    program.run(want, threads=2)
    shift = seed % 3  # move every slot off its allocation's alignment, by the same bytes
    moved = [torch.empty(t.numel() * itemsize + shift, dtype=torch.uint8) for t in got]
    for m, t in zip(moved, got):
        m[shift:] = t.view(torch.uint8)
    bases = np.array([m.data_ptr() + shift for m in moved], dtype=np.int64)
    emulator[0].emulate(tasks.ctypes.data, len(tasks), bases.ctypes.data)
    for m, w in zip(moved, want):
        assert torch.equal(m[shift:], w.view(torch.uint8))
