"""Train-phase arithmetic speed against a plain matmul of the same machine, in one process.

    python bench/train_flops.py [--threads 1] [--repeats 3] [--packing shared_prompt] [--response-len 40]

Builds the demo's policy (SmolLM2-135M-Instruct, Megatron-Core, TP=1, fp32) and one rank's share of
a demo step: 4 of the demo's prompts x 8 responses (random tokens of ``--response-len``), two
mini-batches packed as the recipe packs them (``trainer.packing``, ``trainer.micro_batch_tokens``).
Times, after one untimed warm-up, the logprob pass (forward) and the policy update (forward,
backward, AdamW: ``policy_update``), median of ``--repeats``, and a plain fp32 matmul in the shape
of the model's MLP (``[2048, hidden] x [hidden, ffn]``, ``torch.mm``) on the same threads.

Model FLOPs count the work the update needs, not what a kernel happens to do: ``2 x P x T``
forward and ``6 x P x T`` for forward + backward, with ``P`` the matmul parameters (the layers'
and the output layer's, no embedding lookup) and ``T`` the distinct tokens of the packing (with
``shared_prompt`` each group's prompt once), plus causal attention (``2 x layers x hidden x
sum(len^2)`` forward, 3x that with backward). Prints GFLOP/s of each and the final line

    train_vs_matmul=<update GFLOP/s over matmul GFLOP/s> logprob_vs_matmul=<...>
"""
from __future__ import annotations

import argparse
import os
import random
import time
from types import SimpleNamespace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--packing", default=None, help="trainer.packing (default: the recipe's)")
    ap.add_argument("--response-len", type=int, default=40)
    ap.add_argument("--config", default="configs/grpo_smollm2.yaml")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from timing import median_time
    from yatt.algos.update import compute_logprobs, policy_update
    from yatt.assets.data import load_prompts
    from yatt.assets.model import resolve_model
    from yatt.config import load_config
    from yatt.controller.batch import make_mini_batches, make_samples
    from yatt.dist import init_distributed
    from yatt.trainer import MegatronPolicy, OptimConfig

    cfg = load_config(args.config, [f"trainer.packing={args.packing}"] if args.packing else [])
    init_distributed(threads=args.threads)
    path = resolve_model(cfg.model.path)
    hf, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    actor = MegatronPolicy(path, optim=OptimConfig(lr=1e-6, total_steps=100))

    rows, _ = load_prompts(cfg.data, tok, "train")
    rows, n, rng = rows[:cfg.trainer.prompts_per_rank], cfg.rollout.n, random.Random(0)
    completions = [[SimpleNamespace(token_ids=[rng.randrange(1000, hf.vocab_size) for _ in range(args.response_len)],
                                    logprobs=[0.0] * args.response_len, finish_reason="length") for _ in range(n)]
                   for _ in rows]
    advantages = [rng.choice((-1.0, 1.0)) for _ in range(len(rows) * n)]  # every sample trains
    samples = make_samples(rows, completions, [0.0] * len(advantages), advantages)
    minis = make_mini_batches(samples, cfg.algo.mini_batches, cfg.trainer.micro_batch_tokens, tok.pad_token_id,
                              packing=cfg.trainer.packing)

    h, layers, ffn = hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size
    kv = h * hf.num_key_value_heads // hf.num_attention_heads
    p_matmul = layers * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + h * hf.vocab_size
    prompts_once = cfg.trainer.packing == "shared_prompt"
    tokens = sum(len(r.prompt_ids) * (1 if prompts_once else n) + n * args.response_len for r in rows)
    lengths = [len(r.prompt_ids) + args.response_len for r in rows for _ in range(n)]
    attn_fwd = 2 * layers * h * sum(s * s for s in lengths)
    fwd_flops = 2 * p_matmul * tokens + attn_fwd

    logprob_s = median_time(lambda: compute_logprobs(actor, None, minis, recompute_old=True), args.repeats)
    update_s = median_time(lambda: policy_update(actor, minis, cfg.algo, None), args.repeats)

    a, b = torch.randn(2048, h), torch.randn(h, ffn)
    mm_s = median_time(lambda: torch.mm(a, b), max(5, args.repeats))
    mm_gflops = 2 * 2048 * h * ffn / mm_s / 1e9
    lp_gflops, up_gflops = fwd_flops / logprob_s / 1e9, 3 * fwd_flops / update_s / 1e9
    print(f"{cfg.model.path}: {len(samples)} samples, {tokens} distinct tokens ({cfg.trainer.packing}), "
          f"{torch.get_num_threads()} thread(s), {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"logprob pass: {logprob_s:.2f} s, {lp_gflops:.1f} GFLOP/s")
    print(f"policy update: {update_s:.2f} s, {up_gflops:.1f} GFLOP/s (forward + backward + AdamW)")
    print(f"matmul [2048x{h}]x[{h}x{ffn}]: {mm_s * 1e3:.2f} ms, {mm_gflops:.1f} GFLOP/s")
    print(f"train_vs_matmul={up_gflops / mm_gflops:.3f} logprob_vs_matmul={lp_gflops / mm_gflops:.3f}")


if __name__ == "__main__":
    main()
