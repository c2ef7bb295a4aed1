"""TensorBoard event files of a run's metric records, beside ``metrics.jsonl`` (rank 0 only).

Every number of a record becomes a scalar at the record's ``step``, under a tag that keeps the
``metrics.jsonl`` key behind a group: ``train/reward_mean``, ``eval/eval_accuracy``,
``time/time_rollout_s``, ``memory/mem_peak_train_gib``, ``genrm/genrm_unparsable``; a list
(``idle_rank_s``) gives one scalar per element (``time/idle_rank_s/1`` is rank 1's). Missing
values (``None``, from a non-finite metric) are left out. View with
``tensorboard --logdir <output_dir>``.
"""
from __future__ import annotations

import math
from pathlib import Path

_GROUPS = {"eval": "eval", "time": "time", "idle": "time", "mem": "memory", "genrm": "genrm"}


def tag(key: str) -> str:
    """The TensorBoard tag of a ``metrics.jsonl`` key (``time_rollout_s`` -> ``time/time_rollout_s``)."""
    return f"{_GROUPS.get(key.split('_', 1)[0], 'train')}/{key}"


class TensorBoardWriter:
    """Scalars of metric records in ``log_dir`` (``torch.utils.tensorboard``, the ``tensorboard`` package).

    Args:
        log_dir: folder of the event files (created).
        resume_step: the checkpoint step a resumed run starts after (0: a fresh run). A fresh run
            deletes the event files an older run left there (as ``metrics.jsonl`` starts empty);
            a resumed run keeps them and purges their events after ``resume_step`` (TensorBoard's
            ``purge_step``), which the resumed run writes again.
    """

    def __init__(self, log_dir: str | Path, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(log_dir)
        if not resume_step:
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self._writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else None)

    def add(self, record: dict) -> None:
        """Write the numbers of ``record`` (which holds ``step``) and flush them to disk."""
        step = int(record["step"])
        for key, value in record.items():
            if key == "step":
                continue
            items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
            for i, v in items:
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._writer.add_scalar(tag(key) if i is None else f"{tag(key)}/{i}", float(v), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
