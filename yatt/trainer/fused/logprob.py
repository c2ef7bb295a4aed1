"""Fused log-probability and entropy of vocab-parallel logits (Triton; the CUDA path of
:func:`yatt.trainer.actor.vocab_parallel_logprobs_entropy`).

Forward, per row of this TP rank's logits ``z`` [Vl], ONE read of the row (:func:`_stats_kernel`,
blocks of :data:`VOCAB_BLOCK` with an online max, fp32 accumulation, no fp32 copy of the logits):
``m = max z``, ``s = sum exp(z - m)``, ``d = sum exp(z - m) (z - m)`` and the target's logit ``zt``
(0 when the target is on another shard). :func:`combine` merges the shards (two all-reduces: MAX of
``m``, SUM of the rescaled ``s, d, zt``): ``log p_t = zt - M - log S``, ``H = log S - D / S``.

Backward, per row, one read and one write (:func:`_grad_kernel`): ``p = exp(z - M - log S)`` block
by block and ``g_lp (1[i=t] - p) - g_H p (log p + H)`` written IN PLACE into the logits (the input is
consumed; its last use is this backward). No communication in the backward pass.

Sources: Megatron-Core ``vocab_parallel_cross_entropy`` (max / sum all-reduces over the TP group,
the gradient written into the logits' buffer); Liger-Kernel ``cross_entropy`` (online-softmax
Triton loop over vocab blocks, gradient written in place); Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from yatt.trainer.fused import jit, next_pow2, on_triton, tl

VOCAB_BLOCK = 4096  # vocab elements per loop step: 8 KiB of bf16 per row block, 16 per thread at 8 warps
NUM_WARPS = 8  # one row per program; 8 warps keep enough loads in flight for HBM3e


def supported(t: torch.Tensor) -> bool:
    """Logits ``t`` can take the Triton path: a CUDA tensor, triton importable."""
    return on_triton(t)


@jit
def _stats_kernel(z_ptr, tgt_ptr, out_ptr, n_rows, T, stride_b, stride_t, start, n_local, valid,
                  BLOCK: tl.constexpr):
    """Row ``r`` (= b * T + t) of ``z``: out[0..3, r] = m, s, d, zt; out[4, r] = target on the shard."""
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + (row // T) * stride_b + (row % T) * stride_t
    cols = tl.arange(0, BLOCK)
    m = -3.0e38  # the max of a shard with no valid column: finite (no inf - inf), exp(m - M) == 0
    s = 0.0
    d = 0.0
    for off in range(0, valid, BLOCK):
        idx = off + cols
        z = tl.load(base + idx, mask=idx < valid, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        zc = tl.where(e > 0.0, z - m_new, 0.0)  # padding lanes: 0, not 0 * -inf
        d = scale * (d + (m - m_new) * s) + tl.sum(e * zc, 0)
        s = s * scale + tl.sum(e, 0)
        m = m_new
    local = tl.load(tgt_ptr + row) - start
    here = (local >= 0) & (local < n_local)
    zt = tl.load(base + local, mask=here, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + n_rows + row, s)
    tl.store(out_ptr + 2 * n_rows + row, d)
    tl.store(out_ptr + 3 * n_rows + row, zt)
    tl.store(out_ptr + 4 * n_rows + row, here.to(tl.float32))


@jit
def _grad_kernel(z_ptr, tgt_ptr, shift_ptr, log_s_ptr, ent_ptr, g_lp_ptr, g_h_ptr, T, stride_b, stride_t,
                 start, n_local, valid, HAS_LP: tl.constexpr, HAS_H: tl.constexpr, BLOCK: tl.constexpr):
    """Overwrite row ``r`` of ``z`` with d(g_lp . log p_t + g_H . H)/dz (0 in padding columns)."""
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + (row // T) * stride_b + (row % T) * stride_t
    cols = tl.arange(0, BLOCK)
    shift = tl.load(shift_ptr + row)
    log_s = tl.load(log_s_ptr + row)
    local = tl.load(tgt_ptr + row) - start
    if HAS_LP:
        g_lp = tl.load(g_lp_ptr + row)
    if HAS_H:
        g_h = tl.load(g_h_ptr + row)
        ent = tl.load(ent_ptr + row)
    for off in range(0, valid, BLOCK):
        idx = off + cols
        mask = idx < valid
        logp = (tl.load(base + idx, mask=mask, other=0.0).to(tl.float32) - shift) - log_s
        p = tl.exp(logp)
        g = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_LP:
            g += g_lp * (tl.where(idx == local, 1.0, 0.0) - p)
        if HAS_H:
            g -= g_h * p * (logp + ent)
        tl.store(base + idx, g.to(z_ptr.dtype.element_ty), mask=mask)
    for off in range(valid, n_local, BLOCK):
        idx = off + cols
        tl.store(base + idx, tl.zeros([BLOCK], dtype=z_ptr.dtype.element_ty), mask=idx < n_local)


def _rows(logits: torch.Tensor) -> tuple[int, int, int, int]:
    """(N, T, stride_b, stride_t) of [B, T, Vl] or [N, Vl] logits read in place (row r = b * T + t)."""
    if logits.dim() == 2:
        return logits.shape[0], 1, logits.stride(0), 0
    return logits.shape[0] * logits.shape[1], logits.shape[1], logits.stride(0), logits.stride(1)


def _block(n_local: int) -> int:
    return min(VOCAB_BLOCK, max(16, next_pow2(n_local)))


def shard_stats(logits: torch.Tensor, targets: torch.Tensor, start: int, valid: int) -> torch.Tensor:
    """Per-row statistics of one vocab shard, one read of ``logits``.

    Args:
        logits: [B, T, Vl] or [N, Vl], bf16 / fp16 / fp32, last dim contiguous, any other strides.
        targets: [N] int64 global token ids (row ``r = b * T + t``), contiguous.
        start: the shard's first global id; ``valid``: its columns ``[0, valid)`` are real vocab,
            ``[valid, Vl)`` padding (probability 0, never read).
    Returns:
        fp32 [5, N]: max ``m``, ``s = sum exp(z - m)``, ``d = sum exp(z - m) (z - m)``, the target's
        logit ``zt`` (0 if the target is not in ``[start, start + Vl)``) and that flag (1.0 / 0.0).
    """
    n_rows, T, stride_b, stride_t = _rows(logits)
    out = torch.empty(5, n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        _stats_kernel[(n_rows,)](logits, targets, out, n_rows, T, stride_b, stride_t, start, logits.shape[-1],
                                 valid, BLOCK=_block(logits.shape[-1]), num_warps=NUM_WARPS)
    return out


def rescale(m: torch.Tensor, s: torch.Tensor, d: torch.Tensor, zt: torch.Tensor,
            gmax: torch.Tensor) -> torch.Tensor:
    """A shard's ``(s, d, zt)`` relative to the global max ``gmax``: [3, ...] to be summed over shards.
    ``sum e^(z-M) (z-M) = e^(m-M) (d + (m-M) s)``; an empty shard (``m = -3e38``, ``s = 0``) adds 0."""
    w = torch.exp(m - gmax)
    return torch.stack([s * w, w * (d + (m - gmax) * s), zt])


def finish(gmax: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(gmax, log S, log p_t, H) from the global max and the summed ``(S, D, zt)`` [3, ...]."""
    s, d, zt = sums
    log_s = s.log()
    return gmax, log_s, zt - gmax - log_s, log_s - d / s


