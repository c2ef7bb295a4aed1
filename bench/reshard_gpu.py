"""GPU check of the resharding kernel: equality with the CPU kernel and bandwidth against a
device-to-device copy, in one run.

    YATT_WITH_CUDA=1 pip install --no-build-isolation --no-deps -e .   # CUDA build of yatt._C
    python bench/reshard_gpu.py [--repeats 20]

Needs a CUDA build of torch and of ``yatt._C`` (exits with a message otherwise). For the
synthetic ~1 GB Llama of ``bench/reshard.py`` (bf16) and t -> i in (2 -> 1, 4 -> 2, 1 -> 4):
builds the t training shards on the GPU, runs every inference rank's bucketed copy programs
with the CUDA kernel, checks the result is bit-equal to the CPU kernel's on the same shards,
and times it (CUDA events, median of ``--repeats``) against ``Tensor.copy_`` of one
contiguous device buffer of the same size. Final line:

    gpu_reshard_vs_d2d=<min over cases of copy time / reshard time>
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reshard import SYNTHETIC, _synthetic_state, bucket_programs  # noqa: E402

from yatt import _C  # noqa: E402
from yatt.reshard import megatron_params  # noqa: E402
from yatt.trainer.hf_mapping import hf_to_megatron, layout_from_hf  # noqa: E402


def cuda_median_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not getattr(_C, "with_cuda", False):
        print(f"needs CUDA: torch.cuda.is_available()={torch.cuda.is_available()}, "
              f"yatt._C.with_cuda={getattr(_C, 'with_cuda', False)}")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    hf = _synthetic_state(SYNTHETIC)
    for k, v in hf.items():  # distinct values, so a misplaced block shows
        v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(hash(k) % 2**31)))
    ratios = []
    for t, i in ((2, 1), (4, 2), (1, 4)):
        layout = layout_from_hf(SYNTHETIC, t)
        specs = megatron_params(layout)
        shards = [dict(hf_to_megatron(hf, layout, r)) for r in range(t)]
        cpu_sources = {s.name: [shards[r][s.name].reshape(-1).contiguous() for r in range(t)] if s.dim is not None
                       else [shards[0][s.name].reshape(-1).contiguous()] for s in specs}
        gpu_sources = {n: [x.cuda() for x in v] for n, v in cpu_sources.items()}
        cpu = bucket_programs(layout, specs, cpu_sources, i, "cpu")
        gpu = bucket_programs(layout, specs, gpu_sources, i, "cuda")
        for program, slots in cpu:
            program.run(slots)
        for program, slots in gpu:
            program.run(slots)
        equal = all(torch.equal(c[1][0], g[1][0].cpu()) for c, g in zip(cpu, gpu))
        nbytes = 2 * sum(slots[0].numel() for _, slots in gpu)
        ms = cuda_median_ms(lambda: [p.run(s) for p, s in gpu], args.repeats)
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = cuda_median_ms(lambda: dst.copy_(src), args.repeats)
        ratios.append(copy_ms / ms)
        print(f"t={t} -> i={i}: {nbytes / 1e9:.3f} GB, equal_to_cpu={equal}, reshard {nbytes / ms / 1e6:.0f} GB/s, "
              f"d2d copy {nbytes / copy_ms / 1e6:.0f} GB/s, ratio {copy_ms / ms:.3f}", flush=True)
        if not equal:
            print("MISMATCH between the CUDA and CPU kernels")
            return 1
        del gpu, gpu_sources, src, dst
        torch.cuda.empty_cache()
    print(f"gpu_reshard_vs_d2d={min(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
