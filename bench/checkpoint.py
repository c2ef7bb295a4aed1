"""Checkpoint stall benchmark: how long training waits for an async save against a synchronous
save of the same state, in one run.

    .venv/bin/python bench/checkpoint.py [--model smollm2-135m-instruct] [--steps 6] [--threads 1]

State: a ``MegatronPolicy`` with AdamW state (SmolLM2-135M fp32: model 0.54 GB + optimizer
1.08 GB), trained on synthetic micro-batches. Timings:

- baseline: median train step without any save;
- synchronous save: ``torch.save`` of the live model and optimizer/scheduler states into a
  checkpoint folder, fsync, commit (what a save without a snapshot costs: the step waits for all of it);
- async save (:class:`yatt.checkpoint.saver.Checkpointer`): the ``save()`` call (host snapshot)
  plus the extra time of the train steps that run while the background thread writes
  (their total minus as many baseline steps), until the commit. The first async save also
  allocates the host buffers; later ones reuse them. Each is reported; the final line is the
  steady state (median over the async saves after the first; the sync time is a median of 3):

    async_stall_vs_sync=<async stall / sync stall>
"""
from __future__ import annotations

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as yatt.launch does, before torch allocates

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def micro_batches(vocab: int, rows: int = 4, length: int = 192) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length)
    mask[:, length // 2:] = 1.0
    return [{"input_ids": ids, "response_mask": mask}]


def loss_fn(logprobs, entropy, mb):
    return -(logprobs * mb["response_mask"]).sum() / mb["response_mask"].sum(), {}


def main() -> None:
    from yatt.assets.model import resolve_model
    from yatt.checkpoint import files
    from yatt.checkpoint.saver import Checkpointer, _save
    from yatt.dist import init_distributed
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=6, help="baseline train steps (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training (the demo: 1 per rank)")
    ap.add_argument("--saves", type=int, default=4, help="async saves (the first allocates the host buffers)")
    ap.add_argument("--dir", default=None, help="checkpoint folder (default: a temp folder under the repo's runs/)")
    args = ap.parse_args()
    init_distributed(threads=args.threads)
    actor = MegatronPolicy(resolve_model(args.model), optim=OptimConfig(lr=1e-6, total_steps=1000))
    mbs = micro_batches(actor.layout.vocab_size)
    step = lambda: actor.train_step(mbs, loss_fn)  # noqa: E731
    state = lambda: (actor.module.state_dict(),  # noqa: E731
                     {"optimizer": actor.optimizer.state_dict(), "scheduler": actor.scheduler.state_dict()})
    step()  # the optimizer state exists from here on

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    base = statistics.median(timed(step) for _ in range(args.steps))
    Path("runs").mkdir(exist_ok=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_", dir="runs"))
    ckpt = Checkpointer(root, rank=0, model_key="tp0_pp0", keep_last=1)

    def sync_save(n: int) -> None:
        model, optim = state()
        tmp = files.step_dir(root, n, tmp=True)
        _save(model, tmp / "model" / "tp0_pp0.pt")
        _save(optim, tmp / "optim" / "tp0_pp0.pt")
        _save({}, tmp / "rank" / "00000.pt")
        files.commit(root, n, {})

    def async_stall(n: int) -> tuple[float, float, int]:
        """(save() call seconds, extra seconds of the steps overlapping the write, those steps)."""
        model, optim = state()
        call = timed(lambda: ckpt.save(n, model, optim, {}, {}))
        extra, steps = 0.0, 0
        while ckpt.poll() is None:
            extra += timed(step) - base
            steps += 1
        return call, max(0.0, extra), steps

    sync = statistics.median(timed(lambda: sync_save(n)) for n in (1, 2, 3))
    size = sum(p.stat().st_size for p in (root / "step_000003").rglob("*.pt")) / 1e9
    saves = [async_stall(n) for n in range(4, 4 + args.saves)]
    shutil.rmtree(root, ignore_errors=True)

    print(f"state {size:.2f} GB; train step {base:.3f} s (median of {args.steps}, {args.threads} thread(s))")
    print(f"sync save: stall {sync:.3f} s (median of 3)")
    for i, (call, extra, n) in enumerate(saves):
        print(f"async save {i + 1}{' (allocates the buffers)' if i == 0 else ''}: stall {call + extra:.3f} s = "
              f"snapshot {call:.3f} s + {extra:.3f} s extra over the {n} step(s) that overlapped the write; "
              f"ratio {(call + extra) / sync:.3f}")
    steady = statistics.median(call + extra for call, extra, _ in saves[1:])
    print(f"async_stall_vs_sync={steady / sync:.3f}")


if __name__ == "__main__":
    main()
