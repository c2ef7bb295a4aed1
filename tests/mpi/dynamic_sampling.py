"""DynamicSampler under mpirun -np 2 (no models): the ranks agree on the rounds and trim to the target.

Rank 0 draws one informative group per round, rank 1 never does. With target 3 both ranks run
exactly 2 extra rounds (then 3 informative groups exist, all on rank 0); with target 5 and a cap
of 2 both stop at the cap and train on 3. Prints "dynamic sampling OK" per rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def main() -> None:
    from yatt.controller.dynamic_sampling import DynamicSampler
    from yatt.dist import init_distributed

    info = init_distributed(threads=1)

    def draw(r):
        rewards = [[0.0, 1.0]] if info.rank == 0 else [[1.0, 1.0], [0.0, 0.0]]
        return [(info.rank, r, i) for i in range(len(rewards))], rewards

    for target, cap, want_rounds, want_total, want_hit in ((3, 5, 2, 3, 0), (5, 2, 2, 3, 1), (2, 0, 0, 1, 1)):
        groups, _, stats = DynamicSampler(target, cap).fill(*draw(0), draw)
        total = torch.tensor([len(groups)])
        dist.all_reduce(total)
        assert stats["dynamic_sampling_rounds"][0] == want_rounds, (target, stats)
        assert int(total) == want_total and stats["dynamic_sampling_cap_hit"][0] == want_hit, (target, int(total), stats)
        assert all(g[0] == info.rank for g in groups)
    print(f"rank {info.rank}: dynamic sampling OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()  # a gloo group torn down at interpreter exit may abort the process


if __name__ == "__main__":
    main()
