"""GPU check of the resharding kernel: equality with the CPU kernel and bandwidth against a
device-to-device copy, in one run (well under a minute on an H200).

    YATT_WITH_CUDA=1 pip install --no-build-isolation --no-deps -e .   # CUDA build of yatt._C
    python bench/reshard_gpu.py [--repeats 20]

Needs a CUDA build of torch and of ``yatt._C`` (exits with 2 and a message otherwise). Cases, all
bf16: ``flat``, one block of a buffer the size of the synthetic ~1 GB Llama of
``bench/reshard.py`` through a :class:`~yatt.reshard.kernel.CopyProgram`; and for that model and
t -> i in (2 -> 1, 4 -> 2, 1 -> 4), every inference rank's bucketed copy programs over the t
training shards (built on the GPU from random weights), checked bit-equal to the CPU kernel on
the same shards; and, untimed, small random plans with odd alignments and more slots than go
by value (``odd plans``). Times are device times (CUDA events, median of ``--repeats``) of all of a
case's programs queued back to back on one stream with no host synchronisation in between, as
the weight sync queues them; the queue starts behind a sleep kernel, so that the host's launch
overhead (printed separately as ``host`` per round) is not counted. The reference is
``Tensor.copy_`` of one contiguous device buffer of the same bytes, timed the same way. One line
per case with its ratio (d2d copy time / program time), then

    gpu_reshard_flat_vs_d2d=<flat ratio>
    gpu_reshard_vs_d2d=<min over the three reshard cases>

Exit status 1 if a result differs from the CPU kernel's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reshard import SYNTHETIC, bucket_programs  # noqa: E402

from yatt import _C  # noqa: E402
from yatt.reshard import megatron_params  # noqa: E402
from yatt.reshard.kernel import CopyProgram  # noqa: E402
from yatt.trainer.hf_mapping import hf_to_megatron, layout_from_hf  # noqa: E402


def device_median_ms(fn, repeats: int) -> tuple[float, float]:
    """(median device ms, median host ms to queue) of ``fn``'s work on the current stream.

    Each round queues a sleep kernel, the start event, ``fn`` and the stop event; a round in which
    the device reached the start event before the host had queued everything is repeated with a
    longer sleep, so host overhead never shows as device time."""
    fn()
    torch.cuda.synchronize()
    cycles, device, host = 1 << 22, [], []
    while len(device) < repeats:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        fn()
        queued = time.perf_counter() - t0
        stop.record()
        ahead = not start.query()  # the device was still sleeping: the whole round was queued
        torch.cuda.synchronize()
        if not ahead and cycles < 1 << 34:
            cycles *= 2
            continue
        device.append(start.elapsed_time(stop))
        host.append(queued * 1e3)
    return statistics.median(device), statistics.median(host)


def synthetic_gpu_state(cfg: dict) -> dict[str, torch.Tensor]:
    """HF-shaped bf16 tensors of ``cfg`` on the GPU, random (distinct values: a misplaced block shows)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(LlamaConfig(**cfg)).named_parameters()}
    g = torch.Generator(device="cuda").manual_seed(0)
    return {n: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for n, s in shapes.items()}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def report(name: str, nbytes: int, equal: bool, ms: float, host_ms: float, copy_ms: float) -> float:
    ratio = copy_ms / ms
    print(f"{name}: {nbytes / 1e9:.3f} GB, equal_to_cpu={equal}, program {nbytes / ms / 1e6:.0f} GB/s "
          f"({ms:.3f} ms device, host {host_ms:.3f} ms), d2d copy {nbytes / copy_ms / 1e6:.0f} GB/s, "
          f"ratio {ratio:.3f}", flush=True)
    return ratio


