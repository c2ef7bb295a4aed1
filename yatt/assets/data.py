"""Prompt datasets: reasoning-gym tasks or local jsonl/parquet files, chat template applied.

A row is a prompt and a reference answer (``data.answer_key``). The prompt is a question string
(``data.question_key``), templated as ``[system?, user: question]``, or a conversation
(``data.messages_key``, used when the row has it): a list of ``{"role", "content"}`` messages in the
OpenAI chat format, roles ``system``, ``user``, ``assistant`` or ``tool``, content a string. Either is
laid out by the tokenizer's chat template with the generation prompt; ``data.system_prompt`` goes
first unless the conversation has a system message. A prompt conversation ends with a user or tool
turn, and the row's ``question`` is its last user turn's text (what rule, GenRM and reward-model
scorers read). Only for ``stage: sft`` (``targets=True``) may it end with an assistant turn: that
turn is the row's target (:attr:`PromptRow.target`), and the prompt is the turns before it.

Each rank reads only its own shard, and the train split is never materialised:
:class:`PromptStream` streams this rank's rows of jsonl/parquet files (line by line, or parquet
batch by batch, through a bounded shuffle buffer) or keeps only the row indices of a
reasoning-gym task and generates each row when it is drawn. Rows are validated and tokenized as
they are drawn. A bad row is skipped and counted by reason in :class:`LoadStats`, and warned
about once per file and reason, with the file and line (jsonl) or row (parquet):

- ``not_json``: a jsonl line that is not JSON, or is JSON but not an object;
- ``missing_field``: no question (nor conversation) or no answer (``data.question_key`` /
  ``data.messages_key`` / ``data.answer_key``);
- ``wrong_type``: a question that is not a string, or an answer that is not a string or number;
- ``empty_field``: an empty (or whitespace-only) question or answer;
- ``bad_messages``: a conversation that is not a list of message objects, a role outside
  system/user/assistant/tool, a content that is not a string, no user turn, an empty last user
  turn, a prompt that does not end with a user or tool turn (a final assistant turn outside
  ``stage: sft``), or one the chat template rejects;
- ``too_long``: the templated prompt is longer than ``data.max_prompt_len`` tokens;
- ``unreadable``: a parquet batch that cannot be read (the rest of that file is skipped).

The job stops (``ValueError``) only when a whole epoch of a rank's shard, or of one of its files,
gave no usable row. :func:`load_prompts` returns a whole (small) shard as a list, for the held-out
eval split.
"""
from __future__ import annotations

import copy
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
    question: str  # the question, or a conversation's last user turn
    answer: str
    entry: dict[str, Any]  # every field of the row, with question, answer and metadata (what scorers read)
    messages: list[dict] | None = None  # the conversation prompt_ids lays out ({role, content}, system prompt in)
    target: str | None = None  # stage sft: the content of a conversation's final assistant turn, split off


SKIP_REASONS = ("not_json", "missing_field", "wrong_type", "empty_field", "bad_messages", "too_long", "unreadable")
ROLES = ("system", "user", "assistant", "tool")  # the roles a conversation's messages may have


@dataclass
class LoadStats:
    """Counters of the rows validated so far (one rank's)."""

    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))  # by reason
    files: dict[str, list[int]] = field(default_factory=dict)  # file -> [rows, kept] (file data only)
    warned: set[tuple[str, str]] = field(default_factory=set)  # (file, reason) pairs already logged

    def skipped_so_far(self) -> dict[str, int]:
        """The reasons with at least one skipped row, and their counts."""
        return {k: v for k, v in self.skipped.items() if v}


@dataclass(frozen=True)
class FileRow:
    """One raw row of a data file: the parsed row (``None`` when unreadable), where it is, and why
    it could not be read (``(reason, detail)``; ``None`` when it was)."""

    row: Any
    file: str
    where: str  # "line 7" (jsonl) or "row 12" (parquet), 1-based
    error: tuple[str, str] | None = None


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


def _file_records(files: list[str], start: int, step: int) -> Iterator[FileRow]:
    """Rows ``start, start + step, ...`` of the jsonl/parquet ``files`` read in order, streamed:
    one jsonl line or one 256-row parquet batch in memory at a time (rows of others not parsed).
    Nothing raises for bad content: a line that is not JSON comes back with ``error`` set, and a
    parquet batch that cannot be read ends its file with one such row (every rank reads every
    batch, so the row split stays the same on all ranks)."""
    i = 0
    for path in files:
        if path.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
                    first = (start - i) % step
                    for k, row in zip(range(first, batch.num_rows, step),
                                      batch.take(list(range(first, batch.num_rows, step))).to_pylist()):
                        yield FileRow(row, path, f"row {i + k + 1}")
                    i += batch.num_rows
            except (pa.ArrowException, OSError) as e:
                yield FileRow(None, path, f"row {i + 1} on", ("unreadable", str(e).splitlines()[0][:200]))
            continue
        with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one bad row, not a crash
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    if i % step == start:
                        try:
                            yield FileRow(json.loads(line), path, f"line {lineno}")
                        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                            yield FileRow(None, path, f"line {lineno}", ("not_json", str(e)))
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


