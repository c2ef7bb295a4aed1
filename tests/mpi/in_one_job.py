"""Several ``tests/mpi`` scripts in one ``mpirun`` job, one after another in the same processes, so
the job's fixed start (interpreter, MPI, and ~10 s of torch, vLLM and Megatron-Core imports per
rank on the dev machine) is paid once instead of once per script.

    mpirun -np 2 python tests/mpi/in_one_job.py sync_onpolicy reshard_sync:tp reshard_sync:pp rollout_dp

Each item is ``script[:arg,...]``: ``tests/mpi/<script>.py``'s ``main(*args)``. Each script checks
its own properties and prints its own OK lines, as it does when run alone. Megatron's parallel
state is destroyed after each script (the next builds its own sizes); torch.distributed's world
group stays until the end. Any failure prints the traceback and aborts the whole job
(MPI_Abort), so no rank waits for a peer that failed; a job still running after
``YATT_TEST_JOB_TIMEOUT`` s (default 900) dumps every thread's stack and exits.
"""
from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # the scripts' own imports (trainer_tp) and yatt


def run(items: list[str]) -> None:
    for item in items:
        script, _, args = item.partition(":")
        t0 = time.perf_counter()
        importlib.import_module(script).main(*filter(None, args.split(",")))
        if os.environ.get("PMI_RANK", os.environ.get("RANK", "0")) == "0":
            print(f"in_one_job: {item} took {time.perf_counter() - t0:.1f} s", flush=True)
        if "megatron.core.parallel_state" in sys.modules:
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()  # a gloo group torn down at interpreter exit may abort the process


def or_abort(fn, *args) -> None:
    """``fn(*args)``; on any failure print the traceback and abort the whole job (MPI_Abort), so
    no rank waits for a peer that failed. Each script's ``__main__`` runs its ``main`` this way."""
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("YATT_TEST_JOB_TIMEOUT", 900)), exit=True)
    or_abort(run, sys.argv[1:])
