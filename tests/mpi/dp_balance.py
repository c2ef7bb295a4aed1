"""DP balancing under mpirun on a tiny random Qwen2 with SmolLM2's tokenizer (fp32): the balanced
layout gives the same logprobs (and, with ``train``, the same gradient) as every rank keeping its
own samples. The property is the layout's (only padding and batching differ between layouts), not
the model's; the real SmolLM2 costs several times as much here and checks nothing more.

    mpirun -np 2 python tests/mpi/dp_balance.py train   # logprobs + one optimizer step, both transports
    mpirun -np 4 python tests/mpi/dp_balance.py         # logprobs, both transports

Every rank holds 8 samples in groups of 2: real prompts from the demo task, responses of random tokens whose
lengths are skewed on purpose (rank 0's are long-tailed and up to 12x longer). Checks:
- both plans (samples one by one, and by group for shared-prompt packing), two transports;
- routing: rollout logprobs and response tokens returned to their owners with ``to_owners`` are
  bit-equal to the owners' own (every sample arrived exactly once, in order);
- the balanced per-rank cost imbalance is lower than the rollout layout's, and near 1;
- the trainer's old logprobs computed on the balanced layout and returned to the owners equal
  those computed on the owners' layout within LOGPROB_ATOL (only the padding/batching differs);
- ``train``: one optimizer step (lr 0, so the weights stay put) on each layout: the global grad
  norm and the token-summed loss statistics agree within GRAD_RTOL.
Prints "dp_balance OK" per rank; asserts otherwise.
"""
from __future__ import annotations

import os
import random
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
LOGPROB_ATOL = 2e-5  # measured 0 on CPU; batch shapes (padding width, rows) may change GPU matmul blocking
GRAD_RTOL = 1e-4     # summation order differs between layouts


