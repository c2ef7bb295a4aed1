"""Exact resume of the demo recipe under ``mpirun -np 2``, after a SIGKILL and after a Ctrl-C.

One uninterrupted 4-step run is the reference. A second run in another folder is SIGKILLed (every
process of the job) while the async write of step 2's checkpoint is in flight during step 3's
rollout and training; meanwhile a second job on the same folder is refused (exit 2, naming the
holder) and leaves it as it was. ``resume=auto`` must continue from step 1 (the last complete
checkpoint), and is sent SIGINT (Ctrl-C, which ``mpirun`` forwards) after its first step: it
saves, exits with code 130, and a last ``resume=auto`` finishes the run. Every metric of every
step must equal the reference's (CPU runs with fixed seeds are deterministic), also across the
data's epoch boundary (3 prompts per rank and 1 per step: step 4 crosses it).

The runs use conftest's tiny random policy, since what resumes (weights, Adam moments, RNG
streams, the data position, the metric files) is the same code for any model. Its answers score
0: an entropy bonus gives every step a gradient, and the weights, the sampled responses and so
every logprob and entropy metric depend on the whole restored state. They train PPO with a critic
(GAE) and an adaptive KL penalty in the reward, so the critic (weights, Adam moments, LR schedule:
``value_loss``, ``values_mean``, ``critic_grad_norm`` are among the metrics compared) and the KL
coefficient's state resume too (it changes every step: ``kl_coef_current``).
"""
from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (DEMO_ARGS, DEMO_RECIPE, MPIRUN, ROOT, TIMING, HostedJob, JobSpec, TinyModels, copy_paths,
                      hosted_jobs, job_env, kill_job, launch_job, metric_records, resume_from, resumed_pair,
                      tensorboard_scalars, wait_job, write_jsonl)
from yatt.preload import runtime_libraries

pytestmark = [pytest.mark.e2e, pytest.mark.mpi, pytest.mark.slow]


def _scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """The run's TensorBoard scalars (purged steps dropped), timings left out."""
    return {t: v for t, v in tensorboard_scalars(out).items() if not t.split("/")[1].startswith(TIMING)}


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in metric_records(out) if "reward_mean" in r]


# the PPO run that the kill/preempt and world-size tests compare with (every checkpoint kept)
PPO = ("algo.entropy_coef=0.01", "algo.estimator=gae", "critic.enabled=true",
       "algo.kl_in_reward=0.05", "algo.kl_target=0.01", "algo.kl_horizon=4",  # + the KL coefficient's state
       "checkpoint.keep_last=4")
PAIRS = [{"prompt": f"Calculate {i} + 1.", "chosen": f"<answer>{i + 1}</answer>", "rejected": f"I think {i}",
          "answer": str(i + 1)} for i in range(8)]


@hosted_jobs
def resume_jobs(root: Path, models: TinyModels) -> dict[str, JobSpec]:
    """``ppo_ref``, the uninterrupted 4-step PPO run, and an SFT and an RM run each resumed from its
    own step 2 (``sft_ref``/``sft_run``, ``rm_resume_ref``/``rm_resume_run``): conftest's ``hosted``
    fixture runs them, with the other modules' jobs."""
    model = f"model.path={models.policy}"
    pairs = write_jsonl(root / "resume_pairs.jsonl", PAIRS)
    rm = [model, "stage=rm", "data.source=file", f"data.train_files=[{pairs}]", f"data.eval_files=[{pairs}]",
          "data.question_key=prompt", "data.answer_key=answer", "trainer.prompts_per_rank=2", "trainer.lr=1e-3",
          "checkpoint.keep_last=4"]
    sft = [*DEMO_ARGS, model, "stage=sft", "trainer.lr=3e-3", "checkpoint.keep_last=4"]  # the evals see it learn
    return {"ppo_ref": JobSpec(DEMO_RECIPE, [*DEMO_ARGS, model, *PPO]),
            **resumed_pair(root, "sft", DEMO_RECIPE, sft, step=2),
            "sft_rollout_tp": JobSpec(DEMO_RECIPE, [*sft, "rollout.tp=2"]),
            **resumed_pair(root, "rm_resume", DEMO_RECIPE, [*DEMO_ARGS, *rm], step=2)}


@pytest.fixture
def reference_run(hosted, tiny_policy) -> tuple[Path, tuple[str, ...]]:
    """(the folder, the arguments after :data:`DEMO_ARGS`) of the hosted ``ppo_ref`` run."""
    job = hosted("ppo_ref")
    return job.out, (f"model.path={tiny_policy}", *PPO)


