"""Rotary position embedding as Megatron-Core 0.16.1 applies it unfused (Triton).

Reference: ``megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd`` with
``rotary_interleaved=False``, ``mscale=1`` and rotary dim == head dim::

    cos_, sin_ = cos(freqs).to(t.dtype), sin(freqs).to(t.dtype)
    out = t * cos_ + cat(-t2, t1) * sin_          # t1, t2 = the two halves of the head dim

One program per (s, b): cos / sin of the D angles computed once in fp32 (then rounded to t's dtype,
as Megatron does) and applied to all H heads, tiles of [BLOCK_H, D/2]; one read of ``t`` and one
write of the output. The products are rounded to t's dtype before the sum, as torch's bf16
arithmetic does: the forward matches Megatron's bf16 result to the rounding of cos / sin.
Backward: the transpose (rotation by -angle), fp32 math, one rounding.

Sources: Megatron-Core ``rope_utils`` (semantics), Liger-Kernel / Unsloth ``rope`` kernels
(one program per token, heads tiled, backward = forward with sin negated).
"""
from __future__ import annotations

import torch

from yatt.trainer.fused import jit, next_pow2, on_triton, tl

TILE = 1024  # elements of the [BLOCK_H, D/2] tile per loop step (D = 128: 16 heads)
NUM_WARPS = 4


def supported(t: torch.Tensor) -> bool:
    """``t`` can take the Triton path: a CUDA tensor, triton importable."""
    return on_triton(t)


@jit
def _rope_kernel(x_ptr, f_ptr, o_ptr, B, H, sx_s, sx_b, sx_h, sx_d, sf_s, sf_b, sf_d, so_s, so_b, so_h, so_d,
                 HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, INVERSE: tl.constexpr):
    """o = R x (forward) or R^T x (INVERSE) with R Megatron's rotate-half rotation at angles f[s, b]."""
    pid = tl.program_id(0).to(tl.int64)
    s = pid // B
    b = pid % B
    j = tl.arange(0, BLOCK_D)
    jm = j < HALF
    fp = f_ptr + s * sf_s + b * sf_b + j * sf_d
    f1 = tl.load(fp, mask=jm, other=0.0).to(tl.float32)
    f2 = tl.load(fp + HALF * sf_d, mask=jm, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    c1 = tl.cos(f1).to(dt).to(tl.float32)[None, :]
    s1 = tl.sin(f1).to(dt).to(tl.float32)[None, :]
    c2 = tl.cos(f2).to(dt).to(tl.float32)[None, :]
    s2 = tl.sin(f2).to(dt).to(tl.float32)[None, :]
    hs = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hs
        mask = (h < H)[:, None] & jm[None, :]
        xp = x_ptr + s * sx_s + b * sx_b + h[:, None] * sx_h + j[None, :] * sx_d
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF * sx_d, mask=mask, other=0.0).to(tl.float32)
        if INVERSE:  # transpose of the forward map: grads in fp32, one rounding
            y1 = c1 * x1 + s2 * x2
            y2 = c2 * x2 - s1 * x1
        else:  # torch's bf16 rounding: each product, then the sum
            y1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
            y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        op = o_ptr + s * so_s + b * so_b + h[:, None] * so_h + j[None, :] * so_d
        tl.store(op, y1.to(dt), mask=mask)
        tl.store(op + HALF * so_d, y2.to(dt), mask=mask)


def _launch(x: torch.Tensor, freqs: torch.Tensor, inverse: bool) -> torch.Tensor:
    S, B, H, D = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        block_d = max(16, next_pow2(D // 2))
        block_h = min(max(2, next_pow2(H)), max(2, TILE // block_d))
        sf_b = freqs.stride(1) if freqs.shape[1] > 1 else 0
        _rope_kernel[(S * B,)](x, freqs, out, B, H, *x.stride(), freqs.stride(0), sf_b, freqs.stride(3), *out.stride(),
                               HALF=D // 2, BLOCK_D=block_d, BLOCK_H=block_h, INVERSE=inverse, num_warps=NUM_WARPS)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        return _launch(t, freqs, inverse=False)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _launch(grad, freqs, inverse=True), None


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``t`` at angles ``freqs`` (Megatron's bshd, non-interleaved), differentiable
    w.r.t. ``t`` (``freqs`` gets no gradient).

    Args:
        t: [S, B, H, D] bf16 / fp16 / fp32, D even; any strides (the q / k views of Megatron's fused
            qkv split are read in place).
        freqs: [S, 1 or B, 1, D] angles, fp32 (cos / sin taken in fp32 in the kernel).
    Returns:
        [S, B, H, D] contiguous, t's dtype.
    Raises:
        ValueError: shapes other than these (a rotary dim below the head dim is not supported).
    Runs on CUDA tensors (see :func:`supported`), or on CPU under ``TRITON_INTERPRET=1``.
    """
    if t.dim() != 4 or t.shape[-1] % 2 or not t.is_floating_point():
        raise ValueError(f"t must be a float [S, B, H, D] with D even, got {tuple(t.shape)} {t.dtype}")
    S, B, _, D = t.shape
    if freqs.dim() != 4 or freqs.shape[0] != S or freqs.shape[1] not in (1, B) or freqs.shape[2] != 1 \
            or freqs.shape[3] != D:
        raise ValueError(f"freqs must be [{S}, 1 or {B}, 1, {D}] for t {tuple(t.shape)}, got {tuple(freqs.shape)}")
    return _Rope.apply(t, freqs)
