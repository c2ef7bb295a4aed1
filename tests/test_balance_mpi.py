"""tests/mpi/dp_balance.py under mpirun: balanced logprobs (np 2 and 4) and gradients (np 2) equal
the owners' layout's, over both transports."""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("ranks, args", [(2, ["train"]), (4, [])])
def test_dp_balance_matches_own_layout(mpirun, ranks, args):
    proc = mpirun(["tests/mpi/dp_balance.py", *args], ranks)
    assert proc.stdout.count("dp_balance OK") == ranks
