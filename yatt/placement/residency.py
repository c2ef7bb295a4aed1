"""Whether released engines may stay resident: one decision for the whole job, from measurements.

On CPU vLLM has no sleep mode, so colocated placements release an engine by tearing it down and
rebuild it for its next phase (seconds per engine per step). Memory permitting, both engines can
instead stay built. The first step runs releasing, as before, and measures what that would cost:
each engine's resident size at its build (:attr:`yatt.placement.slots.EngineSlot.built_bytes`)
and the machine's lowest available memory over the step (:attr:`PhaseTimer.avail_min
<yatt.controller.metrics.PhaseTimer>`). Engines stay resident from then on when, on every
machine, that low point less the engines of all its ranks still leaves :data:`RESERVE_FRACTION`
of the machine's memory free (conservative: an engine counts against every phase, also one in
which it was already resident).
"""
from __future__ import annotations

import socket
from collections import defaultdict

RESERVE_FRACTION = 0.10  # of a machine's memory, kept free with the engines resident


def engines_fit(reports: list[tuple[str, int, float, int]],
                reserve: float = RESERVE_FRACTION) -> tuple[bool, str]:
    """Decide from every rank's report whether the engines fit resident.

    Args:
        reports: one ``(host, engine bytes, lowest available bytes over the step, machine bytes)``
            per rank: the engines it would keep, what its machine had left at the step's low point.
        reserve: fraction of each machine's memory that must stay free.
    Returns:
        (fit on every machine, a one-line account: per machine, GiB of engines against GiB left).
    """
    need: dict[str, int] = defaultdict(int)
    low: dict[str, float] = {}
    total: dict[str, int] = {}
    for host, engine_bytes, avail_min, machine in reports:
        need[host] += engine_bytes
        low[host] = min(low.get(host, float("inf")), avail_min)
        total[host] = machine
    fit = all(low[h] - need[h] >= reserve * total[h] for h in need)
    account = ", ".join(f"{h}: {need[h] / 2**30:.2f} GiB of engines, {low[h] / 2**30:.1f} of {total[h] / 2**30:.1f} GiB "
                        f"left at the step's low point" for h in need)
    return fit, account


def gather_reports(engine_bytes: int, avail_min: float) -> list[tuple[str, int, float, int]]:
    """This rank's report, all-gathered over the world (collective)."""
    import psutil
    import torch.distributed as dist

    mine = (socket.gethostname(), int(engine_bytes), float(avail_min), int(psutil.virtual_memory().total))
    if not dist.is_initialized():
        return [mine]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every
