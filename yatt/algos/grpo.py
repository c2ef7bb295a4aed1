"""GRPO math as pure tensor functions (no model, no process groups).

Sources: GRPO group-normalised advantages, Shao et al. 2024, "DeepSeekMath" (eq. 3 and the
outcome-supervision paragraph); clipped surrogate, Schulman et al. 2017, "Proximal Policy
Optimization" (eq. 7), with DAPO's decoupled low/high clip ratios and token-level loss
aggregation, Yu et al. 2025, "DAPO" (eq. 8-10); KL estimators k1/k2/k3, Schulman 2020,
"Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html).

Shapes: ``B`` sequences, ``T`` token positions; masks are float or bool ``[B, T]``.
"""
from __future__ import annotations

import torch

# Below this group std the rewards are treated as equal: the group carries no signal.
EQUAL_REWARD_TOL = 1e-6
# Every log importance ratio is clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] before its exp: exp(20)
# = 4.9e8 is far past any clip range, yet the exp, the loss and its gradient stay finite in fp32 (whose
# exp overflows past 88.7) and bf16 alike. verl and OpenRLHF clamp at the same bound. A token past it gets
# no gradient through its ratio (the clamp's), instead of an inf or NaN that would drop the whole step.
LOG_RATIO_BOUND = 20.0


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is set, 0 elsewhere, selected (``torch.where``), never multiplied:
    a NaN or inf outside the mask (a padded position's logprob) neither reaches the result nor, in
    the backward pass, the gradient of ``values`` (which is 0 there).

    Args:
        values: float ``[B, T]`` (or broadcastable to ``mask``). mask: bool or 0/1 float ``[B, T]``.
    Returns:
        float ``[B, T]`` of ``values``' dtype.
    """
    return torch.where(mask.bool() if mask.dtype != torch.bool else mask, values, values.new_zeros(()))


def bounded_log_ratio(logprob: torch.Tensor, old_logprob: torch.Tensor, mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``logprob - old_logprob`` clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` (:data:`LOG_RATIO_BOUND`),
    0 outside ``mask`` (selected, :func:`masked`): its ``exp`` is finite for any input. Shapes ``[B, T]``."""
    log_ratio = logprob - old_logprob
    if mask is not None:
        log_ratio = masked(log_ratio, mask)
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def group_advantages(rewards: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages: reward minus its group mean, over the group std.

    Args:
        rewards: float ``[G, n]``, ``n`` samples for each of ``G`` prompts.
        norm_by_std: divide by the (unbiased) group std; False gives Dr. GRPO's mean-only form.
        eps: added to the std.
    Returns:
        float32 ``[G, n]``. A group whose rewards are all equal gets exactly 0 (never NaN),
        also for ``n == 1``. Computed in float64: rewards up to 1e30 in magnitude give finite
        advantages (in float32 the std's squares overflow past 1.8e19).
    """
    rewards = rewards.to(torch.float64)
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards, dtype=torch.float32)
    std = rewards.std(dim=-1, keepdim=True)
    adv = centered / (std + eps) if norm_by_std else centered
    return torch.where(std < EQUAL_REWARD_TOL, torch.zeros_like(adv), adv).to(torch.float32)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str = "k3",
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    With ``d = ref_logprob - logprob``: k1 = -d (unbiased, can be negative),
    k2 = d^2 / 2 (low variance, biased), k3 = exp(d) - d - 1 (unbiased, >= 0; ``d`` clamped to
    ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` first: past it the policies share no support).

    Args:
        logprob, ref_logprob: float ``[B, T]`` log-probabilities of the sampled tokens.
        estimator: ``k1``, ``k2`` or ``k3``.
        mask: bool or 0/1 float ``[B, T]``: ``d`` is 0 outside it, selected (:func:`masked`), so the
            estimate there is 0 and ``logprob`` gets no gradient (None: every position).
    Returns:
        float ``[B, T]``.
    Raises:
        ValueError: unknown estimator.
    """
    d = ref_logprob - logprob
    if mask is not None:
        d = masked(d, mask)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        d = d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r} (expected k1, k2 or k3)")


def clipped_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token, with decoupled clip range ``[1 - low, 1 + high]``, on the
    ratio ``exp(bounded_log_ratio(logprob, old_logprob, mask))`` (finite for any input).

    Args:
        logprob: float ``[B, T]`` under the current policy (carries the gradient).
        old_logprob: float ``[B, T]`` under the policy that sampled (no gradient).
        advantages: float ``[B, T]`` (or ``[B, 1]``, broadcast over tokens).
        clip_low, clip_high: clip ratios epsilon_low, epsilon_high.
        mask: bool or 0/1 float ``[B, T]``, the response tokens; outside it the ratio is 1 and
            ``logprob`` gets no gradient, whatever it holds (None: every position).
    Returns:
        (loss ``[B, T]`` to minimise, ratio ``[B, T]``, clipped ``[B, T]`` bool: the clipped
        branch was the active one).
    """
    ratio = torch.exp(bounded_log_ratio(logprob, old_logprob, mask))
    if mask is not None and advantages.shape == ratio.shape:
        advantages = masked(advantages, mask)
    return clipped_surrogate(ratio, advantages, clip_low, clip_high)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))`` for any importance ratio ``r`` (per token, or a
    sequence's broadcast over its tokens); returns (loss, ``ratio``, clipped) as
    :func:`clipped_policy_loss`. Shapes ``[B, T]`` (``advantages`` also ``[B, 1]``)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), ratio, clipped > unclipped


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (selected: :func:`masked`). Shapes ``[B, T]``; returns
    a 0-dim tensor."""
    return masked(values, mask).sum()