def merge(m: torch.Tensor, s: torch.Tensor, d: torch.Tensor, zt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`combine` of K shards held in one process: inputs stacked [K, N] -> (gmax, log S, log p_t, H),
    each [N]. What the two all-reduces compute; for tests and single-process use."""
    gmax = m.amax(0)
    return finish(gmax, rescale(m, s, d, zt, gmax).sum(1))


def combine(m: torch.Tensor, s: torch.Tensor, d: torch.Tensor, zt: torch.Tensor,
            group=None) -> tuple[torch.Tensor, ...]:
    """This shard's [N] statistics merged over the TP ``group`` -> (gmax, log S, log p_t, H), identical
    on every rank: an all-reduce MAX of ``m``, then one SUM of the rescaled ``(s, d, zt)``. No
    communication when ``group`` is None or of size 1."""
    if group is None or dist.get_world_size(group) == 1:
        return finish(m, torch.stack([s, d, zt]))
    gmax = m.clone()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    sums = rescale(m, s, d, zt, gmax)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return finish(gmax, sums)


def logits_grad_(logits: torch.Tensor, targets: torch.Tensor, start: int, valid: int, gmax: torch.Tensor,
                 log_s: torch.Tensor, entropy: torch.Tensor, g_lp: torch.Tensor | None,
                 g_h: torch.Tensor | None) -> torch.Tensor:
    """Overwrite ``logits`` (as in :func:`shard_stats`) with the gradient of
    ``sum g_lp log p_t + sum g_h H`` w.r.t. them, in their dtype, from the merged ``gmax``,
    ``log_s``, ``entropy`` [N] fp32 (:func:`combine`); a None incoming gradient drops its term,
    padding columns get 0. One read and one write per element. Returns ``logits``."""
    n_rows, T, stride_b, stride_t = _rows(logits)
    flat = [gmax if g is None else g.reshape(-1).float().contiguous() for g in (g_lp, g_h)]
    if n_rows:
        _grad_kernel[(n_rows,)](logits, targets, gmax, log_s, entropy, flat[0], flat[1], T, stride_b, stride_t,
                                start, logits.shape[-1], valid, HAS_LP=g_lp is not None, HAS_H=g_h is not None,
                                BLOCK=_block(logits.shape[-1]), num_warps=NUM_WARPS)
    return logits


class FusedLogprobEntropy(torch.autograd.Function):
    """``(logits, targets [N] int64, start, valid, group) -> (log p_t, H)`` [logits.shape[:-1]] fp32.
    Saves the logits themselves (no softmax copy); the backward overwrites them with the gradient
    and returns them: the input is consumed."""

    @staticmethod
    def forward(ctx, logits, targets, start, valid, group):
        m, s, d, zt, _ = shard_stats(logits, targets, start, valid)
        gmax, log_s, logprob, entropy = combine(m, s, d, zt, group)
        ctx.save_for_backward(logits, targets, gmax, log_s, entropy)
        ctx.meta = (start, valid)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logprob.view(logits.shape[:-1]), entropy.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, g_lp, g_h):
        logits, targets, gmax, log_s, entropy = ctx.saved_tensors
        if g_lp is None and g_h is None:
            return None, None, None, None, None
        start, valid = ctx.meta
        return logits_grad_(logits, targets, start, valid, gmax, log_s, entropy, g_lp, g_h), None, None, None, None


def logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int, group=None,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets`` and entropy from logits split over the TP vocab shards: the
    contract of :func:`yatt.trainer.actor.vocab_parallel_logprobs_entropy`, on Triton.

    Args:
        logits: [B, T, Vl] or [N, Vl], this rank's ids ``[start, start + Vl)``; bf16, fp16 or fp32,
            last dim contiguous (other strides free: a transposed [S, B] view is read in place).
            CONSUMED by the backward pass: the gradient is written into it, so nothing may read
            these logits after ``backward`` (the output layer's backward only needs its input).
        targets: logits.shape[:-1] int64 global ids (< vocab_size).
        start: this shard's first global id (``tp_rank * Vl``).
        vocab_size: true vocab size V; ids in ``[V, Vp)`` are padding and get probability 0.
        group: the TP process group; None or size 1: no communication.
        entropy_grad: the entropy carries a gradient (an entropy bonus).
    Returns:
        (logprobs, entropy), fp32 of shape logits.shape[:-1]; logprobs differentiable w.r.t.
        ``logits``, entropy detached unless ``entropy_grad`` and grad mode is on. Identical on
        every TP rank. Gradient in the logits' dtype.
    Raises:
        ValueError: logits not 2-D / 3-D, not a float16 / bfloat16 / float32 tensor, last dim not
            contiguous, or targets of another shape.
    Runs on CUDA tensors (see :func:`supported`), or on CPU under ``TRITON_INTERPRET=1``.
    """
    if logits.dim() not in (2, 3) or logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits must be [B, T, V] or [N, V] fp16/bf16/fp32, got {tuple(logits.shape)} {logits.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError(f"logits' last dim must be contiguous, strides {logits.stride()}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(logits.shape)}")
    valid = max(0, min(logits.shape[-1], vocab_size - start))
    flat_targets = targets.reshape(-1).to(device=logits.device, dtype=torch.int64).contiguous()
    logprobs, entropy = FusedLogprobEntropy.apply(logits, flat_targets, start, valid, group)
    if not (entropy_grad and torch.is_grad_enabled()):
        entropy = entropy.detach()
    return logprobs, entropy
