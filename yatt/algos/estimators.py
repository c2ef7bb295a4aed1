"""Outcome advantage estimators, chosen by name (``algo.estimator``): pure tensor functions.

An outcome estimator turns the scores of a prompt's ``n`` responses into one advantage per
response: ``f(rewards) -> advantages``, both float ``[G, n]`` (``G`` prompts of the step, on the
rank that owns the whole group). A group whose rewards are all equal carries no signal: every
estimator here gives it exactly 0 (which is what DAPO dynamic sampling filters on).

Registered: ``grpo`` (Shao et al. 2024), ``dr_grpo`` (Liu et al. 2025), ``rloo`` (Ahmadian et al.
2024). ``algo.estimator=package.module:function`` loads a user's function with the same contract.
``reinforce_pp`` and ``reinforce_pp_baseline`` (Hu 2025) register their outcome stage here (the
score, or the score minus its group mean), and ``gae`` (Schulman et al. 2016) the score; their
token-level advantages come later, from :mod:`yatt.algos.token_advantages` and
:mod:`yatt.algos.gae`, once the reference logprobs and the critic's values exist.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from yatt.algos.grpo import group_advantages
from yatt.config import GROUP_RELATIVE, TOKEN_ESTIMATORS
from yatt.imports import load_callable

Estimator = Callable[[torch.Tensor], torch.Tensor]
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: make ``fn`` selectable as ``algo.estimator=<name>``.

    Raises:
        ValueError: ``name`` is taken.
    """
    def add(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = fn
        return fn

    return add


@register("grpo")
def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the group (Shao et al. 2024,
    "DeepSeekMath", eq. 3, outcome supervision); the std is the unbiased one.

    Args:
        rewards: float ``[G, n]``.
    Returns:
        float32 ``[G, n]``; 0 for a group of equal rewards and for ``n == 1``.
    """
    return group_advantages(rewards, norm_by_std=True)


@register("dr_grpo")
def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: ``A_i = r_i - mean(r)``, without GRPO's division by the group std, which weights
    prompts whose rewards barely differ most (Liu et al. 2025, "Understanding R1-Zero-Like
    Training: A Critical Perspective", sec. 3.1, eq. 3; its length-bias fix is the loss's
    aggregation, not the advantage).

    Args:
        rewards: float ``[G, n]``.
    Returns:
        float32 ``[G, n]``; 0 for a group of equal rewards.
    """
    return group_advantages(rewards, norm_by_std=False)


@register("rloo")
def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: REINFORCE with a leave-one-out baseline, ``A_i = r_i - mean_{j != i} r_j =
    n / (n - 1) * (r_i - mean(r))`` (Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs", eq. 6; Kool et al. 2019).

    Args:
        rewards: float ``[G, n]``, ``n >= 2``.
    Returns:
        float32 ``[G, n]``; 0 for a group of equal rewards.
    Raises:
        ValueError: ``n < 2`` (no other sample to form the baseline).
    """
    n = rewards.shape[-1]
    if n < 2:
        raise ValueError(f"rloo needs at least 2 samples per prompt, got {n}")
    return group_advantages(rewards, norm_by_std=False) * (n / (n - 1))


@register("gae")
@register("reinforce_pp")
def reinforce_pp(rewards: torch.Tensor) -> torch.Tensor:
    """The outcome stage of REINFORCE++ (Hu 2025, "REINFORCE++", sec. 3) and of PPO's GAE: the
    score itself, ``r_i``. Their advantages are token-level, made once the reference logprobs
    (and the critic's values) exist: :func:`yatt.algos.token_advantages.reinforce_pp_advantages`
    (KL-shaped token rewards, discounted returns, whitening over the step) and
    :func:`yatt.algos.gae.gae_advantages`. Not an advantage: equal rewards are not 0.

    Args:
        rewards: float ``[G, n]``.
    Returns:
        float32 ``[G, n]``.
    """
    return rewards.to(torch.float32)


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group baseline, outcome stage: ``r_i - mean(r)`` over the group (Hu 2025,
    "REINFORCE++", the baseline variant for multi-sample prompts); then the token stage of
    :func:`reinforce_pp`. A group of equal rewards gets exactly 0.

    Args:
        rewards: float ``[G, n]``.
    Returns:
        float32 ``[G, n]``.
    """
    return group_advantages(rewards, norm_by_std=False)


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``, or the function ``name`` = ``"module:function"`` names.

    Raises:
        ValueError: an unknown name, or a ``module:function`` that cannot be imported or is not
            callable; the message names ``algo.estimator``.
    """
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    if ":" not in name:
        raise ValueError(f"algo.estimator: unknown estimator {name!r}; one of {sorted(ESTIMATORS)}, or "
                         "'package.module:function' for your own")
    return load_callable(name, "algo.estimator")


def estimator_for(name: str, norm_adv_by_std: bool = True) -> Estimator:
    """The function of ``algo.estimator`` (``grpo`` with ``algo.norm_adv_by_std: false`` is
    Dr. GRPO's advantage). Raises as :func:`get_estimator`."""
    return dr_grpo if name == "grpo" and not norm_adv_by_std else get_estimator(name)


def outcome_advantages(estimator: Estimator, rewards: list[list[float]]) -> list[float]:
    """The outcome stage of a step on the rank that owns its groups: ``G`` groups of ``n`` rewards
    -> ``G * n`` advantages, prompt-major (checked as :func:`advantages`; ``[]`` for no group)."""
    if not rewards:
        return []
    return advantages(estimator, torch.tensor(rewards, dtype=torch.float32)).flatten().tolist()


def group_informative(name: str, estimator: Estimator, rewards: Sequence[float]) -> bool:
    """Whether a group of ``n`` scored responses can move the policy under ``algo.estimator=name``
    (DAPO dynamic sampling keeps only such groups). Without a group baseline a group always can
    (``reinforce_pp`` whitens the scores over the whole step, ``gae`` subtracts the critic's
    values: equal scores still get non-zero advantages); otherwise when its outcome-stage
    advantages are not all zero (for ``grpo``, ``dr_grpo``, ``rloo`` and ``reinforce_pp_baseline``:
    when its rewards are not all equal; the whitening's shift of a tied group is not its signal).

    Args:
        name: ``algo.estimator``. estimator: its function. rewards: the group's ``n`` scores.
    """
    if name in TOKEN_ESTIMATORS and name not in GROUP_RELATIVE:
        return len(rewards) > 0
    if not len(rewards):
        return False
    return bool(advantages(estimator, torch.tensor([list(rewards)], dtype=torch.float32)).ne(0).any())


def advantages(estimator: Estimator, rewards: torch.Tensor) -> torch.Tensor:
    """``estimator(rewards)``, checked: float ``[G, n]`` in, a finite float ``[G, n]`` out.

    Raises:
        ValueError: the estimator returned another shape or a non-finite value (a user's function).
    """
    adv = estimator(rewards)
    if not isinstance(adv, torch.Tensor) or adv.shape != rewards.shape:
        got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise ValueError(f"algo.estimator returned {got} for rewards of shape {tuple(rewards.shape)}")
    if not torch.isfinite(adv).all():
        raise ValueError("algo.estimator returned a non-finite advantage")
    return adv.to(torch.float32)
