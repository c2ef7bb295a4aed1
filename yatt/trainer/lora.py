"""LoRA adapters on the Megatron trainer's linear layers (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", eq. 3: ``h = W x + (alpha / r) B A x``).

:func:`add_adapters` freezes every parameter of a bare ``GPTModel`` and gives each targeted
linear layer two trainable matrices, ``lora_A [r, in]`` and ``lora_B [out, r]``, added to its
output by a forward hook. The targets are Megatron's fused layers, so one adapter covers
what PEFT calls several modules:

=============  ================================  ==========  ===========================
target         HF modules                        TP split    split adapter (dim)
=============  ================================  ==========  ===========================
linear_qkv     q_proj, k_proj, v_proj            columns     ``lora_B`` (0), as W's rows
linear_proj    o_proj                            rows        ``lora_A`` (1), as W's columns
linear_fc1     gate_proj, up_proj                columns     ``lora_B`` (0)
linear_fc2     down_proj                         rows        ``lora_A`` (1)
=============  ================================  ==========  ===========================

The other adapter matrix is replicated over the TP group. A column-parallel layer's input is
whole on every TP rank: ``h = A x`` is computed there and passed through
``copy_to_tensor_model_parallel_region`` (all-reduce of its gradient), so every rank's ``A``
gets the whole gradient. A row-parallel layer's ``A x`` is a partial sum over the input shards:
``reduce_from_tensor_model_parallel_region`` all-reduces it before the replicated ``B``. Each
costs one all-reduce of ``[tokens, r]`` per layer and pass. A shared ``A`` under a fused layer
is what PEFT writes as one LoRA per HF module with equal ``A`` matrices
(:func:`peft_tensors`), so the export is exact.

``A`` starts as PEFT's (Kaiming-uniform, bound ``1 / sqrt(in)``) and ``B`` at zero, so the
adapted model starts as the base model. ``A`` is drawn whole from a generator seeded by the
seed, layer and target, then sliced: the same adapters at every TP size.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_ROW_PARALLEL = ("linear_proj", "linear_fc2")
_MODULE = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
           "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
# HF modules under each target (PEFT's target_modules), in the order megatron_to_hf returns them
HF_MODULES = {"linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "linear_proj": ("self_attn.o_proj",), "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
              "linear_fc2": ("mlp.down_proj",)}


def is_adapter(name: str) -> bool:
    """Whether Megatron parameter ``name`` is an adapter matrix (``....linear_fc1.lora_B``)."""
    return name.endswith((".lora_A", ".lora_B"))


def split_adapter(name: str) -> bool:
    """Whether adapter matrix ``name`` is the one of its layer split over TP ranks, laid out as
    the layer's weight (``B`` of a column-parallel target, ``A`` of a row-parallel one; module
    docstring); the other one is replicated."""
    layer, kind = name.rsplit(".lora_", 1)
    return _split(layer.rsplit(".", 1)[1], kind)


def _split(target: str, kind: str) -> bool:
    """Whether adapter ``kind`` (``"A"``/``"B"``) of ``target`` is its TP-split matrix."""
    return (kind == "A") == (target in _ROW_PARALLEL)


def adapted_weight(name: str) -> str:
    """The weight of adapter matrix ``name``'s layer (``....linear_fc1.weight``)."""
    return name.rsplit(".lora_", 1)[0] + ".weight"


@dataclass(frozen=True)
class LoraSpec:
    """What :func:`add_adapters` adds: rank ``r``, scale ``alpha / r``, dropout on the adapter's
    input (training only; TP = 1 only, see :func:`add_adapters`) and the targeted layers."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _init_a(spec: LoraSpec, layer: int, target: str, fan_in: int) -> torch.Tensor:
    """The whole ``A [r, fan_in]`` of global layer ``layer``'s ``target``, fp32: U(-1/sqrt(fan_in),
    1/sqrt(fan_in)), as ``kaiming_uniform_(a=sqrt(5))`` in PEFT, from a generator seeded per adapter."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + layer * len(TARGETS) + TARGETS.index(target))
    bound = 1.0 / math.sqrt(fan_in)
    return torch.rand(spec.rank, fan_in, generator=g).mul_(2 * bound).sub_(bound)


