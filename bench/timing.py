"""Wall-clock timing shared by the CPU benchmarks (imported as ``timing``: bench/ is the script's folder)."""
from __future__ import annotations

import statistics
import time


def median_time(fn, repeats: int, warmup: bool = True) -> float:
    """Median seconds of ``repeats`` calls of ``fn()``, after one untimed call when ``warmup``."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
