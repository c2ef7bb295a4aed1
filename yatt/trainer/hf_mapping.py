"""Hugging Face <-> Megatron-Core GPTModel: config and weight mapping (Llama, Qwen2).

Pure functions of tensors and dicts; nothing here touches torch.distributed.

Notation: ``L`` layers, ``H`` hidden size, ``nq`` query heads, ``ng`` KV heads (query groups),
``d`` head dim, ``F`` MLP size, ``V`` vocab size, ``Vp`` vocab padded to a multiple of the TP
size ``tp``, ``r`` the TP rank. Megatron layouts (local layer spec) for TP rank ``r``:

==========================================  ==============================  ===================
Megatron name (``decoder.layers.{i}.`` ...)  shape on one TP rank            HF source
==========================================  ==============================  ===================
``embedding.word_embeddings.weight``         [Vp/tp, H]                      embed_tokens (padded)
``input_layernorm.weight``                   [H]                             input_layernorm
``self_attention.linear_qkv.weight``         [(nq+2ng)d/tp, H]               q/k/v per KV group
``self_attention.linear_qkv.bias``           [(nq+2ng)d/tp]                  q/k/v bias (Qwen2)
``self_attention.linear_proj.weight``        [H, nq d/tp]                    o_proj
``pre_mlp_layernorm.weight``                 [H]                             post_attention_layernorm
``mlp.linear_fc1.weight``                    [2F/tp, H]                      [gate_r; up_r]
``mlp.linear_fc2.weight``                    [H, F/tp]                       down_proj
``decoder.final_layernorm.weight``           [H]                             model.norm
``output_layer.weight`` (untied only)        [Vp/tp, H]                      lm_head (padded)
==========================================  ==============================  ===================

``linear_qkv`` rows are grouped per KV group g: ``[q heads of g (nq/ng*d); k_g (d); v_g (d)]``,
and rank r holds groups ``[r*ng/tp, (r+1)*ng/tp)``. Source of the layouts: megatron-core 0.16.1
``transformer/attention.py`` (``get_query_key_value_tensors``) and ``transformer/mlp.py``
(``glu`` chunks the local fc1 output in two).
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class Layout:
    """Shapes that the mapping needs (built by :func:`layout_from_hf`)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    tp: int

    @property
    def padded_vocab_size(self) -> int:
        """``V`` rounded up to a multiple of ``tp`` (padding rows are zero)."""
        return -(-self.vocab_size // self.tp) * self.tp


def _rope_theta(hf: Mapping) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"rope type {rope_type!r} is not mapped (only 'default')")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def layout_from_hf(hf: Mapping, tp: int = 1) -> Layout:
    """Read the shapes of a Llama / Qwen2 ``config.json`` dict and check them against ``tp``.

    Raises:
        NotImplementedError: unsupported model type or feature (non-SiLU MLP, MLP or output
            projection bias, sliding window).
        ValueError: KV heads or MLP size not divisible by ``tp``.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"model_type {model_type!r} not supported ({SUPPORTED_MODEL_TYPES})")
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {hf['hidden_act']!r} (only silu / SwiGLU)")
    if hf.get("mlp_bias") or (model_type == "llama" and hf.get("attention_bias")):
        raise NotImplementedError("MLP / o_proj biases are not mapped")
    if hf.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention is not mapped")
    heads = hf["num_attention_heads"]
    layout = Layout(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2", tp=tp)
    if layout.num_kv_heads % tp or layout.ffn_hidden_size % tp:
        raise ValueError(f"TP={tp} must divide the KV heads ({layout.num_kv_heads}) and the MLP "
                         f"size ({layout.ffn_hidden_size})")
    return layout


def stage_layers(layout: Layout, pp: int, stage: int) -> range:
    """Global indices of the decoder layers on pipeline stage ``stage`` of ``pp`` (even split,
    as Megatron-Core assigns them without a custom layout).

    Raises:
        ValueError: ``pp`` does not divide the number of layers.
    """
    if layout.num_layers % pp:
        raise ValueError(f"PP={pp} must divide the number of layers ({layout.num_layers})")
    per = layout.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def global_param_name(name: str, layout: Layout, pp: int, stage: int) -> str:
    """A parameter name as a stage's module reports it (wrapper ``module.`` prefixes, stage-local
    layer index) -> the Megatron name with the global layer index (no prefix)."""
    while name.startswith("module."):
        name = name[len("module."):]
    if name.startswith("decoder.layers."):
        k, rest = name[len("decoder.layers."):].split(".", 1)
        name = f"decoder.layers.{int(k) + stage_layers(layout, pp, stage).start}.{rest}"
    return name


def transformer_config(hf: Mapping, *, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32, **overrides):
    """Megatron ``TransformerConfig`` equivalent to a Llama / Qwen2 ``config.json`` dict.

    RMSNorm, SwiGLU, GQA, no dropout, no fused kernels (CPU), CPU initialisation; Qwen2 gets
    ``add_qkv_bias``. With ``pp > 1`` stages exchange activations of any micro-batch shape
    (``variable_seq_lengths``). Rope theta and tied embeddings are GPTModel arguments: see
    :func:`gpt_model_kwargs`. ``overrides`` are passed to ``TransformerConfig``.

    Raises:
        ValueError: as :func:`layout_from_hf`, or ``pp`` does not divide the layers.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = layout_from_hf(hf, tp)
    stage_layers(layout, pp, 0)  # checks pp
    kwargs = dict(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads, num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim, ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, variable_seq_lengths=pp > 1,
        moe_token_dispatcher_type="alltoall",  # no MoE; the default "allgather" rejects variable_seq_lengths
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
        cuda_graph_scope=[],  # what the default "full" means; "full" itself is deprecated (a warning per build)
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_model_kwargs(hf: Mapping, tp: int = 1) -> dict:
    """``GPTModel`` keyword arguments (vocab, positions, rope, tying) for a ``config.json`` dict."""
    layout = layout_from_hf(hf, tp)
    return dict(vocab_size=layout.padded_vocab_size,
                max_sequence_length=hf.get("max_position_embeddings", 4096),
                position_embedding_type="rope", rotary_base=_rope_theta(hf), rotary_percent=1.0,
                share_embeddings_and_output_weights=layout.tied_embeddings)


def _rows(t: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[r]


def _pad_vocab(w: torch.Tensor, layout: Layout) -> torch.Tensor:
    pad = layout.padded_vocab_size - w.shape[0]
    return torch.cat([w, w.new_zeros(pad, *w.shape[1:])]) if pad else w


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, r: int) -> torch.Tensor:
    """q [nq d, *], k/v [ng d, *] -> this rank's ``linear_qkv`` rows [(nq+2ng) d/tp, *]."""
    ng, d = layout.num_kv_heads, layout.head_dim
    tail = q.shape[1:]
    grouped = torch.cat([q.reshape(ng, -1, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], 1)
    return _rows(grouped, r, layout.tp).reshape(-1, *tail).contiguous()


def megatron_names(layout: Layout) -> Iterator[str]:
    """Every GPTModel parameter's Megatron name (global layer indices), in :func:`hf_to_megatron`'s
    order; ``output_layer.weight`` only for untied embeddings."""
    yield "embedding.word_embeddings.weight"
    for i in range(layout.num_layers):
        mc = f"decoder.layers.{i}."
        yield mc + "input_layernorm.weight"
        yield mc + "self_attention.linear_qkv.weight"
        if layout.qkv_bias:
            yield mc + "self_attention.linear_qkv.bias"
        yield from (mc + s for s in ("self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                                     "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"))
    yield "decoder.final_layernorm.weight"
    if not layout.tied_embeddings:
        yield "output_layer.weight"


def megatron_param(name: str, hf_state: Mapping[str, torch.Tensor], layout: Layout, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of one Megatron parameter (global layer index, no ``module.``
    prefix), from full HF tensors: the inverse of :func:`megatron_to_hf`. ``output_layer.weight``
    of tied embeddings (the last pipeline stage's copy) is the embedding's shard.

    Args:
        name: Megatron parameter name, e.g. ``decoder.layers.3.mlp.linear_fc1.weight``.
        hf_state: HF name -> full tensor (only the names this parameter needs are read).
        layout: shapes, see :func:`layout_from_hf`.
        tp_rank: 0 <= tp_rank < layout.tp.
    Returns:
        A contiguous tensor in the HF dtype, shaped as in the module docstring.
    Raises:
        KeyError: unknown parameter name, or a needed HF tensor is missing.
    """
    r, tp = tp_rank, layout.tp
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        src = "lm_head.weight" if name == "output_layer.weight" and not layout.tied_embeddings else "model.embed_tokens.weight"
        return _rows(_pad_vocab(hf_state[src], layout), r, tp).contiguous()
    if name == "decoder.final_layernorm.weight":
        return hf_state["model.norm.weight"]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise KeyError(f"no HF name for Megatron parameter {name!r}")
    hf, suffix = f"model.layers.{m.group(1)}.", m.group(2)
    if suffix in _SIMPLE:
        full = hf_state[hf + _SIMPLE[suffix]]
        dim = tp_shard_dim(name)
        return full if dim is None else full.chunk(tp, dim)[r].contiguous()
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = (hf_state[f"{hf}self_attn.{p}_proj.{kind}"] for p in "qkv")
        return _qkv(q, k, v, layout, r)
    if suffix == "mlp.linear_fc1.weight":
        gate, up = hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]
        return torch.cat([_rows(gate, r, tp), _rows(up, r, tp)])
    raise KeyError(f"no HF name for Megatron parameter {name!r}")


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], layout: Layout, tp_rank: int
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Megatron name, this TP rank's shard) for every GPTModel parameter
    (:func:`megatron_names`, :func:`megatron_param`).

    Args:
        hf_state: HF name -> full tensor (lazily read mappings are fine: each name is read once).
        layout: shapes, see :func:`layout_from_hf`.
        tp_rank: 0 <= tp_rank < layout.tp.
    Yields:
        Contiguous tensors in the HF dtype, shapes as in the module docstring.
    Raises:
        KeyError: a needed HF tensor is missing.
    """
    for name in megatron_names(layout):
        yield name, megatron_param(name, hf_state, layout, tp_rank)


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_SIMPLE = {  # Megatron layer suffix -> HF layer suffix (one tensor each way)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def tp_shard_dim(name: str) -> int | None:
    """Dimension along which Megatron parameter ``name`` is split over TP ranks (None: replicated)."""
    if name.endswith(("layernorm.weight", "layernorm.bias")):
        return None
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return 0


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FROM_HF = {hf: mc for mc, hf in _SIMPLE.items()} | {
    f"self_attn.{p}_proj.{kind}": f"self_attention.linear_qkv.{kind}" for p in "qkv" for kind in ("weight", "bias")} | {
    "mlp.gate_proj.weight": "mlp.linear_fc1.weight", "mlp.up_proj.weight": "mlp.linear_fc1.weight"}
_FROM_HF_TOP = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "lm_head.weight": "output_layer.weight",
                "model.norm.weight": "decoder.final_layernorm.weight"}


def megatron_name_of(hf_name: str) -> str:
    """The Megatron parameter (global layer index) that :func:`megatron_to_hf` turns into HF
    tensor ``hf_name`` (q, k and v come from one ``linear_qkv``, gate and up from one ``linear_fc1``).

    Raises:
        KeyError: ``hf_name`` is no tensor of the mapping.
    """
    if hf_name in _FROM_HF_TOP:
        return _FROM_HF_TOP[hf_name]
    m = _HF_LAYER.fullmatch(hf_name)
    if m is None or m.group(2) not in _FROM_HF:
        raise KeyError(f"no Megatron parameter for HF tensor {hf_name!r}")
    return f"decoder.layers.{m.group(1)}.{_FROM_HF[m.group(2)]}"


def megatron_to_hf(name: str, shards: list[torch.Tensor], layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors for one Megatron parameter, given its shards from every TP rank.

    Plain torch slicing and concatenation: the reference that the resharding kernels
    (:mod:`yatt.reshard`, used by the weight sync) are tested against.

    Args:
        name: Megatron parameter name (as in :func:`hf_to_megatron`; a ``module.`` prefix from
            wrappers is ignored).
        shards: the parameter on TP ranks 0..tp-1 in order (one tensor if replicated).
        layout: shapes, see :func:`layout_from_hf`.
    Returns:
        [(HF name, full tensor)]: one entry, or three for ``linear_qkv`` (q, k, v) and two for
        ``linear_fc1`` (gate, up). Vocab padding is stripped. With tied embeddings the
        embedding is exported as ``model.embed_tokens.weight`` only (no ``lm_head``).
    Raises:
        KeyError: unknown parameter name.
    """
    while name.startswith("module."):
        name = name[len("module."):]
    dim = tp_shard_dim(name)
    full = shards[0] if dim is None or len(shards) == 1 else torch.cat(shards, dim)
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", full[:layout.vocab_size])]
    if name == "output_layer.weight":
        return [("lm_head.weight", full[:layout.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", full)]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise KeyError(f"no HF name for Megatron parameter {name!r}")
    hf, suffix = f"model.layers.{m.group(1)}.", m.group(2)
    if suffix in _SIMPLE:
        return [(hf + _SIMPLE[suffix], full)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        ng, d = layout.num_kv_heads, layout.head_dim
        qpg = layout.num_heads // ng * d
        q, k, v = full.reshape(ng, qpg + 2 * d, *full.shape[1:]).split([qpg, d, d], dim=1)
        kind = suffix.rsplit(".", 1)[1]
        return [(f"{hf}self_attn.{p}_proj.{kind}", t.reshape(-1, *full.shape[1:]).contiguous())
                for p, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(hf + "mlp.gate_proj.weight", torch.cat([g for g, _ in halves])),
                (hf + "mlp.up_proj.weight", torch.cat([u for _, u in halves]))]
    raise KeyError(f"no HF name for Megatron parameter {name!r}")
