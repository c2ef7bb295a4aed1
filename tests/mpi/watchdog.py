"""yatt.watchdog under ``mpirun -np 2`` (or as N plain processes with RANK/WORLD_SIZE/MASTER_PORT set).

``python tests/mpi/watchdog.py SCENARIO [VICTIM] [TIMEOUT_S]``:

* ``hang``: every rank starts a Watchdog and enters phase 'train' of step 3; rank VICTIM (default 1)
  then SIGSTOPs itself, printing ``stopping at <wall time>`` first. Rank 0 (or, when rank 0 is the
  victim, every rank) waits in ``dist.barrier()``, which without the watchdog would block for the
  600 s gloo timeout; other ranks sleep. The job must end with :data:`EXIT_RANK_LOST` naming the victim.
* ``kill``: the same, with SIGKILL.
* ``clean``: a few phases with sleeps longer than the heartbeat interval; rank 1 stops its watchdog
  early and waits in the final barrier while rank 0 keeps working for longer than the timeout (its
  done marker must keep rank 0 from flagging it); everything exits 0 and prints ``clean OK``. Also
  prints the main thread's cost per ``phase()`` call.

Every rank prints ``pid <rank> <pid>`` first so the driver can check that none survives.
"""
import logging
import os
import signal
import sys
import time

import torch.distributed as dist

from yatt.dist import init_distributed
from yatt.watchdog import Watchdog


def main() -> None:
    scenario = sys.argv[1]
    victim = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    info = init_distributed(threads=1)
    logging.basicConfig(level=logging.INFO, format=f"[r{info.rank}] %(message)s")
    print(f"pid {info.rank} {os.getpid()}", flush=True)
    wd = Watchdog(info.rank, info.world_size, timeout_s=timeout_s)
    wd.start()
    if scenario in ("hang", "kill"):
        wd.phase("train", 3)
        time.sleep(3 * wd.interval_s)  # let the heartbeat carry the phase
        if info.rank == victim:
            print(f"stopping at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP if scenario == "hang" else signal.SIGKILL)
        elif info.rank == 0 or victim == 0 or info.source == "mpi":
            dist.barrier()  # blocks: the victim never arrives
        else:
            time.sleep(120)  # (not MPI) a peer of rank 0: only rank 0's abort note can end it
        print(f"rank {info.rank}: still running", flush=True)
        sys.exit(3)
    assert scenario == "clean", scenario
    n = 100_000
    t = time.perf_counter()
    for i in range(n):
        wd.phase("rollout", i)
    per_call = (time.perf_counter() - t) / n
    print(f"rank {info.rank}: phase() {per_call * 1e9:.0f} ns/call", flush=True)
    assert per_call < 20e-6, per_call
    for step in range(2):
        for name in ("rollout", "train"):
            wd.phase(name, step)
            time.sleep(1.5 * wd.interval_s)
    if info.rank == 1:
        wd.stop()  # leaves early: rank 0 must not count the silence that follows as a hang
    else:
        wd.phase("save", 2)
        time.sleep(timeout_s + 3 * wd.interval_s)
        wd.stop()
    assert wd.failure is None, wd.failure
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {info.rank}: clean OK", flush=True)


if __name__ == "__main__":
    main()
