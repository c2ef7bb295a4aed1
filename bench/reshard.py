"""Resharding benchmark: the copy kernel against a plain copy of the same bytes, in one run.

    python bench/reshard.py [--repeats 11] [--threads 0] [--demo-run runs/grpo_smollm2]

Cases (bf16, CPU): the demo model SmolLM2-135M (its 3 KV heads allow t, i in {1, 3}: t=3 -> i=1
and t=1 -> i=3) and a synthetic Llama of about 1 GB (16 heads / 4 KV heads, hidden 2048, MLP
5632, 9 layers, vocabulary 32000, untied) with t=2 -> i=1 and t=4 -> i=2. Each case builds the
t training shards in memory, then times producing *every* inference rank's HF tensors from them
(bytes moved = the model's bytes once) in buckets of 512 MiB, one kernel call per bucket, with
the same number of threads torch uses. References: one contiguous buffer of the same size
copied by ``torch.Tensor.copy_`` (torch's own multi-threaded copy) and by the kernel as a single
block (threaded ``memcpy``). All destinations are allocated and touched before timing, so the
numbers compare copying, not page faults. The three run in ``--repeats`` rounds after one
warm-up round, each round calling each once (``timing.interleaved_times``). Prints GB/s per case
(medians over the rounds); ``ratio`` is the median over the rounds of the reshard's bandwidth
over the faster reference *in the same round*, so a shared machine's drifting load (the same
copy ran at 9 and at 18.7 GB/s in runs minutes apart) falls on both sides. The final line is

    reshard_vs_memcpy=<min over cases of ratio>

With ``--demo-run`` pointing at a finished demo run (``make demo``), it also prints the weight
sync's share of the step time from that run's ``metrics.jsonl`` (mean over the steps).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from timing import interleaved_times

from yatt.reshard import copy_blocks, megatron_params, plan_buckets, run_copies
from yatt.reshard.kernel import CopyProgram
from yatt.reshard.plan import target_shape
from yatt.trainer.hf_mapping import hf_to_megatron, layout_from_hf

SYNTHETIC = dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=9,
                 num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
BUCKET_BYTES = 512 << 20


def _synthetic_state(cfg: dict) -> dict[str, torch.Tensor]:
    """HF-shaped bf16 tensors (values do not matter for bandwidth; filled so pages are touched)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(LlamaConfig(**cfg)).named_parameters()}
    return {n: torch.full(s, 0.5, dtype=torch.bfloat16) for n, s in shapes.items()}


def _demo_state() -> tuple[dict, dict[str, torch.Tensor]]:
    from yatt.assets.model import resolve_model
    from yatt.trainer.model import SafetensorsState, read_hf_config

    path = resolve_model("smollm2-135m-instruct")
    state = SafetensorsState(path)
    return read_hf_config(path), {n: state[n].to(torch.bfloat16) for n in state}


def bucket_programs(layout, specs, sources: dict, i: int, device) -> list[tuple[CopyProgram, list]]:
    """Every inference rank's tensors, bucket by bucket, as BucketedSync runs them: one compiled
    program per bucket, with its slots (0: the bucket's bf16 output buffer on ``device``, then
    the flattened source shards ``sources[name]``)."""
    flat = [t for s in specs for t in sources[s.name]]
    slot_of = {id(t): k + 1 for k, t in enumerate(flat)}
    programs = []
    for j in range(i):
        for bucket in plan_buckets(specs, layout, BUCKET_BYTES, 2, i, j):
            jobs, pos = [], 0
            for s in bucket:
                refs = [(slot_of[id(t)], 0) for t in sources[s.name]]
                for (n, shape), blocks in zip(s.targets, copy_blocks(s, layout, i, j)):
                    jobs.append((refs, (0, pos), blocks))
                    pos += torch.Size(target_shape(n, shape, layout, i, j)).numel()
            out = torch.zeros(pos, dtype=torch.bfloat16, device=device)
            programs.append((CopyProgram([pos, *(t.numel() for t in flat)], jobs), [out, *flat]))
    return programs


def bench_case(cfg: dict, hf: dict[str, torch.Tensor], t: int, i: int, repeats: int, threads: int) -> dict:
    layout = layout_from_hf(cfg, t)
    shards = [dict(hf_to_megatron(hf, layout, r)) for r in range(t)]
    specs = megatron_params(layout)
    sources = {s.name: [shards[r][s.name].reshape(-1) for r in range(t)] if s.dim is not None
               else [shards[0][s.name].reshape(-1)] for s in specs}
    nbytes = 0
    for j in range(i):
        for s in specs:
            nbytes += 2 * sum(torch.Size(target_shape(n, shape, layout, i, j)).numel() for n, shape in s.targets)

    programs = bucket_programs(layout, specs, sources, i, "cpu")

    def reshard():
        for program, buffers in programs:
            program.run(buffers, threads)

    src = torch.full((nbytes // 2,), 0.5, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    whole = np.array([[0, 0, src.numel(), 0, src.numel(), 1, src.numel()]], dtype=np.int64)

    def torch_copy():
        dst.copy_(src)

    def memcpy():  # the same bytes as one contiguous block: threaded memcpy
        run_copies([([src], dst, whole)], threads)

    times = interleaved_times({"reshard": reshard, "torch": torch_copy, "memcpy": memcpy}, repeats)
    gbs = {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}
    ratio = statistics.median(min(a, b) / r for r, a, b in zip(times["reshard"], times["torch"], times["memcpy"]))
    return dict(gb=nbytes / 1e9, **gbs, ratio=ratio)


def sync_share(run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time_sync_s" in r and "time_step_s" in r]
    if not rows:
        return f"{run_dir}: no steps with time_sync_s"
    sync = statistics.mean(r["time_sync_s"] for r in rows)
    step = statistics.mean(r["time_step_s"] for r in rows)
    return f"demo sync: {sync:.3f} s of a {step:.1f} s step = {100 * sync / step:.2f}% ({len(rows)} steps, {run_dir})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: torch.get_num_threads())")
    ap.add_argument("--demo-run", type=Path, default=None, help="a finished demo run directory")
    args = ap.parse_args()
    threads = args.threads or torch.get_num_threads()
    print(f"threads={threads} (torch copy uses {torch.get_num_threads()})", flush=True)
    demo_cfg, demo = _demo_state()
    cases = [("smollm2-135m", demo_cfg, demo, 3, 1), ("smollm2-135m", demo_cfg, demo, 1, 3)]
    synthetic = _synthetic_state(SYNTHETIC)
    cases += [("llama-1gb", SYNTHETIC, synthetic, 2, 1), ("llama-1gb", SYNTHETIC, synthetic, 4, 2)]
    ratios = []
    print(f"{'model':<14}{'t->i':>6}{'GB':>8}{'reshard GB/s':>14}{'torch copy_':>13}{'memcpy':>9}{'ratio':>8}")
    for name, cfg, hf, t, i in cases:
        r = bench_case(cfg, hf, t, i, args.repeats, threads)
        ratios.append(r["ratio"])
        print(f"{name:<14}{f'{t}->{i}':>6}{r['gb']:>8.3f}{r['reshard']:>14.2f}{r['torch']:>13.2f}"
              f"{r['memcpy']:>9.2f}{r['ratio']:>8.3f}", flush=True)
    if args.demo_run is not None:
        print(sync_share(args.demo_run))
    print(f"reshard_vs_memcpy={min(ratios):.3f}")


if __name__ == "__main__":
    main()
