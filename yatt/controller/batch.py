"""A rank's rollout samples and their packing into trainer micro-batches.

One :class:`Sample` is one response to one prompt. Micro-batches are right-padded
``prompt + response`` rows; which samples share one is decided by the C++ balancer
(:func:`yatt.balance.split_micro_batches` or :func:`yatt.balance.dp_balance`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from yatt.algos.grpo import response_mask
from yatt.controller import wire


@dataclass
class Sample:
    """One response to one prompt and what the step knows about it. Each field declares how it
    travels between DP ranks (:mod:`yatt.controller.wire`), so a field added here (or in a
    subclass) moves with the sample when the balancer re-partitions a step."""

    prompt_ids: list[int] = field(metadata=wire.TOKENS)
    response_ids: list[int] = field(metadata=wire.TOKENS)
    rollout_logprobs: list[float] = field(metadata=wire.PER_TOKEN)  # engine's logprob of each response token
    finish_reason: str = field(metadata=wire.choice("stop", "length"))
    reward: float = field(default=0.0, metadata=wire.SCALAR)
    advantage: float = field(default=0.0, metadata=wire.SCALAR)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def pack_micro_batches(samples: list[Sample], groups, pad_id: int) -> list[dict]:
    """Pack samples into one micro-batch per group of indices.

    Args:
        samples: the samples the indices point into.
        groups: index lists/arrays into ``samples``, one per micro-batch (empty ones are skipped).
        pad_id: token id filling each row after its sequence.
    Returns:
        list of dicts with ``input_ids`` long ``[B, T]`` (pad: ``pad_id``), ``response_mask``
        float ``[B, T]``, ``rollout_logprobs`` float ``[B, T]`` (aligned with the token they
        score, 0 outside responses), ``advantages`` float ``[B, 1]`` and ``index`` long ``[B]``
        (positions in ``samples``).
    """
    out = []
    for idx in groups:
        idx = [int(i) for i in idx]
        if not idx:
            continue
        rows = [samples[i] for i in idx]
        width = max(s.length for s in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        lps = torch.zeros((len(rows), width), dtype=torch.float32)
        for b, s in enumerate(rows):
            p, r = len(s.prompt_ids), len(s.response_ids)
            ids[b, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
            lps[b, p : p + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        out.append({
            "input_ids": ids,
            "response_mask": response_mask([len(s.prompt_ids) for s in rows], [len(s.response_ids) for s in rows], width),
            "rollout_logprobs": lps,
            "advantages": torch.tensor([[s.advantage] for s in rows], dtype=torch.float32),
            "index": torch.tensor(idx, dtype=torch.long),
        })
    return out


def make_samples(rows, completions, rewards: list[float], estimator=None) -> list[Sample]:
    """Turn each prompt's ``n`` scored completions into samples with outcome advantages.

    Args:
        rows: the step's :class:`~yatt.assets.data.PromptRow` list (``G`` prompts).
        completions: ``G`` lists of ``n`` engine completions (token ids, logprobs, finish reason).
        rewards: ``G * n`` floats, prompt-major (``rewards[g * n + k]`` scores completion k of g).
        estimator: ``[G, n] -> [G, n]`` advantages (:mod:`yatt.algos.estimators`; default GRPO).
    Returns:
        ``G * n`` samples, prompt-major.
    Raises:
        ValueError: the number of rewards is not ``G * n``; the estimator's output is not a
            finite ``[G, n]`` tensor.
    """
    from yatt.algos.estimators import advantages, grpo

    samples = [Sample(row.prompt_ids, list(c.token_ids), list(c.logprobs), c.finish_reason)
               for row, group in zip(rows, completions) for c in group]
    if len(rewards) != len(samples):
        raise ValueError(f"{len(rewards)} rewards for {len(samples)} samples")
    if samples:
        n = len(completions[0])
        adv = advantages(estimator or grpo, torch.tensor(rewards, dtype=torch.float32).view(-1, n)).flatten()
        for s, r, a in zip(samples, rewards, adv.tolist()):
            s.reward, s.advantage = float(r), a
    return samples
