"""Rollout correction, chosen by name (``algo.rollout_correction``): importance sampling between
the policy that generated a sample (the rollout engine, ``pi_rollout``, whose logprobs every
sample carries) and the policy the update starts from (the trainer's old logprobs, ``pi_old``).

The two differ when samples are stale (generated some updates ago) and, even on-policy, when the
engine's numerics differ from the trainer's (bf16 kernels, another attention). The policy loss of
each response token is multiplied by a weight ``w`` (no gradient) built from the ratio
``r = pi_old / pi_rollout`` (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training": truncated IS, and masked IS that drops instead of truncating):

- ``none``: no weight.
- ``tis``: ``w = min(r, C)`` per token.
- ``mis_token``: ``w = r`` where ``1/C <= r <= C``, else 0 (the token is dropped).
- ``mis_seq``: one ratio per sequence, ``r_seq = prod_t r_t = exp(sum_t log r_t)`` over its
  response tokens; every token gets ``w = r_seq`` where ``1/C <= r_seq <= C``, else 0.

A function ``f(old_logprob, rollout_logprob, mask, cap) -> Correction`` is a pure function of
tensors: ``B`` rows, ``T`` positions, ``mask`` 0/1 float or bool ``[B, T]`` marking the response
tokens. Log-ratios are bounded (:func:`~yatt.algos.grpo.bounded_log_ratio`) and masked positions
selected out, so any input gives finite weights. A dropped token keeps its place in the loss
normaliser (it adds 0), as a zero-advantage sample does.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from yatt.algos.grpo import LOG_RATIO_BOUND, bounded_log_ratio, masked
from yatt.algos.policy_loss import register_in


@dataclass(frozen=True)
class Correction:
    """What a rollout correction gives, all ``[B, T]``, detached: ``weights`` float32, the factor on
    each token's policy loss (0 outside the mask and on dropped tokens); ``ratio`` float32, the IS
    ratio the weight came from (the token's, or its sequence's; 1 outside the mask); ``corrected``
    bool, response tokens whose weight is not their ratio (truncated or dropped)."""

    weights: torch.Tensor
    ratio: torch.Tensor
    corrected: torch.Tensor


CorrectionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Correction]
ROLLOUT_CORRECTIONS: dict[str, CorrectionFn] = {}


def register_correction(name: str):
    """Decorator: make ``fn`` selectable as ``algo.rollout_correction=<name>``. Raises ValueError: taken."""
    return register_in(ROLLOUT_CORRECTIONS, "rollout correction", name)


def _log_ratio(old_logprob, rollout_logprob, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool mask, ``log r_t`` = bounded ``old - rollout``, 0 outside the mask), float32, no grad."""
    keep = mask.bool() if mask.dtype != torch.bool else mask
    return keep, bounded_log_ratio(old_logprob.detach().float(), rollout_logprob.detach().float(), keep)


@register_correction("none")
def no_correction(old_logprob, rollout_logprob, mask, cap: float) -> Correction:
    """Weight 1 on every response token (the ratio is still reported)."""
    keep, log_r = _log_ratio(old_logprob, rollout_logprob, mask)
    r = torch.exp(log_r)
    return Correction(keep.float(), r, torch.zeros_like(keep))


@register_correction("tis")
def truncated_is(old_logprob, rollout_logprob, mask, cap: float) -> Correction:
    """Truncated IS per token: ``w = min(r, cap)`` (Yao et al. 2025, TIS)."""
    keep, log_r = _log_ratio(old_logprob, rollout_logprob, mask)
    r = torch.exp(log_r)
    return Correction(masked(r.clamp(max=cap), keep), r, keep & (r > cap))


@register_correction("mis_token")
def masked_is_token(old_logprob, rollout_logprob, mask, cap: float) -> Correction:
    """Masked IS per token: ``w = r`` inside ``[1/cap, cap]``, else 0 (Yao et al. 2025, MIS)."""
    keep, log_r = _log_ratio(old_logprob, rollout_logprob, mask)
    r = torch.exp(log_r)
    inside = (r >= 1.0 / cap) & (r <= cap)
    return Correction(masked(r, keep & inside), r, keep & ~inside)


@register_correction("mis_seq")
def masked_is_seq(old_logprob, rollout_logprob, mask, cap: float) -> Correction:
    """Masked IS per sequence: ``r_seq = exp(sum_t log r_t)`` (the sequence's likelihood ratio;
    its log bounded to +-``LOG_RATIO_BOUND``) on every token of the sequence, 0 for a sequence
    outside ``[1/cap, cap]`` (Yao et al. 2025, MIS at sequence level)."""
    keep, log_r = _log_ratio(old_logprob, rollout_logprob, mask)
    seq = torch.exp(log_r.sum(-1, keepdim=True).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).expand_as(log_r)
    r = torch.where(keep, seq, torch.ones_like(seq))
    inside = (r >= 1.0 / cap) & (r <= cap)
    return Correction(masked(r, keep & inside), r, keep & ~inside)


def correction_for(name: str) -> CorrectionFn:
    """The function of ``algo.rollout_correction``. Raises ValueError: unknown name (naming the key)."""
    if name not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"algo.rollout_correction: unknown {name!r}; one of {sorted(ROLLOUT_CORRECTIONS)}")
    return ROLLOUT_CORRECTIONS[name]
