"""Padded rows against packed and shared-prompt rows on a GRPO-shaped batch, in one run.

    python bench/gpu_packing.py [--shapes smollm2-135m,qwen2.5-1.5b] [--repeats 3] [--profile DIR]

The batch: 16 prompts of 64-256 tokens x 8 responses of 32-1024 tokens (long-tailed), random
token ids (fixed seed), split into micro-batches of 2 prompts' groups as the job packs them
(:func:`yatt.controller.batch.pack_micro_batches`). For each model shape (random weights in the
real model's configuration, bf16 on CUDA; a tiny fp32 model on the CPU as a dry run) and each
``trainer.packing`` layout, one train step of a policy-gradient loss with the update skipped
(forward, backward, gradient reduction; ``skip_update``), median wall time of ``--repeats`` after
one warm-up, peak memory, the tokens the model body runs, and the layouts' logprobs against the
padded rows' (max and mean |diff| over response tokens). Final lines:

    gpu_packed_vs_padded=<padded time / shared_prompt time, min over shapes>   (the default layout)
    gpu_packed_only_vs_padded=<padded time / packed time, min over shapes>
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import SHAPES, TINY, save_random_hf  # noqa: E402

from yatt.controller.batch import Sample, pack_micro_batches  # noqa: E402

LAYOUTS = ("padded", "packed", "shared_prompt")


def grpo_batch(vocab: int, prompts: int = 16, n: int = 8, seed: int = 0, scale: float = 1.0) -> list[Sample]:
    """``prompts`` x ``n`` samples: prompts of 64-256 tokens, responses of 32-1024 (log-normal,
    median ~200), lengths times ``scale``; random ids and advantages."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(prompts):
        prompt = rng.integers(1, vocab, max(2, int(rng.integers(64, 257) * scale))).tolist()
        for _ in range(n):
            length = max(1, int(np.clip(rng.lognormal(np.log(200), 0.8), 32, 1024) * scale))
            resp = rng.integers(1, vocab, length).tolist()
            samples.append(Sample(prompt, resp, [0.0] * length, "stop", advantage=float(rng.standard_normal())))
    return samples


def pg_loss(logprobs, entropy, mb):
    """-sum(advantage x logprob) over response tokens / their count (a GRPO-shaped loss)."""
    mask = mb["response_mask"]
    loss = -(mb["advantages"] * logprobs * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"loss": loss.detach()}


def timed(fn, repeats: int, cuda: bool) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_shape(name: str, cfg: dict, dtype: torch.dtype, args, tmp: Path) -> dict[str, float]:
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    cuda = torch.cuda.is_available()
    folder = save_random_hf(cfg, tmp / name, dtype)
    policy = MegatronPolicy(folder, dtype=dtype, optim=OptimConfig(lr=1e-6, total_steps=100))
    samples = grpo_batch(cfg["vocab_size"], scale=args.scale, prompts=args.prompts)
    groups = [list(range(g * 8, g * 8 + 16)) for g in range(0, len(samples) // 8, 2)]
    useful = sum(s.length for s in samples)
    times, lps = {}, {}
    for layout in LAYOUTS:
        mbs = pack_micro_batches(samples, groups, pad_id=0, packing=layout)
        body = sum(int(mb["body_tokens"][1]) for mb in mbs)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        step = timed(lambda: policy.train_step(mbs, pg_loss, skip_update=lambda norm: True), args.repeats, cuda)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        lps[layout] = [(lp.float().cpu(), mb["response_mask"]) for (lp, _), mb in
                       zip(policy.compute_logprobs(mbs), mbs)]
        diff = [((a - b[0]).abs() * m) for (a, m), b in zip(lps[layout], lps["padded"])]
        max_diff = max(float(d.max()) for d in diff)
        mean_diff = sum(float(d.sum()) for d in diff) / sum(float(m.sum()) for _, m in lps[layout])
        times[layout] = step
        print(f"{name} {layout}: step {step:.3f} s, body tokens {body} (useful {useful}), peak {peak:.1f} GiB, "
              f"logprobs vs padded max|diff| {max_diff:.3g} mean {mean_diff:.3g}", flush=True)
        if args.profile and layout == "shared_prompt" and cuda and name == args.shapes.split(",")[-1]:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                policy.train_step(mbs, pg_loss, skip_update=lambda norm: True)
                torch.cuda.synchronize()
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            (Path(args.profile) / f"packing_{name}.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    del policy
    if cuda:
        torch.cuda.empty_cache()
    return {k: times["padded"] / v for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-1.5b")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", default=None, help="write a kernel table of one shared_prompt step here")
    ap.add_argument("--dry-run", action="store_true", help="tiny fp32 model on the CPU (automatic without CUDA)")
    args = ap.parse_args()
    from yatt.dist import init_distributed

    init_distributed()
    dry = args.dry_run or not torch.cuda.is_available()
    args.scale, args.prompts = (0.05, 4) if dry else (1.0, 16)
    shapes = {"tiny": {**SHAPES["qwen2.5-0.5b"], **TINY}} if dry else {k: SHAPES[k] for k in args.shapes.split(",")}
    dtype = torch.float32 if dry else torch.bfloat16
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in shapes.items():
            ratios[name] = run_shape(name, cfg, dtype, args, Path(tmp))
    if dry:
        print("(a CPU dry run: the ratios say nothing about a GPU)")
    print(f"gpu_packed_vs_padded={min(r['shared_prompt'] for r in ratios.values()):.3f}")
    print(f"gpu_packed_only_vs_padded={min(r['packed'] for r in ratios.values()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
