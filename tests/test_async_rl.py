"""Asynchronous RL (``placement.mode=rollout_apart``, ``rollout.max_staleness``) under ``mpirun -np 2``:
rank 0 trains, rank 1 samples and scores, on conftest's tiny random policy (what is checked is the
batch flow, the weight push, the checkpoint and the watchdog, the same code for any model).

The runs use DAPO dynamic sampling with a reward that carries a signal in about half of the groups
(``tests.reward_fns:parity``), so refill rounds happen, and recompute the old logprobs with truncated
importance sampling, so every step's metrics depend on the stale rollout logprobs too.
"""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from conftest import (DEMO_ARGS, DEMO_RECIPE, TIMING, JobSpec, TinyModels, hosted_jobs, kill_job,
                      launch_job, metric_records, wait_job)
from yatt.watchdog import EXIT_RANK_LOST

pytestmark = [pytest.mark.e2e, pytest.mark.mpi, pytest.mark.slow]
ARGS = ("placement.mode=rollout_apart", "trainer.total_steps=3", "algo.recompute_old_logprobs=true",
        "algo.rollout_correction=tis", "algo.dynamic_sampling=true",
        "reward.sources=[{name: parity, type: function, path: 'tests.reward_fns:parity', weight: 1.0}]")
# what differs between runs that train the same samples: timings, waits, and each side's busy time
_TIMING = (*TIMING, "sampler_", "trainer_")


@hosted_jobs
def async_jobs(root: Path, models: TinyModels) -> dict[str, JobSpec]:
    """``async_record``, a K = 1 run that records the groups each rank trains on at each step, and
    ``async_replay``, the same run synchronous (K = 0: samplers wait for each new policy) fed them
    (tests/mpi/stale_replay.py)."""
    groups = root / "async_groups"
    groups.mkdir()
    args = [*DEMO_ARGS, f"model.path={models.policy}", *ARGS]
    return {"async_record": JobSpec(DEMO_RECIPE, [*args, "rollout.max_staleness=1"],
                                    hook=("stale_replay", "record", str(groups))),
            "async_replay": JobSpec(DEMO_RECIPE, [*args, "rollout.max_staleness=0"],
                                    hook=("stale_replay", "replay", str(groups)))}


def _run(out: Path, *args: str) -> list[dict]:
    code = wait_job(launch_job(out, *args))
    assert code == 0, (out.parent / f"{out.name}.log").read_text()[-4000:]
    return metric_records(out, _TIMING)


def test_async_run_equals_a_sync_run_fed_its_stale_samples_and_resumes_exactly_after_sigterm(
        tmp_path, tiny_policy, hosted):
    model = f"model.path={tiny_policy}"
    ref = metric_records(hosted("async_record").out, _TIMING)
    train = [r for r in ref if "staleness_max" in r]
    # staleness: step 1 trains the first policy's samples, then every batch was made one update ahead
    assert [r["staleness_max"] for r in train] == [0, 1, 1] and [r["staleness_mean"] for r in train] == [0, 1, 1]
    assert sum(r["dynamic_sampling_rounds"] for r in train) > 0  # refills obeyed the bound too
    assert train[2]["rollout_kl"] > 0 and train[2]["is_weight_mean"] != 1.0  # stale samples were corrected

    # 1. a synchronous run (K = 0: samplers wait for each new policy) fed the async run's groups: every
    #    step's loss, grad norm, IS statistics, ... and the evals (the engines got the weights)
    assert metric_records(hosted("async_replay").out, _TIMING) == ref

    # 2. SIGTERM once step 1 is recorded: the run saves, with its in-flight batch, and exits 75; run
    #    again, it resumes there and ends with every record equal to the uninterrupted run's
    run, log = tmp_path / "preempted", tmp_path / "preempted.log"
    proc = launch_job(run, model, *ARGS, "rollout.max_staleness=1")
    assert wait_job(proc, until=lambda: log.exists() and "step    1 |" in log.read_text()) is None
    proc.send_signal(signal.SIGTERM)  # mpirun forwards it to every rank
    assert wait_job(proc) == 75, log.read_text()[-4000:]
    saved = int(re.search(r"SIGTERM received: saved step (\d+)", log.read_text()).group(1))
    assert saved in (1, 2), log.read_text()[-4000:]
    assert _run(run, model, *ARGS, "rollout.max_staleness=1") == ref
    # a batch sampled anew by the resumed policy would have differed; the log names the one restored
    text = log.read_text().partition("exiting with code 75")[2]  # the second run's lines
    restored = f"1 in-flight batch(es) (steps [{saved + 1}], made by the policy of step(s) [{saved - 1}])"
    assert restored in text, text[-3000:]


def test_a_sampler_that_stops_ends_the_job_naming_it(tmp_path, tiny_policy):
    """SIGSTOP the sampler rank (rank 1) once step 1 is recorded: the trainer, waiting for its next
    batch, never hears from it again; the watchdog ends the job with exit 4 and names rank 1."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch_job(run, f"model.path={tiny_policy}", *ARGS, "rollout.max_staleness=1", "trainer.total_steps=8",
                      "fault.timeout_s=6")
    try:
        assert wait_job(proc, until=lambda: log.exists() and "step    1 |" in log.read_text()) is None
        pid = int(re.search(r"rank=host:pid 0=\S+:\d+ 1=\S+:(\d+)", log.read_text()).group(1))
        os.kill(pid, signal.SIGSTOP)
        code = wait_job(proc, timeout=120)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    text = log.read_text()
    assert code == EXIT_RANK_LOST, text[-4000:]
    assert re.search(r"yatt: rank 1 \(\S+\) sent no heartbeat for [\d.]+ s; its last phase was", text), text[-4000:]
