"""The actor's and the critic's losses over one micro-batch, in the form the trainer's
``train_step`` expects."""
from __future__ import annotations

import torch

from yatt.algos.gae import clipped_value_loss
from yatt.algos.grpo import kl_penalty, masked, masked_sum
from yatt.algos.policy_loss import LOSS_AGGS, POLICY_LOSSES, LossNorm, PolicyTerms, token_mean
from yatt.config import AlgoConfig


class PolicyLoss:
    """``agg(policy loss) + kl_coef * agg(KL to the reference) - entropy_coef * agg(entropy)``,
    the policy loss ``cfg.policy_loss`` and the aggregation ``cfg.loss_agg``
    (:mod:`yatt.algos.policy_loss`) normalised by ``norm``, the counts of the whole mini-batch
    across micro-batches and data-parallel ranks, so the summed gradient is the mini-batch's.

    Micro-batch keys read: ``response_mask``, ``old_logprobs``, ``rollout_logprobs``,
    ``advantages`` (``[B, 1]`` or ``[B, T]``), ``ref_logprobs`` when ``kl_coef > 0``, and
    ``is_weights`` ``[B, T]`` when present (``algo.rollout_correction``: the policy loss of each
    token is multiplied by it). Stats
    returned are sums over response tokens: ``pg_loss``, ``kl``, ``ppo_kl``, ``clip_frac``,
    ``ratio``, ``entropy``, ``tokens``, and, with ``on_policy`` (weights not yet updated this
    step), ``logprob_diff_rollout_vs_train`` and ``diff_tokens``. ``entropy_grad`` tells the
    trainer that the entropy must carry a gradient (``entropy_coef > 0``).
    """

    def __init__(self, cfg: AlgoConfig, norm: LossNorm, on_policy: bool = False):
        self.cfg, self.norm, self.on_policy = cfg, norm, on_policy
        self.policy_loss, self.agg = POLICY_LOSSES[cfg.policy_loss], LOSS_AGGS[cfg.loss_agg]
        self.entropy_grad = cfg.entropy_coef > 0

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        cfg, mask = self.cfg, mb["response_mask"]
        terms = self.policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mask, cfg)
        if "is_weights" in mb:  # algo.rollout_correction: pi_old / pi_rollout, truncated or masked (no grad)
            terms = PolicyTerms(terms.loss * mb["is_weights"], terms.ratio, terms.clipped)
        loss = self.agg(terms.loss, mask, self.norm)
        kl = None
        if cfg.kl_coef > 0:
            kl = kl_penalty(logprobs, mb["ref_logprobs"], cfg.kl_estimator, mask)
            loss = loss + cfg.kl_coef * self.agg(kl, mask, self.norm)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * self.agg(masked(entropy, mask), mask, self.norm)
        with torch.no_grad():
            stats = {
                "pg_loss": masked_sum(terms.loss, mask),
                "kl": masked_sum(kl, mask) if kl is not None else mask.new_zeros(()),
                "ppo_kl": masked_sum(kl_penalty(logprobs, mb["old_logprobs"], "k3", mask), mask),
                "clip_frac": masked_sum(terms.clipped.float(), mask),
                "ratio": masked_sum(terms.ratio, mask),
                "entropy": masked_sum(entropy, mask),
                "tokens": mask.sum(),
            }
            if self.on_policy:
                stats["logprob_diff_rollout_vs_train"] = masked_sum((logprobs - mb["rollout_logprobs"]).abs(), mask)
                stats["diff_tokens"] = mask.sum()
        return loss, stats


class ValueLoss:
    """The critic's loss: ``token_mean`` of :func:`~yatt.algos.gae.clipped_value_loss` (clip
    ``value_clip``; 0: unclipped), normalised by ``norm``, the response tokens of the whole
    mini-batch across micro-batches and DP ranks.

    Micro-batch keys read: ``response_mask``, ``values`` (before this step's updates) and
    ``returns`` ``[B, T]``. Stats returned are sums over response tokens: ``value_loss``,
    ``value_clip_frac``, ``tokens``.
    """

    def __init__(self, value_clip: float, norm: LossNorm):
        self.clip, self.norm = value_clip or None, norm

    def __call__(self, values: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"]
        terms = clipped_value_loss(values, mb["values"], mb["returns"], self.clip, mask)
        loss = token_mean(terms.loss, mask, self.norm)
        with torch.no_grad():
            stats = {"value_loss": masked_sum(terms.loss, mask), "value_clip_frac": masked_sum(terms.clipped.float(), mask),
                     "tokens": mask.sum()}
        return loss, stats
