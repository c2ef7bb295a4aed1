"""Wall-clock timing shared by the CPU benchmarks (imported as ``timing``: bench/ is the script's folder)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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
