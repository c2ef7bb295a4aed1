"""Prompt datasets: reasoning-gym tasks or local jsonl/parquet files, chat template applied.

Each rank loads only its own shard (row ``i`` belongs to rank ``i % world``). Rows with a
missing/empty question or answer, or whose templated prompt is longer than
``data.max_prompt_len`` tokens, are skipped and counted in :class:`LoadStats`, never fatal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from yatt.config import DataConfig

# Keeps held-out prompts away from the training stream of the same task.
EVAL_SEED_OFFSET = 1_000_003


@dataclass
class PromptRow:
    prompt_ids: list[int]  # chat-templated prompt tokens, generation prompt included
    question: str
    answer: str
    entry: dict[str, Any]  # what the task's scorer reads (question, answer, metadata)


@dataclass
class LoadStats:
    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"missing_field": 0, "too_long": 0})


def _reasoning_gym_rows(cfg: DataConfig, split: str, rank: int, world: int) -> Iterator[dict]:
    import reasoning_gym as rg

    size = cfg.train_size if split == "train" else cfg.eval_size
    seed = cfg.seed if split == "train" else cfg.seed + EVAL_SEED_OFFSET
    ds = rg.create_dataset(cfg.task, size=size, seed=seed, **cfg.task_config)
    seen: set[str] = set()
    if split == "eval":  # held out: drop questions that also occur in the training set
        train = rg.create_dataset(cfg.task, size=cfg.train_size, seed=cfg.seed, **cfg.task_config)
        seen = {row["question"] for row in train}
    for i in range(rank, size, world):
        row = ds[i]
        if row["question"] not in seen:
            yield row


def _file_rows(cfg: DataConfig, split: str, rank: int, world: int) -> Iterator[dict]:
    import datasets

    files = cfg.train_files if split == "train" else cfg.eval_files
    if not files:
        return
    kind = "parquet" if files[0].endswith(".parquet") else "json"
    ds = datasets.load_dataset(kind, data_files=list(files), split="train")
    yield from ds.shard(num_shards=world, index=rank, contiguous=False)


def load_prompts(cfg: DataConfig, tokenizer, split: str, rank: int = 0, world: int = 1) -> tuple[list[PromptRow], LoadStats]:
    """Load this rank's shard of the train or eval prompts.

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
    stats, kept = LoadStats(), []
    for row in source(cfg, split, rank, world):
        stats.rows += 1
        question, answer = row.get(cfg.question_key), row.get(cfg.answer_key)
        if question in (None, "") or answer is None or str(answer) == "":
            stats.skipped["missing_field"] += 1
            continue
        messages = [{"role": "user", "content": str(question)}]
        if cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) > cfg.max_prompt_len:
            stats.skipped["too_long"] += 1
            continue
        entry = {"question": str(question), "answer": str(answer), "metadata": row.get("metadata") or {}}
        kept.append(PromptRow(list(ids), str(question), str(answer), entry))
    stats.kept = len(kept)
    return kept, stats
