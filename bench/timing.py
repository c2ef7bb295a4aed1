"""Wall-clock timing shared by the CPU benchmarks (imported as ``timing``: bench/ is the script's folder)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


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


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each of ``fns`` in ``repeats`` rounds, after one untimed round. Every round calls
    each function once, in an order rotated by one each round, so a ratio of two functions taken
    within a round compares them under the same state of a shared machine (its load drifts over
    seconds; timing one function's repeats after another's put that drift into their ratio)."""
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def run_job(np_: int, args: list[str], out: Path, name: str) -> tuple[list[dict], float]:
    """``mpirun -np np_ python -m yatt.launch *args`` from the repo root (one thread per rank unless
    OMP_NUM_THREADS is set); returns (the records of ``out/metrics.jsonl``, wall seconds). Exits
    with the job's output tail, naming ``name``, when it fails."""
    cmd = [str(Path(sys.prefix) / "bin" / "mpirun"), "-np", str(np_), sys.executable, "-m", "yatt.launch", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print("+", " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()], wall