def _file_rows(cfg: DataConfig, split: str, rank: int, world: int) -> Iterator[FileRow]:
    files = cfg.train_files if split == "train" else cfg.eval_files
    yield from _file_records(*_file_part(files, rank, world))


def _is_chat(cfg: DataConfig, row: dict) -> bool:
    """Whether ``row`` holds its prompt as a conversation (``data.messages_key``, not null)."""
    return cfg.messages_key is not None and row.get(cfg.messages_key) is not None


def _split_target(messages: list[dict], targets: bool) -> tuple[list[dict], str | None]:
    """(prompt turns, target) of a conversation of message objects: with ``targets`` a final
    assistant turn is split off as the target (its content), else the target is None."""
    if targets and messages and messages[-1]["role"] == "assistant":
        return messages[:-1], messages[-1]["content"]
    return messages, None


def _messages_problem(key: str, messages: Any, targets: bool) -> str | None:
    """What makes ``messages`` (the row's ``key`` field) no prompt conversation (the detail of a
    ``bad_messages`` skip), or None."""
    if not isinstance(messages, list):
        return f"{key!r} is a {type(messages).__name__}, not a list of messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"{key}[{i}] is a {type(m).__name__}, not a message object"
        if m.get("role") not in ROLES:
            return f"{key}[{i}] has role {m.get('role')!r}, not one of {'/'.join(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"{key}[{i}] has content of type {type(m.get('content')).__name__}, not a string"
    prompt, _ = _split_target(messages, targets)
    users = [m for m in prompt if m["role"] == "user"]
    if not users:
        return f"{key!r} has no user turn" + (" before its final assistant turn" if len(prompt) < len(messages) else "")
    if prompt[-1]["role"] not in ("user", "tool"):
        hint = "" if targets else " (a final assistant turn is a target: stage sft only)"
        return f"{key!r} ends with a {prompt[-1]['role']!r} turn; a prompt ends with a user or tool turn{hint}"
    if not users[-1]["content"].strip():
        return f"{key!r} has an empty last user turn"
    return None


def _answer_problem(cfg: DataConfig, answer: Any) -> tuple[str, str] | None:
    """``(reason, detail)`` when ``answer`` (the row's ``data.answer_key`` field) is no reference answer."""
    if answer is None:
        return "missing_field", f"no {cfg.answer_key!r}"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return "wrong_type", f"{cfg.answer_key!r} has type {type(answer).__name__}"
    if not str(answer).strip():
        return "empty_field", f"empty {cfg.answer_key!r}"
    return None


def _check(cfg: DataConfig, row: Any, targets: bool = False) -> tuple[str, str] | None:
    """``(reason, detail)`` when ``row`` cannot be a prompt, else None (the length is checked later)."""
    if not isinstance(row, dict):
        return "not_json", f"a JSON {type(row).__name__}, not an object"
    if _is_chat(cfg, row):
        problem = _messages_problem(cfg.messages_key, row[cfg.messages_key], targets)
        return ("bad_messages", problem) if problem else _answer_problem(cfg, row.get(cfg.answer_key))
    question, answer = row.get(cfg.question_key), row.get(cfg.answer_key)
    if question is None or answer is None:
        key = cfg.question_key if question is None else cfg.answer_key
        nor = f" (nor {cfg.messages_key!r})" if question is None and cfg.messages_key else ""
        return "missing_field", f"no {key!r}{nor}"
    if not isinstance(question, str) or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        key, value = (cfg.question_key, question) if not isinstance(question, str) else (cfg.answer_key, answer)
        return "wrong_type", f"{key!r} has type {type(value).__name__}"
    if not question.strip() or not str(answer).strip():
        return "empty_field", f"empty {cfg.question_key if not question.strip() else cfg.answer_key!r}"
    return None


def _conversation(cfg: DataConfig, row: dict, targets: bool) -> tuple[list[dict], str, str | None]:
    """(prompt conversation, question, target) of a row :func:`_check` passed: a question row's
    ``[system?, user: question]``, or a chat row's turns (a final assistant turn split off as the
    target with ``targets``); ``data.system_prompt`` first unless the conversation has a system turn."""
    if _is_chat(cfg, row):
        messages, target = _split_target([dict(m) for m in row[cfg.messages_key]], targets)
        question = [m for m in messages if m["role"] == "user"][-1]["content"]
    else:
        question, target = row[cfg.question_key], None
        messages = [{"role": "user", "content": question}]
    if cfg.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return messages, question, target


def _prompt_ids(cfg: DataConfig, tokenizer, messages: list[dict]) -> tuple[list[int], tuple[str, str] | None]:
    """(the chat template's ids of ``messages`` with the generation prompt, and ``(reason, detail)``
    when the template rejects them (``bad_messages``) or they are over ``data.max_prompt_len``)."""
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except TemplateError as e:
        return [], ("bad_messages", f"the chat template rejects it: {e}")
    if len(ids) > cfg.max_prompt_len:
        return [], ("too_long", f"{len(ids)} prompt tokens > data.max_prompt_len {cfg.max_prompt_len}")
    return list(ids), None


