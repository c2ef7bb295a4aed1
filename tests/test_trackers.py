"""Experiment trackers (log.trackers): the records of a MetricsWriter read back from TensorBoard,
W&B (offline, its .wandb transaction log) and MLflow (file store); a resumed run continues the same
W&B and MLflow runs; a tracker that fails warns once and the records still reach metrics.jsonl.
No network: W&B is offline, MLflow a file store under tmp_path."""
from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
from pathlib import Path

import pytest

from conftest import tensorboard_scalars
from yatt.config import ConfigError, LogConfig, load_config
from yatt.controller import trackers
from yatt.controller.metrics import MetricsWriter

RECORDS = [{"step": 1, "reward_mean": 0.5, "kl": float("nan"), "time_rollout_s": 2.0, "idle_rank_s": [0.0, 0.25]},
           {"step": 2, "reward_mean": 0.75, "kl": 0.125, "time_rollout_s": 3.0, "idle_rank_s": [0.5, 0.0],
            "eval_accuracy": None}]
WANT = {  # values exact in float32 (TensorBoard)
        "train/reward_mean": [(1, 0.5), (2, 0.75)], "train/kl": [(2, 0.125)], "time/time_rollout_s": [(1, 2.0), (2, 3.0)],
        "time/idle_rank_s/0": [(1, 0.0), (2, 0.5)], "time/idle_rank_s/1": [(1, 0.25), (2, 0.0)]}
CONFIG = load_config(None, ["trainer.total_steps=2"]).model_dump(mode="json")


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))


def _log(*names: str, **options) -> LogConfig:
    return LogConfig(trackers=list(names), wandb={"mode": "offline"}, **options)


def _write(out: Path, cfg: LogConfig, records: list[dict], resume_step: int = 0) -> None:
    writer = MetricsWriter(out, rank=0, resume_step=resume_step, log=cfg, config=CONFIG)
    for r in records:
        writer.write(r)
    writer.close()


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B transaction log (``run-<id>.wandb``: LevelDB's log format,
    32 KiB blocks of chunks with a 7-byte header, after a 7-byte ``:W&B`` file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or kind == 0:  # the block's padding
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7:pos + 7 + size], pos + 7 + size
        if kind in (1, 4):  # a full record, or the last chunk of one
            out.append(pb.Record.FromString(chunk))
            chunk = b""
    return out


def _wandb_runs(out: Path) -> list[tuple[str, dict[str, list[tuple[int, float]]], dict]]:
    """(run id, {name: [(step, value)]}, config) of each offline W&B run under ``out/wandb``, oldest first."""
    runs = []
    for run_dir in sorted((out / "wandb").glob("offline-run-*")):
        history, config, run_id = {}, {}, None
        for rec in _wandb_records(next(run_dir.glob("run-*.wandb"))):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id = rec.run.run_id
            if kind in ("run", "config"):
                items = rec.run.config.update if kind == "run" else rec.config.update
                config.update({i.key: json.loads(i.value_json) for i in items})
            if kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                for name, value in row.items():
                    if not name.startswith("_") and name != "step":
                        history.setdefault(name, []).append((row["step"], value))
        runs.append((run_id, history, config))
    return runs


def _mlflow(out: Path, run_id: str) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as the tracker does in the job's process

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    history = {name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)] for name in run.data.metrics}
    return history, run.data.params


