"""tests/mpi/rollout_dp.py and rollout_tp.py under ``mpirun -np 2`` (conftest's shared 2-rank job):
two vLLM engines, data parallel, uneven prompts; one engine over both ranks (rollout TP 2, the
trainer at TP 2), synced shard by shard; a reward model's pooling engine at TP 2."""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_rollout_data_parallel_mpi(shared_job):
    out = shared_job("ranks_2")
    assert "rank 0: OK" in out and "rank 1: OK" in out, out[-3000:]


def test_rollout_tensor_parallel_mpi(shared_job):
    out = shared_job("ranks_2")
    assert out.count("rollout tp OK") == 2, out[-3000:]
    assert "rank 1: reward model at TP 2 scores [" in out, out[-3000:]
