"""The demo recipe end to end under ``mpirun -np 2``: data parallelism (conftest's shared 2-step
``demo_run``), a 2-stage pipeline with DAPO dynamic sampling through the Python API (1 step); the
GenRM recipe in each placement mode (2 steps each, with REINFORCE++ (group baseline, an adaptive
KL penalty in the reward), gspo, and dual_clip + an entropy bonus)."""
import json
import math
from pathlib import Path

import pytest

from conftest import JobSpec, TinyModels, hosted_jobs, metric_records, tensorboard_scalars


pytestmark = [pytest.mark.e2e, pytest.mark.mpi, pytest.mark.slow]

REQUIRED = (
    "step reward_mean accuracy kl entropy clip_frac grad_norm response_len_mean "
    "logprob_diff_rollout_vs_train time_rollout_s time_reward_s time_logprob_s time_train_s "
    "time_sync_s time_step_s tokens_per_s dp_imbalance_before dp_imbalance_after"
).split()
# Smaller than the recipes: the checks below hold for any length.
SHORT = ["trainer.total_steps=2", "trainer.prompts_per_rank=2", "data.eval_size=8", "rollout.max_tokens=24",
         "eval.max_tokens=16"]


def _check_run(out, log: str, steps: int, stages: int = 1, dynamic: bool = False) -> None:
    """The checks every demo-recipe run must pass: finite metrics at each step, the step-0 and
    final evals, the final checkpoint (one model file per pipeline stage), config.yaml,
    TensorBoard and the progress bars."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    final = out / "checkpoints" / f"step_{steps:06d}"
    assert (out / "checkpoints" / "latest").read_text() == f"{final.name}\n"
    assert sorted(p.name for p in (final / "model").iterdir()) == [f"tp0_pp{s}.pt" for s in range(stages)]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert [r["step"] for r in evals] == [0, steps]
    for r in train:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        bad = {k: r[k] for k in REQUIRED if not (isinstance(r[k], (int, float)) and math.isfinite(r[k]))}
        assert not bad, bad
        assert r["logprob_diff_rollout_vs_train"] < 1e-3 and r["time_step_s"] > 0
        # no KL term: a gradient exactly when some group's rewards differ (else every advantage, and pg_loss, is 0)
        assert (r["grad_norm"] > 0) == (r["pg_loss"] != 0), r
        assert 1.0 <= r["dp_imbalance_after"] <= r["dp_imbalance_before"]  # DP balancing is on by default
        if dynamic:  # 2 ranks x 2 prompts: kept + dropped + trimmed = groups drawn
            drawn = 4 * (1 + r["dynamic_sampling_rounds"])
            trained = drawn - r["dynamic_sampling_groups_dropped"] - r["dynamic_sampling_groups_trimmed"]
            assert r["dynamic_sampling_rounds"] <= 1 and (trained == 4 or r["dynamic_sampling_cap_hit"] == 1)
    assert any(r["grad_norm"] > 0 for r in train)
    for r in evals:
        assert 0.0 <= r["eval_accuracy"] <= 1.0
    assert (out / "config.yaml").exists()
    _check_tensorboard_and_bars(out, train, log)


def test_data_parallel_demo_run_writes_finite_metrics(demo_run):
    _check_run(demo_run.out, demo_run.log, steps=2)
    assert demo_run.log.count("DP gradient sum: shared memory over 2 ranks") == 1  # rank 0 logs it
    assert not demo_run.shm_left, demo_run.shm_left  # MPI finalized before the fast exit


def test_api_run_on_a_pipeline_with_dynamic_sampling_writes_finite_metrics(mpirun, tmp_path, tiny_policy):
    """tests/mpi/api_train.py: ``Trainer(...).train`` as a user script; one 2-stage pipeline (DP=1)
    with DAPO dynamic sampling (one extra round at most); the script holds the settings. The policy is
    the tiny random one (the demo run trains the packaged model by name)."""
    out = tmp_path / "run"
    proc = mpirun(["tests/mpi/api_train.py", str(out), str(tiny_policy)], 2, timeout=900)
    assert "api OK 3" in proc.stdout  # rank 0's records: eval at 0, step 1, eval at 1
    _check_run(out, proc.stderr, steps=1, stages=2, dynamic=True)


def _check_tensorboard_and_bars(out, train, stderr: str) -> None:
    """The run's TensorBoard scalars are its metrics.jsonl values; rank 0 drew the progress bars."""
    scalars = tensorboard_scalars(out)
    for key in ("reward_mean", "kl", "entropy", "response_len_mean"):
        assert scalars[f"train/{key}"] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in train], key
    assert "steps: 100%" in stderr and "rollout: 100%" in stderr, stderr[-3000:]


