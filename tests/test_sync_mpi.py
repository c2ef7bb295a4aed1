"""Trainer -> engine weight sync under ``mpirun -np 2``: on-policy ratio (tests/mpi/sync_onpolicy.py)
and the bucketed, resharded sync from a TP=2 or PP=2 trainer (tests/mpi/reshard_sync.py)."""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_sync_and_on_policy_ratio(mpirun):
    proc = mpirun(["tests/mpi/sync_onpolicy.py"], 2)
    assert proc.stdout.count("sync OK") == 2, proc.stdout[-3000:]


def test_bucketed_sync_tp2_then_pp2_trainer_into_tp1_engines(mpirun):
    """tests/mpi/reshard_sync.py tp,pp in one job (one start-up): a TP=2 trainer, then a PP=2 trainer
    (tied embeddings, no stale stage), each two steps, 256 KiB buckets, vLLM logprobs after each sync.
    Each mode prints its per-step lines and "reshard sync OK" on both ranks."""
    proc = mpirun(["tests/mpi/reshard_sync.py", "tp,pp"], 2)
    assert proc.stdout.count("reshard sync OK") == 4, proc.stdout[-3000:]
    for mode in ("tp", "pp"):
        assert all(f"rank {r} {mode} step {s}:" in proc.stdout for r in (0, 1) for s in (1, 2)), proc.stdout[-3000:]
