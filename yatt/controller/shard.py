"""The controller shard: this rank's own prompts, served in reshuffled epochs.

Each rank owns a disjoint slice of the dataset (see :mod:`yatt.assets.data`) and draws
``prompts_per_rank`` prompts per step from it; no rank sees the global batch, and with a
:class:`~yatt.assets.data.PromptStream` source no rank holds its whole shard either: rows are
read, validated and tokenized as they are drawn. The position ``(seed, epoch, position)`` is a
small state dict, so a run can resume where it stopped.
"""
from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Any, Generic, Iterator, Protocol, Sequence, TypeVar

from yatt.assets.data import epoch_order

T = TypeVar("T")
_END = object()


class RowSource(Protocol[T]):
    """Where a shard's rows come from (e.g. :class:`~yatt.assets.data.PromptStream`). It may also
    have ``end_epoch()``, called after a whole epoch was drawn, which raises to stop the job."""

    def rows(self, seed: int, epoch: int) -> Iterator[Any]:
        """Raw rows of one epoch, deterministic in ``(seed, epoch)`` and cheap to skip."""

    def prepare(self, raw: Any) -> T | None:
        """The row served for ``raw``, or ``None`` to skip it."""


class SequenceSource(Generic[T]):
    """A :class:`RowSource` over rows already in memory, each epoch a fresh permutation."""

    def __init__(self, rows: Sequence[T]):
        self.items = rows

    def rows(self, seed: int, epoch: int) -> Iterator[int]:
        return iter(epoch_order(len(self.items), seed, epoch))

    def prepare(self, raw: int) -> T:
        return self.items[raw]


class PromptShard(Generic[T]):
    """Epoch-shuffled, resumable iterator over a rank's rows.

    The position is the number of raw rows of the current epoch already drawn (kept or
    skipped); resuming replays the epoch's raw rows up to it without preparing them, so a
    resumed shard serves exactly the batches an uninterrupted one would.

    Args:
        source: a :class:`RowSource` (rows read lazily), or this rank's rows as a sequence.
        batch_size: rows per :meth:`next_batch`.
        seed: shuffle seed (give each rank its own).
    Raises:
        ValueError: empty shard (no raw rows at all) or non-positive batch size.
    """

    def __init__(self, source: RowSource[T] | Sequence[T], batch_size: int, seed: int):
        if isinstance(source, Sequence):
            source = SequenceSource(source)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.epoch, self.position = 0, 0
        self._it: Iterator[Any] | None = None
        if next(iter(source.rows(seed, 0)), _END) is _END:
            raise ValueError("this rank's data shard is empty: raise data.train_size or lower the world size")

    def _open(self) -> Iterator[Any]:
        it = iter(self.source.rows(self.seed, self.epoch))
        deque(islice(it, self.position), maxlen=0)  # replay up to the position, nothing prepared
        self._whole_epoch, self._kept = self.position == 0, 0
        return it

    def next_batch(self) -> list[T]:
        """The next ``batch_size`` rows, crossing into a freshly shuffled epoch when needed.

        Raises:
            ValueError: a whole epoch gave no usable row (every row skipped), or the source's
                ``end_epoch()`` refused the epoch (a data file with no usable row).
        """
        out: list[T] = []
        while len(out) < self.batch_size:
            if self._it is None:
                self._it = self._open()
            raw = next(self._it, _END)
            if raw is _END:
                if self._whole_epoch and not self._kept:
                    stats = getattr(self.source, "stats", None)
                    counts = stats.skipped_so_far() if stats is not None else ""
                    raise ValueError(f"every row of this rank's data shard was skipped in epoch {self.epoch}: "
                                     f"skipped {counts}")
                if self._whole_epoch and hasattr(self.source, "end_epoch"):
                    self.source.end_epoch()
                self.epoch, self.position, self._it = self.epoch + 1, 0, None
                continue
            self.position += 1
            row = self.source.prepare(raw)
            if row is not None:
                out.append(row)
                self._kept += 1
        return out

    def state_dict(self) -> dict:
        """``{"seed", "epoch", "position"}``: ints, what :meth:`load_state_dict` needs to resume."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._it = None