# Each placement run also trains with another algorithm (their math: test_policy_loss, test_token_advantages).
ALGOS = {"colocate": ["algo.estimator=reinforce_pp_baseline", "algo.kl_in_reward=0.05",  # + a reference model
                      "algo.kl_target=0.01", "algo.kl_horizon=8"],  # adaptive: 8 samples a step, a full correction
         "partial_colocate": ["algo.policy_loss=gspo", "algo.loss_agg=seq_mean_token_mean",
                              "placement.keep_engines=always"],  # colocate decides (auto, the default)
         "disaggregated": ["algo.policy_loss=dual_clip", "algo.loss_agg=seq_mean_token_sum_norm",
                           "algo.entropy_coef=0.01", "algo.estimator=gae", "critic.enabled=true",  # PPO's critic
                           "algo.reward_norm=batch", "algo.reward_clip=5"],  # whitened over the trainer subgroup
         # rank 1 samples one step ahead and judges half of each batch, rank 0 judges the other half and trains
         "rollout_apart": ["rollout.max_staleness=1", "placement.trainer_judge_share=0.5",
                           "algo.recompute_old_logprobs=true", "algo.rollout_correction=tis"]}
CRITIC = ["value_loss", "value_clip_frac", "values_mean", "returns_mean", "explained_variance", "critic_grad_norm",
          "critic_lr", "entropy_bonus"]


PARITY = "tests.reward_fns:parity"  # a reward with a signal for any policy (the tiny one)
GENRM_MODES = ["colocate", "partial_colocate", "disaggregated", "rollout_apart"]
RM_MODES = ["colocate", "partial_colocate", "disaggregated"]


@hosted_jobs
def placement_jobs(root: Path, models: TinyModels) -> dict[str, JobSpec]:
    """The GenRM recipe in each placement mode (``genrm_<mode>``), a reward model as the only source
    in each placement with a judge slot (``rm_<mode>``) and rollout TP 2 (``rollout_tp``), on the
    tiny models: conftest's ``hosted`` fixture runs them, with the other modules' jobs."""
    jobs = {f"genrm_{mode}": JobSpec("configs/grpo_smollm2_genrm.yaml", [
        *SHORT, f"placement.mode={mode}", "rollout.n=2", f"model.path={models.policy}",
        f"reward.genrm.model={models.judge}", *ALGOS[mode]]) for mode in GENRM_MODES}
    jobs |= {f"rm_{mode}": JobSpec("configs/grpo_smollm2.yaml", [
        "trainer.total_steps=1", "trainer.prompts_per_rank=2", "data.eval_size=0", "rollout.n=2",
        "rollout.max_tokens=16", "placement.keep_engines=never", f"placement.mode={mode}", f"model.path={models.policy}",
        f"reward.sources=[{{name: rm, type: reward_model, model: '{models.rm}', batch_size: 3}}]"]) for mode in RM_MODES}
    jobs["rollout_tp"] = JobSpec("configs/grpo_smollm2.yaml", [  # one engine (and judge) over both ranks, the trainer DP
        *SHORT, "data.eval_size=7", "rollout.n=2", "rollout.tp=2", f"model.path={models.policy}",
        f"reward.genrm.model={models.judge}",
        f"reward.sources=[{{name: parity, type: function, path: '{PARITY}'}}, {{name: genrm, type: genrm, weight: 0.5}}]"])
    return jobs


