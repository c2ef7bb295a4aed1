"""The controller shard: this rank's own prompts, served in reshuffled epochs.

Each rank owns a disjoint slice of the dataset (see :mod:`yatt.assets.data`) and draws
``prompts_per_rank`` prompts per step from it; no rank sees the global batch, and with a
:class:`~yatt.assets.data.PromptStream` source no rank holds its whole shard either: rows are
read, validated and tokenized as they are drawn. The position ``(seed, epoch, position)`` is a
small state dict, so a run can resume where it stopped, on the same number of ranks or, through
:func:`resharded_state`, on another.
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
    have ``end_epoch()``, called after a whole epoch was drawn, which raises to stop the job, and
    ``for_rank(rank, world)``, the same data's source for another rank of another world size
    (what a shard resumed on another world size serves first: :func:`resharded_state`)."""

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
        self.carry: dict | None = None  # rows of the shards of a run resumed on another world size
        self._carry_it: Iterator[Any] | None = None
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
            if self.carry is not None:  # first the rows the old world's shards had left
                if self._carry_it is None:
                    self._carry_it = self._carried_rows()
                raw = next(self._carry_it, _END)
                if raw is _END:
                    self.carry, self._carry_it = None, None
                    continue
                self.carry["taken"] += 1
                if (row := self.source.prepare(raw)) is not None:
                    out.append(row)
                continue
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

    def _carried_rows(self) -> Iterator[Any]:
        """This rank's share of the carried rows: every ``ranks``-th of the old shards' rows left
        (each old shard's rest of its epoch ``first``, then its epochs up to ``last``, in old rank
        order), from the ``taken + 1``-th on."""
        c = self.carry

        def left() -> Iterator[Any]:
            for old_rank, (seed, first, position, last) in enumerate(c["shards"]):
                source = self.source.for_rank(old_rank, c["world"])
                for epoch in range(first, last + 1):
                    it = iter(source.rows(seed, epoch))
                    if epoch == first:
                        deque(islice(it, position), maxlen=0)
                    yield from it

        return islice(left(), c["rank"] + c["taken"] * c["ranks"], None, c["ranks"])

    def state_dict(self) -> dict:
        """``{"seed", "epoch", "position"}`` (ints) and, while rows of a run on another world size
        are served, ``"carry"``: what :meth:`load_state_dict` needs to resume."""
        state = {"seed": self.seed, "epoch": self.epoch, "position": self.position}
        if self.carry is not None:
            state["carry"] = {**self.carry, "shards": [list(s) for s in self.carry["shards"]]}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.carry = dict(state["carry"]) if state.get("carry") else None
        self._it = self._carry_it = None


def resharded_state(states: list[dict], rank: int, world: int, seed: int) -> dict:
    """The shard state of ``rank`` of ``world`` that continues a run whose ``len(states)`` ranks
    left ``states`` (their :meth:`PromptShard.state_dict`, in rank order): resuming on another
    number of ranks with no row drawn twice or left out.

    The old shards' rows not yet drawn are served first: each old shard's rest of its current
    epoch, then (a shard behind the others) its whole epochs up to the furthest shard's, so that
    every row has been drawn as often as the furthest shard's rows; they are dealt round-robin to
    the new ranks (this rank takes every ``world``-th). Then each new rank draws its own shard of
    the new world (``seed``) from the next epoch on.

    Raises:
        ValueError: a state still serves the rows of an earlier resize (resume on that world
            size until they are drawn).
    """
    if any(s.get("carry") for s in states):
        raise ValueError(f"the checkpoint's ranks still serve the rows of an earlier resume on another world size; "
                         f"resume it on {len(states)} ranks")
    last = max(s["epoch"] for s in states)
    shards = [[s["seed"], s["epoch"], s["position"], last] for s in states]
    return {"seed": seed, "epoch": last + 1, "position": 0,
            "carry": {"world": len(states), "shards": shards, "rank": rank, "ranks": world, "taken": 0}}
