"""Policy losses and loss aggregations, chosen by name: pure tensor functions.

A **policy loss** (``algo.policy_loss``) turns the current and old logprobs of the sampled
tokens and their advantages into a per-token loss to minimise:
``f(logprob, old_logprob, advantages, mask, cfg) -> PolicyTerms``. Registered: ``ppo_clip``
(Schulman et al. 2017, with DAPO's decoupled clip), ``dual_clip`` (Ye et al. 2020), ``gspo``
(Zheng et al. 2025).

A **loss aggregation** (``algo.loss_agg``) turns a per-token loss into the scalar of one
micro-batch, ``agg(values, mask, norm) -> 0-dim``, such that the sum over the micro-batches of a
mini-batch and over the data-parallel ranks is the mini-batch's loss: every division is by a
count of the whole mini-batch (:class:`LossNorm`), never by a local one. Registered:
``token_mean`` (DAPO), ``seq_mean_token_mean`` (GRPO as published), ``seq_mean_token_sum_norm``
(Dr. GRPO).

Shapes: ``B`` rows (one sequence each), ``T`` positions; ``mask`` 0/1 float ``[B, T]`` marks the
response tokens; ``advantages`` ``[B, T]`` or ``[B, 1]`` (broadcast over positions).

Numerics: every policy loss bounds its log-ratio before the exp
(:data:`~yatt.algos.grpo.LOG_RATIO_BOUND`) and every loss and aggregation selects the masked
positions instead of multiplying by the mask (:func:`~yatt.algos.grpo.masked`), so whatever a
padded position holds (NaN, inf) the loss and its gradient are those with it zeroed
(``tests/test_numerics.py``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from yatt.algos.grpo import LOG_RATIO_BOUND, clipped_policy_loss, clipped_surrogate, masked


@dataclass(frozen=True)
class PolicyTerms:
    """What a policy loss gives: ``loss`` float ``[B, T]`` to minimise (per token), ``ratio``
    float ``[B, T]`` the importance ratio it used (per token, or its sequence's, broadcast), and
    ``clipped`` bool ``[B, T]`` where a clip was the active branch."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor


@dataclass(frozen=True)
class LossNorm:
    """Counts of the whole mini-batch (every micro-batch, every DP rank): ``tokens`` response
    tokens, ``seqs`` sequences with at least one response token, ``max_tokens`` the response
    length budget (``rollout.max_tokens``, Dr. GRPO's constant)."""

    tokens: float
    seqs: float
    max_tokens: float


PolicyLossFn = Callable[..., PolicyTerms]
AggFn = Callable[[torch.Tensor, torch.Tensor, LossNorm], torch.Tensor]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
LOSS_AGGS: dict[str, AggFn] = {}
ZERO_AT_ZERO_ADVANTAGE: set[str] = set()  # policy losses with no loss and no gradient where A == 0


def register_in(table: dict, kind: str, name: str):
    """A decorator adding ``fn`` to ``table`` under ``name``. Raises ValueError: the name is taken."""
    def add(fn):
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = fn
        return fn

    return add


def register_policy_loss(name: str, *, zero_at_zero_advantage: bool = False):
    """Decorator: make ``fn`` selectable as ``algo.policy_loss=<name>``. Raises ValueError: taken.

    ``zero_at_zero_advantage``: the loss declares that a token whose advantage is exactly 0 has loss 0
    and gradient 0 (it is linear in the advantage), so a sample of zero advantage may be left out of
    the train pass (:mod:`yatt.algos.zero_signal`); ``tests/test_zero_signal.py`` checks the claim."""
    if zero_at_zero_advantage:
        ZERO_AT_ZERO_ADVANTAGE.add(name)
    return register_in(POLICY_LOSSES, "policy loss", name)


def register_loss_agg(name: str):
    """Decorator: make ``fn`` selectable as ``algo.loss_agg=<name>``. Raises ValueError: taken."""
    return register_in(LOSS_AGGS, "loss aggregation", name)


@register_policy_loss("ppo_clip", zero_at_zero_advantage=True)
def ppo_clip(logprob, old_logprob, advantages, mask, cfg) -> PolicyTerms:
    """PPO's clipped surrogate per token, ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``
    with ``r = exp(logprob - old_logprob)`` (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms", eq. 7; decoupled ``cfg.clip_ratio_low``/``clip_ratio_high``: Yu et al. 2025,
    "DAPO", eq. 10). Outside ``mask`` the ratio is 1 and ``logprob`` gets no gradient."""
    loss, ratio, clipped = clipped_policy_loss(logprob, old_logprob, advantages, cfg.clip_ratio_low,
                                               cfg.clip_ratio_high, mask)
    return PolicyTerms(loss, ratio, clipped)


@register_policy_loss("dual_clip", zero_at_zero_advantage=True)
def dual_clip(logprob, old_logprob, advantages, mask, cfg) -> PolicyTerms:
    """Dual-clip PPO: for a negative advantage the clipped surrogate is also bounded by
    ``-c A`` (``c = cfg.clip_ratio_c > 1``), so a huge ratio on a bad token cannot blow the loss
    up: ``A < 0: min(L_ppo, -c A)``, else ``L_ppo`` (Ye et al. 2020, "Mastering Complex Control in
    MOBA Games with Deep Reinforcement Learning", eq. 5). ``clipped`` counts both clips."""
    terms = ppo_clip(logprob, old_logprob, advantages, mask, cfg)
    advantages = advantages.expand_as(terms.loss)
    bound = -cfg.clip_ratio_c * advantages
    lower = (advantages < 0) & (terms.loss > bound)
    return PolicyTerms(torch.where(lower, bound, terms.loss), terms.ratio, terms.clipped | lower)


@register_policy_loss("gspo", zero_at_zero_advantage=True)
def gspo(logprob, old_logprob, advantages, mask, cfg) -> PolicyTerms:
    """GSPO: one importance ratio per sequence, the length-normalised
    ``s_i = exp(mean_t (logprob - old_logprob))`` over its response tokens, clipped to
    ``[1 - cfg.seq_clip_ratio_low, 1 + cfg.seq_clip_ratio_high]``; per token
    ``s_i,t = sg[s_i] * exp(logprob_t - sg[logprob_t])`` has the value ``s_i`` and the gradient of
    ``s_i`` times ``d logprob_t``, so ``max(-A s_i,t, -A clip(s_i,t))`` summed as a token mean of
    each sequence is the sequence objective (Zheng et al. 2025, "Group Sequence Policy
    Optimization", eq. 5-7 and 10-11). The log-ratio is bounded to ``[-LOG_RATIO_BOUND, 10]`` (exp
    overflow; a sequence's mean ratio past e^10 is off-policy beyond any clip). Pairs with
    ``loss_agg=seq_mean_token_mean``."""
    logprob, old_logprob = masked(logprob, mask), masked(old_logprob, mask)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
    seq_log_ratio = (logprob - old_logprob).sum(-1, keepdim=True) / lengths
    log_ratio = (logprob - logprob.detach() + seq_log_ratio.detach()).clamp(-LOG_RATIO_BOUND, 10.0)
    return PolicyTerms(*clipped_surrogate(torch.exp(log_ratio), advantages, cfg.seq_clip_ratio_low,
                                          cfg.seq_clip_ratio_high))


@register_loss_agg("token_mean")
def token_mean(values: torch.Tensor, mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """``sum_tokens(values) / tokens``: every response token of the mini-batch weighs the same
    (Yu et al. 2025, "DAPO", eq. 12, token-level policy gradient loss)."""
    return masked(values, mask).sum() / max(norm.tokens, 1.0)


@register_loss_agg("seq_mean_token_mean")
def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """``mean_seqs(mean_tokens(values))``: each sequence's token mean, then the mean over the
    mini-batch's sequences (Shao et al. 2024, "DeepSeekMath", eq. 3: ``1/G sum_i 1/|o_i| sum_t``)."""
    per_seq = masked(values, mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(norm.seqs, 1.0)


@register_loss_agg("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(values: torch.Tensor, mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """``sum_tokens(values) / (max_tokens * seqs)``: each sequence's token sum over a constant
    length budget instead of its own length, then the mean over sequences, which removes GRPO's
    length bias (Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1, Dr. GRPO)."""
    return masked(values, mask).sum() / (max(norm.max_tokens, 1.0) * max(norm.seqs, 1.0))
