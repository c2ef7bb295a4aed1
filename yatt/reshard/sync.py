"""Bucketed weight sync: the trainer's Megatron shards -> HF tensors for the inference engine.

For each bucket (a run of consecutive parameters of one pipeline stage whose HF tensors fill at
most ``bucket_bytes``): the stage's TP group all-gathers the bucket's local shards with one
collective (on CPU under MPI an ``MPI_Allgather``, through shared memory; else torch.distributed), the block-copy kernel writes every HF tensor of the bucket straight from the
gathered shards into one flat output buffer, and with PP > 1 the buffer is broadcast to the
other stages. The bucket's tensors are then handed to the consumer (``VLLMEngine.update_weights``
loads them while the next bucket is built). Nothing is cached across calls: every sync reads
the live parameters.

Extra memory: the output buffer of one bucket, plus (TP > 1, while the kernel runs) the
gathered shards of that bucket (``bucket_bytes`` again) and this rank's packed shards
(``bucket_bytes / t``). A parameter larger than ``bucket_bytes`` gets a bucket of its own.
Targets that are one contiguous run of a local parameter are not copied (see
:class:`BucketedSync`).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from yatt.dist import mpi_comm
from yatt.reshard.kernel import CopyProgram
from yatt.reshard.plan import ParamSpec, copy_blocks, megatron_params, target_shape
from yatt.trainer.hf_mapping import Layout, global_param_name

DEFAULT_BUCKET_BYTES = 512 << 20


def _bytes(t: torch.Tensor):
    """A contiguous CPU tensor's memory as a uint8 numpy array (a buffer for mpi4py, no copy)."""
    return t.view(torch.uint8).numpy()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def plan_buckets(specs: Sequence[ParamSpec], layout: Layout, bucket_bytes: int, itemsize: int,
                 i: int = 1, j: int = 0) -> list[list[ParamSpec]]:
    """Consecutive parameters grouped into buckets of at most ``bucket_bytes`` of target bytes.

    A bucket never spans two pipeline stages. The split depends on shapes only, so every rank
    computes the same buckets without communication.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, size = [], 0
    for spec in specs:
        nbytes = itemsize * sum(_numel(target_shape(n, s, layout, i, j)) for n, s in spec.targets)
        if not buckets or buckets[-1][-1].stage != spec.stage or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += nbytes
    return [b for b in buckets if b]


class BucketedSync:
    """Iterate over ``(HF name, tensor)`` for inference TP rank ``j`` of ``i``, one bucket at a time.

    Args:
        module: this rank's bare Megatron ``GPTModel`` (its stage, its TP shard); parameter
            names may carry ``module.`` prefixes and stage-local layer indices.
        layout: the model's :class:`~yatt.trainer.hf_mapping.Layout`, ``layout.tp`` = trainer TP.
        tp_group: the TP group of this rank (None when ``layout.tp == 1``).
        pp / stage / pp_group / pp_ranks: pipeline size, this rank's stage, its PP group and the
            global rank of each stage's member of that group (index = stage); only for pp > 1.
        bucket_bytes: target bytes per bucket (default 512 MiB).
        i, j: inference TP size and rank of the consumer (1, 0: full HF tensors).
        threads: CPU threads of the copy kernel (0: ``torch.get_num_threads()``).

    Iterating is collective over the TP and PP groups: every member must consume the iterator
    to the end, in step. Yielded tensors are in the parameter dtype, on the parameter device:
    views of the bucket's buffer (each bucket has its own, so they stay valid after iteration
    moves on), except, with PP = 1, targets that are one contiguous run of a local parameter
    (TP=1: gate, up, an unpadded embedding; norms), which are views of that parameter, as a
    zero-copy path: consume them before the parameters change (``clone`` to keep them).

    Raises:
        ValueError: at construction, if ``module`` lacks a parameter that ``layout`` says its stage
            holds or holds it with another shape.
    """

    def __init__(self, module: torch.nn.Module, layout: Layout, *, tp_group=None,
                 pp: int = 1, stage: int = 0, pp_group=None, pp_ranks: Sequence[int] = (0,),
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, i: int = 1, j: int = 0, threads: int = 0):
        self.layout, self.tp_group = layout, tp_group
        self.stage, self.pp_group, self.pp_ranks = stage, pp_group, list(pp_ranks)
        self.i, self.j, self.threads = i, j, threads
        specs = megatron_params(layout, pp)
        self.params = self._local_params(module, specs, pp)
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device
        self.buckets = plan_buckets(specs, layout, bucket_bytes, first.element_size(), i, j)
        self._programs: dict[int, _BucketProgram] = {}  # per bucket: shapes and offsets only
        # CPU: large gathers and broadcasts go through MPI (shared memory) when MPI started the job
        cpu = self.device.type == "cpu"
        self.tp_mpi = mpi_comm(dist.get_process_group_ranks(tp_group)) if cpu and tp_group is not None else None
        self.pp_mpi = mpi_comm(self.pp_ranks) if cpu and len(self.pp_ranks) > 1 else None

    def _local_params(self, module, specs, pp) -> dict[str, torch.Tensor]:
        local = {global_param_name(name, self.layout, pp, self.stage): param
                 for name, param in module.named_parameters()}
        params = {}
        for spec in specs:
            if spec.stage != self.stage:
                continue
            p = local.get(spec.name)
            if p is None or tuple(p.shape) != spec.shape:
                got = None if p is None else tuple(p.shape)
                raise ValueError(f"stage {self.stage} parameter {spec.name}: expected {spec.shape}, got {got}")
            params[spec.name] = p
        return params

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k in range(len(self.buckets)):
            yield from self._bucket(k)

    @torch.no_grad()
    def _bucket(self, k: int) -> Iterator[tuple[str, torch.Tensor]]:
        bucket, owner = self.buckets[k], self.buckets[k][0].stage
        if owner == self.stage:
            if k not in self._programs:
                self._programs[k] = _BucketProgram(bucket, self.layout, self.params, self.i, self.j,
                                                   (self.tp_group, self.tp_mpi), views=len(self.pp_ranks) == 1)
            program = self._programs[k]
            out = program.run(self.params, self.threads)
            entries = program.entries
        else:  # another stage builds this bucket: receive all of it
            entries, pos = [], 0
            for spec in bucket:
                for name, shape in spec.targets:
                    shape = target_shape(name, shape, self.layout, self.i, self.j)
                    entries.append((name, shape, None, pos))
                    pos += _numel(shape)
            out = torch.empty(pos, dtype=self.dtype, device=self.device)
        if self.pp_mpi is not None:
            self.pp_mpi.Bcast(_bytes(out), root=owner)
        elif len(self.pp_ranks) > 1:
            dist.broadcast(out, src=self.pp_ranks[owner], group=self.pp_group)
        for name, shape, param, pos in entries:
            base = out if param is None else self.params[param].detach().view(-1)
            yield name, base[pos:pos + _numel(shape)].view(shape)


class _BucketProgram:
    """One bucket's compiled copies (shapes only, no tensors kept): pack this rank's TP-split
    shards into a send buffer, all-gather them, reshard from the gathered shards and the local
    replicated parameters into the output buffer.

    With ``views``, a target that is one contiguous run of a local parameter (TP=1: gate, up,
    an unpadded embedding; norms at any TP) is not copied: ``entries`` points it at the
    parameter. ``entries``: (HF name, shape, parameter name or None for the output buffer,
    element offset) in load order."""

    def __init__(self, bucket: list[ParamSpec], layout: Layout, params: dict[str, torch.Tensor],
                 i: int, j: int, tp: tuple, views: bool):
        t = layout.tp
        (self.tp_group, self.tp_mpi), self.t = tp, t
        split = [s for s in bucket if s.dim is not None and t > 1]
        self.split_names = [s.name for s in split]
        self.total = sum(s.numel for s in split)  # elements one rank contributes to the gather
        self.local_names = [s.name for s in bucket if s.name not in self.split_names]
        # slots of the reshard: 0 = output, 1 = gathered shards, 2.. = local parameters
        slot_of = {n: 2 + k for k, n in enumerate(self.local_names)}
        refs, pos = {}, 0
        for s in split:
            refs[s.name] = [(1, r * self.total + pos) for r in range(t)]
            pos += s.numel
        jobs, self.entries, out_pos = [], [], 0
        for s in bucket:
            for (name, shape), blocks in zip(s.targets, copy_blocks(s, layout, i, j)):
                shape = target_shape(name, shape, layout, i, j)
                if views and s.name in slot_of and len(blocks) == 1 and blocks[0, 5] == 1 \
                        and blocks[0, 6] == _numel(shape):  # one contiguous run of a local parameter
                    self.entries.append((name, shape, s.name, int(blocks[0, 1])))
                    continue
                jobs.append((refs.get(s.name) or [(slot_of[s.name], 0)], (0, out_pos), blocks))
                self.entries.append((name, shape, None, out_pos))
                out_pos += _numel(shape)
        self.out_numel = out_pos
        self.reshard = CopyProgram([out_pos, t * self.total, *(params[n].numel() for n in self.local_names)], jobs)
        pos, pack = 0, []
        for k, s in enumerate(split):
            pack.append(([(1 + k, 0)], (0, pos), np.array([[0, 0, s.numel, 0, s.numel, 1, s.numel]])))
            pos += s.numel
        self.pack = CopyProgram([self.total, *(s.numel for s in split)], pack)

    def run(self, params: dict[str, torch.Tensor], threads: int) -> torch.Tensor:
        """The bucket's output buffer (``out_numel`` elements, the parameters' dtype and device),
        filled. The output is allocated after the send buffer is freed, so a bucket holds at most
        two of its three buffers at a time (one vocab-parallel embedding can be a bucket of its own:
        Qwen2.5-0.5B's is 545 MB)."""
        like = next(iter(params.values()))
        recv = like.new_empty(self.t * self.total)
        if self.total:
            send = like.new_empty(self.total)
            self.pack.run([send, *(params[n].detach().view(-1) for n in self.split_names)], threads)
            if self.tp_mpi is not None:
                self.tp_mpi.Allgather(_bytes(send), _bytes(recv))
            else:
                dist.all_gather_single(recv, send, group=self.tp_group)
            del send
        out = like.new_empty(self.out_numel)
        self.reshard.run([out, recv, *(params[n].detach().view(-1) for n in self.local_names)], threads)
        return out
