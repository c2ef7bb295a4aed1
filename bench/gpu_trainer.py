"""The Megatron trainer against plain transformers on one GPU: train step, logprob pass, MFU, peak
memory, and the weight sync against a device-to-device copy, in one process.

    python bench/gpu_trainer.py [--shapes smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b] [--repeats 3]
                                [--profile DIR] [--dry-run]

World 1 (``yatt.dist.init_distributed``: NCCL on CUDA, gloo on the CPU; no launcher needed). For
each model shape (random weights in the real model's configuration, built in code, no downloads):
SmolLM2-135M (Llama, tied), Qwen2.5-0.5B and Qwen2.5-1.5B (Qwen2: QKV bias, tied), in bf16 on
CUDA, on the same 4 micro-batches of 8 x 1024 random token ids (fixed seed; ``input_ids`` only,
so every position after the first is scored):

1. transformers (``attn_implementation="sdpa"``, ``torch.optim.AdamW(fused=True)``): a train step
   is zero_grad; per micro-batch logits -> fp32 log_softmax -> next-token logprobs -> loss =
   -(their sum) / their count -> backward; ``clip_grad_norm_(1.0)``; ``step()``. The logprob pass
   is the same forward for the 4 micro-batches under ``torch.no_grad()``. The micro-batches are
   on the GPU beforehand.
2. The same weights saved (safetensors) and loaded as ``MegatronPolicy(dtype=bf16, optim=AdamW
   lr 1e-6, clip 1.0)``: ``train_step`` with the same loss, ``compute_logprobs``. Its
   micro-batches are CPU tensors, as the job hands them (the policy copies them). Before timing,
   micro-batch 0's logprobs are compared with transformers' (max and mean |diff|; over the
   tolerance, ``LOGPROB_TOL``, the script exits 1 after printing everything).
3. The weight sync of that policy: ``export_hf_weights()`` (default bucket size), every tensor
   kept until the end, then ``torch.cuda.synchronize()``; against one ``copy_`` of a buffer of
   the same bytes on the device. At TP=1 some HF tensors are views of the parameters (no copy,
   see ``yatt.reshard.sync``), so the sync can beat the copy (ratio > 1).

Times are wall clock (``torch.cuda.synchronize()`` before each clock read), the median of
``--repeats`` after warm-ups (2 train steps, 1 logprob pass, 1 sync). Peak memory is
``torch.cuda.max_memory_allocated`` over the timed train steps (weights, grads and optimizer
states included). MFU = 6 x (matmul parameters per token: the layers' and the tied output
layer's, no embedding lookup; + causal attention multiply-adds per token, layers x 2 x heads x
head_dim x (T + 1) / 2) x tokens / train step time / 989e12 (H200 dense bf16 peak).

Output: one line per shape,

    <shape>: params <P>M, tokens <N>; hf train <s> s, logprob <s> s, peak <GiB> GiB, mfu <x>;
    yatt train <s> s, logprob <s> s, peak <GiB> GiB, mfu <x>, logprob |diff| vs hf max <d> mean <d>;
    sync <GB> GB in <s> s (<s/GB> s/GB), d2d copy <s> s (<s/GB> s/GB), d2d/sync <r>

then, for the largest shape run (the last of equal sizes), one per line:

    gpu_train_vs_hf=<HF train step time / YATT train step time>   (> 1: YATT faster)
    gpu_logprob_vs_hf=<HF logprob pass time / YATT logprob pass time>
    gpu_mfu=<YATT train step MFU>
    gpu_peak_gib=<YATT peak GiB> (hf <HF peak GiB>)
    gpu_sync_vs_d2d=<min over shapes of d2d copy time / sync time>

``--profile DIR`` also writes ``DIR/gpu_trainer_profile_{yatt,hf}.txt``: torch.profiler's table
(top 40 by self CUDA time) of one train step of each on the largest shape.

``--dry-run`` (automatic without CUDA; hides the GPUs when given on a GPU machine): the same code
on the CPU in fp32 over gloo with tiny models (2 layers, hidden 64, 4 heads / 2 KV heads, vocab
256, each shape's model type and tying; shapes that then coincide run once), micro-batches 2 x 32,
one repeat: a check that the script runs, whose ratios say nothing about a GPU (peak memory prints
0: CUDA only).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))
from gpu_models import SHAPES, TINY, hf_model  # noqa: E402

MICRO_BATCHES, ROWS, SEQ = 4, 8, 1024
DRY_ROWS, DRY_SEQ = 2, 32
PEAK_FLOPS = 989e12  # H200 (SXM) dense bf16
TRAIN_WARMUP, LOGPROB_WARMUP, SYNC_WARMUP = 2, 1, 1
# (max, mean) |diff| of micro-batch 0's logprobs against transformers'. bf16 against bf16 through two
# sets of kernels: on the H200 (2026-12-04) the max grew with depth, 0.028 (135M, 30 layers), 0.048
# (0.5B), 0.121 (1.5B, 28 layers of hidden 1536) at logprobs near -12; a wiring error moves them by ~1
LOGPROB_TOL = {"bfloat16": (0.25, 0.02), "float32": (1e-3, 1e-4)}


def matmul_params(cfg: dict) -> int:
    """Multiply-adds per token of the weight matmuls: q, k, v, o, gate, up, down per layer and the
    (tied) output layer; no embedding lookup, no biases or norms."""
    h, ffn, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    return layers * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + h * cfg["vocab_size"]


def attention_macs(cfg: dict, seq: int) -> float:
    """Causal attention multiply-adds per token averaged over positions: QK^T and PV over the
    ``(T + 1) / 2`` keys a position sees on average."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_attention_heads"] * head_dim * (seq + 1) / 2


