"""Prompt datasets: reasoning-gym tasks or local jsonl/parquet files, chat template applied.

Each rank reads only its own shard, and the train split is never materialised:
:class:`PromptStream` streams this rank's rows of jsonl/parquet files (line by line, or parquet
batch by batch, through a bounded shuffle buffer) or keeps only the row indices of a
reasoning-gym task and generates each row when it is drawn. Rows are validated and tokenized as
they are drawn. Rows with a missing/empty question or answer, or whose templated prompt is
longer than ``data.max_prompt_len`` tokens, are skipped and counted in :class:`LoadStats`, never
fatal. :func:`load_prompts` returns a whole (small) shard as a list, for the held-out eval split.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Iterator

from yatt.config import DataConfig

log = logging.getLogger("yatt")
# Keeps held-out prompts away from the training stream of the same task.
EVAL_SEED_OFFSET = 1_000_003
# Rows held by the streaming shuffle of file data (per rank): bounds memory, not the dataset size.
SHUFFLE_BUFFER = 1024


@dataclass
class PromptRow:
    prompt_ids: list[int]  # chat-templated prompt tokens, generation prompt included
    question: str
    answer: str
    entry: dict[str, Any]  # what the task's scorer reads (question, answer, metadata)


@dataclass
class LoadStats:
    rows: int = 0  # rows validated so far
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"missing_field": 0, "too_long": 0})


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of ``range(n)``, fixed by ``(seed, epoch)``."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _task_dataset(cfg: DataConfig, split: str):
    import reasoning_gym as rg

    size = cfg.train_size if split == "train" else cfg.eval_size
    seed = cfg.seed if split == "train" else cfg.seed + EVAL_SEED_OFFSET
    return rg.create_dataset(cfg.task, size=size, seed=seed, **cfg.task_config)


def _reasoning_gym_rows(cfg: DataConfig, split: str, rank: int, world: int) -> Iterator[dict]:
    ds = _task_dataset(cfg, split)
    seen: set[str] = set()
    if split == "eval":  # held out: drop questions that also occur in the training set
        seen = {row["question"] for row in _task_dataset(cfg, "train")}
    for i in range(rank, len(ds), world):
        row = ds[i]
        if row["question"] not in seen:
            yield row


def _file_part(files: list[str], rank: int, world: int) -> tuple[list[str], int, int]:
    """This rank's part of ``files``: (files to read, first row, row step).

    Whole files go to ranks when their number divides by ``world``, else row ``i`` of all the
    files read in the given order goes to rank ``i % world``. The split never depends on a
    shuffle seed, so each rank may shuffle with its own seed and the parts stay disjoint.
    """
    if len(files) % world == 0:
        return list(files[rank::world]), 0, 1
    return list(files), rank, world


def _file_records(files: list[str], start: int, step: int) -> Iterator[dict]:
    """Rows ``start, start + step, ...`` of the jsonl/parquet ``files`` read in order, streamed:
    one jsonl line or one 256-row parquet batch in memory at a time (rows of others not parsed).

    Raises:
        json.JSONDecodeError: a malformed jsonl line of this rank's.
    """
    i = 0
    for path in files:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
                first = (start - i) % step
                yield from batch.take(list(range(first, batch.num_rows, step))).to_pylist()
                i += batch.num_rows
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    if i % step == start:
                        yield json.loads(line)
                    i += 1


def _buffer_shuffled(rows: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """``rows`` in a shuffled order, holding at most ``size`` of them (a streaming shuffle buffer)."""
    buffer: list[Any] = []
    for row in rows:
        if len(buffer) < size:
            buffer.append(row)
            continue
        j = rng.randrange(size)
        yield buffer[j]
        buffer[j] = row
    rng.shuffle(buffer)
    yield from buffer


def _file_rows(cfg: DataConfig, split: str, rank: int, world: int) -> Iterator[dict]:
    files = cfg.train_files if split == "train" else cfg.eval_files
    yield from _file_records(*_file_part(files, rank, world))


def _prepare(cfg: DataConfig, tokenizer, row: dict, stats: LoadStats) -> PromptRow | None:
    """Validate and tokenize one raw row; ``None`` (and a counted skip) for a bad one."""
    stats.rows += 1
    question, answer = row.get(cfg.question_key), row.get(cfg.answer_key)
    reason = None
    if question in (None, "") or answer is None or str(answer) == "":
        reason = "missing_field"
    else:
        messages = [{"role": "user", "content": str(question)}]
        if cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) > cfg.max_prompt_len:
            reason = "too_long"
    if reason is not None:
        stats.skipped[reason] += 1
        if stats.skipped[reason] == 1:
            log.warning("data: skipping a row (%s); skipped so far %s, counted as rows are drawn", reason, stats.skipped)
        return None
    stats.kept += 1
    entry = {"question": str(question), "answer": str(answer), "metadata": row.get("metadata") or {}}
    return PromptRow(list(ids), str(question), str(answer), entry)


def load_prompts(cfg: DataConfig, tokenizer, split: str, rank: int = 0, world: int = 1) -> tuple[list[PromptRow], LoadStats]:
    """Load this rank's whole shard of the train or eval prompts as a list (for the eval split).

    Args:
        cfg: the ``data`` section of the recipe.
        tokenizer: HF tokenizer with a chat template.
        split: ``"train"`` or ``"eval"``.
        rank, world: this rank's index and the number of shards.
    Returns:
        (rows kept, in shard order; load statistics with skip counters).
    Raises:
        ValueError: unknown split. Bad rows are skipped, never raised.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    source = _reasoning_gym_rows if cfg.source == "reasoning_gym" else _file_rows
    stats = LoadStats()
    kept = [row for raw in source(cfg, split, rank, world) if (row := _prepare(cfg, tokenizer, raw, stats)) is not None]
    return kept, stats


