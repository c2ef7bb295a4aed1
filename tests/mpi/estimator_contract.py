"""The contract of every registered advantage estimator, on 2 ranks with DP balancing.

    mpirun -np 2 python tests/mpi/estimator_contract.py

For each name in ``yatt.algos.estimators.ESTIMATORS`` the same step (6 prompts x 3 responses of
mixed lengths, equal-reward groups among them) runs two ways in one job:

- on one rank: every group on this rank, no balancing (a process group of one rank);
- on two ranks: each rank owns half the groups (its outcome stage runs on whole groups, as in the
  step loop), the DP balancer moves samples across the ranks, then the token stage (REINFORCE++'s
  or GAE's) runs with its whitening reduced over both ranks.

The per-token inputs a token stage reads (old and reference logprobs, the critic's values) travel
with the samples as fields of a Sample subclass, as a new field would. Each sample's advantages
must be finite, 0 outside its response, ``[B, 1]`` (outcome) or ``[B, T]`` (token), and equal on
both ways to 1e-6. Prints ``[rank r] estimator <name> OK`` per estimator, then ``contract OK``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

G, N, TOL = 6, 3, 1e-6


def _sample_type():
    from yatt.controller import wire
    from yatt.controller.batch import Sample

    @dataclass
    class StepSample(Sample):
        uid: float = field(default=0.0, metadata=wire.SCALAR)  # the sample's index in the step
        old_lp: list[float] = field(default_factory=list, metadata=wire.PER_TOKEN)
        ref_lp: list[float] = field(default_factory=list, metadata=wire.PER_TOKEN)
        value: list[float] = field(default_factory=list, metadata=wire.PER_TOKEN)

    return StepSample


def _step(cls):
    """The step's groups: (rows, completions, rewards) and each sample's per-token inputs, the
    same on every rank."""
    gen = torch.Generator().manual_seed(11)
    rewards = [[1.0, 0.0, 1.0], [0.5, 0.5, 0.5], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.2, 0.9, 0.4], [0.0, 0.0, 0.0]]
    samples = []
    for g in range(G):
        prompt = torch.randint(3, 90, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
        for k in range(N):
            r = int(torch.randint(1, 9, (1,), generator=gen))
            per_token = torch.randn(3, r, generator=gen) * 0.3
            samples.append(cls(prompt, torch.randint(3, 90, (r,), generator=gen).tolist(),
                               (per_token[0] - 1.0).tolist(), "stop" if k else "length", uid=float(g * N + k),
                               old_lp=(per_token[0] - 1.0).tolist(), ref_lp=(per_token[0] - 1.1 + per_token[1] * 0.1).tolist(),
                               value=per_token[2].tolist()))
    return samples, rewards


def _outcome(samples, rewards, name):
    from yatt.algos.estimators import advantages, get_estimator

    adv = advantages(get_estimator(name), torch.tensor(rewards, dtype=torch.float32)).flatten().tolist()
    flat = [x for r in rewards for x in r]
    for s in samples:
        i = int(s.uid)
        s.reward, s.advantage = flat[i], adv[i]


def _token_inputs(mbs, samples) -> None:
    """Per-token fields of the packed samples -> old/ref logprobs and values ``[B, T]``."""
    for mb in mbs:
        shape = mb["input_ids"].shape
        old, ref, val = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        for b, i in enumerate(mb["index"].tolist()):
            s = samples[i]
            p, r = len(s.prompt_ids), len(s.response_ids)
            old[b, p:p + r], ref[b, p:p + r], val[b, p:p + r] = (torch.tensor(x) for x in (s.old_lp, s.ref_lp, s.value))
        mb.update(old_logprobs=old, ref_logprobs=ref, values=val)


def _advantages_by_uid(name, samples, group, balancer):
    """(``uid -> advantages over the response tokens`` of this rank's samples after the full
    step, the uids of the samples it trained on)."""
    from yatt.algos.update import finish_advantages
    from yatt.config import AlgoConfig
    from yatt.controller.batch import pack_micro_batches

    if balancer is not None:
        bal = balancer.balance(samples, 1)
        samples, mbs = bal.samples, [pack_micro_batches(bal.samples, split, 0) for split in bal.splits]
    else:
        mbs = [pack_micro_batches(samples, [list(range(len(samples)))], 0)]
    flat = [mb for m in mbs for mb in m]
    _token_inputs(flat, samples)
    kl = 0.05 if name.startswith("reinforce_pp") or name == "gae" else 0.0
    extra = {"lam": 0.9} if name == "gae" else {}
    finish_advantages(mbs, AlgoConfig(estimator=name, kl_in_reward=kl, gamma=0.99, **extra), group)
    out = {}
    for mb in flat:
        adv, mask = mb["advantages"], mb["response_mask"]
        assert adv.shape in ((mask.shape[0], 1), mask.shape), (name, adv.shape)
        assert torch.isfinite(adv).all(), name
        full = adv.expand_as(mask) * mask
        if adv.shape == mask.shape:
            assert adv[mask == 0].eq(0).all(), f"{name}: advantage outside the response"
        for b, i in enumerate(mb["index"].tolist()):
            out[int(samples[i].uid)] = full[b][mask[b] > 0]
    return out, [int(s.uid) for s in samples]


def main() -> int:
    import torch.distributed as dist

    from yatt.algos.estimators import ESTIMATORS
    from yatt.config import BalanceConfig
    from yatt.controller.rebalance import DpBalancer
    from yatt.dist import init_distributed

    info = init_distributed(threads=1)
    assert info.world_size == 2, "mpirun -np 2"
    alone = [dist.new_group([r]) for r in range(2)][info.rank]  # collective: every rank creates both
    cls = _sample_type()
    balancer = DpBalancer(BalanceConfig(), 64, None, sample_type=cls)
    for name in sorted(ESTIMATORS):
        samples, rewards = _step(cls)
        _outcome(samples, rewards, name)
        reference, _ = _advantages_by_uid(name, samples, alone, None)
        mine = [s for s in samples if (int(s.uid) // N) % 2 == info.rank]  # the groups this rank owns
        shard, trained = _advantages_by_uid(name, mine, None, balancer)
        every = [None, None]
        dist.all_gather_object(every, {k: v.tolist() for k, v in shard.items()})
        merged = {k: torch.tensor(v) for part in every for k, v in part.items()}
        assert sorted(merged) == list(range(G * N)), (name, sorted(merged))
        diff = max((merged[k] - reference[k]).abs().max().item() for k in merged)
        assert diff <= TOL, (name, diff)
        moved = sum(uid // N % 2 != info.rank for uid in trained)
        print(f"[rank {info.rank}] estimator {name} OK: 2 ranks vs 1 max|diff| {diff:.1e}, "
              f"{moved} samples balanced in from the other rank", flush=True)
    print(f"[rank {info.rank}] contract OK", flush=True)
    return 0


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `import yatt`
    sys.exit(main())
