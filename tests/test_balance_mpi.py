"""tests/mpi/dp_balance.py under mpirun (conftest's shared jobs of 2 and 4 ranks): balanced
logprobs (np 2 and 4) and gradients (np 2) equal the owners' layout's, over both transports."""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("ranks", [2, 4])  # 2: with "train" (one optimizer step on each layout)
def test_dp_balance_matches_own_layout(shared_job, ranks):
    out = shared_job(f"ranks_{ranks}")
    assert out.count("dp_balance OK") == ranks, out[-3000:]
