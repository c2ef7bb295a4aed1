"""The GRPO loss over one micro-batch, in the form the trainer's ``train_step`` expects."""
from __future__ import annotations

import torch

from yatt.algos.grpo import clipped_policy_loss, kl_penalty, masked_sum
from yatt.config import AlgoConfig


class GRPOLoss:
    """Token-level GRPO/DAPO loss: clipped surrogate plus ``kl_coef`` times the reference KL.

    The loss of one micro-batch is ``sum_tokens(loss_t) / num_tokens`` where ``num_tokens`` is
    the response-token count of the whole mini-batch across data-parallel ranks, so the summed
    gradient over micro-batches and ranks is the token mean (DAPO eq. 10).

    Micro-batch keys read: ``response_mask``, ``old_logprobs``, ``rollout_logprobs``,
    ``advantages`` (``[B, 1]``), and ``ref_logprobs`` when ``kl_coef > 0``. Stats returned are
    sums over response tokens: ``pg_loss``, ``kl``, ``ppo_kl``, ``clip_frac``, ``ratio``,
    ``entropy``, ``tokens``, and, with ``on_policy`` (weights not yet updated this step),
    ``logprob_diff_rollout_vs_train`` and ``diff_tokens``.
    """

    def __init__(self, cfg: AlgoConfig, num_tokens: float, on_policy: bool = False):
        self.cfg = cfg
        self.num_tokens = max(float(num_tokens), 1.0)
        self.on_policy = on_policy

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"]
        pg, ratio, clipped = clipped_policy_loss(
            logprobs, mb["old_logprobs"], mb["advantages"], self.cfg.clip_ratio_low, self.cfg.clip_ratio_high
        )
        per_token = pg
        kl = torch.zeros_like(pg)
        if self.cfg.kl_coef > 0:
            kl = kl_penalty(logprobs, mb["ref_logprobs"], self.cfg.kl_estimator)
            per_token = per_token + self.cfg.kl_coef * kl
        loss = masked_sum(per_token, mask) / self.num_tokens
        with torch.no_grad():
            stats = {
                "pg_loss": masked_sum(pg, mask),
                "kl": masked_sum(kl, mask),
                "ppo_kl": masked_sum(kl_penalty(logprobs, mb["old_logprobs"], "k3"), mask),
                "clip_frac": masked_sum(clipped.float(), mask),
                "ratio": masked_sum(ratio, mask),
                "entropy": masked_sum(entropy, mask),
                "tokens": mask.sum(),
            }
            if self.on_policy:
                stats["logprob_diff_rollout_vs_train"] = masked_sum((logprobs - mb["rollout_logprobs"]).abs(), mask)
                stats["diff_tokens"] = mask.sum()
        return loss, stats
