"""The demo recipe end to end: ``mpirun -np 2 python -m yatt.launch`` for 2 steps (smaller batch),
with data parallelism and with a 2-stage pipeline; the GenRM recipe in each placement mode."""
import json
import math

import pytest

from conftest import tensorboard_scalars

REQUIRED = (
    "step reward_mean accuracy kl entropy clip_frac grad_norm response_len_mean "
    "logprob_diff_rollout_vs_train time_rollout_s time_reward_s time_logprob_s time_train_s "
    "time_sync_s time_step_s tokens_per_s dp_imbalance_before dp_imbalance_after"
).split()


# DP=2; one 2-stage pipeline; DP=2 with DAPO dynamic sampling (one extra round at most)
@pytest.mark.parametrize("parallel", ["trainer.pp=1", "trainer.pp=2", "algo.dynamic_sampling=true"])
def test_two_rank_two_step_demo_writes_finite_metrics(mpirun, tmp_path, parallel):
    out = tmp_path / "run"
    proc = mpirun(["-m", "yatt.launch", "--config", "configs/grpo_smollm2.yaml", "trainer.total_steps=2",
                   f"output_dir={out}", "trainer.prompts_per_rank=2", "rollout.n=4", "data.eval_size=24", parallel,
                   "algo.max_sampling_rounds=1"],
                  2, timeout=900)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    final = out / "checkpoints" / "step_000002"  # the final save, one model file per pipeline stage
    assert (out / "checkpoints" / "latest").read_text() == "step_000002\n"
    stages = 2 if parallel == "trainer.pp=2" else 1
    assert sorted(p.name for p in (final / "model").iterdir()) == [f"tp0_pp{s}.pt" for s in range(stages)]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["step"] for r in evals] == [0, 2]
    for r in train:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        bad = {k: r[k] for k in REQUIRED if not (isinstance(r[k], (int, float)) and math.isfinite(r[k]))}
        assert not bad, bad
        assert r["logprob_diff_rollout_vs_train"] < 1e-3 and r["grad_norm"] > 0 and r["time_step_s"] > 0
        assert 1.0 <= r["dp_imbalance_after"] <= r["dp_imbalance_before"]  # DP balancing is on by default
        if "dynamic" in parallel:  # 2 ranks x 2 prompts: kept + dropped + trimmed = groups drawn
            drawn = 4 * (1 + r["dynamic_sampling_rounds"])
            trained = drawn - r["dynamic_sampling_groups_dropped"] - r["dynamic_sampling_groups_trimmed"]
            assert r["dynamic_sampling_rounds"] <= 1 and (trained == 4 or r["dynamic_sampling_cap_hit"] == 1)
    for r in evals:
        assert 0.0 <= r["eval_accuracy"] <= 1.0
    assert (out / "config.yaml").exists()
    _check_tensorboard_and_bars(out, train, proc.stderr)


def _check_tensorboard_and_bars(out, train, stderr: str) -> None:
    """The run's TensorBoard scalars are its metrics.jsonl values; rank 0 drew the progress bars."""
    scalars = tensorboard_scalars(out)
    for key in ("reward_mean", "kl", "entropy", "response_len_mean"):
        assert scalars[f"train/{key}"] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in train], key
    assert "steps: 100%" in stderr and "rollout: 100%" in stderr, stderr[-3000:]


@pytest.mark.parametrize("mode", ["colocate", "partial_colocate", "disaggregated"])
def test_genrm_recipe_runs_in_each_placement_mode(mpirun, tmp_path, mode):
    out = tmp_path / "run"
    proc = mpirun(["-m", "yatt.launch", "--config", "configs/grpo_smollm2_genrm.yaml", "trainer.total_steps=2",
                   f"placement.mode={mode}", f"output_dir={out}", "trainer.prompts_per_rank=2", "rollout.n=2",
                   "data.eval_size=8"], 2, timeout=900)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    final = out / "checkpoints" / "step_000002"  # every rank's state; the model once (judge-only ranks have none)
    assert sorted(p.name for p in (final / "rank").iterdir()) == ["00000.pt", "00001.pt"]
    assert [p.name for p in (final / "model").iterdir()] == ["tp0_pp0.pt"]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
    keys = REQUIRED + ["reward_genrm_mean", "genrm_unparsable", "time_genrm_s", "reward_rule_mean",
                       "time_rollout_genrm_s", "idle_s", "idle_max_s"]
    if mode != "colocate":
        keys += ["genrm_queue_tokens_max", "genrm_queue_groups_max", "genrm_queue_tokens_mean"]
    if mode != "disaggregated":
        keys += ["time_engines_s"]  # CPU: engines torn down and rebuilt to release memory
    for record in train:
        bad = {k: record.get(k) for k in keys
               if not (isinstance(record.get(k), (int, float)) and math.isfinite(record[k]))}
        assert not bad, bad
        assert record["reward_mean"] == record["reward_genrm_mean"] and 0.0 <= record["reward_genrm_mean"] <= 1.0
        assert record["genrm_unparsable"] == 0  # P(yes) mode: every judgement is read from logprobs
        assert record["logprob_diff_rollout_vs_train"] < 1e-3  # the rollout engine got the new weights
        assert len(record["idle_rank_s"]) == 2 and all(x >= 0 for x in record["idle_rank_s"])
        if mode != "colocate":
            assert record["genrm_queue_groups_max"] >= 1
        if mode == "disaggregated":  # the GenRM rank waits while rank 0 trains
            assert record["idle_rank_s"][1] > record["time_train_s"] * 0.5
    if mode == "colocate":  # rank 0 judges too
        assert "genrm: 100%" in proc.stderr, proc.stderr[-3000:]
