"""Bucketed weight sync: the trainer's Megatron shards -> HF tensors for the inference engine.

For each bucket (a run of consecutive parameters of one pipeline stage whose HF tensors fill at
most ``bucket_bytes``): the stage's TP group all-gathers the bucket's local shards with one
collective, the block-copy kernel writes every HF tensor of the bucket straight from the
gathered shards into one flat output buffer, and with PP > 1 the buffer is broadcast to the
other stages. The bucket's tensors are then handed to the consumer (``VLLMEngine.update_weights``
loads them while the next bucket is built). Nothing is cached across calls: every sync reads
the live parameters.

Extra memory: the output buffer of one bucket, plus (TP > 1, while the kernel runs) the
gathered shards of that bucket (``bucket_bytes`` again) and this rank's packed shards
(``bucket_bytes / t``). A parameter larger than ``bucket_bytes`` gets a bucket of its own.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from yatt.reshard.kernel import CopyProgram
from yatt.reshard.plan import ParamSpec, copy_blocks, megatron_params, target_shape
from yatt.trainer.hf_mapping import Layout, stage_layers

DEFAULT_BUCKET_BYTES = 512 << 20


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
    to the end, in step. Yielded tensors are views of the bucket's buffer, in the parameter dtype,
    on the parameter device; they stay valid after iteration moves on (each bucket has its own
    buffer), and share nothing with the parameters.

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

    def _local_params(self, module, specs, pp) -> dict[str, torch.Tensor]:
        offset = stage_layers(self.layout, pp, self.stage).start
        local = {}
        for name, param in module.named_parameters():
            while name.startswith("module."):
                name = name[len("module."):]
            if name.startswith("decoder.layers."):
                k, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{int(k) + offset}.{rest}"
            local[name] = param
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
        bucket = self.buckets[k]
        shapes = [(n, target_shape(n, s, self.layout, self.i, self.j)) for spec in bucket for n, s in spec.targets]
        out = torch.empty(sum(_numel(s) for _, s in shapes), dtype=self.dtype, device=self.device)
        owner = bucket[0].stage
        if owner == self.stage:
            program = self._programs.get(k) or self._programs.setdefault(k, self._compile(bucket))
            program.run(out, self.params, self.threads)
        if len(self.pp_ranks) > 1:
            dist.broadcast(out, src=self.pp_ranks[owner], group=self.pp_group)
        pos = 0
        for name, shape in shapes:
            yield name, out[pos:pos + _numel(shape)].view(shape)
            pos += _numel(shape)

    def _compile(self, bucket: list[ParamSpec]) -> "_BucketProgram":
        return _BucketProgram(bucket, self.layout, self.params, self.i, self.j, self.tp_group)


class _BucketProgram:
    """One bucket's compiled copies (shapes only, no tensors kept): pack this rank's TP-split
    shards into a send buffer, all-gather them, reshard from the gathered shards and the local
    replicated parameters into the output buffer."""

    def __init__(self, bucket: list[ParamSpec], layout: Layout, params: dict[str, torch.Tensor],
                 i: int, j: int, tp_group):
        t = layout.tp
        self.names = [s.name for s in bucket]
        self.tp_group, self.t = tp_group, t
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
        jobs, out_pos = [], 0
        for s in bucket:
            src = refs.get(s.name) or [(slot_of[s.name], 0)]
            for (name, shape), blocks in zip(s.targets, copy_blocks(s, layout, i, j)):
                jobs.append((src, (0, out_pos), blocks))
                out_pos += _numel(target_shape(name, shape, layout, i, j))
        self.reshard = CopyProgram([out_pos, t * self.total, *(params[n].numel() for n in self.local_names)], jobs)
        pos, pack = 0, []
        for k, s in enumerate(split):
            pack.append(([(1 + k, 0)], (0, pos), np.array([[0, 0, s.numel, 0, s.numel, 1, s.numel]])))
            pos += s.numel
        self.pack = CopyProgram([self.total, *(s.numel for s in split)], pack)

    def run(self, out: torch.Tensor, params: dict[str, torch.Tensor], threads: int) -> None:
        recv = out.new_empty(self.t * self.total) if self.total else out.new_empty(0)
        if self.total:
            send = out.new_empty(self.total)
            self.pack.run([send, *(params[n].detach().view(-1) for n in self.split_names)], threads)
            dist.all_gather_single(recv, send, group=self.tp_group)
            del send
        self.reshard.run([out, recv, *(params[n].detach().view(-1) for n in self.local_names)], threads)
