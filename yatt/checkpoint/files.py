"""Checkpoint directories: names, the ``latest`` pointer, atomic commit, lookup and retention.

Layout under a checkpoint root (``checkpoint.dir``, default ``<output_dir>/checkpoints``)::

    step_000012/            a complete checkpoint (never written in place)
      meta.json             step, format, world/TP/PP/DP sizes, dtype, base model folder, run config
      model/tp{t}_pp{p}.pt  GPTModel.state_dict() of TP rank t, pipeline stage p (torch.save)
      optim/tp{t}_pp{p}.pt  {"optimizer", "scheduler", "param_names"} of that model shard (the names of the optimizer state's parameters)
      model/critic_tp{t}_pp{p}.pt, optim/critic_tp{t}_pp{p}.pt   the critic's, when PPO trains one
      rank/{rank:05d}.pt    this rank's RNG states, controller-shard position and counters
    step_000013.tmp/        being written: ignored by resume and export, removed at start
    latest                  the name of the newest complete checkpoint ("step_000012\\n")

A checkpoint becomes visible in one ``rename`` of its ``.tmp`` folder after every rank's files
are written and fsynced; ``latest`` is replaced (write, fsync, ``os.replace``) after that. A crash
at any point leaves either the previous checkpoint or the new one, never a partial one.

``meta.json`` also records each file's size and CRC-32 (``files``), computed while it was
written; :func:`verify` checks them, so a file damaged later (truncated by a copy, a bad disk)
is named before anything is loaded from it, and ``resume=auto`` falls back to the newest
checkpoint that verifies (:func:`newest_verified`).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path

log = logging.getLogger("yatt")
LATEST = "latest"
META = "meta.json"
FORMAT = 2  # 2: meta.json lists every file's size and CRC-32; rank files load with weights_only=True
_STEP_DIR = re.compile(r"step_(\d+)")


def role_key(role: str, model_key: str) -> str:
    """The file key of a trained role's shard: the actor's is ``model_key`` (``tp{t}_pp{p}``, as
    before roles existed), another role's ``<role>_<model_key>`` (``critic_tp0_pp0``)."""
    return model_key if role == "actor" else f"{role}_{model_key}"


