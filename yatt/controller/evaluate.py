"""Held-out evaluation: each rank scores its own eval shard, the metrics are reduced.

Every prompt gets its greedy answer (``accuracy``); with ``k > 1`` also ``k`` sampled answers, which
give ``mean@k`` and the unbiased ``pass@j`` (:mod:`yatt.algos.pass_at_k`).
"""
from __future__ import annotations

from yatt.algos.pass_at_k import mean_at_k, pass_at_k, reported_ks
from yatt.controller.metrics import global_means
from yatt.rollout.episodes import answer_ids, make_generate


def evaluate(engine, rows, score_fn, tokenizer, max_tokens: int, *, k: int = 1, temperature: float = 1.0,
             seed: int | None = None, prefix: str = "eval_", generate=None) -> dict[str, float]:
    """Greedy-decode this rank's eval prompts (and sample ``k`` answers each when ``k > 1``) and
    score them (collective: the reduction).

    ``engine`` may be None on a rank without eval prompts (a GenRM-only rank). ``score_fn(rows,
    texts) -> list[float]`` scores the responses (``texts[i]`` answers ``rows[i]``; 1 = correct).

    Args:
        max_tokens: most response tokens of each answer, greedy and sampled.
        k: sampled answers per prompt besides the greedy one (1: the greedy answer only).
        temperature, seed: sampling of the ``k`` answers (``seed``: see ``SamplingSpec``).
        prefix: prepended to every returned name.
        generate: ``(engine, rows, spec) -> out[i][k]`` (:func:`yatt.rollout.episodes.make_generate`:
            with ``rollout.env`` an answer is an episode, scored on its last model turn); default:
            one response per prompt.
    Returns:
        ``{prefix}accuracy`` (fraction of greedy answers with score exactly 1),
        ``{prefix}reward_mean`` and ``{prefix}response_len_mean`` (tokens) of the greedy answers
        over all ranks' eval prompts; for episodes (``rollout.env``) also ``{prefix}turns_mean``
        (model turns per greedy episode) and ``{prefix}tool_use`` (the fraction of greedy episodes
        that called a tool); with ``k > 1`` also ``{prefix}mean_at_{k}`` (fraction of the
        sampled answers that are correct) and ``{prefix}pass_at_{j}`` for ``j`` in
        :func:`~yatt.algos.pass_at_k.reported_ks` (``k`` samples per prompt, unbiased estimator).
    """
    from yatt.rollout.vllm_engine import SamplingSpec

    generate = generate or make_generate(None, None)  # one response per prompt

    def answers(spec):
        # every rank with an engine calls it, also with no rows: with rollout TP its other ranks call too
        outs = generate(engine, rows, spec) if engine is not None else []
        texts = [tokenizer.decode(answer_ids(c), skip_special_tokens=True) for group in outs for c in group]
        scores = score_fn([r for r in rows for _ in range(spec.n)], texts) if rows else []
        return outs, scores

    outs, scores = answers(SamplingSpec(n=1, max_tokens=max_tokens, temperature=0.0))
    n = len(rows)
    sums = {
        "accuracy": (sum(float(r == 1.0) for r in scores), n), "reward_mean": (sum(scores), n),
        "response_len_mean": (sum(len(c.token_ids) for (c,) in outs), n),
        **_episode_means([c for (c,) in outs], n),
    }
    if k > 1:
        _, sampled = answers(SamplingSpec(n=k, max_tokens=max_tokens, temperature=temperature, seed=seed))
        correct = [[s == 1.0 for s in sampled[i * k:(i + 1) * k]] for i in range(n)]  # per prompt, its k answers
        sums[f"mean_at_{k}"] = (sum(mean_at_k(c) for c in correct), n)
        sums.update({f"pass_at_{j}": (sum(pass_at_k(k, sum(c), j) for c in correct), n) for j in reported_ks(k)})
    return global_means({prefix + name: v for name, v in sums.items()})


def _episode_means(completions, n: int) -> dict[str, tuple[float, float]]:
    """``turns_mean`` and ``tool_use`` (sum, count) of greedy episodes; none for single responses."""
    infos = [c.episode for c in completions if getattr(c, "episode", None) is not None]
    if not infos:  # ranks may report different names (global_means takes their union)
        return {}
    return {"turns_mean": (float(sum(i["turns"] for i in infos)), n),
            "tool_use": (float(sum(i.get("tool_calls", 0.0) > 0 for i in infos)), n)}
