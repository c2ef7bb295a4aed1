"""Weight-sync benchmark: the bucketed reshard against a per-tensor export, trainer TP=2 (or 1)
into TP=1 vLLM engines, same process, same weights.

    OMP_NUM_THREADS=1 .venv/bin/mpirun -np 2 .venv/bin/python bench/sync.py [--model NAME] [--tp 2] [--repeats 3]

Default model: the GenRM judge Qwen2.5-Coder-0.5B (fp32; 2 KV heads allow TP=2; QKV bias; ~2 GB).
The trainer is a frozen ``MegatronPolicy(tp=--tp)``; each rank has its own TP=1 engine
(``--model smollm2-135m-instruct --tp 1`` is the demo's layout). Reference: the
straightforward export (``yatt.reshard.reference``: one ``all_gather`` per TP-split parameter,
then plain torch slicing and concatenation into HF tensors). Times are medians of ``--repeats`` runs
between barriers: the export alone (iterating the tensors) and the export streamed into
``VLLMEngine.update_weights``. Final line:

    bucketed_vs_per_tensor=<per-tensor time / bucketed time, export + engine load>

Run it through ``mpirun`` from the repository root (``yatt.launch`` is not involved, so the
huge-page setting that ``yatt.launch`` makes is made here too, before torch allocates).
"""
from __future__ import annotations

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as yatt.launch does, before torch allocates

import argparse  # noqa: E402
from functools import partial  # noqa: E402

import torch.distributed as dist  # noqa: E402
from timing import median_time  # noqa: E402

timed = partial(median_time, barrier=dist.barrier)  # a warm-up run, then repeats between barriers


def drain(iterator) -> None:
    for _ in iterator:
        pass


def main() -> None:
    from yatt.assets.model import resolve_model
    from yatt.config import GenRMConfig
    from yatt.dist import init_distributed
    from yatt.reshard.reference import per_tensor_hf_weights
    from yatt.rollout import VLLMEngine
    from yatt.trainer import MegatronPolicy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=GenRMConfig().model)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    info = init_distributed(threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    path = resolve_model(args.model)
    actor = MegatronPolicy(path, tp=args.tp)
    bucketed = lambda: actor.export_hf_weights(512 << 20)  # noqa: E731
    rows = [("export only", timed(lambda: drain(per_tensor_hf_weights(actor)), args.repeats),
             timed(lambda: drain(bucketed()), args.repeats))]
    engine = VLLMEngine(str(path), max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=info.rank)
    rows.append(("export + engine load", timed(lambda: engine.update_weights(per_tensor_hf_weights(actor)), args.repeats),
                 timed(lambda: engine.update_weights(bucketed()), args.repeats)))
    engine.shutdown()
    if info.rank == 0:
        print(f"{args.model}, trainer TP={args.tp} -> TP=1 engine per rank, {dist.get_world_size()} ranks")
        for what, ref, new in rows:
            print(f"{what:<22} per-tensor {ref:7.3f} s   bucketed {new:7.3f} s   speed-up {ref / new:5.2f}x")
        print(f"bucketed_vs_per_tensor={rows[-1][1] / rows[-1][2]:.2f}", flush=True)


if __name__ == "__main__":
    main()
