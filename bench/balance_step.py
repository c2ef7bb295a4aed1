"""What DP balancing costs per step: the balancer's plan + all-to-all-v against building the
same micro-batches from each rank's own samples (no exchange), same samples, one run.

    OMP_NUM_THREADS=1 mpirun -np 2 python bench/balance_step.py [--samples 32] [--repeats 20]

Each rank holds ``--samples`` synthetic samples shaped like the demo's (prompt 50-80 tokens,
response 1-48, long-tailed by rank) split into 2 mini-batches under a 2048-token budget. Prints,
on rank 0, the median seconds of ``DpBalancer.balance`` + packing (over MPI, then over
torch.distributed) and of the local ``make_mini_batches`` split + pack (each call between barriers,
the closing one timed: until the slowest rank is done), the imbalance before/after, and a final line

    balance_overhead_s=<median seconds of the MPI balance> imbalance=<before>-><after>
"""
from __future__ import annotations

import argparse
import random

import numpy as np
import torch.distributed as dist
from timing import median_time

from yatt.config import BalanceConfig
from yatt.controller.batch import Sample, make_mini_batches, pack_micro_batches
from yatt.controller.rebalance import DpBalancer
from yatt.dist import init_distributed


def _samples(rank: int, n: int) -> list[Sample]:
    rng = random.Random(rank)
    out = []
    for _ in range(n):
        r = min(48, int(rng.paretovariate(1.5) * (12 if rank == 0 else 8)))
        out.append(Sample([rng.randrange(49152) for _ in range(rng.randint(50, 80))], [rng.randrange(49152)] * r,
                          [-1.0] * r, "stop", 1.0, 0.5))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    info = init_distributed(threads=1)
    samples = _samples(info.rank, args.samples)

    times, imb = {}, None
    for transport in ("auto", "torch"):
        balancer = DpBalancer(BalanceConfig(), 2048, transport=transport)

        def balanced(b=balancer):
            bal = b.balance(samples, 2)
            return bal, [pack_micro_batches(bal.samples, split, 0) for split in bal.splits]

        times[transport] = median_time(balanced, args.repeats, barrier=dist.barrier)
        imb = imb or balanced()[0]
    times["local"] = median_time(lambda: make_mini_batches(samples, 2, 2048, 0), args.repeats, barrier=dist.barrier)
    if info.rank == 0:
        for name, label in (("auto", "balance (MPI)"), ("torch", "balance (torch.distributed)"), ("local", "own samples")):
            print(f"{label:<30}{times[name] * 1e3:>9.2f} ms")
        tokens = np.sum([s.length for s in samples])
        print(f"{info.world_size} ranks x {args.samples} samples ({tokens} tokens on rank 0), imbalance "
              f"{imb.imbalance_before:.4f} -> {imb.imbalance_after:.4f}")
        print(f"balance_overhead_s={times['auto']:.4f} imbalance={imb.imbalance_before:.4f}->{imb.imbalance_after:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
