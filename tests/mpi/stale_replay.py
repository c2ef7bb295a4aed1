"""A patch of a YATT job (a ``tests/mpi/jobs_in_one.py`` hook) that records or replays the groups
each rank trains on, so tests/test_async_rl.py can feed a synchronous run the stale samples of an
async one.

``install("record", DIR)`` (a run with ``rollout.max_staleness >= 1``): after each step's rollout
phase every rank writes what it got (its groups, their rewards, the phase's (sum, count) metrics)
to ``DIR/rank<r>_step<s>.pt``. ``install("replay", DIR)`` (the same run with
``rollout.max_staleness=0``, synchronous): the rollout phase returns those instead of drawing
prompts and sampling; the trainers train on them, push the new weights, the samplers load them and
evaluate as in any run. Each returns the callable that takes the patch away.
"""
from collections.abc import Callable
from pathlib import Path

import torch

from yatt import loop


def install(mode: str, folder: str) -> Callable[[], None]:
    rollout_and_score, folder = loop._rollout_and_score, Path(folder)

    def file(job, step: int) -> Path:
        return folder / f"rank{job.info.rank}_step{step}.pt"

    def recorded(job, step, timer, sums):
        groups, rewards = rollout_and_score(job, step, timer, sums)
        torch.save((groups, rewards, dict(sums)), file(job, step))
        return groups, rewards

    def replayed(job, step, timer, sums):
        groups, rewards, recorded_sums = torch.load(file(job, step), weights_only=False)
        sums.update(recorded_sums)
        return groups, rewards

    loop._rollout_and_score = {"record": recorded, "replay": replayed}[mode]
    return lambda: setattr(loop, "_rollout_and_score", rollout_and_score)
