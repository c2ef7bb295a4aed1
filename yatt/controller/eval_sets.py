"""Named eval sets (``eval.sets``, ``python -m yatt.eval --sets``): which rows each holds, how a rank
reads its shard of them, and what scores them (``reward.accuracy``'s source, with the set's own
reasoning-gym task for a rule source). Used by ``python -m yatt.eval`` and by a run's evals."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from yatt.config import Config, ConfigError

FILE_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class EvalSet:
    """One set to evaluate: its name, the data section its rows are read with (eval split), and the
    reasoning-gym task (and config) a rule source scores it with."""

    name: str
    data: object  # yatt.config.DataConfig
    task: str
    task_config: dict


def resolve_sets(cfg: Config, names: str | None) -> list[EvalSet]:
    """The sets ``--sets`` names (default: ``eval.sets``, else the data section's eval split), with
    their data files checked.

    Raises:
        ConfigError: a name that is no set, file or reasoning-gym task (naming ``--sets``), or an
            eval file that cannot be read (naming its config key or ``--sets``).
    """
    from yatt.paths import readable_file

    d = cfg.data
    configured = {s.name: (f"eval.sets[{i}]", s) for i, s in enumerate(cfg.eval.sets)}
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else (list(configured) or ["eval"])
    out, problems = [], []
    for name in wanted:
        if name == "eval":
            if d.source == "file":
                problems += [readable_file(f, f"data.eval_files[{i}]") for i, f in enumerate(d.eval_files)]
            out.append(EvalSet("eval", d, d.task, d.task_config))
        elif name in configured:
            key, s = configured[name]
            out.append(_files_set(d, name, s.files, f"{key}.files", problems) if s.type == "files"
                       else _task_set(d, name, s.task, s.task_config, s.size))
        elif name.endswith(FILE_SUFFIXES):  # a file named on the command line: the set is named after it
            out.append(_files_set(d, re.sub(r"[^a-z0-9_]", "_", Path(name).stem.lower()), [name], "--sets", problems))
        elif _is_task(name):
            out.append(_task_set(d, name, name, {}, d.eval_size or 64))
        else:
            problems.append(f"--sets: {name!r} is not a set of eval.sets ({', '.join(configured) or 'none'}), 'eval', "
                            f"a {'/'.join(FILE_SUFFIXES)} file or a reasoning-gym task")
    problems = [p for p in problems if p]
    names = [s.name for s in out]
    problems += [f"--sets: two sets are named {n!r}" for n in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def _files_set(d, name: str, files: list[str], key: str, problems: list) -> EvalSet:
    """A set of ``files`` (each checked: a problem names ``key[i]``, or ``--sets``)."""
    from yatt.paths import readable_file

    for i, f in enumerate(files):
        option = key.startswith("--")  # a file named on the command line
        if problem := readable_file(f, key if option else f"{key}[{i}]", option=option):
            problems.append(problem)
    return EvalSet(name, d.model_copy(update={"source": "file", "eval_files": list(files)}), d.task, d.task_config)


def _task_set(d, name: str, task: str, task_config: dict, size: int) -> EvalSet:
    data = d.model_copy(update={"source": "reasoning_gym", "task": task, "task_config": task_config, "eval_size": size})
    return EvalSet(name, data, task, task_config)


def _is_task(name: str) -> bool:
    from reasoning_gym.factory import DATASETS

    return name in DATASETS


def accuracy_score_fn(cfg: Config, task: str, task_config: dict):
    """``score_fn(rows, texts) -> list[float]`` of ``reward.accuracy``'s source (a rule source with
    ``task``'s scorer): what a run's evals score with (``StepScorer.accuracy_scores``), built
    without the judge engine (the accuracy source is never a judge)."""
    from yatt.reward.item import RewardItem
    from yatt.reward.sources import build_source

    r = cfg.reward
    sources = r.resolved_sources()
    i = next(i for i, s in enumerate(sources) if s.name == r.accuracy_source)
    src = build_source(sources[i], i, r.extract, task, task_config)
    return lambda rows, texts: src.score([RewardItem(x.question, t, x.entry) for x, t in zip(rows, texts)]).scores


def set_rows(s: EvalSet, tokenizer, limit: int | None, rank: int, world: int, targets: bool = False) -> list:
    """This rank's rows of ``s``: the shard a run's evals use (``load_prompts`` of rank of world),
    or with ``limit`` the first ``limit`` rows of the set dealt round-robin. ``targets``: a
    conversation may end with an assistant turn (``stage: sft``; the prompt is the turns before it)."""
    from yatt.assets.data import load_prompts

    if limit is None:
        return load_prompts(s.data, tokenizer, "eval", rank, world, targets=targets)[0]
    return load_prompts(s.data, tokenizer, "eval", targets=targets)[0][:limit][rank::world]


def shard_sets(cfg: Config, sets: list[EvalSet], tokenizer, rank: int | None, world: int,
               limit: int | None = None) -> list[tuple[EvalSet, list, Callable]]:
    """``(set, this rank's rows, score_fn)`` of each of ``sets``: the rows as :func:`set_rows`
    gives them to ``rank`` of ``world`` evaluating ranks (None: a rank that does not evaluate,
    no rows), scored by :func:`accuracy_score_fn`."""
    return [(s, set_rows(s, tokenizer, limit, rank, world, cfg.stage == "sft") if rank is not None else [],
             accuracy_score_fn(cfg, s.task, s.task_config)) for s in sets]
