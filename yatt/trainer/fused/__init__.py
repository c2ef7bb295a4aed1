"""Fused Triton kernels for the trainer's elementwise hot paths on CUDA.

- :mod:`.logprob`: log-probability of the targets and entropy of vocab-parallel logits (one read
  of the logits forward, one read + one in-place write backward).
- :mod:`.swiglu`: ``silu(gate) * up`` of Megatron's gated MLP, forward and backward.
- :mod:`.rope`: Megatron-Core's unfused rotary embedding (``rotary_interleaved=False``).

Each module has ``supported(tensor)``: True for a CUDA tensor with Triton importable (and the
environment not saying ``YATT_FUSED=0``, which keeps torch's unfused code everywhere). Callers
dispatch CUDA -> these kernels, CPU -> the existing torch code. The kernels also run under Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which is how the CPU tests
check them (tests/test_fused_kernels.py).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: supported() is False and no kernel is ever launched
    triton = tl = None


def jit(fn):
    """``triton.jit`` when triton is importable, else ``fn`` unchanged (never launched)."""
    return fn if triton is None else triton.jit(fn)


def on_triton(t: torch.Tensor) -> bool:
    """``t`` can go to a Triton kernel: a CUDA tensor and triton importable."""
    return triton is not None and isinstance(t, torch.Tensor) and t.is_cuda and os.environ.get("YATT_FUSED") != "0"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
