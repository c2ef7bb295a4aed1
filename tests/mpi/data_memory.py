"""Under ``mpirun -np 4``: rank 0's peak memory for the data path does not grow with the world
size at a fixed per-rank batch, nor with the dataset size.

Usage: mpirun -np 4 python tests/mpi/data_memory.py

Rank 0 writes a jsonl and a parquet file of reasoning-gym rows, SMALL and BIG (8x) rows. The
data path, per world size 1, 2 and 4 (sub-communicators of the first ranks): open the streaming
train shard (:class:`~yatt.assets.data.PromptStream`, real SmolLM2 tokenizer), draw ``STEPS``
batches of ``PER_RANK`` prompts, build samples-like metadata (``N`` responses per prompt:
lengths, rewards) and share only scalars (allreduce) and the lengths (allgather of int32). Rank
0's peak Python heap over that path (tracemalloc, above the heap before it) must stay within
``TOL`` of the 1-rank, SMALL-file peak. Prints the peaks and ``OK`` on rank 0.
"""
import gc
import json
import os
import random
import sys
import tempfile
import tracemalloc

import numpy as np
from mpi4py import MPI

SMALL, BIG = 4000, 32000  # rows in the file; far more than the STEPS * PER_RANK drawn per rank
PER_RANK, STEPS, N, BUFFER = 32, 3, 4, 256
TOL = (1.05, 64 << 10)  # allowed: 5% plus 64 KiB over the reference peak (a gathered global batch: ~250 KiB)


def write_files(folder: str) -> dict[tuple[str, int], str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import reasoning_gym as rg

    ds = rg.create_dataset("basic_arithmetic", size=SMALL, seed=0)
    base = [ds[i] for i in range(SMALL)]
    paths = {}
    for rows in (SMALL, BIG):
        table = [{**base[i % SMALL], "id": i} for i in range(rows)]
        paths["jsonl", rows] = os.path.join(folder, f"{rows}.jsonl")
        with open(paths["jsonl", rows], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in table)
        paths["parquet", rows] = os.path.join(folder, f"{rows}.parquet")
        pq.write_table(pa.Table.from_pylist(table), paths["parquet", rows], row_group_size=1024)
    return paths


def data_path(comm, path: str, tokenizer) -> int:
    """Run the data path on ``comm``; the peak of traced memory above the start, in bytes."""
    from yatt.assets.data import PromptStream
    from yatt.config import DataConfig
    from yatt.controller.shard import PromptShard

    gc.collect()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    cfg = DataConfig(source="file", train_files=[path], max_prompt_len=256)
    shard = PromptShard(PromptStream(cfg, tokenizer, comm.rank, comm.size, BUFFER), PER_RANK, seed=7919 + comm.rank)
    rng = random.Random(comm.rank)
    for _ in range(STEPS):
        rows = shard.next_batch()
        lengths = np.array([len(r.prompt_ids) + rng.randrange(1, 64) for r in rows for _ in range(N)], np.int32)
        rewards = [float(rng.random() < 0.5) for _ in range(len(lengths))]
        sums = comm.allreduce(np.array([sum(rewards), len(rewards), int(lengths.sum())], np.float64), op=MPI.SUM)
        every = np.empty(comm.size * len(lengths), np.int32)
        comm.Allgather(lengths, every)
        assert sums[1] == comm.size * PER_RANK * N and every.sum() == sums[2]
    assert shard.source.stats.kept == STEPS * PER_RANK
    peak = tracemalloc.get_traced_memory()[1] - start
    del shard, rows, lengths, rewards, every
    return peak


def main() -> None:
    from transformers import AutoTokenizer

    from yatt.assets.model import resolve_model
    from yatt.dist import mpi_arrive  # ranks wait asleep, not spinning, for rank 0's files and the subgroups

    world = MPI.COMM_WORLD
    assert world.size == 4, "run with mpirun -np 4"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    folder = world.bcast(tempfile.mkdtemp(prefix="yatt_data_mem_") if world.rank == 0 else None)
    files = write_files(folder) if world.rank == 0 else None
    mpi_arrive(world)
    paths = world.bcast(files)
    tracemalloc.start()
    peaks = {}
    runs = [("jsonl", SMALL, 1)] + [(fmt, rows, n) for fmt in ("jsonl", "parquet") for rows, n in
                                    ((SMALL, 1), (BIG, 1), (BIG, 2), (BIG, 4))]
    for i, (fmt, rows, n) in enumerate(runs):
        comm = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
        if comm != MPI.COMM_NULL:
            peak = data_path(comm, paths[fmt, rows], tokenizer)
            if i:  # the first run warms caches (chat template, imports) and is not counted
                peaks[fmt, rows, n] = peak
            comm.Free()
        mpi_arrive(world)
    tracemalloc.stop()  # it slows every allocation (later scripts of tests/mpi/in_one_job.py)
    if world.rank == 0:
        for key, peak in peaks.items():
            print("peak %-7s rows %5d ranks %d: %7.1f KiB" % (*key, peak / 1024))
        for fmt in ("jsonl", "parquet"):
            ref = peaks[fmt, SMALL, 1]
            for key in ((fmt, BIG, 1), (fmt, BIG, 2), (fmt, BIG, 4)):
                assert peaks[key] <= ref * TOL[0] + TOL[1], f"{key}: {peaks[key]} B vs {ref} B at 1 rank, {SMALL} rows"
        for path in paths.values():
            os.remove(path)
        os.rmdir(folder)
        print("data memory OK")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
