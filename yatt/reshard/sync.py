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

from collections.abc import Callable, Iterator, Sequence

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


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


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
        merged: global parameter name -> a function giving the tensor to sync in its place (same
            shape, dtype and device), called when its bucket is built: LoRA's ``W + s B A``
            (:func:`yatt.trainer.lora.merged_weight`), so at most one bucket's merged weights
            exist at a time.

    Iterating is collective over the TP and PP groups: every member must consume the iterator
    to the end, in step. Yielded tensors are in the parameter dtype, on the parameter device:
    views of the bucket's buffer (each bucket has its own, so they stay valid after iteration
    moves on), except, with PP = 1, targets that are one contiguous run of a local parameter
    (TP=1: gate, up, an unpadded embedding; norms), which are views of that parameter, as a
    zero-copy path: consume them before the parameters change (``clone`` to keep them). Where
    those views are most of a bucket (TP=1, PP=1: the copies are q, k, v), its buffer and its
    tensors are kept from one iteration to the next, which writes them again: consume a sync's
    tensors before starting the next. The host then spends a kernel launch and a list per bucket.

    Raises:
        ValueError: at construction, if ``module`` lacks a parameter that ``layout`` says its stage
            holds or holds it with another shape.
    """

    def __init__(self, module: torch.nn.Module, layout: Layout, *, tp_group=None,
                 pp: int = 1, stage: int = 0, pp_group=None, pp_ranks: Sequence[int] = (0,),
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, i: int = 1, j: int = 0, threads: int = 0,
                 merged: dict[str, Callable[[], torch.Tensor]] | None = None):
        self.layout, self.tp_group = layout, tp_group
        self.merged = merged or {}
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

    def _bucket(self, k: int) -> list[tuple[str, torch.Tensor]]:
        """Bucket ``k``'s (HF name, tensor) pairs. The host work per run is the copy kernel's
        launch, one ``as_strided`` per copied target and cached views of the parameters: on CUDA
        the launch is stream-ordered, so the next bucket is planned while this one copies."""
        bucket, owner = self.buckets[k], self.buckets[k][0].stage
        with torch.no_grad():
            if owner == self.stage:
                if k not in self._programs:
                    self._programs[k] = _BucketProgram(bucket, self.layout, self.params, self.i, self.j,
                                                       (self.tp_group, self.tp_mpi), views=len(self.pp_ranks) == 1)
                program = self._programs[k]
                params = self.params
                if self.merged and (names := [s.name for s in bucket if s.name in self.merged]):
                    params = {**params, **{n: self.merged[n]() for n in names}}
                out = program.run(params, self.threads)
                entries = program.entries
            else:  # another stage builds this bucket: receive all of it
                entries, pos = [], 0
                for spec in bucket:
                    for name, shape in spec.targets:
                        shape = target_shape(name, shape, self.layout, self.i, self.j)
                        entries.append((name, shape, None, pos))
                        pos += _numel(shape)
                program, out = None, torch.empty(pos, dtype=self.dtype, device=self.device)
            if self.pp_mpi is not None:
                self.pp_mpi.Bcast(_bytes(out), root=owner)
            elif len(self.pp_ranks) > 1:
                dist.broadcast(out, src=self.pp_ranks[owner], group=self.pp_group)
            if program is not None:
                return program.tensors(out, params)
            return [(e[0], out.as_strided(e[1], _strides(e[1]), e[3])) for e in entries]


class _BucketProgram:
    """One bucket's compiled copies (shapes only, no tensors kept): pack this rank's TP-split
    shards into a send buffer, all-gather them, reshard from the gathered shards and the local
    replicated parameters into the output buffer.

    With ``views``, a target that is one contiguous run of a local parameter (TP=1: gate, up,
    an unpadded embedding; norms at any TP) is not copied: ``entries`` points it at the
    parameter. ``entries``: (HF name, shape, parameter name or None for the output buffer,
    element offset, the shape's contiguous strides) in load order."""

    def __init__(self, bucket: list[ParamSpec], layout: Layout, params: dict[str, torch.Tensor],
                 i: int, j: int, tp: tuple, views: bool):
        t = layout.tp
        (self.tp_group, self.tp_mpi), self.t = tp, t
        split = [s for s in bucket if s.dim is not None and t > 1]
        self.split_names = [s.name for s in split]
        self.total = sum(s.numel for s in split)  # elements one rank contributes to the gather
        refs, pos = {}, 0
        for s in split:
            refs[s.name] = [(1, r * self.total + pos) for r in range(t)]
            pos += s.numel
        jobs, self.entries, out_pos = [], [], 0  # jobs: (source parameter, output offset, blocks)
        for s in bucket:
            for (name, shape), blocks in zip(s.targets, copy_blocks(s, layout, i, j)):
                shape = target_shape(name, shape, layout, i, j)
                _, src, src_stride, _, dst_stride, rows, cols = blocks[0] if len(blocks) == 1 else (0,) * 7
                if views and s.name not in refs and rows * cols == _numel(shape) > 0 and \
                        (rows == 1 or src_stride == dst_stride == cols):  # one contiguous run of a local parameter
                    self.entries.append((name, shape, s.name, int(src), _strides(shape)))
                    continue
                jobs.append((s.name, out_pos, blocks))
                self.entries.append((name, shape, None, out_pos, _strides(shape)))
                out_pos += _numel(shape)
        self.out_numel = out_pos
        # slots of the reshard: 0 = output, 1 = gathered shards, 2.. = the local parameters it reads
        self.local_names = sorted({src for src, _, _ in jobs if src not in refs})
        slot_of = {n: 2 + k for k, n in enumerate(self.local_names)}
        jobs = [(refs.get(src) or [(slot_of[src], 0)], (0, at), blocks) for src, at, blocks in jobs]
        self.view_params = sorted({e[2] for e in self.entries if e[2] is not None})
        self._param_views = None  # (the parameters' data pointers, {entry: view}) of the last run
        # Mostly views (TP=1, one stage: only q/k/v and padded rows are copied): the output buffer,
        # and with it every tensor of the bucket, is kept from run to run.
        self.keep_output = views and not split and 4 * out_pos <= sum(_numel(e[1]) for e in self.entries)
        self._out = self._listing = None  # the kept buffer; (its key, the bucket's pairs) of the last run
        self.reshard = CopyProgram([out_pos, t * self.total, *(params[n].numel() for n in self.local_names)], jobs)
        pos, pack = 0, []
        for k, s in enumerate(split):
            pack.append(([(1 + k, 0)], (0, pos), np.array([[0, 0, s.numel, 0, s.numel, 1, s.numel]])))
            pos += s.numel
        self.pack = CopyProgram([self.total, *(s.numel for s in split)], pack)

    def tensors(self, out: torch.Tensor, params: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The bucket's (HF name, tensor) pairs in load order: views of ``out`` (this run's
        buffer) and of the parameters. A parameter's views are made once and kept while the
        parameter keeps its storage (an optimizer step writes in place)."""
        ptrs = tuple(params[p].data_ptr() for p in self.view_params)
        if self._listing is not None and self._listing[0] == (id(out), ptrs):
            return self._listing[1]
        if self._param_views is None or self._param_views[0] != ptrs:
            self._param_views = (ptrs, {e: params[e[2]].detach().view(-1)[e[3]:e[3] + _numel(e[1])].view(e[1])
                                        for e in self.entries if e[2] is not None})
        views = self._param_views[1]
        pairs = [(e[0], out.as_strided(e[1], e[4], e[3]) if e[2] is None else views[e]) for e in self.entries]
        if out is self._out:
            self._listing = ((id(out), ptrs), pairs)
        return pairs

    def run(self, params: dict[str, torch.Tensor], threads: int) -> torch.Tensor:
        """The bucket's output buffer (``out_numel`` elements, the parameters' dtype and device),
        filled. The output is allocated after the send buffer is freed, so a bucket holds at most
        two of its three buffers at a time (one vocab-parallel embedding can be a bucket of its own:
        Qwen2.5-0.5B's is 545 MB). With :attr:`keep_output` it is the same buffer every run."""
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
        out = self._out
        if out is None or out.dtype != like.dtype or out.device != like.device:
            out = like.new_empty(self.out_numel)
            self._out = out if self.keep_output else None
        self.reshard.run([out, recv, *(params[n].detach().view(-1) for n in self.local_names)], threads)
        return out
