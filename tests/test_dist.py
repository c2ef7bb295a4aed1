"""Rank discovery: each launcher's environment (simulated), then real worlds of 2 processes
started by mpirun, torchrun and a stand-in srun, and the launcher's message when there is none."""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from yatt.dist import LauncherError, RankInfo, discover

_LAUNCHER_VARS = ("PMI", "OMPI_", "PMIX", "MPI_LOCAL", "HYDRA", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                  "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC", "GROUP_")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (pytest itself may hold world-1 ones)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def test_srun_step_environment():
    env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_ID": "42"}
    assert discover(env) == RankInfo(3, 8, 1, "slurm")  # the step's tasks, not the allocation's


def test_slurm_batch_script_is_not_a_launcher():
    # the batch script of an 8-task job: task 0 of the batch step, not rank 0 of 8 started ranks
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "42"}
    assert discover(env) == RankInfo(0, 1, 0, "single")
    with pytest.raises(LauncherError, match="batch script of Slurm job 42: start the ranks with srun or mpirun"):
        discover(env, require_launcher=True)


def test_torchrun_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert discover(env) == RankInfo(1, 2, 1, "torchrun")
    # torchrun started by srun (one agent per node): the workers' ranks are torchrun's
    under_srun = {**env, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert discover(under_srun) == RankInfo(1, 2, 1, "torchrun")


def test_plain_python_is_rank_zero_of_one_unless_a_launcher_is_required():
    assert discover({}) == RankInfo(0, 1, 0, "single")
    with pytest.raises(LauncherError, match="no launcher found.*mpirun -np N.*srun.*torchrun.*--standalone"):
        discover({}, require_launcher=True)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "without WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "without RANK"),
    ({"RANK": "two", "WORLD_SIZE": "2"}, "RANK='two' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "torchrun environment gives rank 2 of world size 2"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "0"}, "slurm environment gives rank 0 of world size 0"),
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "x"}, "SLURM_LOCALID='x'"),
])
def test_contradictory_launcher_variables_are_named(env, message):
    with pytest.raises(LauncherError, match=message):
        discover(env)


def test_launch_without_a_launcher_stops_with_the_message(tmp_path):
    cmd = [sys.executable, "-m", "yatt.launch", "--config", "configs/grpo_smollm2.yaml", f"output_dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "yatt: no launcher found" in out.stderr and "--standalone" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "config.yaml").exists()  # stopped before the run started


def _ranks(stdout: str) -> list[dict]:
    # each rank prints one JSON object; a launcher may join two ranks' lines
    return sorted((json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", stdout)), key=lambda r: r["rank"])


def _world_of_two(records: list[dict], source: str) -> None:
    assert [(r["rank"], r["world_size"], r["local_rank"], r["source"]) for r in records] == \
           [(0, 2, 0, source), (1, 2, 1, source)]
    assert all(r["rank_sum"] == 1 and r["env_rank"] == str(r["rank"]) for r in records)


def test_real_mpirun_world_of_two(mpirun):
    _world_of_two(_ranks(mpirun(["tests/mpi/rank_check.py"], 2, timeout=120).stdout), "mpi")


@pytest.mark.mpi
def test_real_torchrun_world_of_two():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", "--standalone", "tests/mpi/rank_check.py"]
    out = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    _world_of_two(_ranks(out.stdout), "torchrun")


@pytest.mark.mpi
def test_stand_in_srun_world_of_two(tmp_path):
    """An ``srun -n 2`` stand-in that starts the tasks with the variables srun gives a step."""
    srun = tmp_path / "srun"
    srun.write_text('#!/usr/bin/env bash\nfor i in 0 1; do\n'
                    '  SLURM_JOB_ID=7 SLURM_NTASKS=2 SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &\n'
                    'done\nwait -n && wait -n\n')
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = subprocess.run([str(srun), sys.executable, "tests/mpi/rank_check.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    _world_of_two(_ranks(out.stdout), "slurm")


def test_wait_until_sleeps_between_polls():
    """A rank waiting on MPI gives its core away: over a 50 ms wait ``done`` is polled about once a
    millisecond (the backoff's cap), not in a spin of thousands of calls."""
    from yatt.dist import wait_until

    calls, end = [], time.monotonic() + 0.05
    wait_until(lambda: calls.append(1) or time.monotonic() >= end)
    assert time.monotonic() >= end and len(calls) <= 70, len(calls)


_WRITER = """
import sys
from yatt.dist import whole_lines
whole_lines()
for i in range(3000):
    print(f"writer {sys.argv[1]} line {i}:", "x" * 60, flush=True)
    print(f"writer {sys.argv[1]} err {i}:", "y" * 60, file=sys.stderr)
"""


def _two_writers() -> list[str]:
    """The lines two processes, after ``whole_lines()``, print at once into one pipe (stdout and stderr both), as the
    ranks of a job do into mpirun's, under ``PYTHONUNBUFFERED=1``."""
    read_fd, write_fd = os.pipe()
    env = _clean_env(PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(k)], stdout=write_fd, stderr=write_fd, env=env)
             for k in range(2)]
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        lines = pipe.read().splitlines()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    return lines


def test_ranks_lines_reach_a_shared_pipe_whole():
    """After :func:`yatt.dist.whole_lines` (``init_distributed`` calls it), two processes printing
    6000 lines each into one pipe under ``PYTHONUNBUFFERED=1`` leave every line whole. Without it
    ``print`` writes text and newline apart, and another rank's line lands between them (a CI run
    lost one of zero_signal's per-rank lines that way)."""
    lines = _two_writers()
    whole = re.compile(r"writer [01] (line \d+: x{60}|err \d+: y{60})")
    assert len(lines) == 12000 and all(whole.fullmatch(line) for line in lines), \
        [line for line in lines if not whole.fullmatch(line)][:5]


_OPEN_POOL = """
from concurrent.futures import ThreadPoolExecutor
from yatt.launch import exit_process
pool = ThreadPoolExecutor(2)  # left open, as a reward function or a tool may leave one
print(pool.submit(lambda: 41 + 1).result(), flush=True)
exit_process(0)
"""


def test_the_fast_exit_ends_an_open_thread_pools_idle_workers():
    """``yatt.launch.exit_process`` (every job's last call) with a ``concurrent.futures`` pool still
    open: the pool's idle workers end and the process exits 0 (joined before threading's exit hooks
    woke them, they waited forever: a hosted test host once hung there until its 900 s limit)."""
    out = subprocess.run([sys.executable, "-c", _OPEN_POOL], cwd=ROOT, env=_clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "42", out.stderr[-2000:]
