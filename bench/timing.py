"""Wall-clock timing shared by the CPU benchmarks (imported as ``timing``: bench/ is the script's folder)."""
from __future__ import annotations

import statistics
import time


def median_time(fn, repeats: int, warmup: bool = True, barrier=None) -> float:
    """Median seconds of ``repeats`` calls of ``fn()``, after one untimed call when ``warmup``.

    With ``barrier`` (e.g. ``torch.distributed.barrier``, for collective work): every call starts
    after an untimed barrier and ends with a timed one, so a time covers the slowest rank.
    """
    def once() -> float:
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        if barrier is not None:
            barrier()
        return time.perf_counter() - t0

    if warmup:
        once()
    return statistics.median(once() for _ in range(repeats))
