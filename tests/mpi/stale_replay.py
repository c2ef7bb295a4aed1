"""A YATT job as ``python -m yatt.launch`` runs it, recording or replaying the groups each rank
trains on, so tests/test_async_rl.py can feed a synchronous run the stale samples of an async one.

``YATT_REPLAY=record`` (``rollout.max_staleness >= 1``): after each step's rollout phase every rank
writes what it got (its groups, their rewards, the phase's (sum, count) metrics) to
``$YATT_REPLAY_DIR/rank<r>_step<s>.pt``. ``YATT_REPLAY=replay`` (the same run with
``rollout.max_staleness=0``, synchronous): the rollout phase returns those instead of drawing
prompts and sampling; the trainers train on them, push the new weights, the samplers load them and
evaluate as in any run. ``python tests/mpi/stale_replay.py --config FILE [key=value ...]``; exits
with the job's code.
"""
import os
import sys
from pathlib import Path

import torch

from yatt import loop
from yatt.launch import main

_rollout_and_score = loop._rollout_and_score
MODE, DIR = os.environ["YATT_REPLAY"], Path(os.environ["YATT_REPLAY_DIR"])


def _file(job, step: int) -> Path:
    return DIR / f"rank{job.info.rank}_step{step}.pt"


def _recorded(job, step, timer, sums):
    groups, rewards = _rollout_and_score(job, step, timer, sums)
    torch.save((groups, rewards, dict(sums)), _file(job, step))
    return groups, rewards


def _replayed(job, step, timer, sums):
    groups, rewards, recorded = torch.load(_file(job, step), weights_only=False)
    sums.update(recorded)
    return groups, rewards


loop._rollout_and_score = {"record": _recorded, "replay": _replayed}[MODE]
sys.exit(main(sys.argv[1:]))
