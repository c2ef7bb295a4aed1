"""An asynchronous checkpoint whose host copy does not fit in memory on one rank only
(yatt/checkpoint/saver.py): every rank writes that save synchronously, none waits for a peer that
went on (``Checkpointer.wait`` is collective), and the files hold the state at save time.

Rank 0 writes the model shard and sees too little memory; rank 1 writes only its rank file (a DP
copy) and sees plenty. Prints ``checkpoint_memory OK`` per rank (in the shared 2-rank job).
"""
from __future__ import annotations

import shutil
import tempfile
import types


def main(*args: str) -> None:
    import psutil
    import torch
    import torch.distributed as dist

    from yatt.checkpoint.files import step_dir
    from yatt.checkpoint.saver import Checkpointer, load_part
    from yatt.dist import init_distributed

    info = init_distributed(threads=1)
    root = [tempfile.mkdtemp(prefix="yatt_ckpt_mem_") if info.rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    real = psutil.virtual_memory
    if info.rank == 0:  # 1 MiB left, 10% of 10 MiB kept free: the 4 MiB copy does not fit
        psutil.virtual_memory = lambda: types.SimpleNamespace(total=10 << 20, available=1 << 20)
    try:
        w = torch.full((1024, 1024), 1.0)
        ck = Checkpointer(root[0], info.rank, "tp0_pp0" if info.rank == 0 else None)
        for step in (1, 2):
            ck.save(step, {"w": w} if info.rank == 0 else None, {} if info.rank == 0 else None,
                    {"step": step}, {"world": 2, "tp": 1, "pp": 1})
            assert ck.committed == step_dir(root[0], step), (info.rank, ck.committed)  # written when save returns
            w.add_(1.0)  # the update after the save: not in its files
        assert ck.snapshot.held_bytes() == 0
        if info.rank == 0:
            assert torch.equal(load_part(step_dir(root[0], 2), "model", "tp0_pp0")["w"], torch.full((1024, 1024), 2.0))
    finally:
        psutil.virtual_memory = real
    print(f"rank {info.rank}: checkpoint_memory OK", flush=True)
    dist.barrier()
    if info.rank == 0:
        shutil.rmtree(root[0])
