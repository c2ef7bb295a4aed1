"""DP balancer benchmark: the C++ Karmarkar-Karp kernel against a plain-Python one, same inputs, one run.

    python bench/balance.py [--n 1000000] [--k 64] [--max-tokens 8192]     # ~1.5 min on 2 cores

Reference: the heap-based k-way largest differencing method as RL frameworks ship it in Python
(verl's ``seqlen_balancing.karmarkar_karp``): a heap of partial partitions ordered by spread;
pop the two with the largest spread, pair the largest subset of one with the smallest of the
other, push the result. Empty subsets are kept implicit (a state stores its non-empty subsets)
so that 1M states fit in memory; ties follow the kernel's rules, so both produce the same sums.
Kernel: ``yatt.balance.partition`` (``csrc/partition.cpp``). The fused call
``yatt.balance.dp_balance`` (partition *and* each rank's micro-batches under ``--max-tokens``,
plus the pack/unpack arrays) is timed beside it.

Inputs: long-tailed lengths (Pareto, alpha 1.2, scale 64, capped at 16384; seeded): a demo-sized
step (64 sequences, 2 ranks), a large step (8192 sequences, 8 ranks) and ``--n`` into ``--k``.
Prints times (ms) and imbalance (max/mean part tokens) per case and a final line for the last case:

    speedup_vs_python=<python time / kernel time> imbalance=<kernel max/mean>
"""
from __future__ import annotations

import argparse
import heapq
import random
import time

import numpy as np
from timing import median_time

from yatt.balance import dp_balance, imbalance, partition


def python_kk(costs: list[int], k: int) -> list[list[int]]:
    """k-way Karmarkar-Karp in plain Python (heap of states; the reference)."""
    heap = []
    for seq, i in enumerate(sorted(range(len(costs)), key=lambda i: (costs[i], i))):
        heapq.heappush(heap, (-costs[i], -costs[i], seq, [(costs[i], [i])]))
    seq = len(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        a = a + [(0, [])] * (k - len(a))  # descending, empty subsets last
        b = b + [(0, [])] * (k - len(b))
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))),
                        key=lambda s: -s[0])
        merged = [s for s in merged if s[1]]
        bottom = merged[-1][0] if len(merged) == k else 0
        heapq.heappush(heap, (-(merged[0][0] - bottom), -merged[0][0], seq, merged))
        seq += 1
    parts = [items for _, items in heap[0][3]] if heap else []
    return parts + [[] for _ in range(k - len(parts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8192)
    args = ap.parse_args()
    print(f"{'case':<12}{'n':>9}{'k':>5}{'python ms':>12}{'kernel ms':>12}{'speed-up':>10}"
          f"{'imb python':>12}{'imb kernel':>12}{'fused ms':>11}")
    for name, n, k in (("demo step", 64, 2), ("large step", 8192, 8), ("long tail", args.n, args.k)):
        rng = random.Random(n)
        lengths = [min(int(rng.paretovariate(1.2) * 64), 16384) for _ in range(n)]
        t0 = time.perf_counter()
        ref = python_kk(lengths, k)
        t_python = time.perf_counter() - t0
        array = np.asarray(lengths, dtype=np.int64)
        t_kernel = median_time(lambda: partition(array, k), 3, warmup=False)
        small = n < 100_000  # first calls pay for thread start-up and page faults: warm up, take 3
        t_fused = median_time(lambda: dp_balance(array, k, args.max_tokens), 3 if small else 1, warmup=small)
        imb_python, imb_kernel = imbalance(lengths, ref), imbalance(lengths, partition(array, k))
        print(f"{name:<12}{n:>9}{k:>5}{t_python * 1e3:>12.3f}{t_kernel * 1e3:>12.3f}{t_python / t_kernel:>10.1f}"
              f"{imb_python:>12.7f}{imb_kernel:>12.7f}{t_fused * 1e3:>11.3f}", flush=True)
    print(f"speedup_vs_python={t_python / t_kernel:.1f} imbalance={imb_kernel:.7f}")


if __name__ == "__main__":
    main()
