"""Greedy held-out evaluation: each rank scores its own eval shard, accuracy is reduced."""
from __future__ import annotations

from yatt.controller.metrics import global_means


def evaluate(engine, rows, reward_fn, tokenizer, max_tokens: int) -> dict[str, float]:
    """Greedy-decode this rank's eval prompts and score them (collective: the reduction).

    ``engine`` may be None on a rank without eval prompts (a GenRM-only rank).

    Returns:
        ``eval_accuracy`` (fraction with reward exactly 1), ``eval_reward_mean`` and
        ``eval_response_len_mean`` over all ranks' eval prompts.
    """
    from yatt.rollout.vllm_engine import SamplingSpec

    spec = SamplingSpec(n=1, max_tokens=max_tokens, temperature=0.0)
    outs = engine.generate([r.prompt_ids for r in rows], spec) if rows else []
    correct = reward = length = 0.0
    for row, (c,) in zip(rows, outs):
        r = reward_fn(tokenizer.decode(c.token_ids, skip_special_tokens=True), row.entry)
        correct += float(r == 1.0)
        reward += r
        length += len(c.token_ids)
    n = len(rows)
    return global_means({
        "eval_accuracy": (correct, n), "eval_reward_mean": (reward, n), "eval_response_len_mean": (length, n),
    })
