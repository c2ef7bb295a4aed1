"""Whether released engines may stay resident: one decision for the whole job, from measurements.

On CPU vLLM has no sleep mode, so colocated placements release an engine by tearing it down and
rebuild it for its next phase (seconds per engine per step). Memory permitting, both engines can
instead stay built. The first step runs releasing, as before, and measures what keeping them
would have left: each engine's resident size at its build
(:attr:`yatt.placement.slots.EngineSlot.built_bytes`), and the machine's available memory,
sampled through the step, less this rank's engines that were released at that moment
(:attr:`PhaseTimer.avail_min <yatt.controller.metrics.PhaseTimer>`). Engines stay resident from
then on when, on every machine, each rank's low point less the engines of the machine's other
ranks still leaves :data:`RESERVE_FRACTION` of its memory free (conservative for the other ranks:
their engines count in full at that moment, also where they were resident).
"""
from __future__ import annotations

import socket
from collections import defaultdict

RESERVE_FRACTION = 0.10  # of a machine's memory, kept free with the engines resident


def engines_fit(reports: list[tuple[str, int, float, int]],
                reserve: float = RESERVE_FRACTION) -> tuple[bool, str]:
    """Decide from every rank's report whether the engines fit resident.

    Args:
        reports: one ``(host, engine bytes, low point, machine bytes)`` per rank: the engines it
            would keep, and the lowest available memory of its machine over the step less its own
            engines that were released at that moment (what keeping them would have left).
        reserve: fraction of each machine's memory that must stay free.
    Returns:
        (fit on every machine, a one-line account: per machine, its engines and the tightest
        rank's low point less the other ranks' engines, in GiB).
    """
    need: dict[str, int] = defaultdict(int)
    for host, engine_bytes, _, _ in reports:
        need[host] += engine_bytes
    left: dict[str, float] = {}
    total: dict[str, int] = {}
    for host, engine_bytes, low, machine in reports:  # less the engines of the machine's other ranks
        left[host] = min(left.get(host, float("inf")), low - (need[host] - engine_bytes))
        total[host] = machine
    fit = all(left[h] >= reserve * total[h] for h in need)
    account = ", ".join(f"{h}: {need[h] / 2**30:.2f} GiB of engines, {left[h] / 2**30:.1f} of {total[h] / 2**30:.1f} GiB "
                        f"left with them at the step's low point" for h in need)
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
