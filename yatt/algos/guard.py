"""Stability guard: skip an optimizer step whose gradient is non-finite or spikes.

A NaN/Inf in the loss or the gradient, or a gradient norm far above its recent level, usually
means a bad batch or a numerical blow-up; applying the update can ruin the run (large LLM runs
skip such batches, e.g. PaLM, Chowdhery et al. 2022, section 5.1). The guard looks at the
pre-clip global gradient norm, which is the same on every rank (gradients are already summed
over DP and the norm is reduced over TP/PP), so every rank takes the same decision without a
collective.
"""
from __future__ import annotations

import math
import statistics
from collections import deque


class StabilityGuard:
    """Decides per optimizer step whether to skip it.

    Args:
        spike_factor: skip when the grad norm exceeds ``spike_factor`` x the median of the last
            ``window`` applied steps' norms (``> 1``).
        window: applied steps the running median covers.
        min_history: applied steps needed before spikes are judged (non-finite norms are
            always skipped).
    Attributes:
        skipped_non_finite, skipped_spike: steps skipped so far, by reason.
    """

    def __init__(self, spike_factor: float = 10.0, window: int = 20, min_history: int = 5):
        if not spike_factor > 1 or window < 1 or not 1 <= min_history <= window:
            raise ValueError(f"need spike_factor > 1 and 1 <= min_history <= window, got "
                             f"{spike_factor}, {min_history}, {window}")
        self.spike_factor, self.min_history = spike_factor, min_history
        self.history: deque[float] = deque(maxlen=window)
        self.skipped_non_finite = self.skipped_spike = 0

    def __call__(self, grad_norm: float) -> bool:
        """True to skip the step with this pre-clip grad norm. An applied step's norm is recorded
        unless it is 0 (every advantage 0: no signal, and zeros would drag the median to 0)."""
        if not math.isfinite(grad_norm):
            self.skipped_non_finite += 1
            return True
        if len(self.history) >= self.min_history and grad_norm > self.spike_factor * statistics.median(self.history):
            self.skipped_spike += 1
            return True
        if grad_norm > 0:
            self.history.append(grad_norm)
        return False

    def state_dict(self) -> dict:
        """The running median's window and the skip counters (for checkpoints)."""
        return {"history": list(self.history), "skipped_non_finite": self.skipped_non_finite,
                "skipped_spike": self.skipped_spike}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(state["history"])
        self.skipped_non_finite, self.skipped_spike = state["skipped_non_finite"], state["skipped_spike"]
