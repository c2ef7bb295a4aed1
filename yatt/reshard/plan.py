"""Copy plans from Megatron-Core's training layout to the inference layout (Llama, Qwen2).

Source: a Megatron parameter on TP ranks ``0..t-1`` (layouts: :mod:`yatt.trainer.hf_mapping`).
Target: the Hugging Face tensors it holds, as inference TP rank ``j`` of ``i`` holds them
(``i = 1``: the full HF tensors). Every parameter is split along one *split dim* (0 for
column-parallel and vocab-parallel tensors and biases, 1 for row-parallel ``o_proj`` /
``down_proj``) or replicated (norms). Along the split dim, a shard is a concatenation of
:class:`Piece` s, runs of consecutive rows (columns) of one HF tensor: a Megatron ``linear_qkv``
shard is ``[q_g, k_g, v_g]`` for each of its KV groups ``g``, a ``linear_fc1`` shard is
``[gate_r, up_r]``, a vocab shard is its part of the unpadded vocabulary (padding rows belong to
no piece and are never read). A target shard is one piece. Intersecting the two gives the
blocks to copy: contiguous runs for split dim 0, strided 2-D blocks for split dim 1.

Target ranges along the split dim (inference rank ``j`` of ``i``):

* q / k / v (weight and bias), gate / up, o_proj / down_proj: ``j``-th of ``i`` equal parts
  (needs ``i`` to divide the query heads, the KV heads and the MLP size);
* embed_tokens / lm_head: vLLM's ``VocabParallelEmbedding`` rule, vocabulary padded to a
  multiple of 64, ``P/i`` rows per rank, rows past the real vocabulary dropped;
* norms: the whole tensor on every rank.

Plans depend on shapes only, so they are cached; no tensor is cached.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from yatt.trainer.hf_mapping import Layout, stage_layers

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
BLOCK_FIELDS = ("src_shard", "src_off", "src_stride", "dst_off", "dst_stride", "rows", "cols")


@dataclass(frozen=True)
class Piece:
    """``length`` consecutive indices of HF tensor ``tensor`` along the split dim, from ``start``."""

    tensor: str
    start: int
    length: int


@dataclass(frozen=True)
class ParamSpec:
    """One Megatron parameter in the training layout.

    Attributes:
        name: Megatron name with the *global* layer index (``decoder.layers.{k}.``).
        stage: pipeline stage that holds it.
        shape: shape on one TP rank (replicated tensors: the full shape).
        dim: split dim, or None if replicated over TP.
        shards: per TP rank, its pieces in local order along ``dim`` (one shard if replicated).
        targets: (HF name, full HF shape) of every HF tensor it holds, in load order.
    """

    name: str
    stage: int
    shape: tuple[int, ...]
    dim: int | None
    shards: tuple[tuple[Piece, ...], ...]
    targets: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


def _norm(name: str, stage: int, hf_name: str, size: int) -> ParamSpec:
    """A norm weight: replicated over TP, one HF tensor."""
    return ParamSpec(name, stage, (size,), None, ((Piece(hf_name, 0, size),),), ((hf_name, (size,)),))


def _even(tensor: str, total: int, t: int) -> tuple[tuple[Piece, ...], ...]:
    return tuple((Piece(tensor, r * total // t, total // t),) for r in range(t))


def _vocab_shards(tensor: str, layout: Layout) -> tuple[tuple[Piece, ...], ...]:
    per, vocab = layout.padded_vocab_size // layout.tp, layout.vocab_size
    return tuple((Piece(tensor, r * per, max(0, min(per, vocab - r * per))),) for r in range(layout.tp))


def _qkv_shards(prefix: str, kind: str, layout: Layout) -> tuple[tuple[Piece, ...], ...]:
    ng, d, t = layout.num_kv_heads, layout.head_dim, layout.tp
    qpg = layout.num_heads // ng * d  # query rows per KV group
    return tuple(tuple(piece for g in range(r * ng // t, (r + 1) * ng // t)
                       for piece in (Piece(f"{prefix}q_proj.{kind}", g * qpg, qpg),
                                     Piece(f"{prefix}k_proj.{kind}", g * d, d),
                                     Piece(f"{prefix}v_proj.{kind}", g * d, d)))
                 for r in range(t))


def megatron_params(layout: Layout, pp: int = 1) -> list[ParamSpec]:
    """Every Megatron GPTModel parameter of ``layout`` (TP ``layout.tp``) in module order.

    With tied embeddings the last stage's ``output_layer.weight`` (a copy of the embedding kept by
    Megatron under PP) is not listed: the embedding carries the HF tensor.
    """
    t, H, F, V = layout.tp, layout.hidden_size, layout.ffn_hidden_size, layout.vocab_size
    nq_d, ng_d = layout.num_heads * layout.head_dim, layout.num_kv_heads * layout.head_dim
    vp = layout.padded_vocab_size // t
    specs = [ParamSpec("embedding.word_embeddings.weight", 0, (vp, H), 0,
                       _vocab_shards("model.embed_tokens.weight", layout),
                       (("model.embed_tokens.weight", (V, H)),))]
    for s in range(pp):
        for k in stage_layers(layout, pp, s):
            mc, hf = f"decoder.layers.{k}.", f"model.layers.{k}."
            attn = hf + "self_attn."
            specs.append(_norm(mc + "input_layernorm.weight", s, hf + "input_layernorm.weight", H))
            qkv_rows = (nq_d + 2 * ng_d) // t
            for kind, tail in (("weight", (H,)), ("bias", ())) if layout.qkv_bias else (("weight", (H,)),):
                targets = tuple((f"{attn}{p}_proj.{kind}", (n, *tail))
                                for p, n in (("q", nq_d), ("k", ng_d), ("v", ng_d)))
                specs.append(ParamSpec(f"{mc}self_attention.linear_qkv.{kind}", s, (qkv_rows, *tail), 0,
                                       _qkv_shards(attn, kind, layout), targets))
            o = attn + "o_proj.weight"
            specs.append(ParamSpec(mc + "self_attention.linear_proj.weight", s, (H, nq_d // t), 1,
                                   _even(o, nq_d, t), ((o, (H, nq_d)),)))
            specs.append(_norm(mc + "pre_mlp_layernorm.weight", s, hf + "post_attention_layernorm.weight", H))
            gate, up = hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"
            fc1 = tuple(g + u for g, u in zip(_even(gate, F, t), _even(up, F, t)))
            specs.append(ParamSpec(mc + "mlp.linear_fc1.weight", s, (2 * F // t, H), 0, fc1,
                                   ((gate, (F, H)), (up, (F, H)))))
            down = hf + "mlp.down_proj.weight"
            specs.append(ParamSpec(mc + "mlp.linear_fc2.weight", s, (H, F // t), 1,
                                   _even(down, F, t), ((down, (H, F)),)))
    last = pp - 1
    specs.append(_norm("decoder.final_layernorm.weight", last, "model.norm.weight", H))
    if not layout.tied_embeddings:
        specs.append(ParamSpec("output_layer.weight", last, (vp, H), 0,
                               _vocab_shards("lm_head.weight", layout), (("lm_head.weight", (V, H)),)))
    return specs


def _vllm_padded_vocab(layout: Layout) -> int:
    return -(-layout.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def check_inference_tp(layout: Layout, i: int) -> None:
    """Check that an engine of inference TP ``i`` can hold ``layout``'s model: ``i`` splits its
    heads, KV heads and MLP size, and vLLM's padded vocabulary (a multiple of
    :data:`VLLM_VOCAB_PADDING`).

    Raises:
        ValueError: naming the size ``i`` does not divide.
    """
    padded = _vllm_padded_vocab(layout)
    sizes = {"heads": layout.num_heads, "KV heads": layout.num_kv_heads, "MLP size": layout.ffn_hidden_size,
             "padded vocabulary": padded}
    bad = [f"{name} ({n})" for name, n in sizes.items() if n % i]
    if bad:
        raise ValueError(f"inference TP={i} must divide the model's " + ", ".join(bad))


def target_range(name: str, shape: tuple[int, ...], layout: Layout, i: int, j: int
                 ) -> tuple[int | None, int, int]:
    """(split dim, start, stop) of HF tensor ``name`` on inference TP rank ``j`` of ``i``.

    Raises:
        ValueError: from :func:`check_inference_tp`.
    """
    check_inference_tp(layout, i)
    if name.endswith("norm.weight"):
        return None, 0, shape[0]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        per = _vllm_padded_vocab(layout) // i
        return 0, min(j * per, shape[0]), min((j + 1) * per, shape[0])
    dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
    per = shape[dim] // i
    return dim, j * per, (j + 1) * per


def target_shape(name: str, shape: tuple[int, ...], layout: Layout, i: int, j: int) -> tuple[int, ...]:
    """Shape of HF tensor ``name`` (full shape ``shape``) on inference TP rank ``j`` of ``i``."""
    dim, start, stop = target_range(name, shape, layout, i, j)
    return shape if dim is None else tuple(stop - start if d == dim else n for d, n in enumerate(shape))


@functools.lru_cache(maxsize=None)
def _blocks(spec: ParamSpec, layout: Layout, i: int, j: int) -> tuple[np.ndarray, ...]:
    out = []
    for name, shape in spec.targets:
        dim, start, stop = target_range(name, shape, layout, i, j)
        rows = []
        if spec.dim is None:  # replicated: whole tensor from the first shard
            n = int(np.prod(shape))
            rows.append((0, 0, n, 0, n, 1, n))
        for r, pieces in enumerate(spec.shards if spec.dim is not None else ()):
            pos = 0
            for p in pieces:
                lo, hi = max(start, p.start), min(stop, p.start + p.length)
                if p.tensor == name and lo < hi:
                    src, dst, n = pos + lo - p.start, lo - start, hi - lo
                    if spec.dim == 0:  # whole rows: one contiguous run
                        inner = int(np.prod(shape[1:]))
                        rows.append((r, src * inner, n * inner, dst * inner, n * inner, 1, n * inner))
                    else:  # columns of every row
                        rows.append((r, src, spec.shape[1], dst, stop - start, shape[0], n))
                pos += p.length
        out.append(np.array(rows, dtype=np.int64).reshape(-1, len(BLOCK_FIELDS)))
    return tuple(out)


def copy_blocks(spec: ParamSpec, layout: Layout, i: int = 1, j: int = 0) -> tuple[np.ndarray, ...]:
    """The copy plan of ``spec`` for inference TP rank ``j`` of ``i``, one array per target.

    Args:
        spec: the parameter (from :func:`megatron_params` with the same ``layout``).
        layout: source layout (``layout.tp`` = training TP size t).
        i, j: inference TP size and rank.
    Returns:
        For each ``spec.targets`` entry, int64 array [n, 7] with columns :data:`BLOCK_FIELDS`,
        all in elements: copy ``rows`` rows of ``cols`` elements from source shard ``src_shard``
        (flattened, row ``k`` at ``src_off + k*src_stride``) into the target shard (flattened, at
        ``dst_off + k*dst_stride``). The blocks of one target tile it exactly (read-only arrays,
        shared by every caller).
    Raises:
        ValueError: see :func:`target_range`.
    """
    plans = _blocks(spec, layout, i, j)
    for p in plans:
        p.flags.writeable = False
    return plans
