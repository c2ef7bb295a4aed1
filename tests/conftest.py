"""Shared test helpers: launching a script under ``mpirun`` from pytest."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.prefix) / "bin" / "mpirun"
# Set by yatt.dist / torch.distributed in this pytest process: a child rank that inherits
# MASTER_PORT would try to join this process's (world 1) store.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def mpirun():
    """``mpirun(args, ranks, timeout=600, **env) -> CompletedProcess``; fails the test on a non-zero exit.

    ``args`` is the argv after ``python`` (a script path or ``-m module ...``), run from the repo
    root with one thread per rank.
    """
    def run(args: list[str], ranks: int, timeout: int = 600, **extra_env: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
        env.update(extra_env)
        cmd = [str(MPIRUN), "-np", str(ranks), sys.executable, *map(str, args)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail = f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{tail}"
        return proc

    return run


@pytest.fixture(scope="session")
def world1():
    """torch.distributed, Megatron's parallel state (TP=1, PP=1) and its RNG tracker (as a
    ``MegatronPolicy`` sets them up) for a world of one rank, in this process."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from yatt.dist import init_distributed
    from yatt.trainer.actor import init_parallel_state

    info = init_distributed()
    assert info.world_size == 1
    init_parallel_state(1, 1)
    with torch.random.fork_rng(devices=[]):
        model_parallel_cuda_manual_seed(1234)
    return info


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of ``<run_dir>/tensorboard`` as TensorBoard's own reader sees
    it (purged steps dropped; every event kept, not TensorBoard's default sample)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