@pytest.mark.parametrize("mode", GENRM_MODES)
def test_genrm_recipe_runs_in_each_placement_mode(hosted, mode):
    """These runs check the placements (where sampling, judging and training run, the streaming, the
    engine switches and the weight push), which need no real policy or judge: tiny random ones. The
    demo policy trains in the runs above; test_genrm checks the 0.5B judge itself (its P(yes) ranks
    right answers above wrong ones)."""
    job = hosted(f"genrm_{mode}")
    out = job.out
    records = metric_records(out, drop=())
    train = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    final = out / "checkpoints" / "step_000002"  # every rank's state; the model once (judge-only ranks have none)
    assert sorted(p.name for p in (final / "rank").iterdir()) == ["00000.pt", "00001.pt"]
    critic = mode == "disaggregated"  # on the trainer subgroup of rank 0
    assert sorted(p.name for p in (final / "model").iterdir()) == ["critic_tp0_pp0.pt"] * critic + ["tp0_pp0.pt"]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
    keys = REQUIRED + ["reward_genrm_mean", "genrm_unparsable", "time_genrm_s", "reward_rule_mean", "idle_s",
                       "idle_max_s"]
    apart = mode == "rollout_apart"
    if apart:  # step 2 trains the batch rank 1 sampled during step 1 (with the first policy)
        keys += ["staleness_max", "sampler_busy_s", "trainer_busy_s", "is_weight_mean"]
        keys.remove("time_rollout_s")
    else:
        keys += ["time_rollout_genrm_s"]
    if mode in ("partial_colocate", "disaggregated"):  # streamed from samplers to GenRM ranks
        keys += ["genrm_queue_tokens_max", "genrm_queue_groups_max", "genrm_queue_tokens_mean"]
    if mode in ("colocate", "partial_colocate"):
        keys += ["time_engines_s", "engines_resident"]  # CPU: engines torn down and rebuilt, or kept
    if critic:
        keys += CRITIC + ["time_critic_s"]
    for record in train:
        bad = {k: record.get(k) for k in keys
               if not (isinstance(record.get(k), (int, float)) and math.isfinite(record[k]))}
        assert not bad, bad
        assert record["reward_mean"] == record["reward_genrm_mean"] and 0.0 <= record["reward_genrm_mean"] <= 1.0
        assert record["genrm_unparsable"] == 0  # P(yes) mode: every judgement is read from logprobs
        if not (apart and record["step"] == 2):
            assert record["logprob_diff_rollout_vs_train"] < 1e-3  # the rollout engine got the new weights
        assert len(record["idle_rank_s"]) == 2 and all(x >= 0 for x in record["idle_rank_s"])
        if mode in ("partial_colocate", "disaggregated"):
            assert record["genrm_queue_groups_max"] >= 1
        if mode == "disaggregated":  # the GenRM rank waits while rank 0 trains
            assert record["idle_rank_s"][1] > record["time_train_s"] * 0.5
            assert record["grad_norm"] > 0  # the entropy bonus has a gradient even where every advantage is 0
            assert record["critic_grad_norm"] > 0 and record["entropy_bonus"] > 0
    if mode == "partial_colocate":  # kept from the start: the final eval releases them all first
        assert [r["engines_resident"] for r in train] == [1.0, 1.0]
    if mode == "colocate":  # auto: step 1 releases and measures, then the logged decision holds
        resident = "placement: engines stay resident from the next step" in job.log
        assert resident or "placement: engines are released between phases" in job.log, job.log[-3000:]
        assert [r["engines_resident"] for r in train] == [0.0, float(resident)]
    if mode == "colocate":  # the adaptive KL coefficient: step 1's KL is 0 (policy = reference), under target
        assert [r["kl_coef_current"] for r in train] == [pytest.approx(0.05), pytest.approx(0.05 * 0.8)]
    if mode in ("colocate", "rollout_apart"):  # rank 0 judges too (rollout_apart: the half its sampler left it)
        assert "genrm: 100%" in job.log, job.log[-3000:]
    if apart:
        assert [r["staleness_max"] for r in train] == [0, 1]
        assert "time_rollout_s" in train[0] and train[1]["time_genrm_s"] > 0  # step 2: rank 0 judged its half


@pytest.mark.parametrize("mode", RM_MODES)
def test_reward_model_source_runs_in_each_placement(hosted, mode):
    """A discriminative reward model (tiny, random) as the only weighted source, on its vLLM
    pooling engine in the judge's slot: colocated (built after the rollout engine is released,
    released before training, on both ranks), and on the GenRM rank of each split placement
    (streamed to by the sampler in partial colocation), with a finite ``reward_rm_mean``."""
    (record,) = metric_records(hosted(f"rm_{mode}").out, drop=())
    assert math.isfinite(record["reward_rm_mean"]) and record["reward_mean"] == record["reward_rm_mean"], record
    assert record["reward_rm_errors"] == 0 and "reward_rule_mean" in record and record["time_genrm_s"] > 0, record
    if mode == "colocate":
        assert record["time_engines_s"] > 0 and record["engines_resident"] == 0, record


def test_rollout_tensor_parallel_run_trains_on_the_engines_own_logprobs(hosted):
    """``rollout.tp=2``: both ranks serve one engine (their prompts share its calls, an uneven eval
    split of 7 prompts included) and each gets its own shard at every sync: the engine's logprobs
    equal the trainer's at every step (1e-6 measured; one wrong shard or a rank's own seed gives ~1).
    The GenRM judge runs colocated at TP 2 too, and judges every response."""
    records = metric_records(hosted("rollout_tp").out, drop=())
    train = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
    for record in train:
        assert record["logprob_diff_rollout_vs_train"] < 1e-4 and record["grad_norm"] > 0, record
        assert 0.0 < record["reward_genrm_mean"] < 1.0 and record["genrm_unparsable"] == 0, record
