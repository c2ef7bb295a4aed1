"""Trainer <-> engine under ``mpirun -np 2`` (DP=2), fp32, on a tiny random Llama in SmolLM2's
architecture (tied embeddings, SmolLM2's tokenizer; the demo runs of test_e2e check SmolLM2 itself:
logprob_diff_rollout_vs_train < 1e-3 at every step).

Checks: (1) before any update the trainer's logprobs equal the engine's rollout logprobs;
(2) the first (on-policy) mini-batch has ratio exactly 1 and clip_frac 0; (3) after one
optimizer step and an in-place sync, the engine's logprobs of a fixed sequence equal the
trainer's (tolerance SYNC_TOL) and differ from before the step. Prints "sync OK" per rank.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SYNC_TOL = 1e-4  # measured ~2e-5 (fp32 CPU kernels of two engines)


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from yatt.algos.estimators import grpo, outcome_advantages
    from yatt.algos.update import compute_logprobs, policy_update
    from yatt.assets.data import load_prompts
    from yatt.config import AlgoConfig, DataConfig
    from yatt.controller.batch import make_mini_batches, make_samples
    from yatt.dist import init_distributed
    from yatt.rollout import SamplingSpec, VLLMEngine
    from yatt.trainer import MegatronPolicy, OptimConfig

    from trainer_tp import tiny_model_dir

    info = init_distributed(threads=1)
    path = tiny_model_dir(info.rank, "sync_onpolicy", model_type="llama", tied=True)
    tok = AutoTokenizer.from_pretrained(path)
    actor = MegatronPolicy(path, tp=1, optim=OptimConfig(lr=1e-5, total_steps=4))
    engine = VLLMEngine(str(path), max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=info.rank)

    rows, _ = load_prompts(DataConfig(train_size=8, seed=5), tok, "train", info.rank, info.world_size)
    rows = rows[:2]
    completions = engine.generate([r.prompt_ids for r in rows], SamplingSpec(n=4, max_tokens=24, seed=11))
    rewards = [float(i % 2) for i in range(len(rows) * 4)]  # a guaranteed non-zero update
    samples = make_samples(rows, completions, rewards, outcome_advantages(grpo, [rewards[i:i + 4] for i in (0, 4)]))
    minis = make_mini_batches(samples, 2, 512, tok.pad_token_id)

    sums = compute_logprobs(actor, None, minis, recompute_old=True)
    diff = sums["logprob_diff_rollout_vs_train"][0] / sums["logprob_diff_rollout_vs_train"][1]
    assert diff < SYNC_TOL, f"rollout vs trainer logprobs differ by {diff}"

    seq = samples[0].prompt_ids + samples[0].response_ids
    before = torch.tensor(engine.score([seq])[0])
    out = policy_update(actor, minis[:1], AlgoConfig(), None)
    ratio, clip = out["ratio"][0] / out["ratio"][1], out["clip_frac"][0] / out["clip_frac"][1]
    assert abs(ratio - 1.0) < 1e-6 and clip == 0.0, f"on-policy ratio {ratio}, clip_frac {clip}"

    engine.update_weights(actor.export_hf_weights())
    after = torch.tensor(engine.score([seq])[0])
    (trainer, _), = actor.compute_logprobs([{"input_ids": torch.tensor([seq])}])
    sync_err = float((after[1:] - trainer[0, 1:]).abs().max())
    moved = float((after[1:] - before[1:]).abs().max())
    assert sync_err < SYNC_TOL, f"engine vs trainer after sync: {sync_err}"
    assert moved > 1e-3, f"engine logprobs did not change after the step ({moved})"
    print(f"rank {info.rank}: diff {diff:.2e} ratio {ratio:.8f} sync_err {sync_err:.2e} moved {moved:.3f}")
    engine.shutdown()
    print("sync OK", flush=True)


if __name__ == "__main__":
    from in_one_job import or_abort

    or_abort(main)
