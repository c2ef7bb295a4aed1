"""Trainer -> engine weight sync under ``mpirun -np 2`` (conftest's shared 2-rank job): on-policy
ratio (tests/mpi/sync_onpolicy.py), the trainer -> sampler push of ``rollout_apart``
(tests/mpi/push_apart.py) and the bucketed, resharded sync from a TP=2 or PP=2 trainer
(tests/mpi/reshard_sync.py)."""
import re

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_sync_and_on_policy_ratio(shared_job):
    out = shared_job("ranks_2")
    assert len(re.findall(r"(?<!reshard )sync OK", out)) == 2, out[-3000:]


def test_weight_push_from_a_trainer_rank_to_a_sampler_rank(shared_job):
    """Mixed dtypes bit for bit and 16-byte aligned in one bucket or many; after each of two
    optimizer steps and a push in 64 KiB buckets, the sampler's vLLM logprobs equal the trainer's
    (< 1e-4) and moved since the push before."""
    out = shared_job("ranks_2")
    assert out.count("push OK") == 2, out[-3000:]
    assert all(f"push {p}: engine vs trainer" in out for p in (0, 1)), out[-3000:]


def test_bucketed_sync_tp2_then_pp2_trainer_into_tp1_engines(shared_job):
    """A TP=2 trainer, then a PP=2 trainer (tied embeddings, no stale stage), each two steps, 256 KiB
    buckets, vLLM logprobs after each sync. Each mode prints its per-step lines and "reshard sync OK"
    on both ranks."""
    out = shared_job("ranks_2")
    assert out.count("reshard sync OK") == 4, out[-3000:]
    for mode in ("tp", "pp"):
        assert all(f"rank {r} {mode} step {s}:" in out for r in (0, 1) for s in (1, 2)), out[-3000:]
