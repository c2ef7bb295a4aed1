"""tests/mpi/rollout_dp.py under ``mpirun -np 2`` (conftest's shared 2-rank job): two vLLM
engines, data parallel, uneven prompts."""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_rollout_data_parallel_mpi(shared_job):
    out = shared_job("ranks_2")
    assert "rank 0: OK" in out and "rank 1: OK" in out, out[-3000:]