def _prepare(cfg: DataConfig, tokenizer, raw: Any, stats: LoadStats, targets: bool = False) -> PromptRow | None:
    """Validate and tokenize one raw row (a row dict, or a :class:`FileRow`); ``None`` (and a
    counted skip, warned about once per file and reason) for a bad one. ``targets``: a chat row
    may end with an assistant turn, its target (``stage: sft``)."""
    stats.rows += 1
    file, row, bad = (raw.file, raw.row, raw.error) if isinstance(raw, FileRow) else (None, raw, None)
    if file is not None:
        stats.files.setdefault(file, [0, 0])[0] += 1
    bad = bad or _check(cfg, row, targets)
    if bad is None:
        messages, question, target = _conversation(cfg, row, targets)
        ids, bad = _prompt_ids(cfg, tokenizer, messages)
    if bad is not None:
        reason, detail = bad
        stats.skipped[reason] += 1
        if (file, reason) not in stats.warned:
            stats.warned.add((file, reason))
            where = f"{file}, {raw.where}" if file else "a row"
            log.warning("data: skipping %s (%s: %s); further %s rows%s are counted, not logged; skipped so "
                        "far %s", where, reason, detail, reason, " of this file" if file else "",
                        stats.skipped_so_far())
        return None
    stats.kept += 1
    if file is not None:
        stats.files[file][1] += 1
    answer = str(row[cfg.answer_key])
    entry = {**row, "question": question, "answer": answer, "metadata": row.get("metadata") or {}}
    return PromptRow(ids, question, answer, entry, messages, target)


def load_prompts(cfg: DataConfig, tokenizer, split: str, rank: int = 0, world: int = 1,
                 targets: bool = False) -> tuple[list[PromptRow], LoadStats]:
    """Load this rank's whole shard of the train or eval prompts as a list (for the eval split).

    Args:
        cfg: the ``data`` section of the recipe.
        tokenizer: HF tokenizer with a chat template.
        split: ``"train"`` or ``"eval"``.
        rank, world: this rank's index and the number of shards.
        targets: a conversation may end with an assistant turn, split off as the row's target
            (``stage: sft``); otherwise such a row is skipped (``bad_messages``).
    Returns:
        (rows kept, in shard order; load statistics with skip counters).
    Raises:
        ValueError: unknown split. Bad rows are skipped, never raised.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    source = _reasoning_gym_rows if cfg.source == "reasoning_gym" else _file_rows
    stats = LoadStats()
    kept = [row for raw in source(cfg, split, rank, world)
            if (row := _prepare(cfg, tokenizer, raw, stats, targets)) is not None]
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
        targets: a conversation may end with an assistant turn, its target (``stage: sft``); see
            :func:`load_prompts`.
    Raises:
        ValueError: ``data.source == "file"`` without ``train_files``.
    Attributes:
        stats: :class:`LoadStats` counters, accumulated as rows are validated (:meth:`prepare`).
    """

    def __init__(self, cfg: DataConfig, tokenizer, rank: int = 0, world: int = 1, buffer_size: int = SHUFFLE_BUFFER,
                 targets: bool = False):
        self.cfg, self.tokenizer, self.buffer_size, self.targets = cfg, tokenizer, buffer_size, targets
        self.stats = LoadStats()
        if cfg.source == "reasoning_gym":
            self._task = _task_dataset(cfg, "train")
            self._indices = range(rank, len(self._task), world)
        elif not cfg.train_files:
            raise ValueError("data.source is 'file' but data.train_files is empty")
        else:
            self._files, self._start, self._step = _file_part(cfg.train_files, rank, world)

    def for_rank(self, rank: int, world: int) -> "PromptStream":
        """The same data's stream for ``rank`` of ``world`` (a resume on another world size reads
        the old ranks' rows through it); it shares this stream's counters and task rows."""
        other = copy.copy(self)
        if self.cfg.source == "reasoning_gym":
            other._indices = range(rank, len(self._task), world)
        else:
            other._files, other._start, other._step = _file_part(self.cfg.train_files, rank, world)
        return other

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
        return _prepare(self.cfg, self.tokenizer, row, self.stats, self.targets)

    def end_epoch(self) -> None:
        """Called after a whole epoch was drawn: a file of this rank's that gave rows but no usable
        one is a wrong file or key, not a few bad rows.

        Raises:
            ValueError: naming the file(s), with the skip counts.
        """
        dead = [f for f, (rows, kept) in self.stats.files.items() if rows and not kept]
        if dead:
            raise ValueError(f"data: no usable row in {', '.join(dead)} (this rank's rows of it, all skipped; "
                             f"skipped so far {self.stats.skipped_so_far()}); check "
                             f"the file and data.question_key={self.cfg.question_key!r} / "
                             f"data.messages_key={self.cfg.messages_key!r} / data.answer_key={self.cfg.answer_key!r}")
        self.stats.files.clear()  # the next epoch is judged on its own
