"""Rank discovery from each launcher's environment (MPI itself is covered by the mpirun tests)."""
from yatt.dist import RankInfo, discover


def test_slurm_environment():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert discover(env) == RankInfo(3, 8, 1, "slurm")


def test_torchrun_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert discover(env) == RankInfo(1, 2, 1, "torchrun")


def test_plain_python_is_rank_zero_of_one():
    assert discover({}) == RankInfo(0, 1, 0, "single")
