"""Rollout TP under ``mpirun -np 2``: both ranks serve one vLLM engine with TP = 2 (fp32, tiny
random Qwen2 with q/k/v biases, 4 heads / 2 KV heads, SmolLM2's tokenizer) while the trainer
runs TP = ``trainer_tp`` (1: data parallel; 2: the same two ranks).

Checks, each rank with its own, uneven, prompts: (1) every call (generate, generate_stream,
generate_within, score) returns this rank's results only, and the engine's rollout logprobs
equal the trainer's teacher-forced ones (``logprob_diff_rollout_vs_train``, SYNC_TOL); (2) after
one optimizer step the weight sync writes each engine rank's own TP shards
(``export_hf_weights(shard=engine.shard)``, ``update_weights(shards=True)``) and the engine's
logprobs of a fixed sequence equal the trainer's again and moved; (3) full tensors (``yatt.eval``
loading a checkpoint) still load into the TP engine; (4) an expired deadline aborts on both
ranks together (no rank waits for the other); (5) a reward model's pooling engine at TP 2 (a
colocated judge) scores each rank's own items as transformers does. Prints "rollout tp OK" per rank.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SYNC_TOL = 1e-4  # fp32 CPU kernels of two engines: ~2e-5 at TP 1


def main(trainer_tp: str = "1") -> None:
    import torch
    import torch.distributed as dist
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
    rank, t = info.rank, int(trainer_tp)
    path = tiny_model_dir(rank, f"rollout_tp{t}", model_type="qwen2", tied=False)
    tok = AutoTokenizer.from_pretrained(path)
    actor = MegatronPolicy(path, tp=t, optim=OptimConfig(lr=1e-4, total_steps=4))
    engine = VLLMEngine(str(path), tp=2, max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=rank)
    assert engine.shard == (2, rank) and engine.dp_rank == 0, (engine.shard, engine.dp_rank)

    every, _ = load_prompts(DataConfig(train_size=8, seed=5), tok, "train", 0, 1)
    rows = every[:2] if rank == 0 else every[2:3]  # uneven: 2 prompts here, 1 there
    spec = SamplingSpec(n=2, max_tokens=16, seed=11)
    completions = engine.generate([r.prompt_ids for r in rows], spec)
    assert len(completions) == len(rows) and all(len(g) == 2 for g in completions), len(completions)
    streamed = dict(engine.generate_stream([r.prompt_ids for r in rows], spec))
    assert sorted(streamed) == list(range(len(rows))), sorted(streamed)
    assert [[c.token_ids for c in streamed[i]] for i in range(len(rows))] == \
        [[c.token_ids for c in g] for g in completions], "generate_stream sampled other tokens than generate"

    late = engine.generate_within([r.prompt_ids for r in rows], spec, timeout_s=0.0)
    assert len(late) == len(rows) and all(c.finish_reason in ("timeout", "stop", "length") for g in late for c in g)

    rows = every[2 * rank:2 * rank + 2]  # the trainers' DP ranks take equal shares (as the balancer gives them)
    completions = engine.generate([r.prompt_ids for r in rows], spec)
    if t > 1:  # the ranks of one trainer replica train on the same samples: rank 0's
        shared = [(rows, completions)]
        dist.broadcast_object_list(shared, src=0)
        rows, completions = shared[0]
    rewards = [float(i % 2) for i in range(2 * len(rows))]  # a non-zero update on every rank
    samples = make_samples(rows, completions, rewards,
                           outcome_advantages(grpo, [rewards[i:i + 2] for i in range(0, len(rewards), 2)]))
    minis = make_mini_batches(samples, 2 * len(rows), 512, tok.pad_token_id)
    sums = compute_logprobs(actor, None, minis, recompute_old=True)
    diff = sums["logprob_diff_rollout_vs_train"][0] / sums["logprob_diff_rollout_vs_train"][1]
    assert diff < SYNC_TOL, f"rollout vs trainer logprobs differ by {diff}"

    seq = samples[0].prompt_ids + samples[0].response_ids
    before = torch.tensor(engine.score([seq])[0])
    assert engine.score([seq] if rank == 0 else []) == ([before.tolist()] if rank == 0 else [])  # uneven calls
    policy_update(actor, minis, AlgoConfig(), None)
    engine.update_weights(actor.export_hf_weights(shard=engine.shard), shards=True)
    after = torch.tensor(engine.score([seq])[0])
    (trainer, _), = actor.compute_logprobs([{"input_ids": torch.tensor([seq])}])
    sync_err = float((after[1:] - trainer[0, 1:]).abs().max())
    moved = float((after[1:] - before[1:]).abs().max())
    assert sync_err < SYNC_TOL, f"engine vs trainer after the sharded sync: {sync_err}"
    assert moved > 1e-3, f"engine logprobs did not change after the step ({moved})"

    engine.update_weights(actor.export_hf_weights())  # full tensors: vLLM's loaders cut them
    full = torch.tensor(engine.score([seq])[0])
    assert float((full - after).abs().max()) < 1e-6, "full and sharded weights load differently"

    print(f"rank {rank}: trainer tp {t} diff {diff:.2e} sync_err {sync_err:.2e} moved {moved:.3f}", flush=True)
    engine.shutdown()
    _check_reward_model(rank, [r.question for r in (every[:2] if rank == 0 else every[2:3])])
    print("rollout tp OK", flush=True)


def _check_reward_model(rank: int, questions: list[str]) -> None:
    """(5) A colocated judge at rollout TP 2: a reward model's pooling engine over both ranks
    scores each rank's own items (2 here, 1 there) as transformers' model does."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from yatt.reward.genrm import JudgeItem
    from yatt.reward.reward_model import RewardModelScorer

    from trainer_tp import save_tiny_reward_model

    path = Path(tempfile.gettempdir()) / f"yatt_rollout_tp_rm_{os.environ.get('MASTER_PORT', '0')}"
    if rank == 0:
        save_tiny_reward_model(path)
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    dist.barrier()
    rm = RewardModelScorer(str(path), batch_size=4, max_length=256, kv_cache_memory_bytes=32 << 20, tp=2)
    items = [JudgeItem(q, f"<answer>{k}</answer>", "") for k, q in enumerate(questions)]
    got = [r.score for r in rm.score(items)]
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [float(hf(torch.tensor([rm._ids(it)])).logits[0, 0]) for it in items]
    rm.engine.shutdown()
    assert len(got) == len(items) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
    print(f"rank {rank}: reward model at TP 2 scores {got} (transformers {want})", flush=True)


if __name__ == "__main__":
    import sys

    from in_one_job import or_abort

    or_abort(main, *sys.argv[1:])