def test_killed_and_preempted_runs_resume_to_the_same_metrics(tmp_path, reference_run):
    ref, args = reference_run
    run = tmp_path / "run"
    ckpts = ref / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    # no stale weights: consecutive checkpoints differ
    for role in ("tp0_pp0", "critic_tp0_pp0"):  # the policy's and the critic's
        w3, w4 = (torch.load(ckpts / f"step_00000{s}" / "model" / f"{role}.pt", weights_only=False) for s in (3, 4))
        assert any(not torch.equal(w3[k], w4[k]) for k in w3), role
    train = [r for r in metric_records(ref) if "reward_mean" in r]
    assert all(r["grad_norm"] > 0 for r in train) and len({r["kl_coef_current"] for r in train}) == 4
    assert all(r["critic_grad_norm"] > 0 for r in train[1:])  # step 1: KL 0 and scores 0, so returns = values = 0

    # 1. SIGKILL while step 2's checkpoint is being written (step 3 trains meanwhile; the write never ends)
    proc = launch_job(run, *args, script="tests/mpi/stalled_checkpoint.py")
    tmp2, done2 = run / "checkpoints" / "step_000002.tmp", run / "checkpoints" / "step_000002"
    assert wait_job(proc, until=lambda: tmp2.is_dir()) is None
    # meanwhile a second job on the same folder is refused, naming the holder (the end compares every metric)
    try:  # the stalled job never ends by itself: killed whatever the checks find
        metrics = (run / "metrics.jsonl").read_bytes()
        second = subprocess.run([str(MPIRUN), "-np", "2", sys.executable, "-m", "yatt.launch", "--config", DEMO_RECIPE,
                                 *DEMO_ARGS, *args, f"output_dir={run}"], cwd=ROOT, env=job_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"output_dir {run} is in use by another YATT job (host " in second.stderr, second.stderr[-3000:]
        assert (run / "metrics.jsonl").read_bytes().startswith(metrics)  # only the first job appends
        assert proc.poll() is None
    finally:
        kill_job(proc)
    assert not done2.exists() and (run / "checkpoints" / "step_000001" / "meta.json").is_file()

    # 2. resume=auto continues from step 1; Ctrl-C once its first step is recorded
    proc = launch_job(run, *args)
    log = tmp_path / "run.log"
    assert wait_job(proc, until=lambda: "step    2 |" in log.read_text().partition("resumed from")[2]) is None
    proc.send_signal(signal.SIGINT)  # Ctrl-C: mpirun forwards it to every rank
    assert wait_job(proc) == 130, (tmp_path / "run.log").read_text()[-4000:]
    text = log.read_text().partition("resumed from")[2]
    assert "step_000001 (step 1)" in text and "Traceback" not in text  # a clean stop: engines closed first
    assert "SIGINT received: saved step" in text and "exiting with code 130" in text
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step_000002", "step_000003") and not list((run / "checkpoints").glob("*.tmp"))

    # 3. resume=auto finishes the run
    assert wait_job(launch_job(run, *args)) == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert metric_records(run) == metric_records(ref)
    assert _steps(run) == [1, 2, 3, 4]
    # TensorBoard, over the killed, preempted and finishing runs' event files, shows each step once
    scalars = _scalars(run)
    assert scalars == _scalars(ref) and [s for s, _ in scalars["train/reward_mean"]] == [1, 2, 3, 4]
    # python -m yatt.launch restarted itself with what yatt.preload found installed (rank 0's line, last run)
    runtime = [line for line in (tmp_path / "run.log").read_text().splitlines() if "memory allocator: " in line][-1]
    found = runtime_libraries()
    assert ("tcmalloc (" in runtime) == any("tcmalloc" in lib for lib in found), (runtime, found)
    assert ("Intel (libiomp5" in runtime) == any("iomp5" in lib for lib in found), (runtime, found)


def test_sigterm_during_start_up_exits_for_requeue(tmp_path, tiny_policy):
    """SIGTERM while the ranks start (before any step): the job ends with the requeue code 75, not
    by the signal, saying there was nothing to save yet; no checkpoint. The ranks check once the
    data is loaded (before any model loads: where this signal, sent as rank 0 logs its start, is
    seen) and again once models and engines are up. The demo recipe with a tiny random policy: the
    start-up is the same code, shorter."""
    run = tmp_path / "run"
    proc = launch_job(run, f"model.path={tiny_policy}")
    log = tmp_path / "run.log"
    assert wait_job(proc, until=lambda: "world 2 (mpi)" in log.read_text()) is None  # rank 0 is up, loading
    proc.send_signal(signal.SIGTERM)  # mpirun forwards it to every rank
    assert wait_job(proc) == 75, log.read_text()[-4000:]
    text = log.read_text()
    assert "SIGTERM received during start-up, nothing to save yet (no step done" in text, text[-4000:]
    assert "Traceback" not in text and not list((run / "checkpoints").glob("step_*"))


def test_an_sft_run_resumes_to_the_same_metrics(hosted):
    """``stage: sft`` on the same machinery: the run's step-2 checkpoint resumed (``resume=auto``,
    in a new job) gives the uninterrupted run's metrics at every later step, the evals included
    (the weights, Adam moments, LR schedule and data position all restored). A run killed during
    a checkpoint's write resumes from the last committed one: the PPO test above."""
    ref, run = hosted("sft_ref"), hosted("sft_run")
    sft = [r for r in metric_records(ref.out) if "sft_loss" in r]
    assert [r["step"] for r in sft] == [1, 2, 3, 4] and all(r["grad_norm"] > 0 for r in sft)
    assert sft[-1]["sft_loss"] < sft[0]["sft_loss"]  # it learns the targets
    _check_resumed(ref, run)


def test_an_sft_run_with_rollout_tp_2_evaluates_as_at_tp_1(hosted):
    """``stage: sft`` with ``rollout.tp=2`` (both ranks serve one engine for the evals, each
    synced with its own shard after every step): the SFT reference run's metrics (``sft_ref``, TP
    1), the final eval of the trained weights included, whose responses have become shorter than
    the untrained policy's (which never ends one before ``eval.max_tokens``): so the engine serves
    the trained weights, and a stale shard would not. fp32 on the CPU, the two engines' logits
    differ in the last bits only, so they sample the same tokens."""
    ref, tp = hosted("sft_ref"), hosted("sft_rollout_tp")
    evals = [r for r in metric_records(tp.out) if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4], evals
    assert evals[0]["eval_response_len_mean"] == 16 > evals[1]["eval_response_len_mean"], evals
    assert metric_records(tp.out) == metric_records(ref.out)


def test_an_rm_run_resumes_to_the_same_metrics(hosted):
    """``stage: rm`` (the critic trained as a reward model on a pairs file): the run's step-2
    checkpoint resumed (``resume=auto``, in a new job) gives the uninterrupted run's metrics at
    every later step, the held-out pair evals included (the critic's weights, Adam moments, LR
    schedule, data position)."""
    ref, run = hosted("rm_resume_ref"), hosted("rm_resume_run")
    rm = [r for r in metric_records(ref.out) if "rm_loss" in r]
    assert [r["step"] for r in rm] == [1, 2, 3, 4] and all(r["grad_norm"] > 0 for r in rm)
    assert len({r["reward_margin"] for r in rm}) == 4  # the head moves every step
    _check_resumed(ref, run)


def _check_resumed(ref: HostedJob, run: HostedJob) -> None:
    """``run``, resumed from ``ref``'s step-2 checkpoint with ``ref``'s whole metrics.jsonl (steps 3
    and 4 included: it must drop them; conftest's ``resumed_pair``), has ``ref``'s metrics at every step."""
    assert "resumed from" in run.log, run.log[-4000:]
    assert metric_records(run.out) == metric_records(ref.out)


def test_a_run_resumes_on_fewer_and_on_more_ranks_and_on_another_tp_and_pp(tmp_path, reference_run):
    """The reference run's (``mpirun -np 2``, TP 1, PP 1) step-2 checkpoint resumed under ``-np 1``,
    and under ``-np 4`` with TP 2 and PP 2 (policy, critic and KL coefficient; the model and
    optimizer shards rebuilt from the saved ones): each trains steps 3 and 4 with finite metrics
    and says that the layout changed and what that means (``tests/test_data.py`` shows that the
    data shards draw no row twice and leave none out; ``tests/test_relayout.py`` that resharded
    states are the saved ones)."""
    ref, args = reference_run
    for ranks, tp, pp in ((1, 1, 1), (4, 2, 2)):
        run = tmp_path / f"np{ranks}"
        copy_paths(resume_from(ref, run, 2))
        out = subprocess.run([str(MPIRUN), "-np", str(ranks), sys.executable, "-m", "yatt.launch", "--config",
                              DEMO_RECIPE, *DEMO_ARGS, *args, f"trainer.tp={tp}", f"trainer.pp={pp}", f"output_dir={run}"],
                             cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-4000:]
        assert f"was saved on 2 ranks and this job has {ranks} (TP {tp}, PP {pp})" in out.stderr, out.stderr[-3000:]
        assert f"the global batch is {ranks} prompts per step (it was 2" in out.stderr
        relaid = f"was saved with TP 1, PP 1 and this job has TP {tp}, PP {pp}: each rank rebuilds its model"
        assert (relaid in out.stderr) == (tp * pp > 1), out.stderr[-3000:]
        train = [r for r in metric_records(run) if "reward_mean" in r]
        assert [r["step"] for r in train] == [1, 2, 3, 4]  # the reference's first two, then its own
        assert all(math.isfinite(r[k]) for r in train for k in ("grad_norm", "reward_mean", "critic_grad_norm"))
        assert (run / "checkpoints" / "step_000004" / "rank" / f"{ranks - 1:05d}.pt").is_file()
