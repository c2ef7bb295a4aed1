"""The objectives of the RLHF stages before RL, as pure tensor functions: supervised fine-tuning
(SFT), the Bradley-Terry reward-model loss and the preference losses of DPO, chosen by name.

Shapes: ``B`` rows, ``T`` positions, ``P`` preference pairs. Sequence logprobs are sums of the
response tokens' logprobs (:func:`sequence_logprobs`); a pair's "chosen" and "rejected" are the
preferred and the dispreferred response to one prompt.

- :func:`sft_loss`: the mean negative log-likelihood of the response tokens, divided by the
  response tokens of the whole mini-batch (every micro-batch and data-parallel rank), so the sum
  over micro-batches and ranks is the mini-batch's token mean.
- :func:`bradley_terry_loss`: ``-log sigmoid(r_chosen - r_rejected)`` per pair (Bradley & Terry
  1952; the reward-model loss of Ouyang et al. 2022, "Training language models to follow
  instructions with human feedback", Eq. 1).
- ``PREFERENCE_LOSSES`` (``dpo.loss_type``): ``sigmoid``, DPO (Rafailov et al. 2023, "Direct
  Preference Optimization", Eq. 7) with the label smoothing of conservative DPO (Mitchell 2023),
  and ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences", Eq. 17). Each returns the per-pair loss and the implicit rewards
  ``beta * (logp - ref_logp)`` of both responses.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from yatt.algos.grpo import masked
from yatt.algos.policy_loss import register_in


@dataclass(frozen=True)
class PairTerms:
    """A pairwise loss's result: ``loss`` float ``[P]`` to minimise, and the rewards it compared,
    ``chosen`` and ``rejected`` float ``[P]`` (a reward model's scores, or DPO's implicit
    rewards), detached."""

    loss: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor

    def stats(self) -> dict[str, torch.Tensor]:
        """Sums over the pairs (divide by the pair count for means): ``pair_loss``,
        ``pair_accuracy`` (chosen scored above rejected; a tie counts as half) and ``reward_margin``
        (chosen minus rejected)."""
        diff = self.chosen - self.rejected
        return {"pair_loss": self.loss.detach().sum(),
                "pair_accuracy": ((diff > 0).float() + 0.5 * (diff == 0).float()).sum(),
                "reward_margin": diff.sum()}


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row sum of the masked token logprobs: ``logprobs`` and ``mask`` float ``[B, T]`` ->
    float ``[B]`` (nats)."""
    return masked(logprobs, mask).sum(dim=-1)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, tokens: float) -> torch.Tensor:
    """Negative log-likelihood of the response tokens.

    Args:
        logprobs: float ``[B, T]``, the model's logprob of each token (``log p(x_t | x_<t)``).
        mask: float ``[B, T]``, 1 on response tokens (built from lengths, so an EOS that ends a
            response is trained on even where the pad id is the EOS id:
            :func:`yatt.controller.batch.response_mask`).
        tokens: response tokens of the whole mini-batch (> 0).
    Returns:
        0-dim: ``-sum(logprobs where mask) / tokens`` (selected: a NaN outside the mask is left out).
    Raises:
        ValueError: ``tokens <= 0``.
    """
    if tokens <= 0:
        raise ValueError(f"tokens must be > 0, got {tokens}")
    return -masked(logprobs, mask).sum() / tokens


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0) -> PairTerms:
    """Bradley-Terry loss of a reward model's scores, ``-log sigmoid(chosen - rejected - margin)``.

    Args:
        chosen, rejected: float ``[P]``, the scalar rewards of each pair's two responses.
        margin: float ``[P]`` or a number, a required gap (Llama 2's margin loss; 0: plain BT).
    Returns:
        :class:`PairTerms` with ``loss`` float ``[P]``.
    """
    return PairTerms(-F.logsigmoid(chosen - rejected - margin), chosen.detach(), rejected.detach())


PreferenceLossFn = Callable[..., PairTerms]
PREFERENCE_LOSSES: dict[str, PreferenceLossFn] = {}


def register_preference_loss(name: str):
    """Decorator: make ``fn(logp_chosen, logp_rejected, ref_chosen, ref_rejected, beta,
    label_smoothing) -> PairTerms`` selectable by ``name``. Raises ValueError: the name is taken."""
    return register_in(PREFERENCE_LOSSES, "preference loss", name)


def _implicit_rewards(logp_chosen, logp_rejected, ref_chosen, ref_rejected, beta):
    return beta * (logp_chosen - ref_chosen).detach(), beta * (logp_rejected - ref_rejected).detach()


@register_preference_loss("sigmoid")
def dpo_sigmoid(logp_chosen: torch.Tensor, logp_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> PairTerms:
    """DPO: ``-log sigmoid(beta * h)`` with ``h = (logp_c - ref_c) - (logp_r - ref_r)``; with label
    smoothing ``e`` (the chance a label is flipped), ``-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)``.

    Args: sequence logprobs float ``[P]`` of the policy (with grad) and of the frozen reference;
    ``beta`` > 0, the KL strength; ``label_smoothing`` in [0, 0.5).
    """
    h = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)
    loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return PairTerms(loss, *_implicit_rewards(logp_chosen, logp_rejected, ref_chosen, ref_rejected, beta))


@register_preference_loss("ipo")
def ipo(logp_chosen: torch.Tensor, logp_rejected: torch.Tensor, ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> PairTerms:
    """IPO: ``(h - 1 / (2 beta))^2`` with ``h`` as in DPO: the log-ratio gap is regressed to a fixed
    target instead of pushed without bound. ``label_smoothing`` does not apply (must be 0).

    Raises:
        ValueError: ``label_smoothing != 0``.
    """
    if label_smoothing:
        raise ValueError("ipo has no label smoothing")
    h = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)
    return PairTerms((h - 1 / (2 * beta)) ** 2,
                     *_implicit_rewards(logp_chosen, logp_rejected, ref_chosen, ref_rejected, beta))
