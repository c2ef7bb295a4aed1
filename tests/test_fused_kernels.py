"""The Triton kernels of yatt.trainer.fused against their torch references, on CPU under Triton's
interpreter. ``TRITON_INTERPRET=1`` must be set before triton is imported, so the kernel checks
(the ``check_*`` functions below) run in a child process, one per kernel family, which prints
each check's outcome as JSON; the pytest process never sets the variable. Small shapes: each
family runs in a few seconds on 2 cores. The checks that launch no kernel run in-process."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import traceback
from functools import cache
from pathlib import Path

import pytest
import torch

N, V, PAD = 13, 300, 4  # logits rows, true vocab, vocab padding columns
WIDE = 320  # row stride of the logits' buffer: columns [V + PAD, WIDE) belong to no one
DEVICE = "cpu"  # where the kernels run: "cpu" under the interpreter, "cuda" in the gpu tests' child


def _close(a, b, tol):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=tol, atol=tol)


# ---- logprob ------------------------------------------------------------------------------
def _reference(z: torch.Tensor, targets: torch.Tensor, w_lp, w_h, uses: str):
    """Logprobs, entropy and d loss / d z of yatt.trainer.actor's CPU path (fp32, padding masked as
    in vocab_parallel_logprobs_entropy, world of one)."""
    from yatt.trainer.actor import _PADDED_LOGIT, _VocabParallelLogprobEntropy

    leaf = z.detach().float().cpu().clone().requires_grad_(True)
    masked = leaf.masked_fill(torch.arange(z.shape[-1]) >= V, _PADDED_LOGIT)
    lp, ent = _VocabParallelLogprobEntropy.apply(masked, targets.cpu(), 0, None)
    _loss(lp, ent, w_lp.cpu(), w_h.cpu(), uses).backward()
    return lp.detach(), ent.detach(), leaf.grad


def _loss(lp, ent, w_lp, w_h, uses):
    return {"logprob": (lp * w_lp).sum(), "entropy": (ent * w_h).sum(),
            "both": (lp * w_lp).sum() + (ent * w_h).sum()}[uses]


def _logits(dtype, gen, layout: str):
    """(buffer, logits view): [N, V+PAD] rows of a [N, WIDE] buffer, or a [B, T, V+PAD] transposed
    view of a [T, B, WIDE] buffer; padding columns and the gap hold NaN (never to be read)."""
    shape = (N, WIDE) if layout == "rows" else (7, 2, WIDE)
    buf = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    buf[..., V:] = float("nan")
    buf = buf.to(DEVICE)
    view = buf[..., :V + PAD]
    return buf, (view if layout == "rows" else view.transpose(0, 1))


def _check_logprob(dtype, tol_out, tol_grad):
    from yatt.trainer.fused.logprob import logprobs_entropy

    gen = torch.Generator().manual_seed(0)
    for layout in ("rows", "transposed"):
        for uses in ("logprob", "entropy", "both"):
            buf, z = _logits(dtype, gen, layout)
            targets = torch.randint(0, V, z.shape[:-1], generator=gen).to(DEVICE)
            w_lp, w_h = (torch.rand(z.shape[:-1], generator=gen).to(DEVICE) for _ in range(2))
            ref_lp, ref_ent, ref_grad = _reference(z, targets, w_lp, w_h, uses)
            with torch.no_grad():  # forward only (the reference policy): no graph, logits untouched
                lp, ent = logprobs_entropy(z, targets, 0, V)
            _close(lp, ref_lp, tol_out)
            z.requires_grad_(True)  # stands for the output layer's logits
            lp, ent = logprobs_entropy(z, targets, 0, V, entropy_grad=uses != "logprob")
            assert ent.requires_grad == (uses != "logprob") and lp.dtype == ent.dtype == torch.float32
            _close(lp, ref_lp, tol_out)
            _close(ent, ref_ent, tol_out)
            _loss(lp, ent, w_lp, w_h, uses).backward()
            assert z.grad.dtype == dtype
            _close(z.grad, ref_grad, tol_grad)
            assert torch.equal(z.detach(), z.grad), "the gradient is not written into the logits"
            assert (z.grad[..., V:] == 0).all(), "stale padding columns"
            assert buf[..., V + PAD:].isnan().all(), "the backward wrote outside the logits"


def check_logprob_fp32_matches_actor():
    """fp32: outputs and gradients (logprob, entropy, both) of _VocabParallelLogprobEntropy, with
    padding columns (NaN-poisoned: never read, zeroed by the backward), row-strided and transposed
    logits; the gradient replaces the logits in place."""
    _check_logprob(torch.float32, 1e-5, 1e-5)


def check_logprob_bf16_matches_actor():
    """bf16 logits: outputs to fp32 accuracy (fp32 math on the same values), gradient to bf16 rounding."""
    _check_logprob(torch.bfloat16, 1e-5, 1e-2)


def check_logprob_in_place_backward_leaves_no_stale_values():
    """The backward overwrites every column of the consumed logits ([0, V) with the gradient,
    padding with 0) and nothing outside them (the buffer's gap keeps its poison)."""
    from yatt.trainer.fused.logprob import logprobs_entropy

    gen = torch.Generator().manual_seed(1)
    buf = torch.full((N, WIDE), 12345.0)
    buf[:, :V] = torch.randn(N, V, generator=gen)
    buf[:, V:V + PAD] = float("nan")
    buf, targets = buf.to(DEVICE), (torch.arange(N) * 7).to(DEVICE)
    ref_lp, ref_ent, ref_grad = _reference(buf[:, :V + PAD], targets, torch.ones(N), torch.ones(N), "both")
    inp = buf[:, :V + PAD]
    inp.requires_grad_(True)
    lp, ent = logprobs_entropy(inp, targets, 0, V, entropy_grad=True)
    (lp.sum() + ent.sum()).backward()
    _close(buf[:, :V + PAD], ref_grad, 1e-5)
    assert (buf[:, V + PAD:] == 12345.0).all(), "the backward wrote outside the logits"


def check_logprob_tp_shards_merge_to_tp1():
    """Simulated TP: per-shard statistics (targets on and off each shard) merged with ``merge``,
    and each shard's in-place gradient from the merged values, equal TP=1; TP=4 with a shard that
    is all padding (vocab 220 of 304)."""
    from yatt.trainer.fused.logprob import logits_grad_, merge, shard_stats

    gen = torch.Generator().manual_seed(2)
    for tp, vocab in ((2, V), (4, 220)):
        z = (3 * torch.randn(N, V + PAD, generator=gen)).to(DEVICE)
        targets = torch.randint(0, vocab, (N,), generator=gen).to(DEVICE)
        g_lp, g_h = (torch.randn(N, generator=gen).to(DEVICE) for _ in range(2))
        full = shard_stats(z, targets, 0, vocab)
        gmax, log_s, lp, ent = merge(*full[:4, None])
        ref_grad = logits_grad_(z.clone(), targets, 0, vocab, gmax, log_s, ent, g_lp, g_h)
        width = (V + PAD) // tp
        shards = [z[:, r * width:(r + 1) * width].clone() for r in range(tp)]
        valid = [max(0, min(width, vocab - r * width)) for r in range(tp)]
        stats = torch.stack([shard_stats(s, targets, r * width, valid[r]) for r, s in enumerate(shards)])
        assert torch.equal(stats[:, 4].sum(0).cpu(), torch.ones(N)), "each target on exactly one shard"
        assert (stats[:, 3][stats[:, 4] == 0] == 0).all(), "off-shard targets give zt = 0"
        m_gmax, m_log_s, m_lp, m_ent = merge(*stats[:, :4].unbind(1))
        _close(m_lp, lp, 1e-5)
        _close(m_ent, ent, 1e-5)
        _close(m_gmax + m_log_s, gmax + log_s, 1e-5)
        grads = [logits_grad_(s, targets, r * width, valid[r], m_gmax, m_log_s, m_ent, g_lp, g_h)
                 for r, s in enumerate(shards)]
        _close(torch.cat(grads, -1), ref_grad, 1e-5)
        if tp == 4:
            assert valid[-1] == 0 and torch.equal(grads[-1], torch.zeros_like(grads[-1]))


# ---- swiglu -------------------------------------------------------------------------------
def check_swiglu_matches_torch():
    """Output and d(x) of swiglu against autograd through the torch formula: fp32 (contiguous and a
    row-strided view) to 1e-5, bf16 to bf16 rounding of the fp32 result of the same inputs."""
    from yatt.trainer.fused.swiglu import swiglu, swiglu_reference

    gen = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        for strided in (False, True):
            buf = (2 * torch.randn(2, 7, 96 if strided else 80, generator=gen)).to(DEVICE)
            x = buf[..., :80].to(dtype)
            dy = torch.randn(2, 7, 40, generator=gen).to(DEVICE, dtype)
            ref_x = x.detach().float().cpu().requires_grad_(True)
            ref_y = swiglu_reference(ref_x)
            ref_y.backward(dy.float().cpu())
            x.requires_grad_(True)
            y = swiglu(x)
            y.backward(dy)
            assert y.shape == (2, 7, 40) and y.dtype == dtype and x.grad.dtype == dtype
            _close(y, ref_y, tol)
            _close(x.grad, ref_x.grad, tol)


# ---- rope ---------------------------------------------------------------------------------
def check_rope_matches_megatron():
    """Output and d(t) of apply_rope against Megatron-Core's unfused _apply_rotary_pos_emb_bshd (its
    autograd backward), for q / k views of a fused qkv tensor [S, B, H, 3D], freqs [S, 1, 1, D]
    and [S, B, 1, D]: fp32 to 1e-5; bf16 forward to one bf16 ulp, backward to bf16 rounding."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from yatt.trainer.fused.rope import apply_rope

    gen = torch.Generator().manual_seed(4)
    S, B, H, D = 7, 2, 3, 16
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        for fb in (1, B):
            inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
            angles = (torch.arange(S).float()[:, None] + torch.rand(S, fb, generator=gen))[..., None] * inv
            freqs = torch.cat([angles, angles], -1)[:, :, None, :]  # [S, fb, 1, D], Megatron's layout
            qkv = torch.randn(S, B, H, 3 * D, generator=gen).to(dtype)
            grad = torch.randn(S, B, H, D, generator=gen).to(dtype)
            ref_t = qkv[..., D:2 * D].clone().requires_grad_(True)
            qkv, grad_ref, grad, ref_freqs, freqs = qkv.to(DEVICE), grad, grad.to(DEVICE), freqs, freqs.to(DEVICE)
            ref = _apply_rotary_pos_emb_bshd(ref_t, ref_freqs)
            ref.backward(grad_ref)
            qkv.requires_grad_(True)
            t = qkv[..., D:2 * D]  # the key's view: not contiguous
            out = apply_rope(t, freqs)
            out.backward(grad)
            assert out.dtype == dtype and out.shape == (S, B, H, D)
            _close(out, ref, tol)
            _close(qkv.grad[..., D:2 * D], ref_t.grad, tol)
            assert (qkv.grad[..., :D] == 0).all() and (qkv.grad[..., 2 * D:] == 0).all()
    # angles whose halves differ: still Megatron's per-column formula
    freqs = torch.rand(S, 1, 1, D, generator=gen) * 6
    ref_t = torch.randn(S, B, H, D, generator=gen, requires_grad=True)
    grad = torch.randn(S, B, H, D, generator=gen)
    t = ref_t.detach().to(DEVICE).requires_grad_(True)
    apply_rope(t, freqs.to(DEVICE)).backward(grad.to(DEVICE))
    ref = _apply_rotary_pos_emb_bshd(ref_t, freqs)
    ref.backward(grad)
    freqs = freqs.to(DEVICE)
    _close(apply_rope(t.detach(), freqs), ref, 1e-5)
    _close(t.grad, ref_t.grad, 1e-5)


FAMILIES = {"logprob_fp32": [check_logprob_fp32_matches_actor, check_logprob_in_place_backward_leaves_no_stale_values],
            "logprob_bf16_tp": [check_logprob_bf16_matches_actor, check_logprob_tp_shards_merge_to_tp1],
            "swiglu": [check_swiglu_matches_torch],
            "rope": [check_rope_matches_megatron]}


@cache
def _children(device: str) -> dict[str, subprocess.Popen]:
    """Every family's child process, started together on first use, on CPU under TRITON_INTERPRET=1
    or compiled on CUDA (one thread each: on CPU they run side by side on the cores)."""
    from conftest import job_env

    env = job_env()
    env.pop("TRITON_INTERPRET", None)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return {family: subprocess.Popen([sys.executable, __file__, family, device], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE) for family in FAMILIES}


@cache
def _child(family: str, device: str = "cpu") -> dict[str, str]:
    """One family's checks, run in its child (:func:`_children`): {check name: "ok" or traceback}."""
    proc = _children(device)[family]
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{stdout}\n{stderr}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("family, check", [(f, c.__name__) for f, cs in FAMILIES.items() for c in cs])
def test_kernel_under_interpreter(family, check):
    """Each check_* above (see its docstring), run by Triton's interpreter in a child process."""
    outcome = _child(family)[check]
    assert outcome == "ok", outcome


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("family, check", [(f, c.__name__) for f, cs in FAMILIES.items() for c in cs])
def test_kernel_on_cuda(family, check):
    """The same checks with the kernels compiled for the CUDA device (references on CPU)."""
    outcome = _child(family, "cuda")[check]
    assert outcome == "ok", outcome


# ---- in-process: no kernel launched ---------------------------------------------------------
def test_cpu_tensors_take_the_torch_path():
    """supported() is False on CPU tensors; SwiGLU(config) then runs the torch formula."""
    from yatt.trainer.fused import logprob, rope, swiglu

    x = torch.randn(3, 8)
    assert not (logprob.supported(x) or rope.supported(x) or swiglu.supported(x))
    torch.testing.assert_close(swiglu.SwiGLU(None)(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])


def test_bad_shapes_raise():
    from yatt.trainer.fused.logprob import logprobs_entropy
    from yatt.trainer.fused.rope import apply_rope
    from yatt.trainer.fused.swiglu import swiglu

    with pytest.raises(ValueError):
        logprobs_entropy(torch.randn(4, 8).t(), torch.zeros(8, dtype=torch.long), 0, 4)  # last dim strided
    with pytest.raises(ValueError):
        logprobs_entropy(torch.randn(4, 8), torch.zeros(5, dtype=torch.long), 0, 8)
    with pytest.raises(ValueError):
        swiglu(torch.randn(2, 7))
    with pytest.raises(ValueError):
        apply_rope(torch.randn(3, 1, 2, 8), torch.randn(3, 1, 1, 4))


def test_combine_over_a_group_equals_merge(monkeypatch):
    """combine's two all-reduces (MAX, then SUM of the rescaled sums) on two ranks, simulated by
    threads over a fake torch.distributed, give merge's result on both ranks."""
    from yatt.trainer.fused import logprob

    barrier, slots = threading.Barrier(2), {}

    class FakeDist:
        ReduceOp = torch.distributed.ReduceOp

        @staticmethod
        def get_world_size(group):
            return 2

        @staticmethod
        def all_reduce(t, op, group):
            rank = threading.current_thread().name
            slots[rank] = t.clone()
            barrier.wait()
            both = torch.stack([slots["0"], slots["1"]])
            t.copy_(both.amax(0) if op == torch.distributed.ReduceOp.MAX else both.sum(0))
            barrier.wait()

    monkeypatch.setattr(logprob, "dist", FakeDist)
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(2, 6, generator=gen) * 5
    s, d, zt = torch.rand(2, 6, generator=gen) + 0.5, torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    results = {}

    def rank(r):
        results[r] = logprob.combine(m[r], s[r], d[r], zt[r], group="tp")

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(2):
        for got, want in zip(results[r], logprob.merge(m, s, d, zt)):
            torch.testing.assert_close(got, want)


if __name__ == "__main__":  # the child: [family, device]; TRITON_INTERPRET=1 set (CPU) before triton is imported
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the actor's reference
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    outcomes = {}
    for fn in FAMILIES[sys.argv[1]]:
        try:
            fn()
            outcomes[fn.__name__] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test
            outcomes[fn.__name__] = traceback.format_exc()
    print(json.dumps(outcomes))
