"""A reward model on its vLLM pooling engine against a transformers forward, in one process.

    python bench/reward_model.py [--responses 32] [--batch-size 16] [--threads 1]

Makes a one-label sequence classifier from the demo policy's weights (SmolLM2-135M-Instruct, a
random score head; written once to ``runs/bench_reward_model/rm``), then scores the same
``--responses`` chat-formatted (question, response) pairs twice: with
:class:`yatt.reward.reward_model.RewardModelScorer` (what a ``reward_model`` source runs) and with
transformers' ``AutoModelForSequenceClassification`` in right-padded batches of ``--batch-size``
sorted by length. Prints the build and scoring seconds of each, the largest logit difference, and
the final line

    hf_vs_vllm_score_time=<transformers seconds over the engine's seconds> (above 1: the engine is faster)
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--responses", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from yatt.assets.model import resolve_model
    from yatt.reward.genrm import JudgeItem
    from yatt.reward.reward_model import RewardModelScorer

    torch.set_num_threads(args.threads)
    path = ROOT / "runs" / "bench_reward_model" / "rm"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        src = resolve_model("smollm2-135m-instruct")
        model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1)
        model.config.pad_token_id = model.config.eos_token_id
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(src).save_pretrained(path)
    rng = random.Random(0)
    words = "the answer is seven because three plus four equals seven so we add both numbers".split()
    items = [JudgeItem(f"What is {i} + {3 * i}? Put the answer in <answer></answer> tags.",
                       " ".join(rng.choices(words, k=rng.randint(5, 60))), str(4 * i)) for i in range(args.responses)]

    start = time.perf_counter()
    import vllm  # noqa: F401  (imported by every job before its engines: not the build's cost)
    imported = time.perf_counter()
    rm = RewardModelScorer(str(path), batch_size=args.batch_size)
    built = time.perf_counter()
    rm.score(items[:2])  # warm-up
    t0 = time.perf_counter()
    engine_scores = [r.score for r in rm.score(items)]
    engine_s = time.perf_counter() - t0
    seqs = [rm._ids(it) for it in items]
    rm.engine.shutdown()
    print(f"engine: import {imported - start:.2f} s, build {built - imported:.2f} s, score {engine_s:.2f} s "
          f"({sum(map(len, seqs))} tokens)")

    t0 = time.perf_counter()
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    hf_build = time.perf_counter() - t0
    pad = hf.config.pad_token_id
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    hf_scores = [0.0] * len(seqs)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(order), args.batch_size):
            batch = order[s:s + args.batch_size]
            width = max(len(seqs[i]) for i in batch)
            ids = torch.full((len(batch), width), pad)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(seqs[i])], mask[row, :len(seqs[i])] = torch.tensor(seqs[i]), 1
            for row, logit in zip(batch, hf(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()):
                hf_scores[row] = logit
    hf_s = time.perf_counter() - t0
    diff = max(abs(a - b) for a, b in zip(engine_scores, hf_scores))
    print(f"transformers: build {hf_build:.2f} s, score {hf_s:.2f} s; largest logit difference {diff:.1e}")
    print(f"hf_vs_vllm_score_time={hf_s / engine_s:.2f}")


if __name__ == "__main__":
    main()
