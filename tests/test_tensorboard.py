"""TensorBoard event files beside metrics.jsonl: the demo's real records written through the
MetricsWriter read back equal (by TensorBoard's own reader), a resumed run replaces the steps
after its checkpoint, a fresh run does not mix in an older run's events."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tensorboard_scalars
from yatt.config import LogConfig
from yatt.controller.metrics import MetricsWriter
from yatt.controller.tensorboard import tag

DEMO = Path(__file__).parent / "data" / "grpo_smollm2_metrics.jsonl"
TB = LogConfig(trackers=["tensorboard"])


def _expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for k, v in r.items():
            if k == "step" or v is None:
                continue
            for name, x in ([(f"{tag(k)}/{i}", x) for i, x in enumerate(v)] if isinstance(v, list) else [(tag(k), v)]):
                out.setdefault(name, []).append((r["step"], float(x)))
    return out


def test_demo_records_read_back_equal(tmp_path):
    records = [json.loads(line) for line in DEMO.read_text().splitlines()]
    writer = MetricsWriter(tmp_path, rank=0, log=TB)
    for r in records:
        writer.write(r)
    writer.close()
    got, want = tensorboard_scalars(tmp_path), _expected(records)
    assert {"train/reward_mean", "train/kl", "train/entropy", "train/response_len_mean", "eval/eval_accuracy",
            "time/time_rollout_s", "time/time_train_s", "memory/mem_peak_train_gib", "time/idle_rank_s/1"} <= set(got)
    assert set(got) == set(want)
    for name, points in want.items():
        assert [s for s, _ in got[name]] == [s for s, _ in points], name
        assert [v for _, v in got[name]] == pytest.approx([v for _, v in points], rel=1e-6), name  # float32
    assert len(got["train/reward_mean"]) == 20 and [s for s, _ in got["eval/eval_accuracy"]] == [0, 20]


def test_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    first = MetricsWriter(tmp_path, rank=0, log=TB)
    for step in range(1, 6):  # the interrupted run got to step 5; its checkpoint is step 2
        first.write({"step": step, "loss": float(step), "lr": float("nan")})
    first.close()
    resumed = MetricsWriter(tmp_path, rank=0, resume_step=2, log=TB)
    for step in (3, 4):
        resumed.write({"step": step, "loss": 10.0 * step})
    resumed.close()
    got = tensorboard_scalars(tmp_path)
    assert got["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert "train/lr" not in got  # non-finite values are left out, as metrics.jsonl writes null


def test_fresh_run_drops_an_older_runs_events_and_other_ranks_write_none(tmp_path):
    old = MetricsWriter(tmp_path, rank=0, log=TB)
    old.write({"step": 1, "loss": 1.0, "old_only": 1.0})
    old.close()
    new = MetricsWriter(tmp_path, rank=0, log=TB)  # overwrite=true, or a fresh output_dir
    new.write({"step": 1, "loss": 5.0})
    new.close()
    assert tensorboard_scalars(tmp_path) == {"train/loss": [(1, 5.0)]}
    MetricsWriter(tmp_path / "r1", rank=1, log=TB).write({"step": 1, "loss": 1.0})
    assert not (tmp_path / "r1").exists()
