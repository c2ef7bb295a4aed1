"""Variable-length causal attention on CUDA: FlashAttention-2's ``varlen`` kernels as torch ships them.

A packed row (:mod:`yatt.trainer.packing`) is a run of query sequences (a trunk, or one response
of a shared prompt); sequence ``i`` holds the row's tokens ``cu_q[i]:cu_q[i+1]`` and attends to
the keys ``cu_k[i]:cu_k[i+1]`` of a key tensor (the row itself, or the row gathered so that each
response follows a copy of its prompt's keys). The mask is causal *aligned at the ends*: query
``j`` of a sequence of ``n`` queries and ``m`` keys sees keys ``0 .. j + m - n``, so a response's
queries see their whole prompt and themselves up to their position. That is FlashAttention-2's own
convention for ``is_causal`` with ``seqlen_q != seqlen_k`` (Dao 2023, "FlashAttention-2", and its
``mha_varlen_fwd``); no mask tensor, no padding, and the kernel skips every key block a query block
cannot see.

:func:`varlen_attention` calls ``torch.ops.aten._flash_attention_forward`` / ``_backward`` (the
kernels behind ``torch.nn.attention.varlen``, whose Python signature changed between torch
releases; the aten ops' leading arguments did not). :func:`available` checks once per process and
device, on a small random problem with grouped-query heads, that the kernel computes
:func:`reference` (the same attention, one ``scaled_dot_product_attention`` per sequence): if the
op is missing or disagrees, the caller keeps its portable path and a warning says why.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

_CHECKED: dict = {}  # device index -> bool (the kernel ran and matched the reference)
_DTYPES = (torch.float16, torch.bfloat16)


class _FlashVarlen(torch.autograd.Function):
    """FlashAttention-2 varlen forward and backward, causal, no dropout."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.sizes = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        max_q, max_k, scale = ctx.sizes
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
        return dq, dk, dv, None, None, None, None, None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal attention of each query sequence over its keys, aligned at the sequences' ends.

    Args:
        q: ``[Sq, heads, d]`` fp16/bf16 CUDA; k, v: ``[Sk, groups, d]`` (``heads % groups == 0``).
        cu_q, cu_k: int32 ``[M + 1]`` on q's device, the sequences' offsets in q and in k/v.
        max_q, max_k: the longest query and key sequence.
        scale: the softmax scale (``1 / sqrt(d)`` usually).
    Returns:
        ``[Sq, heads, d]`` in q's dtype, differentiable w.r.t. q, k and v.
    Raises:
        RuntimeError: from the kernel (wrong dtype, device, head size over 256, ...); check
            :func:`available` first.
    """
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _FlashVarlen.apply(q, k, v, cu_q, cu_k, int(max_q), int(max_k), float(scale))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
              scale: float) -> torch.Tensor:
    """What :func:`varlen_attention` computes, on any device and dtype: one
    ``scaled_dot_product_attention`` per sequence under an explicit end-aligned causal mask."""
    outs = []
    for i in range(len(cu_q) - 1):
        (qa, qb), (ka, kb) = (int(x) for x in cu_q[i:i + 2]), (int(x) for x in cu_k[i:i + 2])
        n, m = qb - qa, kb - ka
        allowed = torch.ones(n, m, dtype=torch.bool, device=q.device).tril_(m - n)
        outs.append(F.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1), attn_mask=allowed,
            scale=scale, enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1))
    return torch.cat(outs)


def available(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`varlen_attention` runs for queries like ``q`` and keys like ``k``: a CUDA
    fp16/bf16 tensor, a head size the kernel takes (a multiple of 8, at most 256), and, checked
    once per device, the kernel present and equal to :func:`reference` (outputs and grads) on a
    small problem with grouped-query heads and responses after a shared prompt."""
    if not (q.is_cuda and q.dtype in _DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and q.shape[-2] % k.shape[-2] == 0):
        return False
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if device not in _CHECKED:
        _CHECKED[device] = _self_check(torch.device("cuda", device), q.dtype)
    return _CHECKED[device]


def _self_check(device: torch.device, dtype: torch.dtype) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    cu_q = torch.tensor([0, 5, 8, 12], dtype=torch.int32, device=device)  # a trunk, then two branches
    cu_k = torch.tensor([0, 5, 13, 22], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(n, h, 64, generator=g, device=device, dtype=dtype, requires_grad=True)
               for n, h in ((12, 4), (22, 2), (22, 2)))
    grad = torch.randn(12, 4, 64, generator=g, device=device, dtype=dtype)
    try:
        out = varlen_attention(q, k, v, cu_q, cu_k, 5, 9, 0.125)
        got = torch.autograd.grad(out, (q, k, v), grad)
    except (RuntimeError, AttributeError, TypeError) as exc:
        warnings.warn(f"FlashAttention varlen is not usable here ({exc}); packed rows use the batched SDPA path",
                      stacklevel=3)
        return False
    want_out = reference(q, k, v, cu_q, cu_k, 0.125)
    want = torch.autograd.grad(want_out, (q, k, v), grad)
    err = max(float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max())
              for a, b in zip((out, *got), (want_out, *want)))
    if err > 0.02:  # relative to the largest value; bf16 rounding gives ~4e-3
        warnings.warn(f"FlashAttention varlen differs from the reference by {err:.3g} (relative); packed rows use "
                      f"the batched SDPA path", stacklevel=3)
        return False
    return True
