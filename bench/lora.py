"""LoRA against full fine-tuning on the Megatron trainer: train-step time and trained state, one process.

    python bench/lora.py [--model smollm2-135m-instruct] [--rank 16] [--rounds 4] [--dtype float32]

Builds the policy twice in this process (world 1, TP 1): full fine-tuning and ``trainer.lora``
with ``--rank`` (alpha 2 x rank, every target), and times ``train_step`` on the same micro-batches
(4 x 8 rows of 96 tokens, a GRPO-shaped policy-gradient loss), the two alternating for
``--rounds`` rounds after one warm-up step each. Prints per-step seconds (median) and

    lora_vs_full_train_step=<LoRA step / full step>
    lora_trained_params=<n> full_trained_params=<n>
    lora_state_gb=<GB> full_state_gb=<GB>

where the state is what training adds to the weights: the gradient buffer and AdamW's moments
(and fp32 main parameters in bf16), read from the optimizer and the DDP buffers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def trained_state_bytes(policy) -> int:
    """Bytes of the gradient buffers and the optimizer's state tensors of ``policy``."""
    import torch

    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in policy.model.buffers)
    state = 0
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for s in inner.state.values():
            state += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
        for group in getattr(opt, "fp32_from_float16_groups", []):  # bf16: fp32 main parameters
            state += sum(p.numel() * 4 for p in group)
    return grads + state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch

    from yatt.assets.model import resolve_model
    from yatt.dist import init_distributed
    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.lora import LoraSpec

    init_distributed()
    path, dtype = resolve_model(args.model), getattr(torch, args.dtype)
    optim = OptimConfig(lr=1e-5, total_steps=args.rounds + 1)
    policies = {"full": MegatronPolicy(path, optim=optim, dtype=dtype),
                "lora": MegatronPolicy(path, optim=optim, dtype=dtype,
                                       lora=LoraSpec(rank=args.rank, alpha=2.0 * args.rank))}
    gen = torch.Generator().manual_seed(0)
    vocab = policies["full"].layout.vocab_size
    mbs = []
    for _ in range(4):
        mask = torch.zeros(8, 96)
        mask[:, 32:] = 1.0  # 32 prompt tokens, 64 response tokens
        mbs.append({"input_ids": torch.randint(0, vocab, (8, 96), generator=gen), "mask": mask,
                    "advantages": torch.randn(8, 1, generator=gen).expand(8, 96).contiguous()})

    def pg_loss(logprobs, entropy, mb):
        loss = -(logprobs * mb["mask"] * mb["advantages"]).sum() / mb["mask"].sum()
        return loss, {"loss": loss.detach()}

    times = {name: [] for name in policies}
    for k in range(args.rounds + 1):
        for name, policy in policies.items():
            t0 = time.perf_counter()
            policy.train_step(mbs, pg_loss)
            if k:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, policy in policies.items():
        n = sum(p.numel() for p in policy.module.parameters() if p.requires_grad)
        print(f"{name}: train step {med[name]:.3f} s (rounds {', '.join(f'{t:.3f}' for t in times[name])}), "
              f"{n} trained parameters, {trained_state_bytes(policy) / 1e9:.3f} GB of gradients and optimizer state")
    print(f"lora_vs_full_train_step={med['lora'] / med['full']:.3f}")
    print(" ".join(f"{name}_trained_params={sum(p.numel() for p in pol.module.parameters() if p.requires_grad)}"
                   for name, pol in (("lora", policies["lora"]), ("full", policies["full"]))))
    print(f"lora_state_gb={trained_state_bytes(policies['lora']) / 1e9:.3f} "
          f"full_state_gb={trained_state_bytes(policies['full']) / 1e9:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
