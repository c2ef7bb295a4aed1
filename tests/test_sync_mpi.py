"""tests/mpi/sync_onpolicy.py under ``mpirun -np 2``: on-policy ratio and weight sync."""


def test_sync_and_on_policy_ratio(mpirun):
    proc = mpirun(["tests/mpi/sync_onpolicy.py"], 2)
    assert proc.stdout.count("sync OK") == 2, proc.stdout[-3000:]