class Clock:
    """Wall-clock timing with the device synchronised before each clock read."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def once(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def median(self, fn, repeats: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(self.once(fn) for _ in range(repeats))


def reset_peak(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(cuda: bool) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0


def free_memory(cuda: bool) -> None:
    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def profile_step(fn, path: Path, cuda: bool) -> None:
    """torch.profiler's table of one call of ``fn`` (top 40 by self device time, CPU time on the
    CPU) written to ``path``; a profiler failure is reported, not raised."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=40)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table + "\n")
        print(f"profile: {path}", flush=True)
    except Exception as e:  # noqa: BLE001 (the benchmark's numbers matter more than its profile)
        print(f"profile {path.name} failed: {type(e).__name__}: {e}", flush=True)


def measure(train_step, logprob_pass, clock: Clock, repeats: int, profile_to: Path | None) -> tuple[float, ...]:
    """(median train step s, its peak GiB, median logprob pass s) after the warm-ups; with
    ``profile_to``, one more profiled train step between the two."""
    for _ in range(TRAIN_WARMUP):
        train_step()
    reset_peak(clock.cuda)
    train_s = clock.median(train_step, repeats, 0)
    peak = peak_gib(clock.cuda)
    if profile_to is not None:
        profile_step(train_step, profile_to, clock.cuda)
    return train_s, peak, clock.median(logprob_pass, repeats, LOGPROB_WARMUP)


