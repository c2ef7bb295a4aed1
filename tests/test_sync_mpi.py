"""Trainer -> engine weight sync under ``mpirun -np 2``: on-policy ratio (tests/mpi/sync_onpolicy.py)
and the bucketed, resharded sync from a TP=2 or PP=2 trainer (tests/mpi/reshard_sync.py)."""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_sync_and_on_policy_ratio(mpirun):
    proc = mpirun(["tests/mpi/sync_onpolicy.py"], 2)
    assert proc.stdout.count("sync OK") == 2, proc.stdout[-3000:]


def test_bucketed_sync_tp2_trainer_into_tp1_engines(mpirun):
    """tests/mpi/reshard_sync.py: TP=2 trainer, 256 KiB buckets, two steps, vLLM logprobs."""
    proc = mpirun(["tests/mpi/reshard_sync.py", "tp"], 2)
    assert proc.stdout.count("reshard sync OK") == 2, proc.stdout[-3000:]


def test_bucketed_sync_pp2_trainer_two_steps(mpirun):
    """tests/mpi/reshard_sync.py pp: PP=2 trainer (tied embeddings), two steps, no stale stage."""
    proc = mpirun(["tests/mpi/reshard_sync.py", "pp"], 2)
    assert proc.stdout.count("reshard sync OK") == 2, proc.stdout[-3000:]
