"""Preference pairs from a policy's own samples, scored by a recipe's accuracy source.

    python -m yatt.stages.pairs --config configs/grpo_smollm2.yaml --out runs/pairs [--model PATH]
                                [--n 4] [--pairs-per-prompt 1] [--max-tokens 48] [key=value ...]

For each prompt of the recipe's train and eval data (``data.*``; reasoning-gym rows are generated,
the eval set excludes every training question), the policy (``model.path``, or ``--model``)
samples ``--n`` responses on one vLLM engine; the recipe's accuracy source scores them (the
task's rule for the demo recipe), and a prompt with at least one right (score 1) and one wrong
response gives pairs: its i-th right response as ``chosen`` against its i-th wrong one as
``rejected``, for i below ``--pairs-per-prompt`` and both counts (so no response is in two
pairs). Writes ``<out>/train.jsonl`` and ``<out>/eval.jsonl`` with rows ``{"prompt", "chosen",
"rejected", "answer"}`` (the prompt's question text, the two responses, the reference
answer; a chat row's also its prompt conversation under ``data.messages_key``) and prints how
many prompts gave a pair. Sampling is seeded (``seed``), so the files
repeat for the same recipe.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def make_pairs(rows, groups: list[list[str]], scores: list[list[float]], per_prompt: int = 1,
               messages_key: str | None = None) -> list[dict]:
    """Pairs ``{"prompt", "chosen", "rejected", "answer"}`` from each row whose responses
    ``groups[i]`` (scored ``scores[i]``) hold right (1.0) and wrong (< 1.0) ones: the j-th right
    against the j-th wrong response, for j < min(``per_prompt``, rights, wrongs), in sample order.
    A chat row (one with a ``messages_key`` field) adds its prompt conversation (``row.messages``)
    under ``messages_key``, so the pairs are prompted as its samples were."""
    pairs = []
    for row, texts, score in zip(rows, groups, scores):
        right = [t for t, s in zip(texts, score) if s == 1.0]
        wrong = [t for t, s in zip(texts, score) if s < 1.0]
        chat = {messages_key: row.messages} if messages_key and row.entry.get(messages_key) is not None else {}
        pairs += [{"prompt": row.question, **chat, "chosen": c, "rejected": r, "answer": row.answer}
                  for c, r in zip(right[:per_prompt], wrong)]
    return pairs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="the policy that samples (default: the recipe's model.path)")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--pairs-per-prompt", type=int, default=1, help="at most this many pairs per prompt, no response in two")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the recipe's rollout.max_tokens")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from yatt import logs

    logs.setup("quiet")  # the library lines a job drops (yatt/logs.py)
    from transformers import AutoTokenizer

    from yatt.assets.data import load_prompts
    from yatt.assets.model import resolve_model
    from yatt.config import load_config
    from yatt.reward.scorer import StepScorer
    from yatt.rollout.vllm_engine import SamplingSpec, VLLMEngine

    cfg = load_config(args.config, args.overrides)
    path = resolve_model(args.model or cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    scorer = StepScorer(cfg.reward, cfg.data.task, cfg.data.task_config, None)
    engine = VLLMEngine(str(path), max_model_len=cfg.rollout.max_model_len,
                        kv_cache_memory_bytes=cfg.rollout.kv_cache_memory_bytes, seed=cfg.seed, dtype=cfg.model.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, seed in (("train", cfg.seed), ("eval", cfg.seed + 1)):
        rows, stats = load_prompts(cfg.data, tokenizer, split, targets=cfg.stage == "sft")
        spec = SamplingSpec(n=args.n, max_tokens=args.max_tokens or cfg.rollout.max_tokens,
                            temperature=cfg.rollout.temperature, seed=seed)
        groups = [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in g]
                  for g in engine.generate([r.prompt_ids for r in rows], spec)]
        flat_rows = [r for r, g in zip(rows, groups) for _ in g]
        flat = scorer.accuracy_scores(flat_rows, [t for g in groups for t in g])
        scores = [flat[i * args.n:(i + 1) * args.n] for i in range(len(rows))]
        pairs = make_pairs(rows, groups, scores, args.pairs_per_prompt, cfg.data.messages_key)
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in pairs)
        right = sum(s == 1.0 for s in flat) / max(len(flat), 1)
        print(f"{split}: {len(pairs)} pairs from {len(rows)} prompts x {args.n} responses "
              f"({right:.3f} of responses right; {sum(stats.skipped.values())} rows skipped) -> {out / f'{split}.jsonl'}",
              flush=True)
    engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
