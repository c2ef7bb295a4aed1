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
window attention, query-key layer scaling, an attention bias, packed-sequence parameters, and
queries and keys of different lengths.

Source: ``megatron.core.transformer.dot_product_attention.DotProductAttention`` (the function);
Dao et al. 2022, "FlashAttention" (the blocked kernel torch runs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


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
            attn_mask_type, attention_bias, packed_seq_params: as Megatron's; a bias or packed
                parameters take Megatron's own path.
        Returns:
            ``[Sq, B, heads * head_dim]``, as ``DotProductAttention.forward``. Every query must be
            allowed at least one key (:func:`yatt.trainer.packing.attention_mask` lets a padding
            query see itself): for a query that sees none Megatron's path returns the mean of the
            values and torch's kernels 0 or NaN.
        """
        if not self._fused(query, key, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, heads, S, head_dim]
        causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, is_causal=causal,
            scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _fused(self, query, key, attention_bias, packed_seq_params) -> bool:
        """The fused kernel computes what Megatron's path would."""
        softmax = self.scale_mask_softmax
        return (attention_bias is None and packed_seq_params is None and self.softmax_offset is None
                and softmax.window_size is None and softmax.scale is None and query.shape[0] == key.shape[0]
                and not (self.training and self.attention_dropout.p > 0))
