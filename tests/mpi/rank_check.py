"""One rank of a rank-discovery check, under any launcher (mpirun, torchrun, a stand-in srun).

Discovers its rank as ``python -m yatt.launch`` does (a launcher required), initialises
torch.distributed, and prints one JSON line: its RankInfo and the all-reduced sum of the ranks,
which only a correctly formed world of ``world_size`` processes gives as ``n (n - 1) / 2``.
"""
import json
import os

import torch
import torch.distributed as dist

from yatt.dist import discover, init_distributed

if __name__ == "__main__":
    info = discover(require_launcher=True)
    assert init_distributed(threads=1) == info
    total = torch.tensor([info.rank])
    dist.all_reduce(total)
    print(json.dumps({**info.__dict__, "rank_sum": int(total), "env_rank": os.environ["RANK"]}), flush=True)
    dist.destroy_process_group()
