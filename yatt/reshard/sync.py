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

from yatt.reshard.kernel import run_copies
from yatt.reshard.plan import ParamSpec, copy_blocks, megatron_params, stage_layers, target_shape
from yatt.trainer.hf_mapping import Layout

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
        for bucket in self.buckets:
            yield from self._bucket(bucket)

    @torch.no_grad()
    def _bucket(self, bucket: list[ParamSpec]) -> Iterator[tuple[str, torch.Tensor]]:
        shapes = [(n, target_shape(n, s, self.layout, self.i, self.j)) for spec in bucket for n, s in spec.targets]
        out = torch.empty(sum(_numel(s) for _, s in shapes), dtype=self.dtype, device=self.device)
        views, pos = [], 0
        for name, shape in shapes:
            views.append((name, out[pos:pos + _numel(shape)].view(shape)))
            pos += _numel(shape)
        owner = bucket[0].stage
        if owner == self.stage:
            sources = self._gather(bucket)
            jobs, k = [], 0
            for spec, srcs in zip(bucket, sources):
                for blocks in copy_blocks(spec, self.layout, self.i, self.j):
                    jobs.append((srcs, views[k][1], blocks))
                    k += 1
            run_copies(jobs, self.threads)
            del sources, jobs
        if len(self.pp_ranks) > 1:
            dist.broadcast(out, src=self.pp_ranks[owner], group=self.pp_group)
        yield from views

    def _gather(self, bucket: list[ParamSpec]) -> list[list[torch.Tensor]]:
        """Source shards of every parameter of the bucket: one all-gather over TP for all of them."""
        t = self.layout.tp
        split = [s for s in bucket if s.dim is not None and t > 1]
        gathered = {}
        if split:
            total = sum(s.numel for s in split)
            send = torch.empty(total, dtype=self.dtype, device=self.device)
            recv = torch.empty(t * total, dtype=self.dtype, device=self.device)
            pos, jobs = 0, []
            for s in split:
                whole = np.array([[0, 0, s.numel, 0, s.numel, 1, s.numel]], dtype=np.int64)
                jobs.append(([self.params[s.name].detach()], send[pos:pos + s.numel], whole))
                pos += s.numel
            run_copies(jobs, self.threads)
            dist.all_gather_into_tensor(recv, send, group=self.tp_group)
            pos = 0
            for s in split:
                gathered[s.name] = [recv[r * total + pos:r * total + pos + s.numel] for r in range(t)]
                pos += s.numel
        return [gathered.get(s.name) or [self.params[s.name].detach().reshape(-1)] for s in bucket]

