"""The straightforward export that the bucketed sync replaces: the reference of its tests and of
``bench/sync.py``.

One ``all_gather`` per TP-split parameter over torch.distributed, then plain torch slicing and
concatenation (:func:`yatt.trainer.hf_mapping.megatron_to_hf`); with PP, every stage's tensors go
to every stage with ``all_gather_object``.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from yatt.trainer.hf_mapping import global_param_name, megatron_to_hf, tp_shard_dim


def per_tensor_hf_weights(actor) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every weight of a ``MegatronPolicy``; collective over its
    TP and PP groups like :meth:`MegatronPolicy.export_hf_weights`.

    Tensors may share storage with the parameters (TP=1, PP=1).
    """
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    out = []
    for name, p in actor.module.named_parameters():
        if actor.pp > 1 and name == "output_layer.weight" and actor.layout.tied_embeddings:
            continue  # the last stage's copy of the tied embedding
        shards = [p.detach()]
        if actor.tp > 1 and tp_shard_dim(name) is not None:
            shards = [torch.empty_like(p) for _ in range(actor.tp)]
            dist.all_gather(shards, p.detach().contiguous(), group=group)
        name = global_param_name(name, actor.layout, actor.pp, actor.stage)
        if actor.pp == 1:
            yield from megatron_to_hf(name, shards, actor.layout)
        else:
            out.extend(megatron_to_hf(name, shards, actor.layout))
    if actor.pp > 1:
        stages = [None] * actor.pp
        dist.all_gather_object(stages, out, group=parallel_state.get_pipeline_model_parallel_group())
        for stage in stages:
            yield from stage
