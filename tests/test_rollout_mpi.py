"""tests/mpi/rollout_dp.py under ``mpirun -np 2``: two vLLM engines, data parallel, uneven prompts."""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_rollout_data_parallel_mpi(mpirun):
    proc = mpirun(["tests/mpi/rollout_dp.py"], 2, ROLLOUT_DP_TIMEOUT="540")
    assert "rank 0: OK" in proc.stdout and "rank 1: OK" in proc.stdout, proc.stdout[-3000:]
