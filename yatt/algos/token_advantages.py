"""Token-level advantages: REINFORCE++'s KL-shaped token rewards, discounted returns and their
whitening over the whole step (every mini-batch, every DP rank): pure tensor functions plus one
reduction.

REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
Models", sec. 3): the token reward is ``r_t = -beta * KL_t`` plus the outcome score at the
response's last token, ``KL_t = log pi_old(y_t) - log pi_ref(y_t)`` (k1); the return is
``G_t = sum_{s >= t} gamma^(s - t) r_s``; the advantage is ``G`` whitened over the global batch,
``(G - mean) / (std + eps)`` over all response tokens. ``reinforce_pp_baseline`` first subtracts
the group's mean score (its outcome stage, :mod:`yatt.algos.estimators`).

Shapes: ``B`` rows, ``T`` positions; ``mask`` float ``[B, T]`` marks the response tokens of a
right-padded ``prompt + response`` row (contiguous).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from yatt.algos.grpo import masked


def token_rewards(scores: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """``r_t = -beta * KL_t`` on response tokens, plus ``scores`` at each row's last response token.

    Args:
        scores: float ``[B]`` or ``[B, 1]`` outcome scores. kl: float ``[B, T]`` per-token KL
            estimates, or None (no KL term). mask: float ``[B, T]``. beta: KL coefficient.
    Returns:
        float32 ``[B, T]``, 0 outside the response.
    """
    mask = mask.to(torch.float32)
    rewards = torch.zeros_like(mask) if kl is None or beta == 0 else masked(-beta * kl.to(torch.float32), mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).amax(-1)  # -1: a row without response tokens
    rows = torch.nonzero(last >= 0).flatten()
    rewards[rows, last[rows]] += scores.reshape(-1).to(torch.float32)[rows]
    return rewards


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{s >= t} gamma^(s - t) r_s`` over each row's response tokens (0 outside).

    Args:
        rewards, mask: float ``[B, T]``. gamma: discount in (0, 1].
    Returns:
        float32 ``[B, T]``.
    """
    rewards = masked(rewards.to(torch.float32), mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return masked(returns, mask)


def whitening_moments(values: list[torch.Tensor], masks: list[torch.Tensor], group=None) -> tuple[float, float]:
    """(mean, unbiased std) of ``values`` over the masked tokens of every tensor of the list and
    of every rank of ``group``: one all-reduce of (count, sum, sum of squares), never a gather.

    Args:
        values, masks: float ``[B_i, T_i]`` each, pairwise the same shape.
    Returns:
        (mean, std); (0.0, 1.0) with fewer than 2 tokens in all.
    """
    acc = torch.zeros(3, dtype=torch.float64)
    for v, m in zip(values, masks):
        v, m = masked(v.to(torch.float64), m), m.to(torch.float64)
        acc += torch.stack([m.sum(), v.sum(), (v * v).sum()])
    if dist.is_initialized():
        dist.all_reduce(acc, group=group)
    n, s, sq = acc.tolist()
    if n < 2:
        return 0.0, 1.0
    mean = s / n
    return mean, max((sq - n * mean * mean) / (n - 1), 0.0) ** 0.5


def reinforce_pp_advantages(micro_batches: list[dict], beta: float, gamma: float, group=None,
                            eps: float = 1e-8) -> None:
    """REINFORCE++ advantages written into each micro-batch's ``advantages`` (``[B, T]``, replacing
    the outcome scores ``[B, 1]`` its outcome stage left there); collective over ``group``.

    Reads per micro-batch: ``advantages`` ``[B, 1]`` (the outcome score), ``response_mask``,
    ``old_logprobs`` and, when ``beta > 0``, ``ref_logprobs``. Adds ``returns`` ``[B, T]``.
    """
    for mb in micro_batches:
        mask = mb["response_mask"]
        kl = mb["old_logprobs"] - mb["ref_logprobs"] if beta > 0 else None  # k1, as the paper
        mb["returns"] = discounted_returns(token_rewards(mb["advantages"], kl, mask, beta), mask, gamma)
    mean, std = whitening_moments([mb["returns"] for mb in micro_batches],
                                  [mb["response_mask"] for mb in micro_batches], group)
    for mb in micro_batches:
        mb["advantages"] = masked((mb["returns"] - mean) / (std + eps), mb["response_mask"])
