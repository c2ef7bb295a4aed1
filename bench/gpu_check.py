"""GPU check of the Megatron trainer, in one run (bench/gpu_check.sh runs it after the CUDA build).

    python bench/gpu_check.py [--dtype bfloat16]

On the current device (CUDA when there is one; else the CPU, a dry run of the same code), with
NCCL (CUDA) or gloo as torch.distributed's backend, world 1: for a tiny random Llama in SmolLM2's
layout (tied embeddings) and a tiny random Qwen2 (QKV bias, vocab padding):

1. the policy's logprobs in ``--dtype`` against transformers' in fp32 on the CPU (max |diff|);
2. one training step: its grad norm against transformers' autograd (relative diff);
3. ``trainer.packing``'s packed and shared-prompt layouts against padded rows, fp32 (max |diff|,
   asserted within the tests' tolerance): the explicit-mask path of ``yatt.trainer.packing``;
   Transformer Engine's THD path is not written (see docs/concepts.md, DP balancing: micro-batches).

Final line: ``gpu_check device=<cuda|cpu> dtype=<...> logprob_max_diff=<...>
grad_norm_rel_diff=<...> packed_max_diff=<...>``; exits 1 when a value is over its tolerance.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "mpi")]
import trainer_tp as ref  # noqa: E402  (the tests' tiny models and references)

# bf16 logits carry ~3 significant digits: logprobs of tiny random models (|logprob| ~ 5) differ by
# up to ~0.05; fp32 matches to 1e-4 (tests/test_trainer.py)
TOLERANCE = {"bfloat16": {"logprob": 0.1, "grad_norm": 0.05}, "float32": {"logprob": 1e-4, "grad_norm": 5e-4}}


def check(model_type: str, dtype: torch.dtype, tmp: Path) -> tuple[float, float, float]:
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    folder = tmp / model_type
    shape = ref.SMOL_SHAPE if model_type == "llama" else {}
    hf = ref.save_tiny_hf(folder, model_type, vocab_size=99 if model_type == "llama" else 100,
                          tied=model_type == "llama", **shape)
    policy = MegatronPolicy(folder, dtype=dtype, optim=OptimConfig(lr=1e-5, total_steps=2))
    mbs = ref.padded_micro_batches([[14, 9], [11, 6]], vocab=99, seed=2)
    lp_diff = 0.0
    for (lp, _), mb in zip(policy.compute_logprobs(mbs), mbs):
        with torch.no_grad():
            want, _ = ref.hf_logprobs_entropy(hf, mb["input_ids"])
        lp_diff = max(lp_diff, float(((lp.cpu() - want) * (mb["mask"] > 0)).abs().max()))
    want_norm = ref.hf_grad_norm(hf, mbs, ref.sum_logprob_loss)
    norm = policy.train_step(mbs, ref.sum_logprob_loss, skip_update=lambda n: True)["grad_norm"]
    # fp32: the layouts must agree to rounding (asserts ref.PACKING_ATOL)
    packed = ref.packed_vs_padded(MegatronPolicy(folder, optim=OptimConfig(lr=1e-5, total_steps=2)), 0, model_type)
    rel = abs(norm - want_norm) / want_norm
    print(f"{model_type}: logprob max|diff| {lp_diff:.2e}, grad norm {norm:.6f} vs {want_norm:.6f} "
          f"(rel {rel:.1e})", flush=True)
    return lp_diff, rel, packed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                    choices=sorted(TOLERANCE))
    args = ap.parse_args()
    from yatt.dist import init_distributed

    info = init_distributed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"world {info.world_size}, device {device}, backend {torch.distributed.get_backend()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = [check(m, getattr(torch, args.dtype), Path(tmp)) for m in ("llama", "qwen2")]
    lp, rel, packed = (max(r[i] for r in results) for i in range(3))
    print(f"gpu_check device={device} dtype={args.dtype} logprob_max_diff={lp:.2e} grad_norm_rel_diff={rel:.1e} "
          f"packed_max_diff={packed:.1e}", flush=True)
    tol = TOLERANCE[args.dtype]
    return int(lp > tol["logprob"] or rel > tol["grad_norm"])


if __name__ == "__main__":
    sys.exit(main())
