"""Fused SwiGLU of Megatron's gated MLP (Triton): ``silu(gate) * up`` with ``gate, up =
torch.chunk(x, 2, -1)``.

Forward: one read of ``x`` [M, 2F], one write of ``y`` [M, F] (torch's unfused form reads ``x``
and writes ``silu(gate)``, then reads both again). Backward: one read of ``x`` and ``dy``, one
write of ``dx`` [M, 2F]; ``silu`` and its derivative are recomputed from the saved input, fp32 math
inside the kernel, one rounding to the input dtype.

Sources: Liger-Kernel ``swiglu`` and Unsloth ``swiglu`` kernels (silu recomputed in the backward);
Megatron-Core ``fused_bias_swiglu`` (the same derivative, ``sig (1 + g (1 - sig))``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from yatt.trainer.fused import cdiv, jit, next_pow2, on_triton, tl

BLOCK = 1024  # feature columns per program (Qwen2.5-1.5B: F = 8960 per TP=1 rank -> 9 programs per row)
NUM_WARPS = 4  # 8 elements per thread of each half: 16-byte bf16 vector loads


def supported(t: torch.Tensor) -> bool:
    """``t`` can take the Triton path: a CUDA tensor, triton importable."""
    return on_triton(t)


@jit
def _fwd_kernel(x_ptr, y_ptr, F, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    x = x_ptr + row * stride_x + cols
    g = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x + F, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + row * F + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _bwd_kernel(x_ptr, dy_ptr, dx_ptr, F, stride_x, stride_dy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    x = x_ptr + row * stride_x + cols
    g = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x + F, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dx = dx_ptr + row * 2 * F + cols
    tl.store(dx, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx + F, (dy * g * sig).to(dx_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [M, last] with a contiguous last dim (a view when possible, else a copy)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(m: int, f: int, block: int) -> tuple[int, int]:
    return m, cdiv(f, block)


def _block(f: int) -> int:
    return min(BLOCK, max(16, next_pow2(f)))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = _rows(x)
        f = x2.shape[-1] // 2
        y = torch.empty(x2.shape[0], f, dtype=x.dtype, device=x.device)
        if y.numel():
            _fwd_kernel[_grid(x2.shape[0], f, _block(f))](x2, y, f, x2.stride(0), BLOCK=_block(f), num_warps=NUM_WARPS)
        ctx.save_for_backward(x)
        return y.view(*x.shape[:-1], f)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        x2, dy2 = _rows(x), _rows(dy)
        f = x2.shape[-1] // 2
        dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        if dx.numel():
            _bwd_kernel[_grid(x2.shape[0], f, _block(f))](x2, dy2, dx, f, x2.stride(0), dy2.stride(0),
                                                          BLOCK=_block(f), num_warps=NUM_WARPS)
        return dx.view(x.shape)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate, up = torch.chunk(x, 2, -1)``, differentiable (Triton).

    Args:
        x: [..., 2F] bf16 / fp16 / fp32 (any strides; a last dim that is not contiguous is copied).
    Returns:
        [..., F] contiguous, x's dtype. Computed in fp32, rounded once (torch's bf16 formula rounds
        ``silu(gate)`` and the product: ~1 bf16 ulp apart). The backward returns d(x) [..., 2F].
    Raises:
        ValueError: x's last dim is odd, or x is not a floating-point tensor.
    Runs on CUDA tensors (see :func:`supported`), or on CPU under ``TRITON_INTERPRET=1``.
    """
    if x.shape[-1] % 2 or not x.is_floating_point():
        raise ValueError(f"swiglu needs a float tensor [..., 2F], got {tuple(x.shape)} {x.dtype}")
    return _SwiGLU.apply(x)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """The plain torch formula (Megatron-Core's unfused gated MLP)."""
    gate, up = torch.chunk(x, 2, -1)
    return F.silu(gate) * up


class SwiGLU(torch.nn.Module):
    """Megatron MLP activation module (``submodules.activation_func`` with
    ``use_te_activation_func``): the whole gated unit, [..., 2F] -> [..., F]. Triton on CUDA
    tensors, the torch formula elsewhere."""

    def __init__(self, config=None):  # a TransformerConfig, unused (build_module passes it)
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x) if supported(x) else swiglu_reference(x)
