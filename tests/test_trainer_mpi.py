"""tests/mpi/trainer_tp.py under mpirun: TP=3 (3 ranks; SmolLM2's 9 heads rule out TP=2), DP=2,
and DP=2 over a trainer subgroup of a 3-rank world.

Measured on 2 shared CPU cores: tp ~37 s, dp ~26 s.
"""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("mode,ranks", [("tp", 3), ("dp", 2), ("subgroup", 3)])
def test_trainer_under_mpirun(mpirun, mode, ranks):
    proc = mpirun(["tests/mpi/trainer_tp.py", mode], ranks)
    assert proc.stdout.count(f"{mode} OK") == ranks, proc.stdout[-3000:]