def _hook(module, args, output):
    """Forward hook of an adapted Megatron linear layer: ``output + scale * B (A x)``."""
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               reduce_from_tensor_model_parallel_region)

    if not module.lora_on:
        return output
    x = args[0]
    if module.lora_dropout and module.training:
        x = torch.nn.functional.dropout(x, module.lora_dropout)
    h = torch.nn.functional.linear(x, module.lora_A)
    if module.lora_tp > 1:
        h = (reduce_from_tensor_model_parallel_region(h) if module.lora_row
             else copy_to_tensor_model_parallel_region(h))
    out, bias = output
    return out + torch.nn.functional.linear(h, module.lora_B) * module.lora_scale, bias


def _frozen_linear_backward(ctx, grad_output):
    """Megatron's ``LinearWithFrozenWeight.backward`` (the input gradient ``g W``, all-reduced over
    TP when asked) with the product taken on a 2-D view of ``g``. Megatron's ``g.matmul(W)`` runs a
    batched matmul against a broadcast ``W`` when ``g [S, B, out]`` is not contiguous over its
    leading dims (the output layer's, from YATT's selected positions): on the 2-core dev machine
    (2026-12-06, SmolLM2, 2 micro-batches of 8 x 96) four such calls took 4.0 s of a 9.9 s LoRA
    train step, against 3.9 s for every other matmul together."""
    (weight,) = ctx.saved_tensors
    flat = grad_output.reshape(-1, grad_output.shape[-1])
    grad_input = flat.mm(weight).view(*grad_output.shape[:-1], weight.shape[-1])
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    return grad_input, None, None, None, None


def _install_frozen_linear_backward() -> None:
    """Point Megatron's frozen-weight linear (every layer of a LoRA model: its weights are frozen)
    at :func:`_frozen_linear_backward`; idempotent, process-wide (a frozen reference model's
    forward is unchanged)."""
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    LinearWithFrozenWeight.backward = staticmethod(_frozen_linear_backward)


def add_adapters(model: torch.nn.Module, spec: LoraSpec, *, tp: int, tp_rank: int, first_layer: int = 0) -> None:
    """Freeze ``model`` (a bare GPTModel: this TP rank's shard of one pipeline stage) and add the
    adapters of ``spec`` to its targeted layers, in the model's dtype and device.

    Args:
        first_layer: global index of the stage's first decoder layer (seeds ``A``).
    Raises:
        ValueError: an unknown target, rank < 1, alpha <= 0, dropout outside [0, 1), or dropout
            with ``tp > 1`` (a column-parallel layer's input is whole on every TP rank and would
            need the same dropout mask on each: not implemented).
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if bad := sorted(set(spec.targets) - set(TARGETS)):
        raise ValueError(f"unknown LoRA targets {bad}; choose from {list(TARGETS)}")
    if spec.rank < 1 or spec.alpha <= 0 or not 0 <= spec.dropout < 1:
        raise ValueError(f"need rank >= 1, alpha > 0 and 0 <= dropout < 1, got {spec}")
    if spec.dropout and tp > 1:
        raise ValueError("LoRA dropout needs TP = 1")
    _install_frozen_linear_backward()
    model.requires_grad_(False)
    for k, layer in enumerate(model.decoder.layers):
        for target in spec.targets:
            linear = layer.get_submodule(_MODULE[target])
            w = linear.weight
            row = target in _ROW_PARALLEL
            fan_in = w.shape[1] * (tp if row else 1)
            a = _init_a(spec, first_layer + k, target, fan_in)
            if row:
                a = a.chunk(tp, dim=1)[tp_rank]
            linear.lora_A = torch.nn.Parameter(a.to(w.dtype, copy=True).to(w.device).contiguous())
            linear.lora_B = torch.nn.Parameter(w.new_zeros(w.shape[0], spec.rank))
            if tp > 1:
                split = linear.lora_A if row else linear.lora_B
                set_tensor_model_parallel_attributes(split, True, 1 if row else 0, 1)
            linear.lora_row, linear.lora_tp, linear.lora_scale = row, tp, spec.scale
            linear.lora_dropout, linear.lora_on = spec.dropout, True
            linear.register_forward_hook(_hook)


def adapted_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name of the layer's weight in ``model``, layer) for every adapted linear layer."""
    for name, module in model.named_modules():
        if hasattr(module, "lora_A"):
            yield f"{name}.weight", module


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes as its base model (every adapter skipped)."""
    layers = [layer for _, layer in adapted_layers(model)]
    for layer in layers:
        layer.lora_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_on = True


class BaseReference:
    """A LoRA policy's frozen base model as the reference policy (KL, DPO): the policy's own
    forward with the adapters off, so no second copy of the model is built. Its
    :meth:`compute_logprobs` is :meth:`MegatronPolicy.compute_logprobs`'s, of the base model."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def compute_logprobs(self, micro_batches: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with adapters_off(self.policy.module):
            return self.policy.compute_logprobs(micro_batches)


