"""Rollout tensor parallelism: ``k`` consecutive ranks serve one vLLM engine of TP size ``k``.

vLLM's external launcher runs the ``k`` engine processes in lockstep: every call must reach
every rank of the group with the same requests. The controller shards stay per rank, so each
engine call first gathers the group's inputs (:meth:`EngineGroup.gather`, rank order), every
rank submits all of them with the same seeds (the group shares one engine seed), and each rank
keeps its own slice of the results. Loops whose length depends on a rank's own data (the
turns of multi-turn episodes, a deadline) agree over the group (:meth:`EngineGroup.any`).

The weight sync hands each engine rank its own TP shard of every HF tensor (the
:mod:`yatt.reshard.plan` target layout for inference TP rank ``j`` of ``k``);
:func:`load_shards_on_worker` loads them through vLLM's own weight loaders, told that the
tensors are already sharded.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

_GROUPS: dict[int, object] = {}  # tp -> this process's gloo group of its rollout TP group


class EngineGroup:
    """The ``tp`` consecutive ranks that serve this rank's engine (``tp = 1``: this rank alone,
    every method a no-op).

    Args:
        tp: ranks per engine; must divide the torch.distributed world size (when ``tp > 1``).
    Raises:
        ValueError: ``tp > 1`` without torch.distributed, or ``tp`` does not divide the world.

    Creating the first group of a given ``tp`` in a process is collective over the whole world
    (``dist.new_group`` for every group); later ones reuse it.
    """

    def __init__(self, tp: int):
        self.tp, self.rank, self.group = tp, 0, None
        if tp == 1:
            return
        if not dist.is_initialized():
            raise ValueError("rollout TP > 1 needs torch.distributed initialised first")
        world = dist.get_world_size()
        if world % tp:
            raise ValueError(f"rollout.tp={tp} does not divide the world size {world}")
        if tp not in _GROUPS:
            for start in range(0, world, tp):  # every rank creates every group, in the same order
                group = dist.new_group(list(range(start, start + tp)), backend="gloo")
                if start <= dist.get_rank() < start + tp:
                    _GROUPS[tp] = group
        self.group, self.rank = _GROUPS[tp], dist.get_rank() % tp

    def gather(self, items: list, common=None) -> tuple[list, slice, object]:
        """The group's ``items`` concatenated in rank order (picklable objects), where this rank's
        own items are in it, and the group's first rank's ``common`` (the call's settings, e.g. its
        SamplingSpec: one engine call has one). Collective over the group."""
        if self.tp == 1:
            return items, slice(0, len(items)), common
        parts: list = [None] * self.tp
        dist.all_gather_object(parts, (list(items), common), group=self.group)
        start = sum(len(p) for p, _ in parts[:self.rank])
        return [x for p, _ in parts for x in p], slice(start, start + len(items)), parts[0][1]

    def first(self, value):
        """The group's first rank's ``value`` on every rank of the group (collective)."""
        return self.gather([], value)[2]

    def any(self, flag: bool) -> bool:
        """True on every rank of the group if ``flag`` is True on any of them (collective)."""
        if self.tp == 1:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


def load_shards_on_worker(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs on the vLLM worker: reload this TP rank's shards in place (``(HF name, shard)`` pairs
    in the :mod:`yatt.reshard.plan` target layout), then re-pack a tied lm_head.

    vLLM's linear loaders slice full checkpoint tensors unless a parameter says
    ``is_sharded_weight``; the vocabulary embedding's loader always slices, so it gets a loader
    that copies the shard (rows past the real vocabulary are zero, as vLLM's own loader leaves
    them). Both are set on the parameters the in-place reload restores, for this call only.
    """
    from yatt.rollout.vllm_engine import _reload_on_worker

    with _presharded(worker.model_runner.get_model()):
        _reload_on_worker(worker, weights)


def _copy_shard(param: torch.Tensor, shard: torch.Tensor) -> None:
    param.data[:shard.shape[0]].copy_(shard)
    param.data[shard.shape[0]:].fill_(0)


@contextlib.contextmanager
def _presharded(model: torch.nn.Module):
    """Mark the reload's parameters of ``model`` as already sharded (see :func:`load_shards_on_worker`)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    undo = []  # (tensor, attribute, previous value or a missing marker)
    missing = object()

    def set_attr(tensor, name, value):
        undo.append((tensor, name, getattr(tensor, name, missing)))
        setattr(tensor, name, value)

    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        restored = list(info.restore_metadata[0].values()) if info is not None else []
        if isinstance(module, LinearBase):
            bias = module._parameters.get("bias")  # live: the reload never restores it from meta
            for tensor in restored + ([bias] if bias is not None else []):
                set_attr(tensor, "is_sharded_weight", True)  # the layer's loader (v1) takes it whole
                if hasattr(tensor, "tp_rank"):  # a vLLM parameter's own loader (v2) cuts at tp_rank
                    set_attr(tensor, "tp_rank", 0)
        elif isinstance(module, VocabParallelEmbedding):
            for tensor in restored:
                set_attr(tensor, "weight_loader", _copy_shard)
    try:
        yield
    finally:
        for tensor, name, value in reversed(undo):
            if value is missing:
                delattr(tensor, name)
            else:
                setattr(tensor, name, value)
