"""tests/mpi/data_memory.py under ``mpirun -np 4`` (conftest's shared 4-rank job, where it runs
first): rank 0's data-path memory is flat in the world size (1, 2, 4 ranks, fixed per-rank batch)
and in the dataset size (jsonl and parquet)."""
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_data_path_memory_flat_in_world_and_dataset_size(shared_job):
    out = shared_job("ranks_4")
    assert "data memory OK" in out, out[-3000:]