def merged_weight(linear: torch.nn.Module) -> torch.Tensor:
    """``W + scale * B A`` of an adapted layer's local shard: a new tensor in W's dtype (W unchanged)."""
    with torch.no_grad():
        return torch.addmm(linear.weight, linear.lora_B, linear.lora_A, alpha=linear.lora_scale)


def peft_tensors(name: str, shards: list[torch.Tensor], layout, kind: str) -> list[tuple[str, torch.Tensor]]:
    """PEFT tensors of one adapter matrix, given its shards on TP ranks 0..tp-1 (one if replicated).

    Args:
        name: global Megatron name of the adapted weight (``decoder.layers.3.mlp.linear_fc1.weight``).
        kind: ``"A"`` or ``"B"``.
    Returns:
        ``[(PEFT name, tensor)]``, e.g. ``base_model.model.model.layers.3.mlp.gate_proj.lora_A.weight``:
        one per HF module under the target (a shared ``A`` copied; a fused ``B`` split by rows
        as the fused weight is, through :func:`yatt.trainer.hf_mapping.megatron_to_hf`).
    """
    from yatt.trainer.hf_mapping import megatron_to_hf

    target = name.rsplit(".", 2)[1]
    layer = int(name.split(".")[2])
    prefix = f"base_model.model.model.layers.{layer}."
    if _split(target, kind):  # laid out as the weight: the mapping merges the shards (and splits fused rows)
        parts = [t for _, t in megatron_to_hf(name, shards, layout)]
    else:
        parts = [shards[0]] * len(HF_MODULES[target])
    # each its own storage: safetensors refuses tensors that share memory
    return [(f"{prefix}{m}.lora_{kind}.weight", t.clone(memory_format=torch.contiguous_format))
            for m, t in zip(HF_MODULES[target], parts)]


def peft_state(shards: list[dict[str, torch.Tensor]], layout) -> dict[str, torch.Tensor]:
    """PEFT's ``adapter_model.safetensors`` tensors from the adapters of every TP rank.

    Args:
        shards: per TP rank (in order), global Megatron name -> tensor for every adapter
            parameter (``decoder.layers.3.mlp.linear_fc1.lora_B``) of the whole model.
        layout: the model's :class:`~yatt.trainer.hf_mapping.Layout` (its ``tp`` = ``len(shards)``).
    Returns:
        PEFT name -> full tensor (:func:`peft_tensors`).
    Raises:
        ValueError: the ranks hold different adapter names.
    """
    if any(s.keys() != shards[0].keys() for s in shards[1:]):
        raise ValueError("TP ranks hold different LoRA adapters")
    out = {}
    for name in shards[0]:
        out.update(peft_tensors(adapted_weight(name), [s[name] for s in shards], layout, name.rsplit(".lora_", 1)[1]))
    return out


def peft_config(rank: int, alpha: float, dropout: float, targets, base_model: str) -> dict:
    """PEFT's ``adapter_config.json`` for adapters on ``targets`` (Megatron names) of ``base_model``."""
    modules = sorted({m.rsplit(".", 1)[1] for t in targets for m in HF_MODULES[t]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "modules_to_save": None}


def merge_into_hf(hf_state: dict[str, torch.Tensor], peft: dict[str, torch.Tensor], scale: float) -> None:
    """Add ``scale * B A`` of every PEFT adapter pair to its HF weight in ``hf_state``, in place
    (computed in fp32, stored in the weight's dtype)."""
    for name, a in peft.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = peft[name.replace(".lora_A.", ".lora_B.")]
        w = hf_state[module + ".weight"]
        hf_state[module + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
