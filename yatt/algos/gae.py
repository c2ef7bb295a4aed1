"""GAE over critic values (PPO's estimator) and the critic's clipped value loss: pure tensor
functions plus the stage that writes them into a step's micro-batches.

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 16): ``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)`` and
``A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}``; the value target (return) is ``R_t = A_t + V(s_t)``
(eq. 17's ``lam``-return). One response is one episode: the state after its last token is terminal
(``V = 0``), also for a response cut at ``rollout.max_tokens``, as verl and OpenRLHF do. Token
rewards are REINFORCE++'s (:func:`~yatt.algos.token_advantages.token_rewards`): the score at the
last response token, ``-beta * KL_t`` on every token with a KL penalty in the reward (Ziegler et
al. 2019). The advantages are then whitened over the whole step (every mini-batch and DP rank;
one all-reduce), as PPO implementations for LLMs do.

Shapes: ``B`` rows, ``T`` positions; ``mask`` float ``[B, T]`` marks the response tokens of a
right-padded ``prompt + response`` row (contiguous); ``values[:, t]`` is the critic's value of the
state before token ``t`` (aligned like the logprobs: the head reads position ``t - 1``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from yatt.algos.grpo import masked
from yatt.algos.token_advantages import token_rewards, whitening_moments


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns over each row's response tokens.

    Args:
        rewards: float ``[B, T]`` token rewards (0 outside the response).
        values: float ``[B, T]`` critic values ``V(s_t)`` of the response tokens' states.
        mask: float ``[B, T]``, the response tokens (contiguous per row).
        gamma: discount in (0, 1]. lam: GAE's lambda in [0, 1] (0: one-step TD, 1: Monte Carlo).
    Returns:
        (advantages, returns), float32 ``[B, T]``, 0 outside the response;
        ``returns = advantages + values`` on response tokens.
    """
    mask = mask.to(torch.float32)
    rewards, values = masked(rewards.to(torch.float32), mask), masked(values.to(torch.float32), mask)
    adv = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    next_value = torch.zeros_like(running)  # V after the last response token: terminal
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m  # 0 past the response: the next row's episode starts fresh
        adv[:, t] = running
        next_value = values[:, t]  # masked: 0 past the response
    return adv, masked(adv + values, mask)


def gae_advantages(micro_batches: list[dict], beta: float, gamma: float, lam: float, group=None,
                   eps: float = 1e-8) -> None:
    """PPO's advantages written into each micro-batch (collective over ``group``): ``advantages``
    ``[B, T]`` (GAE, whitened over every micro-batch and DP rank of the step; replaces the score
    ``[B, 1]`` the outcome stage left there) and ``returns`` ``[B, T]`` (the critic's targets,
    not whitened).

    Reads per micro-batch: ``advantages`` ``[B, 1]`` (the outcome score), ``values``,
    ``response_mask``, ``old_logprobs`` and, when ``beta > 0``, ``ref_logprobs`` (k1 KL per token).
    """
    for mb in micro_batches:
        mask = mb["response_mask"]
        kl = mb["old_logprobs"] - mb["ref_logprobs"] if beta > 0 else None
        mb["advantages"], mb["returns"] = gae(token_rewards(mb["advantages"], kl, mask, beta), mb["values"], mask,
                                              gamma, lam)
    mean, std = whitening_moments([mb["advantages"] for mb in micro_batches],
                                  [mb["response_mask"] for mb in micro_batches], group)
    for mb in micro_batches:
        mb["advantages"] = masked((mb["advantages"] - mean) / (std + eps), mb["response_mask"])


@dataclass(frozen=True)
class ValueTerms:
    """What :func:`clipped_value_loss` gives: ``loss`` float ``[B, T]`` (per token, to minimise)
    and ``clipped`` bool ``[B, T]`` where the clipped branch was the larger (active) one."""

    loss: torch.Tensor
    clipped: torch.Tensor


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float | None, mask: torch.Tensor | None = None) -> ValueTerms:
    """PPO's clipped value loss, ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``
    (the PPO2 baselines code of Schulman et al. 2017; Engstrom et al. 2020, sec. 3, "value function
    clipping").

    Args:
        values: float ``[B, T]`` the critic's current values (with grad).
        old_values: float ``[B, T]`` the values computed before this step's updates.
        returns: float ``[B, T]`` the targets (:func:`gae`).
        clip: ``c``; None: the unclipped ``0.5 * (V - R)^2``.
        mask: bool or 0/1 float ``[B, T]``, the response tokens: the inputs are 0 outside it
            (selected), so the loss there is 0 and ``values`` gets no gradient (None: every position).
    Returns:
        :class:`ValueTerms` ``[B, T]``.
    """
    if mask is not None:
        values, old_values, returns = masked(values, mask), masked(old_values, mask), masked(returns, mask)
    unclipped = (values - returns) ** 2
    if clip is None:
        return ValueTerms(0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool))
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return ValueTerms(0.5 * torch.maximum(unclipped, clipped), clipped > unclipped)
