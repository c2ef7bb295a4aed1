"""The trainers' new weights to the sampler ranks of ``placement.mode=rollout_apart``, over MPI.

A trainer reads its policy in HF layout bucket by bucket (:meth:`MegatronPolicy.export_hf_weights`:
the resharding plans and the copy kernel turn the trainer layout into the engine's), packs each
bucket into one contiguous byte buffer and sends it to its samplers: a small pickled header
(names, dtypes, shapes, byte sizes), then the buffer as one raw MPI message; ``None`` ends the
push. A sampler hands the tensors to its engine as they arrive, so each side holds about one
bucket beyond its model, and no rank ever gathers a second full copy. A push starts when the
sampler says it is ready (it has finished its generation calls), so the trainer's wait for it is
measured apart from the transfer. Point-to-point over ``MPI.COMM_WORLD`` with tags of their own:
the step's other collectives are not disturbed.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

TAG_HEADER, TAG_BUFFER, TAG_READY = 7301, 7302, 7303
ALIGN = 16  # bytes


def pairs_of(roles, rank: int) -> tuple[list[int], int | None]:
    """(samplers this trainer pushes to, the trainer this sampler receives from) for ``rank`` in
    ``roles`` (a ``rollout_apart`` :class:`~yatt.placement.plan.Roles`): sampler ``i`` of the
    sampler group takes its weights from trainer ``i mod len(trainers)``."""
    s, t = roles.samplers, roles.trainers
    if rank in t:
        return [x for i, x in enumerate(s) if t[i % len(t)] == rank], None
    return [], t[s.index(rank) % len(t)]


def send_weights(weights: Iterable[tuple[str, torch.Tensor]], dests: list[int], bucket_bytes: int,
                 comm=None) -> tuple[int, float]:
    """Send ``weights`` (HF name, tensor) to every rank of ``dests`` in buckets of about
    ``bucket_bytes``, once each of them is ready (its :class:`WeightInbox` waits). Blocking:
    returns once every bucket was received. Reads ``weights`` fully even without ``dests`` (it
    may be collective).

    Returns:
        (bytes sent to each rank, seconds spent waiting for the ranks to be ready: idle time).
    """
    comm = comm or _world()
    t0 = time.perf_counter()
    for d in dests:
        comm.recv(source=d, tag=TAG_READY)
    waited = time.perf_counter() - t0
    bucket: list[tuple[str, torch.Tensor]] = []
    size = sent = 0
    for name, tensor in weights:
        if not dests:
            continue
        bucket.append((name, tensor.detach().cpu()))  # copied once, into the bucket's buffer
        size += bucket[-1][1].nbytes
        if size >= bucket_bytes:
            sent += _send_bucket(bucket, dests, comm)
            bucket, size = [], 0
    if bucket:
        sent += _send_bucket(bucket, dests, comm)
    for d in dests:
        comm.send(None, dest=d, tag=TAG_HEADER)
    return sent, waited


def _send_bucket(bucket: list[tuple[str, torch.Tensor]], dests: list[int], comm) -> int:
    from mpi4py import MPI

    header = []
    for name, t in bucket:  # each tensor starts 16-byte aligned, so the receiver views any dtype in place
        header.append((name, t.dtype, tuple(t.shape), t.nbytes + (-t.nbytes % ALIGN)))
    flat = torch.empty(sum(n for *_, n in header), dtype=torch.uint8)  # pads: any bytes
    offset = 0
    for (_, t), (*_, n) in zip(bucket, header):
        flat[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)  # any layout, one copy
        offset += n
    flat = flat.numpy()
    for d in dests:
        comm.send(header, dest=d, tag=TAG_HEADER)
        comm.Send([flat, MPI.BYTE], dest=d, tag=TAG_BUFFER)
    return flat.nbytes


class WeightInbox:
    """The weights one push brings to a sampler, from trainer ``source``.

    :meth:`wait` tells the trainer this rank is ready, then blocks until the push starts
    (``wait_s``: the seconds spent waiting for the trainer, idle time); iterating yields
    ``(HF name, tensor)`` pairs bucket by bucket, each bucket's tensors views of one received
    buffer, until the push ends. Iterate it fully, once.
    """

    def __init__(self, source: int, comm=None) -> None:
        self.source, self.comm = source, comm or _world()
        self.wait_s, self.bytes = 0.0, 0
        self._header = None
        self._waited = False

    def wait(self) -> None:
        t0 = time.perf_counter()
        self.comm.send(True, dest=self.source, tag=TAG_READY)
        self._header = self.comm.recv(source=self.source, tag=TAG_HEADER)
        self.wait_s, self._waited = time.perf_counter() - t0, True

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mpi4py import MPI

        if not self._waited:
            self.wait()
        header = self._header
        while header is not None:
            flat = torch.empty(sum(n for *_, n in header), dtype=torch.uint8)
            self.comm.Recv([flat.numpy(), MPI.BYTE], source=self.source, tag=TAG_BUFFER)
            self.bytes += flat.numel()
            offset = 0
            for name, dtype, shape, n in header:
                count = torch.Size(shape).numel() * dtype.itemsize
                yield name, flat[offset:offset + count].view(dtype).view(shape)
                offset += n
            header = self.comm.recv(source=self.source, tag=TAG_HEADER)


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD
