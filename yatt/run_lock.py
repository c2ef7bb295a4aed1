"""One job per run folder: rank 0 holds an exclusive OS lock on ``<output_dir>/.yatt.lock`` for
the job's life.

The lock is ``flock(2)`` on an open file: the kernel drops it when the process ends however it
ends (exit, crash, SIGKILL), so a killed job leaves no stale lock. The file holds the holder's
host, pid and start time (JSON), which a refused job names. A lock file that outlives its job is
harmless: only the ``flock`` counts, never the file's existence.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".yatt.lock"


class RunLocked(RuntimeError):
    """Another live job holds the lock of this output folder."""


class RunLock:
    """The exclusive lock of a run folder, held from :meth:`acquire` until the process ends or
    :meth:`release`.

    Args:
        output_dir: the run folder (created if missing).
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting and write this process's host, pid and start time into it.

        Raises:
            RunLocked: another process holds it; the message names the holder and ``output_dir``.
            OSError: the folder or the lock file cannot be created.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunLocked(_refusal(self.path.parent, holder)) from None
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record + b"\n", 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the process's end drops it too)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_free(output_dir: str | Path) -> None:
    """Whether another job holds ``output_dir``'s lock, asked without taking it: a shared
    ``flock`` probe, which conflicts only with a holder's exclusive lock, so every rank of a
    job may ask at once (before rank 0 takes the lock with :meth:`RunLock.acquire`).

    Raises:
        RunLocked: another process holds it; the message names the holder and ``output_dir``.
    """
    path = Path(output_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file (or none readable): no job has held this folder
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunLocked(_refusal(path.parent, _holder(fd))) from None
    finally:
        os.close(fd)  # drops the probe's shared lock, if taken


def _refusal(output_dir: Path, holder: str) -> str:
    return (f"output_dir {output_dir} is in use by another YATT job ({holder}); one job per run folder: wait "
            "for that job to end or stop it (its mpirun, srun or batch job; SIGINT or SIGTERM saves first), or "
            "pick another output_dir")


def _holder(fd: int) -> str:
    """``host H, pid P, started T`` from the lock file, or what is known when it cannot be read."""
    try:
        rec = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {rec['host']}, rank 0's pid {rec['pid']}, started {rec['started']}"
    except (OSError, ValueError, KeyError):
        return "holder not recorded yet"
