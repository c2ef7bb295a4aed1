"""The files and folders a job reads and writes, checked before anything loads: each problem is a
:class:`~yatt.config.ConfigError` that names the config key and says what to do, instead of a
traceback after the models have loaded."""
from __future__ import annotations

import os
from pathlib import Path

from yatt.config import ConfigError


def check_job_paths(cfg) -> None:
    """Check ``cfg``'s data files (``data.train_files``/``eval_files`` with ``data.source=file``,
    the files of ``eval.sets``), ``output_dir`` and ``checkpoint.dir``.

    Raises:
        ConfigError: every problem found, one per line, each naming its key.
    """
    problems = []
    if cfg.data.source == "file":
        if not cfg.data.train_files:
            problems.append("config key 'data.train_files': empty; data.source=file needs at least one jsonl/parquet "
                            "file")
        for key in ("train_files", "eval_files"):
            for i, path in enumerate(getattr(cfg.data, key)):
                problems.append(readable_file(path, f"data.{key}[{i}]"))
    for i, s in enumerate(cfg.eval.sets):
        for j, path in enumerate(getattr(s, "files", [])):
            problems.append(readable_file(path, f"eval.sets[{i}].files[{j}]"))
    problems.append(writable_dir(cfg.output_dir, "output_dir"))
    if cfg.checkpoint.dir:
        problems.append(writable_dir(cfg.checkpoint.dir, "checkpoint.dir"))
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError("\n".join(problems))


def readable_file(path: str | os.PathLike, key: str, option: bool = False) -> str | None:
    """None when ``path`` is a file this process can read, else the problem, naming ``key``: a
    config key (``config key 'data.train_files[0]'``), or with ``option`` a command-line option
    or argument as it is (``--sets``)."""
    name = key if option else f"config key '{key}'"
    p = Path(path).expanduser()
    if not p.exists():
        hint = f" (relative to the working directory {os.getcwd()})" if not p.is_absolute() else ""
        return f"{name}: {path} does not exist{hint}; create it or fix the path"
    if not p.is_file():
        return f"{name}: {path} is not a file"
    if not os.access(p, os.R_OK):
        return f"{name}: {path} cannot be read (permissions)"
    return None


def writable_dir(path: str | os.PathLike, key: str, option: bool = False) -> str | None:
    """None when ``path`` is a folder this process can write, or can create (its nearest existing
    ancestor is a writable folder), else the problem, naming ``key`` as :func:`readable_file` does
    (``option``: ``--json``, ``OUT_DIR``)."""
    name = key if option else f"config key '{key}'"
    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        return f"{name}: {path} is a file, not a folder; point {key} at a folder (or move the file away)"
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        return f"{name}: {existing} is a file, so {path} cannot be created under it"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{name}: {existing} is not writable by this user, so {path} cannot be written; pick " \
               "another location"
    return None