def test_two_records_reach_all_three_trackers(tmp_path):
    _write(tmp_path, _log("tensorboard", "wandb", "mlflow"), RECORDS)
    ids = json.loads((tmp_path / "trackers.json").read_text())
    assert set(ids) == {"wandb", "mlflow"}
    assert tensorboard_scalars(tmp_path) == WANT
    [(wandb_id, history, config)] = _wandb_runs(tmp_path)
    assert wandb_id == ids["wandb"] and history == WANT
    assert config["trainer.total_steps"] == 2 and config["reward.sources"] == CONFIG["reward"]["sources"]
    history, params = _mlflow(tmp_path, ids["mlflow"])
    assert history == WANT
    assert params["trainer.total_steps"] == "2" and params["model.path"] == CONFIG["model"]["path"]
    assert len(Path(tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_resumed_run_continues_the_same_tracker_runs_and_a_fresh_one_starts_new_ones(tmp_path):
    cfg = _log("wandb", "mlflow")
    _write(tmp_path, cfg, RECORDS)  # interrupted after step 2; its checkpoint is step 1
    first = json.loads((tmp_path / "trackers.json").read_text())
    _write(tmp_path, cfg, [{"step": 2, "reward_mean": 1.0}, {"step": 3, "reward_mean": 2.0}], resume_step=1)
    assert json.loads((tmp_path / "trackers.json").read_text()) == first
    runs = _wandb_runs(tmp_path)
    assert [r[0] for r in runs] == [first["wandb"]] * 2  # W&B syncs both offline folders into one run
    assert runs[1][1] == {"train/reward_mean": [(2, 1.0), (3, 2.0)]}
    history, _ = _mlflow(tmp_path, first["mlflow"])
    assert history["train/reward_mean"] == [(1, 0.5), (2, 0.75), (2, 1.0), (3, 2.0)]
    _write(tmp_path, cfg, RECORDS[:1])  # a fresh run (overwrite=true) in the same output_dir
    fresh = json.loads((tmp_path / "trackers.json").read_text())
    assert fresh["wandb"] != first["wandb"] and fresh["mlflow"] != first["mlflow"]
    assert _mlflow(tmp_path, fresh["mlflow"])[0] == {k: v[:1] for k, v in WANT.items() if k != "train/kl"}


def _warnings(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(f"log.trackers: {name} disabled")]


def test_a_missing_wandb_package_warns_once_and_the_records_still_go_to_metrics_jsonl(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with caplog.at_level(logging.WARNING, logger="yatt"):
        _write(tmp_path, _log("tensorboard", "wandb"), RECORDS)
    [warning] = _warnings(caplog, "wandb")
    assert "ModuleNotFoundError" in warning and "wandb" in warning, warning
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert tensorboard_scalars(tmp_path) == WANT and not (tmp_path / "trackers.json").exists()


def test_a_bad_mlflow_uri_warns_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="yatt"):
        _write(tmp_path, _log("mlflow", mlflow={"tracking_uri": "nosuchscheme://nowhere"}), RECORDS)
    [warning] = _warnings(caplog, "mlflow")
    assert "nosuchscheme" in warning, warning
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_tracker_that_raises_while_logging_is_disabled_with_one_warning(tmp_path, monkeypatch, caplog):
    def broken(self, step, values):
        raise RuntimeError("store went away")

    monkeypatch.setattr(trackers.MlflowTracker, "log", broken)
    writer = MetricsWriter(tmp_path, rank=0, log=_log("tensorboard", "mlflow"), config=CONFIG)
    with caplog.at_level(logging.WARNING, logger="yatt"):
        for r in RECORDS:
            writer.write(r)
        writer.close()
    assert _warnings(caplog, "mlflow") == ["log.trackers: mlflow disabled, it failed to log: RuntimeError: store went "
                                           "away; the metrics still go to metrics.jsonl"]
    assert writer.trackers.names == [] and tensorboard_scalars(tmp_path) == WANT


def test_config_names_the_key():
    with pytest.raises(ConfigError, match=r"log.tensorboard: replaced by log.trackers"):
        load_config(None, ["log.tensorboard=true"])
    with pytest.raises(ConfigError, match=r"log.trackers: a tracker is listed twice"):
        load_config(None, ["log.trackers=[mlflow,mlflow]"])
    with pytest.raises(ConfigError, match=r"log.trackers\[1\]"):
        load_config(None, ["log.trackers=[wandb,neptune]"])
    with pytest.raises(ConfigError, match=r"log.wandb.mode"):
        load_config(None, ["log.wandb.mode=sometimes"])
    cfg = load_config(None, ["log.trackers=[tensorboard,wandb,mlflow]", "log.wandb.mode=offline"]).log
    assert cfg.trackers == ["tensorboard", "wandb", "mlflow"] and cfg.wandb.mode == "offline"
    assert load_config(None, ["log.trackers=[]"]).log.trackers == []


@pytest.mark.e2e
@pytest.mark.slow
def test_the_demo_job_logs_the_same_metrics_to_every_tracker(demo_run):
    """conftest's 2-step demo run (``mpirun -np 2``) had all three trackers: W&B and MLflow hold
    exactly TensorBoard's scalars (float32 there), the run's config among their parameters."""
    ids = json.loads((demo_run.out / "trackers.json").read_text())
    tb = tensorboard_scalars(demo_run.out)
    assert tb["train/reward_mean"][-1][0] == 2 and "eval/eval_accuracy" in tb
    [(wandb_id, wandb_history, config)] = _wandb_runs(demo_run.out)
    mlflow_history, params = _mlflow(demo_run.out, ids["mlflow"])
    assert wandb_id == ids["wandb"] and config["trainer.total_steps"] == 2 and params["trainer.total_steps"] == "2"
    for history in (wandb_history, mlflow_history):
        assert history.keys() == tb.keys()
        for name, points in tb.items():
            assert [s for s, _ in history[name]] == [s for s, _ in points], name
            assert all(math.isclose(v, w, rel_tol=1e-6, abs_tol=1e-30) for (_, v), (_, w) in zip(history[name], points)), name
    assert "wandb: started run " in demo_run.log and "mlflow: started run " in demo_run.log