def checkpoint_root(cfg) -> Path:
    """The run's checkpoint root: ``checkpoint.dir``, default ``<output_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir or Path(cfg.output_dir) / "checkpoints")


def step_dir(root: str | Path, step: int, tmp: bool = False) -> Path:
    """``root/step_{step:06d}`` (``.tmp`` suffix while being written)."""
    return Path(root) / f"step_{step:06d}{'.tmp' if tmp else ''}"


def committed_steps(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (ascending; ``.tmp`` folders excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := _STEP_DIR.fullmatch(p.name)) and (p / META).is_file())


def resolve(path: str | Path) -> Path:
    """The complete checkpoint folder that ``path`` names: a step folder, or a root whose
    ``latest`` is followed (if it is missing or names no complete step folder of that root:
    the root's newest complete step folder).

    Raises:
        FileNotFoundError: nothing complete there (a ``.tmp`` folder is never complete).
    """
    path = Path(path)
    if path.name.endswith(".tmp"):
        raise FileNotFoundError(f"{path} is an unfinished checkpoint (a .tmp folder is never complete)")
    if (path / META).is_file():
        return path
    pointer = path / LATEST
    if pointer.is_file():  # followed only to a complete step folder of this root
        name = pointer.read_text().strip()
        if _STEP_DIR.fullmatch(name) and (path / name / META).is_file():
            return path / name
    steps = committed_steps(path)
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {path} (no {META}, no {LATEST}, no step_* folder)")
    return step_dir(path, steps[-1])


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None (a fresh start)."""
    try:
        return resolve(root)
    except FileNotFoundError:
        return None


def read_meta(folder: str | Path) -> dict:
    """``meta.json`` of a complete checkpoint folder."""
    return json.loads((Path(folder) / META).read_text())


def crc32_file(path: str | Path, chunk: int = 1 << 24) -> tuple[int, int]:
    """``(bytes, CRC-32)`` of a file, read in 16 MiB chunks (zlib's CRC-32 runs at GB/s)."""
    size = crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            size, crc = size + len(block), zlib.crc32(block, crc)
    return size, crc


def verify(folder: str | Path, under: str = "") -> list[str]:
    """Check a complete checkpoint against its ``meta.json``: every listed file (whose path starts
    with ``under``, e.g. ``"model/"``) is there, with the size and CRC-32 recorded when it was
    written. Returns the problems found (empty: it verifies), each naming the file; reads each
    file once (about a second per GB)."""
    folder = Path(folder)
    try:
        meta = read_meta(folder)
    except (OSError, ValueError) as e:
        return [f"{folder / META}: unreadable ({e})"]
    if meta.get("format", 1) < 2 or "files" not in meta:
        return [f"{folder / META}: written by an earlier YATT (checkpoint format {meta.get('format', 1)}, without "
                "file checksums, rank files not loadable with weights_only=True); resume it with that version or "
                "start fresh"]
    problems = []
    for name, rec in sorted(meta["files"].items()):
        if not name.startswith(under):
            continue
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != rec["bytes"]:
            problems.append(f"{path}: {size} bytes, {rec['bytes']} when written (truncated or replaced)")
        elif crc32_file(path)[1] != rec["crc32"]:
            problems.append(f"{path}: CRC-32 differs from the one recorded when it was written (damaged)")
    return problems


def newest_verified(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` that :func:`verify` passes (the one
    ``latest`` names first), or None. Each damaged one on the way is logged as an error naming
    its file, with a warning that the run falls back to an older checkpoint."""
    first = find_latest(root)
    if first is None:
        return None
    candidates = [first] + [step_dir(root, s) for s in reversed(committed_steps(root)) if step_dir(root, s) != first]
    for i, folder in enumerate(candidates):
        problems = verify(folder)
        if not problems:
            if i:
                log.warning("checkpoint: FALLING BACK to %s: the %d newer checkpoint(s) are damaged (above)", folder, i)
            return folder
        log.error("checkpoint: %s does not verify: %s", folder, "; ".join(problems))
    log.error("checkpoint: none of the %d checkpoints under %s verifies", len(candidates), root)
    return None


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: temp file, fsync, ``os.replace``, fsync folder."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def commit(root: str | Path, step: int, meta: dict, manifest: dict[str, dict] | None = None) -> Path:
    """Make ``step_N.tmp`` (every file in it written and fsynced) the complete ``step_N``, then
    point ``latest`` at it. A complete ``step_N`` already there (a run resumed from an older
    checkpoint) is replaced. ``manifest``: ``{relative path: {"bytes", "crc32"}}`` of every file
    the ranks wrote, recorded in ``meta.json`` for :func:`verify`."""
    root, tmp, final = Path(root), step_dir(root, step, tmp=True), step_dir(root, step)
    (tmp / META).write_text(json.dumps({"format": FORMAT, "step": step, **meta, "files": manifest or {}},
                                       indent=1, default=str))
    for sub in (tmp / "model", tmp / "optim", tmp / "rank", tmp):
        if sub.is_dir():
            fsync_path(sub)
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(root)
    write_durably(root / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def to_delete(steps: list[int], keep_last: int, keep_every: int) -> list[int]:
    """Steps whose checkpoints retention removes: all but the newest ``keep_last`` and, when
    ``keep_every > 0``, those at multiples of ``keep_every``."""
    keep = set(sorted(steps)[-keep_last:]) if keep_last > 0 else set()
    keep |= {s for s in steps if keep_every and s % keep_every == 0}
    return [s for s in steps if s not in keep]


def prune(root: str | Path, keep_last: int, keep_every: int) -> list[int]:
    """Apply :func:`to_delete` under ``root`` (the folder ``latest`` names is always kept)."""
    latest = find_latest(root)
    gone = [s for s in to_delete(committed_steps(root), keep_last, keep_every)
            if latest is None or step_dir(root, s) != latest]
    for s in gone:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return gone


def remove_unfinished(root: str | Path) -> list[Path]:
    """Delete ``.tmp``/``.old`` folders a killed run left behind (call before any rank writes)."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.is_dir() and p.suffix in (".tmp", ".old") and _STEP_DIR.fullmatch(p.stem)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale
