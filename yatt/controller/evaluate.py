"""Greedy held-out evaluation: each rank scores its own eval shard, accuracy is reduced."""
from __future__ import annotations

from yatt.controller.metrics import global_means


def evaluate(engine, rows, score_fn, tokenizer, max_tokens: int) -> dict[str, float]:
    """Greedy-decode this rank's eval prompts and score them (collective: the reduction).

    ``engine`` may be None on a rank without eval prompts (a GenRM-only rank). ``score_fn(rows,
    texts) -> list[float]`` scores the responses (``texts[i]`` answers ``rows[i]``; 1 = correct).

    Returns:
        ``eval_accuracy`` (fraction with reward exactly 1), ``eval_reward_mean`` and
        ``eval_response_len_mean`` over all ranks' eval prompts.
    """
    from yatt.rollout.vllm_engine import SamplingSpec

    spec = SamplingSpec(n=1, max_tokens=max_tokens, temperature=0.0)
    outs = engine.generate([r.prompt_ids for r in rows], spec) if rows else []
    scores = score_fn(rows, [tokenizer.decode(c.token_ids, skip_special_tokens=True) for (c,) in outs]) if rows else []
    n = len(rows)
    return global_means({
        "eval_accuracy": (sum(float(r == 1.0) for r in scores), n), "eval_reward_mean": (sum(scores), n),
        "eval_response_len_mean": (sum(len(c.token_ids) for (c,) in outs), n),
    })
