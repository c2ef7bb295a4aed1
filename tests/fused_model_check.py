"""Child process of tests/test_fused_model.py (TRITON_INTERPRET=1 set before triton loads): a tiny
Megatron policy built with the fused kernels wired in (the CUDA wiring of yatt.trainer.model and
the logprob dispatch of yatt.trainer.actor, here on CPU tensors through Triton's interpreter) gives
the logprobs, entropies and grad norm of the policy built without them. Prints one JSON line."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
import trainer_tp as ref  # noqa: E402


def run(folder, mbs) -> tuple[list, float]:
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    policy = MegatronPolicy(folder, optim=OptimConfig(lr=1e-5, total_steps=2))
    out = policy.compute_logprobs(mbs)
    norm = policy.train_step(mbs, ref.sum_logprob_loss, skip_update=lambda n: True)["grad_norm"]
    return out, norm, policy


def main() -> None:
    from yatt.dist import init_distributed
    from yatt.trainer import model
    from yatt.trainer.fused import logprob, rope, swiglu

    init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_tiny_hf(tmp, "llama", vocab_size=99, tied=True, **ref.SMOL_SHAPE)
        mbs = ref.padded_micro_batches([[14, 9], [11, 6]], vocab=99, seed=2)
        plain, plain_norm, _ = run(tmp, mbs)
        calls = {"rope": 0, "logprob": 0}
        apply_rope, logprobs_entropy = rope.apply_rope, logprob.logprobs_entropy

        def counted_rope(t, freqs):
            calls["rope"] += 1
            return apply_rope(t, freqs)

        def counted_logprob(*args):
            calls["logprob"] += 1
            return logprobs_entropy(*args)

        rope.apply_rope, logprob.logprobs_entropy = counted_rope, counted_logprob
        for module in (logprob, rope, swiglu):
            module.supported = lambda t: True  # the interpreter runs the kernels on CPU tensors
        model.fuse_elementwise = lambda: True
        fused, fused_norm, policy = run(tmp, mbs)
    activation = type(policy.module.decoder.layers[0].mlp.activation_func).__name__
    diff = max(float((a - b).abs().max()) for pa, pb in zip(plain, fused) for a, b in zip(pa, pb))
    print(json.dumps({"max_diff": diff, "norm": [plain_norm, fused_norm], "calls": calls, "activation": activation}),
          flush=True)


if __name__ == "__main__":
    main()
