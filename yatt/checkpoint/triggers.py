"""When to save: every N steps, every T minutes, and on SIGTERM/SIGUSR1/SIGINT (save, then exit).

Slurm sends SIGTERM at preemption or the time limit (and SIGUSR1 ahead of it with
``--signal=USR1@<seconds>``); MPICH's ``mpirun`` forwards SIGTERM and Ctrl-C's SIGINT to every
rank. A handler only sets a flag; the ranks agree at the end of the step (one all-reduce of two
ints: the highest signal number any rank got, and the time interval) whether any of them was
signalled or hit the time interval, so they all save the same step and name the same signal.
After a signal-triggered save is committed the job exits with :data:`EXIT_PREEMPTED` (SIGTERM,
SIGUSR1: a batch script can tell "stopped cleanly, requeue me" from success, 0, and failure) or
:data:`EXIT_INTERRUPTED` (SIGINT: the shell's code for Ctrl-C). A second SIGINT in one process
raises ``KeyboardInterrupt`` at once (Python's own Ctrl-C); under ``mpirun`` a second Ctrl-C
is MPICH's forced abort. Either way the newest committed checkpoint is untouched: a checkpoint
becomes visible only by one ``rename`` when complete (:mod:`yatt.checkpoint.files`).

Before the step loop's triggers exist (models loading, engines starting), :func:`catch_early`'s
handler records the signal instead of letting it kill the rank; the loop then stops at its next
start-up check (:func:`early_stop_requested` once the data is loaded, before any model loads;
:meth:`SaveTriggers.stop_requested` once models and engines are up) with the same exit code and
nothing saved.
A second signal while a save is being written is recorded again, never fatal: the save finishes.
"""
from __future__ import annotations

import os
import signal
import time

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, try again" -> requeue and resume
EXIT_SAVE_FAILED = 74  # sysexits.h EX_IOERR: the final (or a signal's) checkpoint could not be written
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a Ctrl-C'd command


def exit_code(signal_name: str) -> int:
    """The exit code of a run that a signal stopped: :data:`EXIT_INTERRUPTED` for SIGINT (Ctrl-C),
    :data:`EXIT_PREEMPTED` otherwise."""
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


class Preempted(Exception):
    """Raised by the step loop after the checkpoint that a signal asked for is committed, or
    (``saved=False``) when the signal came during start-up, before there was a step to save."""

    def __init__(self, step: int | None, signal_name: str, saved: bool = True):
        done = ("no step done in this job" if step is None else f"the run resumes from step {step}" if step
                else "no step done")
        what = (f": saved step {step} and stopped" if saved
                else f" during start-up, nothing to save yet ({done}); stopped")
        super().__init__(f"{signal_name} received{what}")
        self.step, self.signal_name, self.saved = step, signal_name, saved
        self.exit_code = exit_code(signal_name)


def _announce(name: str, again: bool) -> None:
    """Tell the user at once (rank 0, from the handler: ``os.write``) what a signal will do."""
    rank = next((os.environ[k] for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
                 if k in os.environ), "0")
    if rank != "0" or again:
        return
    more = " (Ctrl-C again to stop at once; the last committed checkpoint stays intact)" if name == "SIGINT" else ""
    os.write(2, f"yatt: {name} received: stopping after this step's checkpoint{more}\n".encode())


def _record(previous: str | None, signum: int) -> str:
    """What a handler does: a second SIGINT raises ``KeyboardInterrupt`` (stop at once), anything
    else is recorded (announced the first time) and returned as the signal to act on."""
    name = signal.Signals(signum).name
    if name == "SIGINT" and previous == "SIGINT":
        raise KeyboardInterrupt
    _announce(name, previous is not None)
    return name if previous is None or signum > signal.Signals[previous] else previous


class _Early:
    received: str | None = None
    previous: dict = {}


def catch_early(signals: tuple[str, ...]) -> None:
    """Record ``signals`` (names such as ``"SIGTERM"``) from now on instead of dying of them; the
    first :class:`SaveTriggers` takes the record over. Call first thing in a job's main thread."""
    def on_signal(signum, frame) -> None:
        _Early.received = _record(_Early.received, signum)

    for name in signals:
        old = signal.signal(getattr(signal, name), on_signal)
        _Early.previous.setdefault(name, old)


def early_stop_requested(group=None) -> str | None:
    """:meth:`SaveTriggers.stop_requested` for the start-up before the step loop's triggers exist:
    the signal :func:`catch_early` recorded on any rank, or None. Collective."""
    return _any_rank(_Early.received, group)


def _any_rank(received: str | None, group) -> str | None:
    """The name of the highest-numbered signal any rank of ``group`` got (``received`` on this
    one), the same on every rank, else None (one all-reduce of one int)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([_signum(received)], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return signal.Signals(int(flag.item())).name if flag.item() else None


def _signum(name: str | None) -> int:
    return int(signal.Signals[name]) if name is not None else 0


def release_early() -> None:
    """Restore the handlers :func:`catch_early` replaced and no :class:`SaveTriggers` took over
    (a job that ended before its step loop; the Python API's caller keeps its own handlers)."""
    for name, old in _Early.previous.items():
        signal.signal(getattr(signal, name), old)
    _Early.previous.clear()
    _Early.received = None


class SaveTriggers:
    """Decides at each step end whether to save and whether to stop.

    Args:
        every_steps: save when ``step % every_steps == 0`` (0: never by step count).
        every_minutes: save when this many minutes passed since the last save or the start
            (0: never by time).
        signals: signal names (``"SIGTERM"``, ``"SIGUSR1"``, ``"SIGINT"``) that ask for a save and a
            clean exit.
        group: process group of all ranks (None: the default group).
    Install from the main thread (Python delivers signals there); :meth:`close` restores the
    previous handlers.
    """

    def __init__(self, every_steps: int = 0, every_minutes: float = 0.0, signals: tuple[str, ...] = (), group=None):
        self.every_steps, self.every_s, self.group = every_steps, every_minutes * 60.0, group
        self.received: str | None = _Early.received  # a signal during start-up (catch_early)
        _Early.received = None
        self._last = time.monotonic()
        self._previous = {}
        for name in signals:
            old = signal.signal(getattr(signal, name), self._on_signal)
            self._previous[name] = _Early.previous.pop(name, old)  # close() restores what was there first

    def _on_signal(self, signum, frame) -> None:
        self.received = _record(self.received, signum)

    def stop_requested(self) -> str | None:
        """The name of a signal received by any rank (the highest-numbered, if several), or None.
        Collective: the same answer on every rank."""
        return _any_rank(self.received, self.group)

    def check(self, step: int) -> tuple[bool, str | None]:
        """(save at this step?, name of the signal that asks to stop, or None). Collective: the
        answer is the same on every rank."""
        import torch
        import torch.distributed as dist

        flags = torch.tensor([_signum(self.received),
                              self.every_s > 0 and time.monotonic() - self._last >= self.every_s], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        stop = signal.Signals(int(flags[0])).name if flags[0] else None
        return bool(flags.any()) or (self.every_steps > 0 and step % self.every_steps == 0), stop

    def saved(self) -> None:
        """Restart the time interval (call after each save)."""
        self._last = time.monotonic()

    def close(self) -> None:
        for name, handler in self._previous.items():
            signal.signal(getattr(signal, name), handler)
        self._previous = {}
