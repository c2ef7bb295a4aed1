"""Choosing the sampler/GenRM split by ternary search over measured phase times.

With ``placement.genrm_ranks: auto`` the number of GenRM ranks ``k`` in ``[lo, hi]`` is tuned
online: each step runs one candidate split, the step's rollout+GenRM phase time is recorded
as that split's cost, and an integer ternary search narrows the interval (the cost is assumed
unimodal in ``k``: too few GenRM ranks and sampling waits on the judge, too many and the
samplers are the bottleneck). Each probe is measured ``repeats`` times and averaged. Once the
interval holds at most three splits, the best measured one is kept for the rest of the run.
"""
from __future__ import annotations

from collections import defaultdict


class SplitSearch:
    """Integer ternary search for the ``k`` minimising a noisy, unimodal measured cost.

    Args:
        lo, hi: inclusive range of candidate splits (``1 <= lo <= hi``).
        repeats: measurements averaged per candidate.
    Raises:
        ValueError: ``lo > hi``, ``lo < 1`` or ``repeats < 1``.
    Every rank must feed the same (globally reduced) costs so all ranks choose the same split.
    Evaluations: about ``2 * log_{3/2}(hi - lo)`` distinct candidates, ``repeats`` steps each.
    """

    def __init__(self, lo: int, hi: int, repeats: int = 1) -> None:
        if lo < 1 or lo > hi or repeats < 1:
            raise ValueError(f"need 1 <= lo <= hi and repeats >= 1, got lo={lo} hi={hi} repeats={repeats}")
        self.lo, self.hi, self.repeats = lo, hi, repeats
        self._costs: dict[int, list[float]] = defaultdict(list)
        self.best: int | None = lo if lo == hi else None

    def next(self) -> int:
        """The split to run this step (the chosen one once converged)."""
        if self.best is not None:
            return self.best
        for k in self._probes():
            if len(self._costs[k]) < self.repeats:
                return k
        raise AssertionError("unreachable: record() narrows the interval once probes are measured")

    def record(self, k: int, cost: float) -> None:
        """Add one measured cost (seconds) of split ``k`` and narrow the interval when possible."""
        self._costs[k].append(float(cost))
        while self.best is None and all(len(self._costs[p]) >= self.repeats for p in self._probes()):
            probes = self._probes()
            if self.hi - self.lo <= 2:
                self.best = min(probes, key=lambda p: (self.mean(p), p))
                break
            m1, m2 = probes
            if self.mean(m1) <= self.mean(m2):  # the minimum is not right of m2
                self.hi = m2 - 1
            else:  # not left of m1
                self.lo = m1 + 1

    def mean(self, k: int) -> float:
        costs = self._costs[k]
        return sum(costs) / len(costs) if costs else float("inf")

    def _probes(self) -> list[int]:
        if self.hi - self.lo <= 2:
            return list(range(self.lo, self.hi + 1))
        third = (self.hi - self.lo) // 3
        return [self.lo + third, self.hi - third]