# ---- transformers ----------------------------------------------------------------------------
def hf_next_logprobs(model, ids):
    """[B, T-1] fp32 log p(ids[:, t] | ids[:, :t]) for t >= 1."""
    import torch

    logits = model(input_ids=ids, use_cache=False).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def run_hf(cfg: dict, mbs: list, dtype, device, clock: Clock, args, folder: Path, profile_to: Path | None) -> dict:
    """Time transformers' train step and logprob pass; save the weights (as they are after the
    timed steps) to ``folder``. Returns the numbers and micro-batch 0's logprobs (on the CPU)."""
    import torch

    model = hf_model(cfg, dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = [mb["input_ids"].to(device) for mb in mbs]

    def train_step():
        model.train()
        opt.zero_grad(set_to_none=True)
        for x in ids:
            lp = hf_next_logprobs(model, x)
            (-lp.sum() / lp.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    out = {}

    def logprob_pass():
        model.eval()
        with torch.no_grad():
            out["lp"] = [hf_next_logprobs(model, x) for x in ids]

    train_s, peak, logprob_s = measure(train_step, logprob_pass, clock, args.repeats, profile_to)
    lp0 = out["lp"][0].float().cpu()
    model.save_pretrained(folder)  # the weights of the last logprob pass
    del model, opt, ids, out
    return {"train_s": train_s, "logprob_s": logprob_s, "peak_gib": peak, "lp0": lp0}


# ---- YATT ------------------------------------------------------------------------------------
def mean_logprob_loss(logprobs, entropy, mb):
    """The transformers reference's loss: -(sum of logprobs at t >= 1) / their count."""
    lp = logprobs[:, 1:]
    loss = -lp.sum() / lp.numel()
    return loss, {"loss": loss.detach()}


def run_yatt(mbs: list, dtype, clock: Clock, args, folder: Path, hf_lp0, profile_to: Path | None) -> dict:
    import torch

    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    cuda = clock.cuda
    policy = MegatronPolicy(folder, dtype=dtype, optim=OptimConfig(lr=1e-6, clip_grad=1.0, total_steps=1000))
    lp0 = policy.compute_logprobs(mbs[:1])[0][0]
    err = (lp0[:, 1:].float().cpu() - hf_lp0).abs()
    diff, mean_diff = float(err.max()), float(err.mean())

    def train_step():
        policy.train_step(mbs, mean_logprob_loss)

    def logprob_pass():
        policy.compute_logprobs(mbs)

    train_s, peak, logprob_s = measure(train_step, logprob_pass, clock, args.repeats, profile_to)
    nbytes = [0]

    def sync():
        kept, n = [], 0
        for _, t in policy.export_hf_weights():
            kept.append(t)
            n += t.nbytes
        clock.sync()  # inside the timed call: the copies are done before the clock is read
        nbytes[0] = n

    sync_s = clock.median(sync, args.repeats, SYNC_WARMUP)
    del policy
    free_memory(cuda)
    device = "cuda" if cuda else "cpu"
    src = torch.empty(nbytes[0], dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    d2d_s = clock.median(lambda: dst.copy_(src), args.repeats, 1)
    del src, dst
    return {"train_s": train_s, "logprob_s": logprob_s, "peak_gib": peak, "diff": diff, "mean_diff": mean_diff,
            "sync_bytes": nbytes[0], "sync_s": sync_s, "d2d_s": d2d_s}


# ---- driver ----------------------------------------------------------------------------------
def micro_batches(vocab: int, rows: int, seq: int, seed: int = 0) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (MICRO_BATCHES, rows, seq), generator=g)
    return [{"input_ids": ids[i].clone()} for i in range(MICRO_BATCHES)]


def run_shape(name: str, cfg: dict, dtype, clock: Clock, args, rows: int, seq: int, tmp: Path,
              profile_dir: Path | None) -> dict:
    device = "cuda" if clock.cuda else "cpu"
    mbs = micro_batches(cfg["vocab_size"], rows, seq)
    folder = tmp / name
    hf = run_hf(cfg, mbs, dtype, device, clock, args, folder,
                profile_dir / "gpu_trainer_profile_hf.txt" if profile_dir else None)
    free_memory(clock.cuda)
    ya = run_yatt(mbs, dtype, clock, args, folder, hf.pop("lp0"),
                  profile_dir / "gpu_trainer_profile_yatt.txt" if profile_dir else None)
    free_memory(clock.cuda)
    shutil.rmtree(folder)
    tokens = MICRO_BATCHES * rows * seq
    flops = 6 * (matmul_params(cfg) + attention_macs(cfg, seq)) * tokens
    hf["mfu"], ya["mfu"] = flops / hf["train_s"] / PEAK_FLOPS, flops / ya["train_s"] / PEAK_FLOPS
    gb = ya["sync_bytes"] / 1e9
    r = {"name": name, "params": matmul_params(cfg), "tokens": tokens, "hf": hf, "yatt": ya,
         "d2d_vs_sync": ya["d2d_s"] / ya["sync_s"]}
    tol = LOGPROB_TOL[str(dtype).removeprefix("torch.")]
    r["agree"] = ya["diff"] <= tol[0] and ya["mean_diff"] <= tol[1]
    print(f"{name}: params {r['params'] / 1e6:.1f}M, tokens {tokens}; "
          f"hf train {hf['train_s']:.4f} s, logprob {hf['logprob_s']:.4f} s, peak {hf['peak_gib']:.2f} GiB, "
          f"mfu {hf['mfu']:.4g}; "
          f"yatt train {ya['train_s']:.4f} s, logprob {ya['logprob_s']:.4f} s, peak {ya['peak_gib']:.2f} GiB, "
          f"mfu {ya['mfu']:.4g}, logprob |diff| vs hf max {ya['diff']:.2e} mean {ya['mean_diff']:.2e} "
          f"({'ok' if r['agree'] else 'OVER'} tol {tol[0]:g} / {tol[1]:g}); "
          f"sync {gb:.4f} GB in {ya['sync_s']:.5f} s ({ya['sync_s'] / gb:.5f} s/GB), "
          f"d2d copy {ya['d2d_s']:.5f} s ({ya['d2d_s'] / gb:.5f} s/GB), d2d/sync {r['d2d_vs_sync']:.3f}",
          flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 3; 1 in a dry run)")
    ap.add_argument("--profile", type=Path, default=None, help="folder for the profiler tables")
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny shapes (automatic without CUDA)")
    args = ap.parse_args()
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        ap.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch looks for a GPU: the same code on the CPU

    import torch
    from transformers.utils import logging as hf_logging

    from yatt.dist import init_distributed

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar
    t_start = time.perf_counter()
    dry = args.dry_run or not torch.cuda.is_available()
    if args.repeats is None:
        args.repeats = 1 if dry else 3
    info = init_distributed()
    cuda = torch.cuda.is_available()
    dtype = torch.float32 if dry else torch.bfloat16
    rows, seq = (DRY_ROWS, DRY_SEQ) if dry else (ROWS, SEQ)
    shapes = {n: ({**SHAPES[n], **TINY} if dry else SHAPES[n]) for n in names}
    if dry:  # shapes that differ only in size are the same tiny model: each one runs once
        shapes = {n: c for i, (n, c) in enumerate(shapes.items()) if c not in list(shapes.values())[:i]}
        names = list(shapes)
    largest = max(range(len(names)), key=lambda i: (matmul_params(shapes[names[i]]), i))
    print(f"gpu_trainer: world {info.world_size}, backend {torch.distributed.get_backend()}, "
          f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, dtype {str(dtype).removeprefix('torch.')}, "
          f"{MICRO_BATCHES} micro-batches of {rows} x {seq}, repeats {args.repeats}"
          + (" -- DRY RUN on the CPU: the numbers say nothing about a GPU" if dry else ""), flush=True)
    clock = Clock(cuda)
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_trainer_") as tmp:
        for i, name in enumerate(names):
            profile_dir = args.profile if i == largest else None
            results.append(run_shape(name, shapes[name], dtype, clock, args, rows, seq, Path(tmp), profile_dir))
    big = results[largest]
    hf, ya = big["hf"], big["yatt"]
    print(f"final ({big['name']}{', dry run: meaningless on the CPU' if dry else ''}; "
          f"{time.perf_counter() - t_start:.1f} s):", flush=True)
    print(f"gpu_train_vs_hf={hf['train_s'] / ya['train_s']:.3f}", flush=True)
    print(f"gpu_logprob_vs_hf={hf['logprob_s'] / ya['logprob_s']:.3f}", flush=True)
    print(f"gpu_mfu={ya['mfu']:.4g}", flush=True)
    print(f"gpu_peak_gib={ya['peak_gib']:.2f} (hf {hf['peak_gib']:.2f})", flush=True)
    print(f"gpu_sync_vs_d2d={min(r['d2d_vs_sync'] for r in results):.3f}", flush=True)
    bad = [r["name"] for r in results if not r["agree"]]
    if bad:
        print(f"FAILED: logprobs differ from transformers' over the tolerance for {', '.join(bad)}", flush=True)
    values = [hf["train_s"], ya["train_s"], hf["logprob_s"], ya["logprob_s"], ya["mfu"]]
    return int(bool(bad) or not all(math.isfinite(v) and v > 0 for v in values))


if __name__ == "__main__":
    sys.exit(main())
