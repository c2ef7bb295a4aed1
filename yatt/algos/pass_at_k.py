"""pass@k and mean@k of ``n`` sampled answers per prompt: pure functions of counts.

pass@k is the chance that at least one of ``k`` answers drawn without replacement from the
``n`` sampled ones is correct, estimated without bias as in Chen et al. 2021 ("Evaluating Large
Language Models Trained on Code", eq. 1): ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct
answers. mean@k is the fraction of the ``k`` samples that are correct (pass@1's estimate).
"""
from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n - c, k) / C(n, k)``.

    Computed from exact integer binomials (Python ints), so it is exact up to the final
    rounding to a float, also for large ``n``.

    Args:
        n: answers sampled for the prompt (``n >= 1``).
        c: how many of them are correct (``0 <= c <= n``).
        k: answers per try (``1 <= k <= n``).
    Returns:
        A probability in [0, 1]: 1.0 when fewer than ``k`` answers are wrong (``n - c < k``).
    Raises:
        ValueError: ``n``, ``c`` or ``k`` out of range.
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_at_k(correct: list[bool] | list[float]) -> float:
    """mean@k of one prompt: the fraction of its ``k = len(correct)`` samples that are correct.

    Raises:
        ValueError: no samples.
    """
    if not correct:
        raise ValueError("mean@k of no samples")
    return sum(map(float, correct)) / len(correct)


def reported_ks(n: int) -> list[int]:
    """The k of the pass@k values reported for ``n`` samples per prompt: the powers of two
    below ``n``, and ``n`` (``8 -> [1, 2, 4, 8]``, ``6 -> [1, 2, 4, 6]``).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return [2 ** i for i in range(n.bit_length()) if 2 ** i < n] + [n]
