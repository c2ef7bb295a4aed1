"""Reward normalisation before the advantage estimator (``algo.reward_norm``, ``algo.reward_clip``):
a pure function of a step's rewards plus one reduction.

- ``none``: the scores as they are.
- ``group``: each prompt's ``n`` rewards whitened, ``(r - mean_g) / (std_g + eps)`` (GRPO's group
  normalisation, :func:`yatt.algos.grpo.group_advantages`: unbiased std, a group of equal rewards
  becomes 0).
- ``batch``: every reward of the step whitened with the mean and std over all groups of every
  rank that trains (one all-reduce of count, sum and sum of squares, never a gather), the
  reward scaling PPO implementations for RLHF use (Ziegler et al. 2019, sec. 2.2; OpenRLHF's
  ``normalize_reward``) so that the critic's targets and the KL penalty keep one scale.

Then, with ``clip > 0``, every value is clipped to ``[-clip, clip]``. The metrics
(``reward_mean``, ``accuracy``) keep the raw scores; the estimator sees the normalised ones.
"""
from __future__ import annotations

import torch

from yatt.algos.grpo import group_advantages
from yatt.algos.token_advantages import whitening_moments


def normalize_rewards(rewards: list[list[float]], mode: str, clip: float = 0.0, group=None,
                      eps: float = 1e-6) -> list[list[float]]:
    """This rank's groups' rewards, normalised (collective over ``group`` for ``mode="batch"``:
    every rank of it calls this, also with no groups).

    Args:
        rewards: ``G`` lists of ``n`` floats (this rank's groups).
        mode: ``"none"``, ``"group"`` or ``"batch"``.
        clip: clip the result to ``[-clip, clip]``; 0: no clipping.
        group: the process group whose ranks hold the step's groups (None: the world).
    Returns:
        ``G`` lists of ``n`` floats.
    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in ("none", "group", "batch"):
        raise ValueError(f"algo.reward_norm: unknown mode {mode!r} (none, group or batch)")
    r = torch.tensor(rewards, dtype=torch.float64) if rewards else torch.zeros(0, 1, dtype=torch.float64)
    if mode == "group":
        r = group_advantages(r, norm_by_std=True, eps=eps)
    elif mode == "batch":
        mean, std = whitening_moments([r], [torch.ones_like(r)], group)
        r = (r - mean) / (std + eps)
    if clip > 0:
        r = r.clamp(-clip, clip)
    return r.tolist()
