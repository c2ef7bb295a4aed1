"""The controller shard: this rank's own prompts, served in reshuffled epochs.

Each rank owns a disjoint slice of the dataset (see :mod:`yatt.assets.data`) and draws
``prompts_per_rank`` prompts per step from it; no rank sees the global batch. The position
``(epoch, cursor)`` is a small state dict, so a run can resume where it stopped.
"""
from __future__ import annotations

import random
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


class PromptShard(Generic[T]):
    """Epoch-shuffled, resumable iterator over a rank's rows.

    Args:
        rows: this rank's rows (non-empty).
        batch_size: rows per :meth:`next_batch`.
        seed: shuffle seed (give each rank its own).
    Raises:
        ValueError: empty shard or non-positive batch size.
    """

    def __init__(self, rows: Sequence[T], batch_size: int, seed: int):
        if not rows:
            raise ValueError("this rank's data shard is empty: raise data.train_size or lower the world size")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[T]:
        """The next ``batch_size`` rows, crossing into a freshly shuffled epoch when needed."""
        out = []
        while len(out) < self.batch_size:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.rows[self._order[self.cursor]])
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self._order = self._shuffled(self.epoch)