def _samples(tok, rank: int, n: int = 8):
    from yatt.assets.data import load_prompts
    from yatt.config import DataConfig
    from yatt.controller.batch import Sample

    rows, _ = load_prompts(DataConfig(train_size=64, seed=3), tok, "train", rank, 8)
    rng = random.Random(rank)
    out = []
    for i in range(n):
        r = rng.randint(60, 240) if rank == 0 and i % 2 == 0 else rng.randint(4, 20)
        resp = [rng.randrange(100, 40000) for _ in range(r)]
        out.append(Sample(rows[i // 2].prompt_ids, resp, [-rng.random() for _ in range(r)],  # groups of 2
                          rng.choice(("stop", "length")), reward=float(i % 2), advantage=rng.uniform(-1, 1)))
    return out


def _response_logprobs(actor, samples, splits, pad_id):
    """Trainer logprobs of every sample's response tokens, as float32 arrays in ``samples`` order."""
    import numpy as np

    from yatt.controller.batch import pack_micro_batches

    out = [None] * len(samples)
    mbs = [mb for split in splits for mb in pack_micro_batches(samples, split, pad_id)]
    for mb, (lp, _) in zip(mbs, actor.compute_logprobs(mbs)):
        for row, i in enumerate(mb["index"].tolist()):
            p, r = len(samples[i].prompt_ids), len(samples[i].response_ids)
            out[i] = lp[row, p:p + r].numpy().astype(np.float32)
    return out


def _own_splits(samples, mini_batches: int, budget: int):
    """The micro-batches (index lists) the loop trains on without balancing."""
    from yatt.controller.batch import make_mini_batches

    return [[mb["index"].tolist() for mb in mbs] for mbs in make_mini_batches(samples, mini_batches, budget, 0)]


def _train_stats(actor, samples, splits, pad_id):
    from yatt.algos.update import compute_logprobs, policy_update
    from yatt.config import AlgoConfig
    from yatt.controller.batch import pack_micro_batches

    minis = [pack_micro_batches(samples, split, pad_id) for split in splits]
    compute_logprobs(actor, None, minis, recompute_old=True)
    out = policy_update(actor, minis[:1], AlgoConfig(), None)
    return {**{k: v[0] for k, v in out.items()}, "tokens": out["pg_loss"][1]}


def main(*args: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from trainer_tp import tiny_model_dir
    from yatt.config import BalanceConfig
    from yatt.controller.rebalance import DpBalancer
    from yatt.dist import init_distributed
    from yatt.trainer import MegatronPolicy, OptimConfig
    from yatt.trainer.actor import init_parallel_state

    train = "train" in args
    info = init_distributed(threads=1)
    init_parallel_state(1, 1)
    path = tiny_model_dir(info.rank, "dp_balance", max_position_embeddings=512)  # sequences up to ~300 tokens
    tok = AutoTokenizer.from_pretrained(path)
    optim = OptimConfig(lr=0.0, min_lr=0.0, total_steps=4) if train else None
    actor = MegatronPolicy(path, tp=1, optim=optim)
    samples, budget, minis = _samples(tok, info.rank), 384, 2
    own = _response_logprobs(actor, samples, _own_splits(samples, minis, budget), tok.pad_token_id)

    for transport, shared in (("auto", False), ("torch", False), ("auto", True)):
        bal = DpBalancer(BalanceConfig(), budget, transport=transport, shared_prompt=shared).balance(samples, minis)
        assert (bal.imbalance_after < bal.imbalance_before and bal.imbalance_after < 1.15), (
            f"imbalance {bal.imbalance_before:.3f} -> {bal.imbalance_after:.3f}")
        back = bal.to_owners([np.array(s.rollout_logprobs, np.float32) for s in bal.samples])
        assert all(np.array_equal(b, np.array(s.rollout_logprobs, np.float32)) for b, s in zip(back, samples))
        back = bal.to_owners([np.array(s.response_ids, np.float32) for s in bal.samples])
        assert all(b.astype(np.int64).tolist() == s.response_ids for b, s in zip(back, samples))
        lps = bal.to_owners(_response_logprobs(actor, bal.samples, bal.splits, tok.pad_token_id))
        err = max(float(np.abs(a - b).max()) for a, b in zip(lps, own))
        assert err < LOGPROB_ATOL, f"{transport}: balanced vs own-layout logprobs differ by {err}"
        print(f"rank {info.rank} {transport}{' by group' if shared else ''}: {len(samples)} -> {len(bal.samples)} samples, imbalance "
              f"{bal.imbalance_before:.3f} -> {bal.imbalance_after:.3f}, logprob err {err:.1e}", flush=True)

    if train:
        base = _train_stats(actor, samples, _own_splits(samples, minis, budget), tok.pad_token_id)
        bal = DpBalancer(BalanceConfig(), budget).balance(samples, minis)
        moved = _train_stats(actor, bal.samples, bal.splits, tok.pad_token_id)
        local = {k: base[k] for k in ("pg_loss", "entropy", "tokens")}
        global_sums = torch.tensor([[local[k], moved[k]] for k in local], dtype=torch.float64)
        dist.all_reduce(global_sums)  # per-rank sums differ by layout; their totals must not
        for (k, (a, b)) in zip(local, global_sums.tolist()):
            assert abs(a - b) <= GRAD_RTOL * max(1.0, abs(a)), f"{k}: {a} vs {b}"
        rel = abs(base["grad_norm"] - moved["grad_norm"]) / base["grad_norm"]
        assert rel < GRAD_RTOL and base["grad_norm"] > 0, f"grad norm {base['grad_norm']} vs {moved['grad_norm']}"
        print(f"rank {info.rank}: grad norm {base['grad_norm']!r} vs {moved['grad_norm']!r} (rel {rel:.1e}); local tokens "
              f"{base['tokens']:.0f} vs {moved['tokens']:.0f}")
    print(f"rank {info.rank}: dp_balance OK", flush=True)
    dist.barrier()


if __name__ == "__main__":
    import torch.distributed as dist

    main(*sys.argv[1:])
    dist.destroy_process_group()  # a gloo group torn down at interpreter exit may abort the process
