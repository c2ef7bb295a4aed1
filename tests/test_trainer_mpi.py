"""Run tests/mpi/trainer_tp.py under mpirun: TP=3 (3 ranks) and DP=2 / PP=2 (2 ranks).

Each case fails when the script exits non-zero; its output is shown on failure.
Measured on 2 shared CPU cores: tp ~37 s, dp ~26 s.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "mpi" / "trainer_tp.py"
# Variables that yatt.dist / torch.distributed may have set in this pytest process: a child
# rank that inherits MASTER_PORT would try to join this process's (world 1) store.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.mark.parametrize("mode,ranks", [("tp", 3), ("dp", 2)])
def test_trainer_under_mpirun(mode, ranks):
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    cmd = [str(Path(sys.prefix) / "bin" / "mpirun"), "-np", str(ranks), sys.executable, str(SCRIPT), mode]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count(f"{mode} OK") == ranks, proc.stdout[-3000:]
