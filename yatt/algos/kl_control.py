"""The coefficient beta of the KL penalty in the token rewards (``algo.kl_in_reward``): fixed, or
adapted toward a target KL.

Adaptive control (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
section 2.2): after each step, with ``KL`` the step's mean per-token KL of the policy to the
reference model,

    e = clip(KL / KL_target - 1, -0.2, 0.2),    beta <- beta * (1 + K * e),    K = min(n / horizon, 1)

where ``n`` is the number of samples the step trained on (the paper's K_beta per batch, written
as batch size over a horizon in samples as in its code, TRL and verl; capped at 1 so that one
step changes beta by at most 20% and beta never turns negative). beta rises while the policy
drifts further than the target and falls while it stays closer.
"""
from __future__ import annotations


class KLController:
    """beta of the token rewards ``r_t = -beta * KL_t`` (:mod:`yatt.algos.token_advantages`).

    Args:
        init: beta at the first step (``algo.kl_in_reward``), >= 0.
        target: the per-token KL (nats) to steer toward (``algo.kl_target``); 0 keeps beta fixed.
        horizon: samples over which a full proportional correction applies (``algo.kl_horizon``), > 0.
    Raises:
        ValueError: a negative ``init`` or ``target``, or ``horizon <= 0``.
    """

    def __init__(self, init: float, target: float = 0.0, horizon: int = 10000):
        if init < 0 or target < 0 or horizon <= 0:
            raise ValueError(f"KLController needs init >= 0, target >= 0 and horizon > 0, got {init}, {target}, {horizon}")
        self.value, self.target, self.horizon = float(init), float(target), int(horizon)

    def update(self, kl: float, n_samples: int) -> float:
        """Adapt beta to the step's mean per-token ``kl`` over ``n_samples`` samples (the same
        values on every rank keep beta the same everywhere); returns the new beta."""
        if self.target > 0 and n_samples > 0:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * min(n_samples / self.horizon, 1.0)
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
