"""Runs tests/mpi/rollout_dp.py under ``mpirun -np 2`` (two vLLM engines, data parallel)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.prefix) / "bin" / "mpirun"


@pytest.mark.skipif(not MPIRUN.exists(), reason="mpirun not in the venv (pip install mpich)")
def test_rollout_data_parallel_mpi():
    env = dict(os.environ, OMP_NUM_THREADS="1", ROLLOUT_DP_TIMEOUT="540",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # stale torch env from an in-process test would mislead the ranks
    proc = subprocess.run([str(MPIRUN), "-np", "2", sys.executable, str(ROOT / "tests/mpi/rollout_dp.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "rank 0: OK" in proc.stdout and "rank 1: OK" in proc.stdout, tail
