"""Asynchronous streaming of finished sample groups from sampler ranks to GenRM ranks.

Partial colocation and the disaggregated baseline split the world (``MPI_Comm_split``) into a
sampler group and a GenRM group joined by an MPI intercommunicator. A sampler sends each
sample group the moment vLLM finishes it (non-blocking ``isend``) to the GenRM rank with the
least queued tokens; a GenRM rank scores whatever has arrived, batch after batch, and reports
its queue length back so the samplers' choice stays current.

Protocol on the intercommunicator (ranks are *remote* ranks of the other group; MPI keeps
messages between one pair in order):

- sampler -> GenRM: ``ITEM`` (one group), then ``DONE`` once to every GenRM rank.
- GenRM -> sampler: ``LOAD`` (the rank's queued tokens) after each change, and ``FIN`` to
  every sampler once all samplers sent ``DONE`` and its queue is empty.

A sampler drains ``LOAD`` messages until it has ``FIN`` from every GenRM rank, so no message
of this step is left for the next one. Every group is delivered exactly once: MPI delivery is
reliable, each ITEM is popped from the queue once, and the phase ends only after every DONE.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from yatt.dist import wait_until

ITEM, DONE, LOAD, FIN = 1, 2, 3, 4


class StreamSender:
    """Sampler side: ``send`` each finished group to the least-loaded GenRM rank.

    Args:
        inter: intercommunicator whose remote group is the GenRM ranks.
    Load estimate of GenRM rank j: the queued tokens it last reported plus the tokens this
    sampler sent it since (other samplers' sends show up with the next report).
    """

    def __init__(self, inter) -> None:
        self.inter = inter
        self.judges = inter.Get_remote_size()
        self.load = [0] * self.judges  # estimated queued tokens per GenRM rank
        self.sent = [0] * self.judges  # groups sent per GenRM rank (for metrics and tests)
        self._requests: list = []

    def send(self, item, tokens: int) -> int:
        """Send ``item`` (any picklable object) of ``tokens`` judge tokens; returns the GenRM rank."""
        self._drain(block=False)
        j = min(range(self.judges), key=lambda r: (self.load[r], r))
        self._requests.append(self.inter.isend(item, dest=j, tag=ITEM))
        self.load[j] += tokens
        self.sent[j] += 1
        return j

    def close(self) -> float:
        """Send DONE to every GenRM rank and wait for all their FINs; returns seconds waited."""
        from mpi4py import MPI

        for j in range(self.judges):
            self._requests.append(self.inter.isend(None, dest=j, tag=DONE))
        t0 = time.perf_counter()
        wait_until(lambda: MPI.Request.Testall(self._requests))  # asleep, not spinning (yatt.dist.wait_until)
        self._requests.clear()
        self._drain(block=True)
        return time.perf_counter() - t0

    def _drain(self, block: bool) -> None:
        """Read LOAD/FIN messages; with ``block``, until every GenRM rank sent FIN."""
        from mpi4py import MPI

        status = MPI.Status()
        fins = 0
        while True:
            if not block and not self.inter.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                return
            if block and fins == self.judges:
                return
            if block:
                wait_until(lambda: self.inter.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG))
            msg = self.inter.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            if status.Get_tag() == LOAD:
                self.load[status.Get_source()] = msg
            elif status.Get_tag() == FIN:
                fins += 1
            else:
                raise RuntimeError(f"sampler got unexpected tag {status.Get_tag()}")


@dataclass
class QueueStats:
    """GenRM-rank queue statistics of one phase (tokens queued = received, not yet scored)."""

    max_tokens: int = 0
    max_groups: int = 0
    samples: list[int] = field(default_factory=list)  # queued tokens seen at each batch start
    idle_s: float = 0.0  # time blocked with an empty queue, waiting for samplers


class StreamReceiver:
    """GenRM side: yields batches of received groups until every sampler is done.

    Args:
        inter: intercommunicator whose remote group is the sampler ranks.
        tokens_of: ``item -> int`` judge tokens of one group (the queue's load unit).
    Use ``for batch in receiver: score(batch); receiver.scored(batch)``; after the loop every
    item sent this phase was yielded exactly once and FIN has gone to every sampler.
    """

    def __init__(self, inter, tokens_of) -> None:
        self.inter = inter
        self.samplers = inter.Get_remote_size()
        self.tokens_of = tokens_of
        self.stats = QueueStats()
        self._queue: list = []
        self._queued_tokens = 0
        self._done = 0
        self._requests: list = []

    def __iter__(self):
        while True:
            self._receive(block=not self._queue and self._done < self.samplers)
            if not self._queue:
                if self._done == self.samplers:
                    break
                continue
            batch, self._queue = self._queue, []
            self.stats.samples.append(self._queued_tokens)
            yield batch
        self._finish()

    def scored(self, batch: list) -> None:
        """Mark ``batch`` scored: its tokens leave the queue and the samplers hear the new load."""
        self._queued_tokens -= sum(self.tokens_of(x) for x in batch)
        self._report()

    def _receive(self, block: bool) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        if block:
            t0 = time.perf_counter()
            wait_until(lambda: self.inter.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG))
            self.stats.idle_s += time.perf_counter() - t0
        got = False
        while self.inter.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            msg = self.inter.recv(source=status.Get_source(), tag=status.Get_tag())
            if status.Get_tag() == ITEM:
                self._queue.append(msg)
                self._queued_tokens += self.tokens_of(msg)
                got = True
            elif status.Get_tag() == DONE:
                self._done += 1
            else:
                raise RuntimeError(f"GenRM rank got unexpected tag {status.Get_tag()}")
        self.stats.max_tokens = max(self.stats.max_tokens, self._queued_tokens)
        self.stats.max_groups = max(self.stats.max_groups, len(self._queue))
        if got:
            self._report()

    def _report(self) -> None:
        for s in range(self.samplers):
            self._requests.append(self.inter.isend(self._queued_tokens, dest=s, tag=LOAD))

    def _finish(self) -> None:
        from mpi4py import MPI

        for s in range(self.samplers):
            self._requests.append(self.inter.isend(None, dest=s, tag=FIN))
        wait_until(lambda: MPI.Request.Testall(self._requests))
        self._requests.clear()