def d2d_ms(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return device_median_ms(lambda: dst.copy_(src), repeats)[0]


def flat_case(nbytes: int, repeats: int) -> tuple[float, bool]:
    """One block of nbytes through a CopyProgram; its CPU result is the source itself."""
    n = nbytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    program = CopyProgram([n, n], [([(1, 0)], (0, 0), np.array([[0, 0, n, 0, n, 1, n]]))])
    slots = [dst, src]
    program.run(slots)
    equal = bits_equal(dst, src)
    ms, host_ms = device_median_ms(lambda: program.run(slots), repeats)
    return report("flat", 2 * n, equal, ms, host_ms, d2d_ms(2 * n, repeats)), equal


def odd_plans_case(seed: int = 0) -> bool:
    """Random small plans that the model's plans never make, bit-equal to the CPU kernel: uint8 and
    bf16 slots, odd offsets, widths and strides (every element width and byte tails), runs and rows
    longer than a task, with 40 slots (bases by value) and 300 (bases uploaded per run)."""
    rng = np.random.default_rng(seed)
    equal = True
    for dtype in (torch.uint8, torch.bfloat16):
        for nslots in (40, 300):
            sizes = [int(rng.choice([3000, 200_000])) for _ in range(nslots)]
            jobs, pos = [], 0
            for k, n in enumerate(sizes):
                cols = int(rng.integers(1, min(n, 100_000 if n > 3000 else 100)))
                ss, ds = cols + int(rng.integers(0, 3)) * int(rng.integers(0, 40)), cols + int(rng.integers(0, 9))
                rows = int(rng.integers(1, (n - cols) // ss + 2))
                so = int(rng.integers(0, n - (rows - 1) * ss - cols + 1))
                do = pos + int(rng.integers(0, 9))
                jobs.append(([(1 + k, 0)], (0, 0), np.array([[0, so, ss, do, ds, rows, cols]])))
                pos = do + (rows - 1) * ds + cols
            program = CopyProgram([pos, *sizes], jobs)
            size = torch.empty(0, dtype=dtype).element_size()
            cpu = [torch.zeros(pos, dtype=dtype), *(torch.randint(0, 256, (n * size,), dtype=torch.uint8).view(dtype)
                                                   for n in sizes)]
            gpu = [x.cuda() for x in cpu]
            program.run(cpu)
            program.run(gpu)
            ok = bool(torch.equal(cpu[0].view(torch.uint8), gpu[0].cpu().view(torch.uint8)))
            print(f"odd plans ({dtype}, {nslots} slots, {len(program.tasks(cpu[0].element_size()))} tasks): "
                  f"equal_to_cpu={ok}", flush=True)
            equal &= ok
    return equal


def reshard_case(hf: dict, t: int, i: int, repeats: int) -> tuple[float, bool]:
    layout = layout_from_hf(SYNTHETIC, t)
    specs = megatron_params(layout)
    shards = [dict(hf_to_megatron(hf, layout, r)) for r in range(t)]
    gpu_sources = {s.name: [shards[r][s.name].reshape(-1).contiguous() for r in range(t)] if s.dim is not None
                   else [shards[0][s.name].reshape(-1).contiguous()] for s in specs}
    del shards
    gpu = bucket_programs(layout, specs, gpu_sources, i, "cuda")
    for program, slots in gpu:
        program.run(slots)
    cpu_sources = {n: [x.cpu() for x in v] for n, v in gpu_sources.items()}
    cpu = bucket_programs(layout, specs, cpu_sources, i, "cpu")
    for program, slots in cpu:
        program.run(slots)
    equal = all(bits_equal(c[1][0], g[1][0].cpu()) for c, g in zip(cpu, gpu))
    del cpu, cpu_sources
    nbytes = 2 * sum(slots[0].numel() for _, slots in gpu)
    ms, host_ms = device_median_ms(lambda: [p.run(s) for p, s in gpu], repeats)
    return report(f"t={t} -> i={i}", nbytes, equal, ms, host_ms, d2d_ms(nbytes, repeats)), equal


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not getattr(_C, "with_cuda", False):
        print(f"needs CUDA: torch.cuda.is_available()={torch.cuda.is_available()}, "
              f"yatt._C.with_cuda={getattr(_C, 'with_cuda', False)}")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    all_equal = odd_plans_case()
    hf = synthetic_gpu_state(SYNTHETIC)
    flat, equal = flat_case(2 * sum(v.numel() for v in hf.values()), args.repeats)
    all_equal &= equal
    torch.cuda.empty_cache()
    ratios = []
    for t, i in ((2, 1), (4, 2), (1, 4)):
        ratio, equal = reshard_case(hf, t, i, args.repeats)
        ratios.append(ratio)
        all_equal &= equal
        torch.cuda.empty_cache()
    if not all_equal:
        print("MISMATCH between the CUDA and CPU kernels")
    print(f"gpu_reshard_flat_vs_d2d={flat:.3f}")
    print(f"gpu_reshard_vs_d2d={min(ratios):.3f}")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
