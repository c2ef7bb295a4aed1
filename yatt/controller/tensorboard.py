"""TensorBoard event files of a run's metric records, beside ``metrics.jsonl`` (rank 0 only).

Every number of a record becomes a scalar at the record's ``step``, under a tag that keeps the
``metrics.jsonl`` key behind a group: ``train/reward_mean``, ``eval/eval_accuracy``,
``time/time_rollout_s``, ``memory/mem_peak_train_gib``, ``genrm/genrm_unparsable``; a list
(``idle_rank_s``) gives one scalar per element (``time/idle_rank_s/1`` is rank 1's). Missing
values (``None``, from a non-finite metric) are left out. View with
``tensorboard --logdir <output_dir>``. The other trackers (:mod:`yatt.controller.trackers`) log
the same names (:func:`scalars`).
"""
from __future__ import annotations

import math
from pathlib import Path

_GROUPS = {"eval": "eval", "time": "time", "idle": "time", "mem": "memory", "genrm": "genrm"}


def tag(key: str) -> str:
    """The TensorBoard tag of a ``metrics.jsonl`` key (``time_rollout_s`` -> ``time/time_rollout_s``)."""
    return f"{_GROUPS.get(key.split('_', 1)[0], 'train')}/{key}"


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a metric record by tag (``{"time/time_rollout_s": 1.5, "time/idle_rank_s/1": 0.2}``):
    a list gives one per element (a bool is 0 or 1); ``step``, ``None``, non-numbers and non-finite values are
    left out."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, v in items:
            if isinstance(v, (int, float)) and math.isfinite(v):
                out[tag(key) if i is None else f"{tag(key)}/{i}"] = float(v)
    return out


class TensorBoardWriter:
    """Scalars of metric records in ``log_dir`` (``torch.utils.tensorboard``, the ``tensorboard`` package).

    Args:
        log_dir: folder of the event files (created).
        resume_step: the checkpoint step a resumed run starts after (0: a fresh run). A fresh run
            deletes the event files an older run left there (as ``metrics.jsonl`` starts empty);
            a resumed run keeps them and purges their events after ``resume_step`` (TensorBoard's
            ``purge_step``), which the resumed run writes again.
    """

    run_id = None  # as a tracker (yatt.controller.trackers): no run to continue, the files are the run

    def __init__(self, log_dir: str | Path, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(log_dir)
        if not resume_step:
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self._writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else None)

    def add(self, record: dict) -> None:
        """Write the numbers of ``record`` (which holds ``step``) and flush them to disk."""
        self.log(int(record["step"]), scalars(record))

    def log(self, step: int, values: dict[str, float]) -> None:
        """Write ``{tag: value}`` (:func:`scalars`) at ``step`` and flush them to disk (a tracker's ``log``)."""
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
