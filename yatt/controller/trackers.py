"""Experiment trackers of a run's metric records (rank 0 only; config key ``log.trackers``).

Every number of each record goes to each tracker once, at the record's ``step``, under the
names of :func:`yatt.controller.tensorboard.scalars` (``train/reward_mean``,
``eval/eval_accuracy``, ``time/idle_rank_s/1``; ``None`` and non-finite values left out). The
resolved config, flattened to dotted keys (``trainer.lr``), is the run's parameters.

- ``tensorboard``: event files in ``<output_dir>/tensorboard`` (:class:`TensorBoardWriter`).
- ``wandb``: a W&B run (``log.wandb``). Its charts plot against the logged ``step`` metric
  (``define_metric``), so the steps a resumed run logs again are never dropped as out of order.
- ``mlflow``: an MLflow run (``log.mlflow``), by default in the file store ``<output_dir>/mlruns``.

A resumed run (``resume_step > 0``) continues the W&B and MLflow runs whose ids
``<output_dir>/trackers.json`` keeps; a fresh run starts new ones. W&B and MLflow cannot delete
points, so the steps after the checkpoint that the interrupted run had logged show twice there
(TensorBoard purges them).

A tracker that fails (its package is missing, its URI is bad, it raises while logging) is
disabled with one warning naming it and why; the records still go to ``metrics.jsonl`` and the
other trackers, and training goes on.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

from yatt.controller.tensorboard import TensorBoardWriter, scalars

if TYPE_CHECKING:
    from yatt.config import LogConfig, MlflowConfig, WandbConfig

log = logging.getLogger("yatt")
STATE_FILE = "trackers.json"  # {tracker name: its run id}, in the output_dir


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"lr": 1e-5}}`` -> ``{"trainer.lr": 1e-5}`` (lists and empty mappings stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class WandbTracker:
    """A Weights & Biases run: ``run_id`` None starts one, else continues that one (``resume="allow"``).

    Raises:
        ImportError: no ``wandb`` package; any error of ``wandb.init`` (e.g. online without a login).
    """

    def __init__(self, output_dir: Path, opts: WandbConfig, params: dict[str, Any], run_id: str | None) -> None:
        # W&B's own terminal lines (banners, integration tips) would interleave with the job's log;
        # the run's id and place are logged below. Exported values win.
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        folder = Path(opts.dir) if opts.dir else output_dir
        folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=opts.project, entity=opts.entity, name=opts.name or output_dir.resolve().name,
                               tags=opts.tags or None, mode=opts.mode, dir=str(folder), id=run_id,
                               resume="allow" if run_id else None, reinit="create_new",
                               settings=wandb.Settings(console="off", silent=True))  # the job's log says it
        self._run.config.update(params, allow_val_change=True)
        self._run.define_metric("step", hidden=True)
        self._run.define_metric("*", step_metric="step")
        self.run_id: str | None = self._run.id
        where = (f"offline in {self._run.dir} (upload: wandb sync {Path(self._run.dir).parent})" if self._run.offline
                 else self._run.url)
        log.info("wandb: %s run %s, %s", "continuing" if run_id else "started", self.run_id, where)

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log({"step": step, **values})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run: ``run_id`` None starts one in ``opts.experiment`` (created if missing), else
    continues that one; parameters it already has keep their first value (MLflow's are immutable).

    Raises:
        ImportError: no ``mlflow`` package; MlflowException: a bad tracking URI or store.
    """

    def __init__(self, output_dir: Path, opts: MlflowConfig, params: dict[str, Any], run_id: str | None) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        uri = opts.tracking_uri or (output_dir.resolve() / "mlruns").as_uri()
        if urlparse(uri).scheme in ("", "file"):  # MLflow 3 refuses its file store unless asked for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(uri)
        known: dict[str, str] = {}
        resumed = False
        if run_id is not None:
            try:
                known = client.get_run(run_id).data.params
                client.update_run(run_id, status="RUNNING")
                resumed = True
            except MlflowException as e:
                log.warning("mlflow: run %s of %s is not in %s (%s): starting a new run", run_id, STATE_FILE, uri, e)
                run_id = None
        if run_id is None:
            exp = client.get_experiment_by_name(opts.experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(opts.experiment)
            run_id = client.create_run(exp_id, run_name=opts.run_name or output_dir.resolve().name,
                                       tags=opts.tags).info.run_id
        text = {k: v if isinstance(v, str) else json.dumps(v) for k, v in params.items() if k not in known}
        new = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in text.items()]
        for i in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            client.log_batch(run_id, params=new[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        self.run_id: str | None = run_id
        log.info("mlflow: %s run %s in %s", "continuing" if resumed else "started", run_id, uri)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in values.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _start(name: str, output_dir: Path, resume_step: int, cfg: LogConfig, params: dict, run_id: str | None):
    if name == "tensorboard":
        return TensorBoardWriter(output_dir / "tensorboard", resume_step)
    if name == "wandb":
        return WandbTracker(output_dir, cfg.wandb, params, run_id)
    if name == "mlflow":
        return MlflowTracker(output_dir, cfg.mlflow, params, run_id)
    raise ValueError(f"log.trackers: unknown tracker {name!r}")


class Trackers:
    """The trackers of ``cfg.trackers`` for the run in ``output_dir``, each disabled with one
    warning on its first failure.

    Args:
        output_dir: the run's folder: ``trackers.json`` and the trackers' default places.
        resume_step: the checkpoint step a resumed run starts after (0: a fresh run, new tracker runs).
        cfg: ``log`` (``trackers``, ``wandb``, ``mlflow``).
        config: the resolved run config, nested (``Config.model_dump(mode="json")``): the run's parameters.
    """

    def __init__(self, output_dir: str | Path, resume_step: int, cfg: LogConfig, config: dict | None = None) -> None:
        output_dir = Path(output_dir)
        self._state_path = output_dir / STATE_FILE
        state = self._read_state() if resume_step else {}
        params = flatten(config or {})
        self._active: dict[str, Any] = {}
        for name in cfg.trackers:
            tracker = self._guard(name, "start", lambda: _start(name, output_dir, resume_step, cfg, params,
                                                                state.get(name)))
            if tracker is not None:
                self._active[name] = tracker
                if tracker.run_id is not None:
                    state[name] = tracker.run_id
        if state:
            tmp = self._state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=1) + "\n")
            tmp.replace(self._state_path)
        else:
            self._state_path.unlink(missing_ok=True)

    @property
    def names(self) -> list[str]:
        """The trackers still enabled."""
        return list(self._active)

    def log(self, record: dict) -> None:
        """Log the numbers of ``record`` (which holds ``step``) to every enabled tracker."""
        step, values = int(record["step"]), scalars(record)
        for name, tracker in list(self._active.items()):
            self._guard(name, "log", lambda: tracker.log(step, values))

    def close(self) -> None:
        """End every tracker's run (flushing it); a second call does nothing."""
        for name, tracker in list(self._active.items()):
            self._guard(name, "close", tracker.close)
        self._active.clear()

    def _read_state(self) -> dict[str, str]:
        try:
            state = json.loads(self._state_path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as e:
            log.warning("%s: unreadable (%s): the trackers start new runs", self._state_path, e)
            return {}
        return {k: v for k, v in state.items() if isinstance(v, str)} if isinstance(state, dict) else {}

    def _guard(self, name: str, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, or None after disabling tracker ``name`` with a warning if it raised."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            self._active.pop(name, None)
            hint = " (pip install -r requirements.txt)" if isinstance(e, ImportError) else ""
            log.warning("log.trackers: %s disabled, it failed to %s: %s: %s%s; the metrics still go to "
                        "metrics.jsonl", name, what, type(e).__name__, e, hint)
            return None