class PromptStream:
    """This rank's train prompts, read lazily: the row source of a :class:`~yatt.controller.shard.PromptShard`.

    Memory does not grow with the dataset: files are streamed through a shuffle buffer of
    ``buffer_size`` rows; a reasoning-gym task keeps only this rank's row indices
    (``range(rank, train_size, world)``) and generates a row when it is drawn. Nothing is read
    until :meth:`rows` is iterated.

    Args:
        cfg: the ``data`` section of the recipe (train split: ``train_size`` or ``train_files``).
        tokenizer: HF tokenizer with a chat template.
        rank, world: this rank's index and the number of shards.
        buffer_size: rows in the streaming shuffle buffer (file data).
    Raises:
        ValueError: ``data.source == "file"`` without ``train_files``.
    Attributes:
        stats: :class:`LoadStats` counters, accumulated as rows are validated (:meth:`prepare`).
    """

    def __init__(self, cfg: DataConfig, tokenizer, rank: int = 0, world: int = 1, buffer_size: int = SHUFFLE_BUFFER):
        self.cfg, self.tokenizer, self.buffer_size = cfg, tokenizer, buffer_size
        self.stats = LoadStats()
        if cfg.source == "reasoning_gym":
            self._task = _task_dataset(cfg, "train")
            self._indices = range(rank, len(self._task), world)
        elif not cfg.train_files:
            raise ValueError("data.source is 'file' but data.train_files is empty")
        else:
            self._files, self._start, self._step = _file_part(cfg.train_files, rank, world)

    def rows(self, seed: int, epoch: int) -> Iterator[Any]:
        """This rank's raw rows (row dicts or task indices) in epoch ``epoch``'s order.

        Cheap to skip (nothing is tokenized here) and deterministic in ``(seed, epoch)``: the
        same arguments give the same sequence, which is what makes a shard resumable. Files:
        this rank's whole files (if it has them) in a shuffled order, through the shuffle buffer.
        """
        if self.cfg.source == "reasoning_gym":
            return (self._indices[i] for i in epoch_order(len(self._indices), seed, epoch))
        rng, files = random.Random(seed * 1_000_003 + epoch), list(self._files)
        if self._step == 1:
            rng.shuffle(files)
        return _buffer_shuffled(_file_records(files, self._start, self._step), self.buffer_size, rng)

    def prepare(self, raw: Any) -> PromptRow | None:
        """The :class:`PromptRow` of one raw row, or ``None`` when it is skipped (counted in :attr:`stats`)."""
        row = self._task[raw] if self.cfg.source == "reasoning_gym" else raw
        return _prepare(self.cfg, self.tokenizer, row, self.stats)
