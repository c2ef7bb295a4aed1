"""Which samples carry no signal for this step's policy update, so the logprob and train passes can
leave them out (exactly: the update stays the full batch's).

A sample contributes to the policy's gradient through its policy loss, and through the KL and
entropy terms when they are on. Under an outcome estimator (``grpo``, ``dr_grpo``, ``rloo`` or a
user's ``module:function``: one advantage per sample, final before the update) with a policy loss
that is zero with zero gradient where the advantage is 0 (every registered one declares it:
:data:`yatt.algos.policy_loss.ZERO_AT_ZERO_ADVANTAGE`), and with ``kl_coef == 0`` and
``entropy_coef == 0``, a sample whose advantage is exactly 0 (a group whose rewards are all equal,
or a response scored at its group's mean) adds exactly nothing. It still counts in the loss
normaliser (:func:`yatt.algos.update.mini_batch_norm`), so every other sample's weight is the one
the full batch gives. Token-level estimators (``reinforce_pp*``, ``gae``) read every sample (the
step's whitening, the critic's values), so nothing is skipped under them.
"""
from __future__ import annotations

from collections.abc import Sequence

from yatt.algos.policy_loss import ZERO_AT_ZERO_ADVANTAGE
from yatt.config import TOKEN_ESTIMATORS, AlgoConfig


def skips_zero_signal(cfg: AlgoConfig) -> bool:
    """Whether ``cfg`` (``algo``) leaves zero-advantage samples out of the update: ``skip_zero_signal``
    is on, the estimator is an outcome estimator, the policy loss is zero at zero advantage, and no
    KL or entropy term reads the sample."""
    return (cfg.skip_zero_signal and cfg.estimator not in TOKEN_ESTIMATORS
            and cfg.policy_loss in ZERO_AT_ZERO_ADVANTAGE and cfg.kl_coef == 0 and cfg.entropy_coef == 0)


def trained_mask(cfg: AlgoConfig, advantages: Sequence[float]) -> list[bool] | None:
    """Per sample, whether the policy update must run it.

    Args:
        cfg: the ``algo`` section.
        advantages: the samples' outcome advantages (``Sample.advantage``), one float each.
    Returns:
        ``advantage != 0`` per sample when :func:`skips_zero_signal`, else None (every sample is trained).
    """
    if not skips_zero_signal(cfg):
        return None
    return [a != 0.0 for a in advantages]
