"""When to save: every N steps, every T minutes, and on SIGTERM/SIGUSR1 (save, then exit).

Slurm sends SIGTERM at preemption or the time limit (and SIGUSR1 ahead of it with
``--signal=USR1@<seconds>``); MPICH's ``mpirun`` forwards SIGTERM to every rank. A handler only
sets a flag; the ranks agree at the end of the step (one all-reduce of two ints) whether any of
them was signalled or hit the time interval, so they all save the same step. After a
signal-triggered save is committed the job exits with :data:`EXIT_PREEMPTED`, so a batch script
can tell "stopped cleanly, requeue me" from success (0) and failure (anything else).
"""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, try again" -> requeue and resume


class Preempted(Exception):
    """Raised by the step loop after the checkpoint that a signal asked for is committed."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"{signal_name} received: saved step {step} and stopped")
        self.step, self.signal_name = step, signal_name


class SaveTriggers:
    """Decides at each step end whether to save and whether to stop.

    Args:
        every_steps: save when ``step % every_steps == 0`` (0: never by step count).
        every_minutes: save when this many minutes passed since the last save or the start
            (0: never by time).
        signals: signal names (``"SIGTERM"``, ``"SIGUSR1"``) that ask for a save and a clean exit.
        group: process group of all ranks (None: the default group).
    Install from the main thread (Python delivers signals there); :meth:`close` restores the
    previous handlers.
    """

    def __init__(self, every_steps: int = 0, every_minutes: float = 0.0, signals: tuple[str, ...] = (), group=None):
        self.every_steps, self.every_s, self.group = every_steps, every_minutes * 60.0, group
        self.received: str | None = None
        self._last = time.monotonic()
        self._previous = {name: signal.signal(getattr(signal, name), self._on_signal) for name in signals}

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def check(self, step: int) -> tuple[bool, str | None]:
        """(save at this step?, name of the signal that asks to stop, or None). Collective: the
        answer is the same on every rank."""
        flags = torch.tensor([self.received is not None,
                              self.every_s > 0 and time.monotonic() - self._last >= self.every_s], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        stop = (self.received or "a signal to another rank") if flags[0] else None
        return bool(flags.any()) or (self.every_steps > 0 and step % self.every_steps == 0), stop

    def saved(self) -> None:
        """Restart the time interval (call after each save)."""
        self._last = time.monotonic()

    def close(self) -> None:
        for name, handler in self._previous.items():
            signal.signal(getattr(signal, name), handler)
        self._previous = {}
