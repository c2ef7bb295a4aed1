"""The cross-group weight push of ``placement.mode=rollout_apart`` under ``mpirun -np 2``: rank 0
trains (a Megatron policy, no engine), rank 1 samples (a vLLM engine, no trainer).

Checks: (1) :func:`send_weights` / :class:`WeightInbox` bring tensors of mixed dtypes and odd
sizes across bit for bit, each 16-byte aligned in its bucket's buffer, in one bucket or in many;
(2) after each of two optimizer steps and a push through the real path
(:meth:`MegatronPolicy.export_hf_weights` -> send -> :meth:`VLLMEngine.update_weights` from the
inbox), the engine's logprobs of a fixed sequence equal the trainer's (tolerance SYNC_TOL) and
moved since the previous push. Prints "push OK" per rank.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
SYNC_TOL = 1e-4  # as tests/mpi/sync_onpolicy.py: fp32 CPU kernels of a trainer and an engine


def _mixed() -> list[tuple[str, "torch.Tensor"]]:
    import torch

    g = torch.Generator().manual_seed(3)
    return [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c", torch.arange(6, dtype=torch.int64).reshape(2, 3)), ("d", torch.randn(1, generator=g).half()),
            ("e", torch.arange(13, dtype=torch.uint8)), ("f", torch.tensor(2.5, dtype=torch.float64)),
            ("g", torch.randn(4, 9, generator=g).t())]  # not contiguous on the sender


def _roundtrip(rank: int) -> None:
    import torch

    from yatt.placement.push import WeightInbox, send_weights

    sent = _mixed()
    for bucket in (1 << 20, 24):  # one bucket; a bucket per tensor or two
        if rank == 0:
            n, _ = send_weights(iter(sent), [1], bucket)
            assert n == sum(-(-t.nbytes // 16) * 16 for _, t in sent), n
            continue
        got = list(WeightInbox(0))
        assert [k for k, _ in got] == [k for k, _ in sent]
        for (k, a), (_, b) in zip(sent, got):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k
            assert b.data_ptr() % 16 == 0, (k, b.data_ptr())


def main() -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from yatt.algos.estimators import grpo, outcome_advantages
    from yatt.algos.update import compute_logprobs, policy_update
    from yatt.assets.data import load_prompts
    from yatt.config import AlgoConfig, DataConfig
    from yatt.controller.batch import make_mini_batches, make_samples
    from yatt.dist import init_distributed
    from yatt.placement.push import WeightInbox, send_weights
    from yatt.rollout import SamplingSpec, VLLMEngine
    from yatt.rollout.vllm_engine import join_engine_groups, leave_engine_groups
    from yatt.trainer import MegatronPolicy, OptimConfig
    from yatt.trainer.actor import init_parallel_state

    from trainer_tp import tiny_model_dir

    info = init_distributed(threads=1)
    assert info.world_size == 2
    _roundtrip(info.rank)
    path = tiny_model_dir(info.rank, "push_apart", model_type="llama", tied=True)
    tok = AutoTokenizer.from_pretrained(path)
    init_parallel_state(1, 1)  # collective: the sampler too, as yatt.job does on every rank
    trainers = dist.new_group([0])  # collective, as the placement makes it
    rows, _ = load_prompts(DataConfig(train_size=8, seed=5), tok, "train", 0, 1)
    seq = rows[0].prompt_ids + tok("The answer is 12.").input_ids
    if info.rank == 1:  # the sampler
        engine = VLLMEngine(str(path), max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=1)
        completions = engine.generate([r.prompt_ids for r in rows[:2]], SamplingSpec(n=4, max_tokens=24, seed=11))
        dist.broadcast_object_list([completions], src=1)
        before = engine.score([seq])[0]
        for push in range(2):
            engine.update_weights(WeightInbox(0))
            after = engine.score([seq])[0]
            dist.send_object_list([after], dst=0)
            moved = max(abs(x - y) for x, y in zip(after[1:], before[1:]))
            assert moved > 1e-3, f"push {push}: the engine's logprobs did not change ({moved})"
            before = after
        engine.shutdown()
    else:  # the trainer
        join_engine_groups(path)
        actor = MegatronPolicy(path, tp=1, optim=OptimConfig(lr=1e-4, total_steps=4), dp_group=trainers)
        box = [None]
        dist.broadcast_object_list(box, src=1)
        rewards = [float(i % 2) for i in range(8)]  # a guaranteed non-zero update
        samples = make_samples(rows[:2], box[0], rewards, outcome_advantages(grpo, [rewards[:4], rewards[4:]]))
        minis = make_mini_batches(samples, 2, 512, tok.pad_token_id)
        compute_logprobs(actor, None, minis, recompute_old=True)
        for push in range(2):
            policy_update(actor, minis[push:push + 1], AlgoConfig(), trainers)
            send_weights(actor.export_hf_weights(1 << 16), [1], 1 << 16)  # 64 KiB buckets: many
            (trainer, _), = actor.compute_logprobs([{"input_ids": torch.tensor([seq])}])
            box = [None]
            dist.recv_object_list(box, src=1)
            err = float((torch.tensor(box[0])[1:] - trainer[0, 1:]).abs().max())
            assert err < SYNC_TOL, f"push {push}: engine vs trainer logprobs differ by {err}"
            print(f"push {push}: engine vs trainer {err:.2e}", flush=True)
        leave_engine_groups()  # as the sampler's shutdown: later engines build their groups anew
    dist.barrier()
    print("push OK", flush=True)


if __name__ == "__main__":
    from in_one_job import or_abort

    or_abort(main)
