"""Core attention for Megatron-Core's local layer spec through torch's fused attention kernel.

Megatron-Core's local ``DotProductAttention`` (the one that runs without Transformer Engine, so on
CPU) materialises the scores: a ``baddbmm`` into ``[B*heads, S, S]``, a masked softmax in a
separate pass, a ``bmm`` with the values, and it saves the ``S x S`` probabilities for the
backward pass. :class:`SdpaAttention` computes the same function with
``torch.nn.functional.scaled_dot_product_attention`` (on CPU a blocked flash-attention kernel,
grouped-query heads without copying the keys and values, only the log-sum-exp saved). On the
trainer's packed rows (SmolLM2's 9 heads, one thread, 2026-12-03, the dev machine) forward +
backward of one layer took 0.55-0.70x the local path's time, with outputs equal to 1e-6.

It stands in for ``DotProductAttention`` in the layer spec (:func:`yatt.trainer.model.build_gpt`):
same constructor, same parameters (none), same state dict. Whatever the fused kernel does not
cover falls back to Megatron's own path: attention dropout while training, a softmax offset,
window attention, query-key layer scaling, an attention bias, other packed-sequence parameters,
and queries and keys of different lengths.

Given a :class:`DocumentAttention` (a packed row of :mod:`yatt.trainer.packing`) it runs each
document's attention alone. On CUDA in bf16/fp16 that is one variable-length FlashAttention call
over the row (:mod:`yatt.trainer.flash_varlen`: each trunk and each response a sequence, a
response's keys its prompt's then its own), with no padding and no mask. Elsewhere (the CPU, fp32)
the trunks are gathered into one batch of causal rows and the branches (a shared prompt's
responses) with their trunk's keys into another, so the row's length never enters the cost. On
one of the demo's mini-batches (SmolLM2's heads, 4 prompts x 8 responses of 40 tokens, one
thread, 2026-12-03, the dev machine) forward + backward of one layer's attention took 57 ms
against 105 ms for the same 1428 tokens as four masked rows of 357.

Source: ``megatron.core.transformer.dot_product_attention.DotProductAttention`` (the function);
Dao et al. 2022, "FlashAttention" (the blocked kernel torch runs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from yatt.trainer import flash_varlen, packing


@dataclass
class DocumentAttention(PackedSeqParams):
    """A packed row's attention plan (:func:`yatt.trainer.packing.pack_rows`), handed to the core attention as
    Megatron-Core's ``packed_seq_params``. Its ``qkv_format`` is ``"sbhd"``, so Megatron-Core's
    layers pass it through untouched (``"thd"`` would restart rotary positions per document,
    which a shared prompt's responses must not) and only :class:`SdpaAttention` reads it.

    Attributes:
        trunk, branch_q, branch_k, branch_lens, gather, segments, branches: ``pack_rows``'
            ``packed_trunk``, ``packed_branch_q``, ``packed_branch_k``, ``packed_branch_lens``,
            ``packed_gather``, ``packed_segments`` and ``packed_branches``.
        cu_q, cu_k, kv_index, max_q, max_k: the variable-length plan (``packed_cu_q``,
            ``packed_cu_k``, ``packed_kv_index`` or None, ``packed_max_lens`` as ints).
    """

    trunk: torch.Tensor = None
    branch_q: torch.Tensor = None
    branch_k: torch.Tensor = None
    branch_lens: torch.Tensor = None
    gather: torch.Tensor = None
    segments: torch.Tensor = None
    branches: torch.Tensor = None
    cu_q: torch.Tensor = None
    cu_k: torch.Tensor = None
    kv_index: torch.Tensor = None
    max_q: int = 0
    max_k: int = 0
    _mask: torch.Tensor = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, mb: dict) -> DocumentAttention:
        """The plan of a micro-batch with ``pack_rows``' tensors (on the model's device)."""
        size = mb["packed_ids"].shape[1]
        lens = mb.get("packed_max_lens", (0, 0))  # read on the host (a CPU tensor, or ints)
        max_q, max_k = (int(x) for x in (lens.tolist() if torch.is_tensor(lens) else lens))
        return cls(qkv_format="sbhd", max_seqlen_q=size, max_seqlen_kv=size, trunk=mb["packed_trunk"],
                   branch_q=mb["packed_branch_q"], branch_k=mb["packed_branch_k"],
                   branch_lens=mb["packed_branch_lens"], gather=mb["packed_gather"],
                   segments=mb["packed_segments"], branches=mb["packed_branches"], cu_q=mb.get("packed_cu_q"),
                   cu_k=mb.get("packed_cu_k"), kv_index=mb.get("packed_kv_index"), max_q=max_q, max_k=max_k)

    def branch_mask(self) -> torch.Tensor:
        """bool ``[N, 1, Q, P + Q]``, True where branch query ``i`` may attend to key ``j``: its
        trunk's tokens, and its own up to itself; a query past the branch's end sees the trunk
        (or the branch's first token when the trunk is empty), its output is never read.
        Built once per plan."""
        if self._mask is None:
            n, q_len = self.branch_q.shape
            P = self.branch_k.shape[1] - q_len
            i = torch.arange(q_len, device=self.branch_q.device)[:, None]
            j = torch.arange(P + q_len, device=self.branch_q.device)[None, :]
            t_len, b_len = (x[:, None, None] for x in self.branch_lens.unbind(1))
            own = (j >= P) & (j - P <= torch.minimum(i, b_len - 1))
            self._mask = ((j < t_len) | own).unsqueeze(1)
        return self._mask


class SdpaAttention(DotProductAttention):
    """``DotProductAttention`` whose forward runs torch's fused scaled-dot-product attention."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """Attention output.

        Args:
            query: ``[Sq, B, heads, head_dim]``; key, value: ``[Sk, B, groups, head_dim]`` (this TP
                rank's heads and query groups), the parameter dtype.
            attention_mask: bool ``[B or 1, 1, Sq, Sk]``, True where a query may *not* attend
                (Megatron's convention), or None for the layer's own mask type (causal: each
                query sees the keys up to its position).
            attn_mask_type, attention_bias: as Megatron's; a bias takes Megatron's own path.
            packed_seq_params: a :class:`DocumentAttention`: ``B = 1``, one packed row, attention
                inside its documents (``attention_mask`` is ignored); other packed parameters
                take Megatron's own path.
        Returns:
            ``[Sq, B, heads * head_dim]``, as ``DotProductAttention.forward``. Every query must be
            allowed at least one key: for a query that sees none Megatron's path returns the mean
            of the values and torch's kernels 0 or NaN.
        """
        if isinstance(packed_seq_params, DocumentAttention):
            if self._fused(query, key, attention_bias, None):
                return self._documents(query, key, value, packed_seq_params)
            attention_mask = packing.attention_mask(packed_seq_params.segments, packed_seq_params.branches)
            packed_seq_params = None  # Megatron's path, on the row's dense mask
        if not self._fused(query, key, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, heads, S, head_dim]
        causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, is_causal=causal,
            scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _documents(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   plan: DocumentAttention) -> torch.Tensor:
        """Attention inside each document of a packed row: ``[S, 1, heads, head_dim]`` in,
        ``[S, 1, heads * head_dim]`` out. Gathers are ``index_select`` (their backward an
        ``index_add_``, not advanced indexing's sort-based accumulation)."""
        q, k, v = (x[:, 0] for x in (query, key, value))  # [S, heads, head_dim]
        out_shape = (query.shape[0], 1, self.hidden_size_per_partition)
        if plan.cu_q is not None and flash_varlen.available(q, k):
            if plan.kv_index is not None:  # each response's keys follow a copy of its prompt's
                k, v = k.index_select(0, plan.kv_index), v.index_select(0, plan.kv_index)
            return flash_varlen.varlen_attention(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
                                                 self.softmax_scale).reshape(out_shape)
        gqa = q.shape[1] != k.shape[1]

        def rows(x, index):  # x[index] for an index [R, L]: [R, heads, L, head_dim]
            return x.index_select(0, index.flatten()).view(*index.shape, *x.shape[1:]).transpose(1, 2)

        outs = []
        if plan.trunk.numel():  # [D, heads, P, head_dim], causal; a row's tail past its trunk is never read
            t = plan.trunk
            outs.append(F.scaled_dot_product_attention(
                rows(q, t), rows(k, t), rows(v, t), is_causal=True,
                scale=self.softmax_scale, enable_gqa=gqa).transpose(1, 2).flatten(0, 1))
        if plan.branch_q.numel():  # [N, heads, Q, head_dim] against [N, groups, P + Q, head_dim]
            bq, bk = plan.branch_q, plan.branch_k
            outs.append(F.scaled_dot_product_attention(
                rows(q, bq), rows(k, bk), rows(v, bk),
                attn_mask=plan.branch_mask(), scale=self.softmax_scale, enable_gqa=gqa).transpose(1, 2).flatten(0, 1))
        return torch.cat(outs).index_select(0, plan.gather).reshape(out_shape)

    def _fused(self, query, key, attention_bias, packed_seq_params) -> bool:
        """The fused kernel computes what Megatron's path would."""
        softmax = self.scale_mask_softmax
        return (attention_bias is None and packed_seq_params is None and self.softmax_offset is None
                and softmax.window_size is None and softmax.scale is None and query.shape[0] == key.shape[0]
                and not (self.training and self.attention_dropout.p > 0))
