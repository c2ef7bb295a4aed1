"""Several whole YATT jobs in one ``mpirun`` job, one after another in the same processes
(``yatt.launch.execute(..., keep_process_group=True)``), so that the interpreter start and the
~10 s of torch, vLLM, Megatron-Core and transformers imports per rank are paid once for all of them.
The processes restart with the runtime libraries ``python -m yatt.launch`` preloads (``yatt.preload``).

    mpirun -np 2 python tests/mpi/jobs_in_one.py JOBS.json

``JOBS.json`` lists ``{"name", "config", "overrides", "copy", "hook", "log"}`` (``python -m
yatt.launch --config CONFIG OVERRIDES...``, after rank 0 has copied each ``[src, dst]`` of ``copy``,
a folder or a file: a resumed run's checkpoint from a job before it; a missing ``src`` skips the
job, exit code 3, the reason in its log; a ``hook`` ``[module, *args]`` patches YATT for the job:
``tests/mpi/<module>.py``'s ``install(*args)`` runs before it and the callable it returns after
it); while a job runs, every rank's stdout and stderr (file descriptors 1 and 2: Python, vLLM and
MPI alike) are appended to ``log``, as ``mpirun`` would merge them. Rank 0 writes each job's exit
code to ``<log>.code`` after it ends. A job that raises aborts the whole ``mpirun`` job (as it
would alone); a job still running after ``YATT_TEST_JOB_TIMEOUT`` s (default 900) in all dumps
every thread's stack and exits.
"""
from __future__ import annotations

import faulthandler
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # yatt, and tests.reward_fns for function rewards


def run_job(config: str, overrides: list[str], log: Path) -> int:
    """One job, its output appended to ``log``; returns its exit code."""
    from yatt.config import ConfigError, load_config
    from yatt.launch import _report, execute

    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush(), sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1), os.dup2(fd, 2)
        try:
            return execute(load_config(config, overrides), require_launcher=True, keep_process_group=True)[0]
        except ConfigError as e:
            _report(e)
            return 2
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def copy_inputs(comm, pairs: list[list[str]], log: Path) -> bool:
    """Rank 0 of ``comm`` copies each ``[src, dst]`` (a folder or a file); every rank learns whether all
    were there."""
    missing = None
    if comm.Get_rank() == 0:
        missing = next((src for src, _ in pairs if not Path(src).exists()), None)
        if missing is not None:
            with open(log, "a") as f:
                f.write(f"jobs_in_one: not run, {missing} is missing (the job that writes it failed)\n")
        else:
            for src, dst in pairs:
                Path(dst).parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if Path(src).is_dir() else shutil.copy2)(src, dst)
    return comm.bcast(missing, root=0) is None


def main(jobs_file: str) -> None:
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for job in json.loads(Path(jobs_file).read_text()):
        t0 = time.perf_counter()
        ready = copy_inputs(comm, job.get("copy", []), Path(job["log"]))
        module, *args = job.get("hook") or [None]
        undo = importlib.import_module(module).install(*args) if module and ready else None
        try:
            code = run_job(job["config"], job["overrides"], Path(job["log"])) if ready else 3
        finally:
            if undo is not None:
                undo()
        if "megatron.core.parallel_state" in sys.modules:  # the next job sets its own TP and PP
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
        if comm.Get_rank() == 0:
            Path(f"{job['log']}.code").write_text(f"{code}\n")
            print(f"jobs_in_one: {job['name']} exited {code} after {time.perf_counter() - t0:.1f} s", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # a gloo group torn down at interpreter exit may abort the process


if __name__ == "__main__":
    from yatt.preload import restart_with_preload

    restart_with_preload()  # the allocator and OpenMP that python -m yatt.launch runs on
    faulthandler.dump_traceback_later(float(os.environ.get("YATT_TEST_JOB_TIMEOUT", 900)), exit=True)
    main(sys.argv[1])
    from yatt.launch import exit_process

    exit_process(0)  # as python -m yatt.launch ends: MPI finalized, no interpreter teardown
