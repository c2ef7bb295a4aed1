"""Dead/hung-rank watchdog: if a rank dies or hangs, the job ends within ``timeout_s``.

Without it a hung rank leaves its peers blocked in a gloo/NCCL collective until the process
group's timeout (600 s, :func:`yatt.dist.init_distributed`), and a rank killed under ``mpirun``
is reported by hydra by PID, not by rank.

How it works
    Every rank runs two daemon threads. The *I/O thread* owns a private connection to the
    torch.distributed rendezvous store (a ``clone()`` of the default process group's store: the
    TCPStore that rank 0 already serves; keys live under ``yatt/watchdog/`` so they cannot collide
    with c10d's). Every ``interval_s`` it publishes this rank's heartbeat, a small JSON record
    ``{seq, wall time, phase, step, pid, host, done, abort}``, and reads the heartbeats it watches.
    The *judge thread* never touches the network: every ``interval_s`` it looks at what the I/O
    thread last managed to read (:class:`Monitor`, pure logic) and declares a failure when

    * a watched rank's heartbeat ``seq`` has not changed for ``timeout_s`` (dead, SIGSTOPped, or its
      interpreter wedged), or never appeared within ``timeout_s`` of ``start()``;
    * the store itself has not answered for ``timeout_s``: rank 0 (which serves the store) is dead
      or frozen. A TCPStore call against a frozen server blocks forever in torch 2.13 (the client's
      cancel-wait has no timeout), which is why the I/O and the decision are separate threads;
    * optionally (``stall_s``), a watched rank's ``(phase, step)`` has not changed for ``stall_s``:
      alive and heartbeating but making no progress (e.g. a Python-level deadlock);
    * rank 0 published an ``abort`` note in its heartbeat (how a failure found by rank 0 reaches
      the others when the launcher is not MPI).

    Staleness is measured on the *checker's* monotonic clock (when it saw ``seq`` change), so clock
    skew between hosts does not matter; a checker that was itself frozen or starved (a gap between
    its own ticks far beyond ``interval_s``) restarts its clocks instead of blaming its peers.

Who checks whom (cost at 1000 ranks)
    Rank 0 checks every rank (one ``multi_get`` of the live ranks' keys per interval: ~130 B a rank;
    measured at 1000 ranks, 2 ms of store round trip plus 8 ms of JSON decoding under the GIL every
    <= 5 s, and, until every rank has started, one ``check`` per missing key, 60 ms for 999); every
    other rank checks only rank 0 (a ``multi_get`` of one key). Rank 0 is special anyway: it
    serves the store, so if it dies or freezes every rank notices the store stopped answering. The store sees 2 requests per rank per interval
    (400/s at 1000 ranks and 5 s), and there is a single checker, so one failure produces one
    report instead of 999. The main thread only ever writes one attribute (:meth:`Watchdog.phase`).

On failure
    ``on_failure(message)`` is called once, on the judge thread. The default prints the message to
    stderr and ends the whole job with exit code :data:`EXIT_RANK_LOST`: ``MPI.COMM_WORLD.Abort``
    when launched by MPI (mpi4py initialises MPI with ``MPI_THREAD_MULTIPLE``; hydra then kills
    every rank, a SIGSTOPped one included, and ``mpirun`` exits with that code), else
    ``os._exit`` (rank 0 first publishes the note and lingers ~2 intervals so the other ranks read
    it and exit too; a frozen rank must then be killed by the launcher, as torchrun/srun do when a
    worker fails). A custom ``on_failure`` that returns leaves the job running; the watchdog then
    stops judging.

A rank that finishes normally calls :meth:`Watchdog.stop` (also run at interpreter exit), which
publishes a ``done`` marker: rank 0 stops watching that rank, and once rank 0 is done the others
stop watching it (its store is about to go away). So the final ``dist.barrier()`` and anything
after ``stop()`` are not watched. Call ``stop()`` before ``dist.destroy_process_group()`` (which
shuts rank 0's store down)::

    wd = Watchdog(info.rank, info.world_size, timeout_s=60)
    wd.start()
    for step in ...:
        wd.phase("rollout", step)
        ...
    wd.stop()
    dist.barrier()
    dist.destroy_process_group()

Timing: a failure is declared once the silence exceeds ``timeout_s``, seen by a check that runs
every ``interval_s`` on what was read at most ``interval_s`` earlier, so the job ends between
``timeout_s`` and ``timeout_s + 2 * interval_s`` after the last heartbeat (70 s at the defaults).

Limits: a heartbeat proves the process and its interpreter are alive, not that the step makes
progress; use ``stall_s`` (longer than the longest legitimate phase) for that. A C extension
holding the GIL for longer than ``timeout_s`` starves the heartbeat and is reported as a hang.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger("yatt")

EXIT_RANK_LOST = 4
"""Exit status of a job ended by the watchdog (a rank died or hung). Distinct from 1 (a Python
error on some rank), 2 (usage), 75 (preempted, :mod:`yatt.checkpoint.triggers`) and hydra's
128+signal / signal-number codes."""
_ABORT_GRACE_S = 1.0  # seconds between the failure message and MPI_Abort (see Watchdog._end_job)

KEY_PREFIX = "yatt/watchdog/"


@dataclass(frozen=True)
class Beat:
    """One decoded heartbeat."""
    seq: int
    wall: float
    phase: str
    step: int
    pid: int
    host: str
    done: bool = False
    abort: str | None = None

    def encode(self) -> bytes:
        return json.dumps({"seq": self.seq, "t": round(self.wall, 3), "phase": self.phase, "step": self.step,
                           "pid": self.pid, "host": self.host, "done": self.done, "abort": self.abort}).encode()

    @staticmethod
    def decode(raw: bytes) -> Beat:
        d = json.loads(raw)
        return Beat(int(d["seq"]), float(d["t"]), str(d["phase"]), int(d["step"]), int(d["pid"]), str(d["host"]),
                    bool(d.get("done")), d.get("abort"))

    @property
    def where(self) -> str:
        return f"{self.host}:{self.pid}"

    @property
    def doing(self) -> str:
        return f"{self.phase!r}" + (f" of step {self.step}" if self.step >= 0 else "")


def observe(seen: Mapping[int, tuple[object, float]], now: float,
            values: Mapping[int, object]) -> dict[int, tuple[object, float]]:
    """Fold one round of readings into ``{rank: (value, changed_at)}``.

    Args:
        seen: the previous table; ranks absent from ``values`` keep their entry.
        now: when ``values`` were read (checker's monotonic clock).
        values: rank -> the value read (a heartbeat ``seq``, or ``(phase, step)``).
    Returns:
        A new table where ``changed_at`` moves to ``now`` for every rank whose value differs.
    """
    out = dict(seen)
    for rank, value in values.items():
        old = seen.get(rank)
        if old is None or old[0] != value:
            out[rank] = (value, now)
    return out


def stale(now: float, changed_at: Mapping[int, float], timeout_s: float) -> list[int]:
    """Ranks whose last change is more than ``timeout_s`` before ``now``, stalest first (ties by rank)."""
    late = [(now - t, r) for r, t in changed_at.items() if now - t > timeout_s]
    return [r for _, r in sorted(late, key=lambda x: (-x[0], x[1]))]


@dataclass(frozen=True)
class Snapshot:
    """What the I/O thread last read: ``ok_at`` is when its last full round succeeded (monotonic;
    the start time before any), ``beats`` that round's heartbeats, ``error`` the error of the
    rounds failing since then (None while they succeed)."""
    ok_at: float
    beats: Mapping[int, Beat]
    error: str | None = None


class Monitor:
    """The failure decision, without threads, sockets or clocks (``now`` is passed in).

    Args:
        rank: the checking rank.
        watched: the ranks it checks (rank 0: all others; the others: ``[0]``).
        now: the start time (monotonic).
        timeout_s, interval_s, stall_s: as :class:`Watchdog`.
    """

    def __init__(self, rank: int, watched: Iterable[int], now: float, timeout_s: float, interval_s: float,
                 stall_s: float | None = None):
        self.rank, self.timeout_s, self.interval_s, self.stall_s = rank, timeout_s, interval_s, stall_s
        self.watched = set(watched)
        self.beats_seen: dict[int, tuple[object, float]] = {r: (None, now) for r in self.watched}
        self.phase_seen: dict[int, tuple[object, float]] = {r: (None, now) for r in self.watched}
        self.last: dict[int, Beat] = {}
        self.done: set[int] = set()
        self.grace = now  # no age counts from before this (set again after the checker itself froze)
        self.last_tick = now
        self._folded: Snapshot | None = None

    @property
    def quiet(self) -> bool:
        """True once every watched rank left cleanly (for a non-zero rank: rank 0 is done)."""
        return self.watched <= self.done

    def tick(self, now: float, snap: Snapshot) -> str | None:
        """One judgement; returns the failure message, or None while all is well."""
        if now - self.last_tick > self.interval_s + self.timeout_s / 2:
            self.grace = now  # this process was frozen or starved: its own clock cannot judge the peers
        self.last_tick = now
        if snap is not self._folded:
            self._fold(snap)
        if self.quiet:
            return None
        note = self.last.get(0).abort if 0 in self.last and self.rank != 0 else None
        if note:
            return f"{note} [reported by rank 0's watchdog]"
        silent = now - max(snap.ok_at, self.grace)
        if silent > self.timeout_s:
            return self._unreachable(silent, snap.error)
        live = {r: max(t, self.grace) for r, (_, t) in self.beats_seen.items() if r not in self.done}
        late = stale(now, live, self.timeout_s)
        if late:
            return self._silent(late, now - live[late[0]])
        if self.stall_s is not None:
            moving = {r: max(t, self.grace) for r, (v, t) in self.phase_seen.items() if r not in self.done and v}
            stuck = stale(now, moving, self.stall_s)
            if stuck:
                b = self.last[stuck[0]]
                return (f"yatt: rank {stuck[0]} ({b.where}) has been in phase {b.doing} for "
                        f"{now - moving[stuck[0]]:.1f} s (stall limit {self.stall_s:g} s){self._others(stuck)}; "
                        "aborting the job")
        return None

    def _fold(self, snap: Snapshot) -> None:
        self._folded = snap
        beats = {r: b for r, b in snap.beats.items() if r in self.watched}
        self.last.update(beats)
        self.done |= {r for r, b in beats.items() if b.done}
        self.beats_seen = observe(self.beats_seen, snap.ok_at, {r: b.seq for r, b in beats.items()})
        self.phase_seen = observe(self.phase_seen, snap.ok_at, {r: (b.phase, b.step) for r, b in beats.items()})

    def _others(self, ranks: list[int]) -> str:
        if len(ranks) < 2:
            return ""
        more = ", ".join(map(str, sorted(ranks[1:])[:8])) + (", ..." if len(ranks) > 9 else "")
        return f" ({len(ranks) - 1} more: {more})"

    def _silent(self, late: list[int], age: float) -> str:
        r = late[0]
        b = self.last.get(r)
        if b is None:
            return (f"yatt: rank {r} sent no heartbeat within {age:.1f} s of the watchdog's start (it died or hung "
                    f"before Watchdog.start()){self._others(late)}; aborting the job")
        return (f"yatt: rank {r} ({b.where}) sent no heartbeat for {age:.1f} s; its last phase was {b.doing}"
                f"{self._others(late)}; aborting the job")

    def _unreachable(self, silent: float, error: str | None) -> str:
        b = self.last.get(0)
        who = f"rank 0 ({b.where})" if b else "rank 0"
        why = f"last error: {error}" if error else "its calls hang"
        tail = f"; rank 0's last phase was {b.doing}" if b and self.rank != 0 else ""
        return (f"yatt: rank {self.rank} got no answer from the rendezvous store served by {who} for {silent:.1f} s "
                f"({why}); rank 0 is dead or hung{tail}; aborting the job")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class Watchdog:
    """Ends the job within ``timeout_s`` when a rank dies or hangs (see the module docstring).

    Args:
        rank, world: this rank and the world size.
        timeout_s: a rank silent for this long (or the store unanswering for this long) is a failure.
        interval_s: heartbeat period; default ``min(timeout_s / 10, 5)``.
        on_failure: called once with the message; default: print it and end the job with
            :data:`EXIT_RANK_LOST`.
        stall_s: also a failure when a rank's ``(phase, step)`` has not changed for this long
            (default None: off). Must exceed the longest legitimate phase.
        store: the store to clone (default: the default process group's store).

    Keys are ``yatt/watchdog/<n>/<rank>`` where ``n`` counts the watchdogs this rank started before,
    so a later watchdog (started by every rank in turn) never reads an earlier one's ``done`` markers.
    """

    _started: dict[int, int] = {}  # rank -> watchdogs started in this process (the key generation)

    def __init__(self, rank: int, world: int, timeout_s: float = 60.0, interval_s: float | None = None,
                 on_failure: Callable[[str], None] | None = None, *, stall_s: float | None = None, store=None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        interval_s = min(timeout_s / 10, 5.0) if interval_s is None else interval_s
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"interval_s must be in (0, timeout_s={timeout_s}), got {interval_s}")
        self.rank, self.world = rank, world
        self.timeout_s, self.interval_s, self.stall_s = float(timeout_s), float(interval_s), stall_s
        self.on_failure = on_failure or self._end_job
        self._base_store = store
        self._phase: tuple[str, int] = ("start", -1)
        self._stop = threading.Event()  # stop(): the I/O thread publishes "done" and leaves
        self._wake = threading.Event()  # publish now (the abort note)
        self._published_abort = threading.Event()
        self._abort: str | None = None
        self._snap: Snapshot | None = None
        self._threads: list[threading.Thread] = []
        self.failure: str | None = None
        self._host, self._pid = socket.gethostname(), os.getpid()

    # -- main thread ------------------------------------------------------------------------
    def start(self) -> None:
        """Begin heartbeating and checking. Every rank calls it, after torch.distributed is initialised
        (a rank that does not is reported once ``timeout_s`` has passed). Never blocks on the network."""
        if self._threads:
            raise RuntimeError("Watchdog.start() called twice")
        if self.world <= 1:
            return
        if self._base_store is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("Watchdog.start() needs torch.distributed initialised (yatt.dist.init_distributed)")
            self._base_store = dist.distributed_c10d._get_default_store()
        generation = Watchdog._started.get(self.rank, 0)
        Watchdog._started[self.rank] = generation + 1
        self._prefix = f"{KEY_PREFIX}{generation}/"
        now = time.monotonic()
        self._snap = Snapshot(now, {})
        watched = range(1, self.world) if self.rank == 0 else [0]
        self._monitor = Monitor(self.rank, watched, now, self.timeout_s, self.interval_s, self.stall_s)
        self._threads = [threading.Thread(target=self._io_loop, name="yatt-watchdog-io", daemon=True),
                         threading.Thread(target=self._judge_loop, name="yatt-watchdog", daemon=True)]
        for t in self._threads:
            t.start()
        atexit.register(self.stop)

    def phase(self, name: str, step: int) -> None:
        """Record the phase this rank is entering (one attribute write; published by the next heartbeat)."""
        self._phase = (name, step)

    def stop(self) -> None:
        """Publish the ``done`` marker and end both threads. Collective-free; waits at most ~2 intervals
        (a store that no longer answers cannot hold it up)."""
        if not self._threads or self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + max(1.0, 2 * self.interval_s)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if self._threads[0].is_alive():
            log.warning("yatt: watchdog on rank %d: could not publish its done marker (store not answering)", self.rank)
        atexit.unregister(self.stop)

    # -- I/O thread -------------------------------------------------------------------------
    def _beat(self, seq: int, done: bool) -> bytes:
        name, step = self._phase
        return Beat(seq, time.time(), name, step, self._pid, self._host, done, self._abort).encode()

    def _io_loop(self) -> None:
        me = f"{self._prefix}{self.rank}"
        watched = sorted(self._monitor.watched)
        present: set[int] = set()
        done: set[int] = set()
        store, seq, error_since, mapped = None, 0, None, self.rank != 0
        while True:
            stopping = self._stop.is_set()
            try:
                if store is None:
                    store = self._base_store.clone()
                    store.set_timeout(timedelta(seconds=self.timeout_s))
                seq += 1
                store.set(me, self._beat(seq, stopping))
                if self._abort:
                    self._published_abort.set()
                if stopping:
                    break
                for r in watched:
                    if r not in present and store.check([f"{self._prefix}{r}"]):
                        present.add(r)
                live = [r for r in watched if r in present and r not in done]
                raw = store.multi_get([f"{self._prefix}{r}" for r in live]) if live else []
                beats = {r: Beat.decode(v) for r, v in zip(live, raw)}
                done |= {r for r, b in beats.items() if b.done}
                self._snap = Snapshot(time.monotonic(), beats)
                if error_since is not None:
                    log.warning("yatt: watchdog on rank %d: store calls work again after %.1f s", self.rank,
                                time.monotonic() - error_since)
                    error_since = None
                if not mapped and len(present) == len(watched):
                    mapped = True
                    self._log_map(beats)
                if self.rank != 0 and 0 in done:
                    break  # rank 0 left cleanly; its store is about to go away
            except Exception as e:  # counts toward the timeout (judge), never silently dropped
                if stopping:
                    break
                if error_since is None:
                    error_since = time.monotonic()
                    log.warning("yatt: watchdog on rank %d: store call failed (%s); failing the job if this "
                                "lasts %g s", self.rank, _first_line(e), self.timeout_s)
                snap = self._snap
                self._snap = Snapshot(snap.ok_at, snap.beats, _first_line(e))
                store = None  # the connection may be broken or out of step: reconnect next round
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _log_map(self, beats: Mapping[int, Beat]) -> None:
        where = {0: f"{self._host}:{self._pid}", **{r: b.where for r, b in beats.items()}}
        log.info("yatt: watchdog on %d ranks (timeout %g s, heartbeat every %g s); rank=host:pid %s", self.world,
                 self.timeout_s, self.interval_s, " ".join(f"{r}={where.get(r, '?')}" for r in range(self.world)))

    # -- judge thread -----------------------------------------------------------------------
    def _judge_loop(self) -> None:
        crash_since = None
        while not self._stop.wait(self.interval_s):
            try:
                message = self._monitor.tick(time.monotonic(), self._snap)
                crash_since = None
            except Exception as e:  # a bug here must not pass silently, nor kill a healthy job at once
                if crash_since is None:
                    log.exception("yatt: watchdog on rank %d: check failed", self.rank)
                    crash_since = time.monotonic()
                message = None
                if time.monotonic() - crash_since > self.timeout_s:
                    message = (f"yatt: the watchdog on rank {self.rank} kept failing ({_first_line(e)}); "
                               "aborting the job")
            if self._monitor.quiet:
                return
            if message:
                self._fail(message)
                return

    def _fail(self, message: str) -> None:
        self.failure = message
        if self.rank == 0:
            self._abort = message  # the next heartbeat carries it to the other ranks
            self._wake.set()
        try:
            self.on_failure(message)
        except BaseException:
            log.exception("yatt: watchdog on rank %d: on_failure raised", self.rank)

    def _end_job(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        from yatt.dist import launched_by_mpi

        if launched_by_mpi():
            from mpi4py import MPI

            # hydra forwards a rank's stderr through its proxy on another channel than the abort,
            # which tears the job down at once: without this pause the message naming the lost rank
            # was sometimes missing from mpirun's output on a busy machine (the job still ended).
            time.sleep(_ABORT_GRACE_S)
            MPI.COMM_WORLD.Abort(EXIT_RANK_LOST)
        if self.rank == 0:  # let the other ranks read the note (they poll every interval)
            self._published_abort.wait(self.interval_s + 1)
            time.sleep(1.5 * self.interval_s)
        os._exit(EXIT_RANK_LOST)
