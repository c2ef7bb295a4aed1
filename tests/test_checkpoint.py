"""Checkpoints (:mod:`yatt.checkpoint`) in one process.

* files: retention, atomic commit and ``latest``, lookup (``.tmp`` never returned), cleanup;
* saver: host snapshot taken at ``save()`` (later in-place changes do not leak into the files,
  reused buffers never hold a stale step), deferred commit by ``poll()``, failed writes dropped;
* triggers: every N steps, every T minutes (fake clock), a real SIGUSR1, handler restored;
* the parts a checkpoint carries: metrics.jsonl truncation on resume, StabilityGuard and
  DynamicSampler state;
* RunCheckpoints: save points, SIGUSR1 preemption and finish on a rank without a policy; on a
  real tiny Megatron policy (world 1, TP=1) rollback and resume restore model, Adam state and
  LR schedule exactly.

The saver/trigger tests run before the Megatron ones, with torch.distributed not initialised
(collectives skipped); run after other modules they see a world-1 gloo group, which gives the
same answers. ``test_checkpointer_without_torch_distributed`` forces the first case.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import pickle
import signal
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from yatt.checkpoint import files, saver as saver_mod, triggers as triggers_mod
from yatt.checkpoint.files import commit, committed_steps, find_latest, prune, remove_unfinished, resolve, step_dir, to_delete
from yatt.checkpoint.saver import Checkpointer, HostSnapshot, load_part
from yatt.checkpoint.triggers import EXIT_PREEMPTED, SaveTriggers

from conftest import trainer_tp as ref


def fake_checkpoint(root: Path, step: int, *, tmp: bool = False, latest: bool = False, payload: str = "") -> Path:
    """A step folder written through ``commit`` (tmp=False) or left unfinished (tmp=True)."""
    d = step_dir(root, step, tmp=True)
    (d / "rank").mkdir(parents=True, exist_ok=True)
    (d / "rank" / "00000.pt").write_text(payload or f"step {step}")
    if tmp:
        return d
    prev = (root / files.LATEST).read_text() if (root / files.LATEST).exists() else None
    out = commit(root, step, {"world": 1})
    if not latest:  # keep the pointer where it was (or absent)
        if prev is None:
            (root / files.LATEST).unlink()
        else:
            (root / files.LATEST).write_text(prev)
    return out


# ============================================================ files.py

def test_to_delete_keep_last():
    steps = [1, 2, 3, 4, 5]
    assert to_delete(steps, keep_last=2, keep_every=0) == [1, 2, 3]
    assert to_delete(steps, keep_last=1, keep_every=0) == [1, 2, 3, 4]
    assert to_delete(steps, keep_last=5, keep_every=0) == []
    assert to_delete(steps, keep_last=10, keep_every=0) == []  # more than there are
    assert to_delete([5, 1, 3], keep_last=1, keep_every=0) == [1, 3]  # order of the input, newest by value


def test_to_delete_keep_every_and_both():
    steps = list(range(1, 11))
    assert to_delete(steps, keep_last=2, keep_every=4) == [1, 2, 3, 5, 6, 7]  # 4, 8 kept + 9, 10
    assert to_delete(steps, keep_last=0, keep_every=5) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert to_delete(steps, keep_last=0, keep_every=0) == steps
    assert to_delete([3, 6, 9], keep_last=1, keep_every=3) == []  # multiples overlap the newest
    assert to_delete([], keep_last=2, keep_every=3) == []


def test_commit_makes_the_step_folder_meta_and_latest(tmp_path):
    tmp = step_dir(tmp_path, 7, tmp=True)
    assert tmp.name == "step_000007.tmp" and step_dir(tmp_path, 7).name == "step_000007"
    (tmp / "model").mkdir(parents=True)
    torch.save({"w": torch.arange(3)}, tmp / "model" / "tp0_pp0.pt")
    final = commit(tmp_path, 7, {"world": 1, "tp": 1, "pp": 1, "obj": Path("/x")})
    assert final == step_dir(tmp_path, 7) and final.is_dir() and not tmp.exists()
    meta = files.read_meta(final)
    assert meta == {"format": files.FORMAT, "step": 7, "world": 1, "tp": 1, "pp": 1, "obj": "/x", "files": {}}
    assert (tmp_path / "latest").read_text() == "step_000007\n"
    assert torch.equal(torch.load(final / "model" / "tp0_pp0.pt")["w"], torch.arange(3))
    assert not (tmp_path / "latest.tmp").exists()
    assert committed_steps(tmp_path) == [7]


def test_commit_replaces_an_existing_step_folder(tmp_path):
    """A run resumed from step 2 of a run that got to step 4 writes step 3 and 4 again."""
    for s in (2, 3, 4):
        fake_checkpoint(tmp_path, s, latest=True, payload=f"old {s}")
    (tmp_path / "latest").write_text("step_000002\n")  # resumed from 2
    fake_checkpoint(tmp_path, 3, latest=True, payload="new 3")
    assert (step_dir(tmp_path, 3) / "rank" / "00000.pt").read_text() == "new 3"
    assert (tmp_path / "latest").read_text() == "step_000003\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003", "step_000004"]
    assert find_latest(tmp_path) == step_dir(tmp_path, 3)


def test_resolve_step_folder_root_latest_and_fallback(tmp_path):
    fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 5)
    fake_checkpoint(tmp_path, 3)
    assert not (tmp_path / "latest").exists()
    # no latest: the newest complete step folder (by step, not by creation order)
    assert resolve(tmp_path) == find_latest(tmp_path) == step_dir(tmp_path, 5)
    (tmp_path / "latest").write_text("step_000003\n")
    assert resolve(tmp_path) == step_dir(tmp_path, 3)  # latest wins over the newest
    assert resolve(step_dir(tmp_path, 1)) == step_dir(tmp_path, 1)  # a step folder names itself
    assert resolve(str(step_dir(tmp_path, 1))) == step_dir(tmp_path, 1)
    (tmp_path / "latest").write_text("step_000009\n")  # points at something gone
    assert resolve(tmp_path) == step_dir(tmp_path, 5)


def test_tmp_folders_are_never_returned(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newer = fake_checkpoint(tmp_path, 8, tmp=True)
    (newer / files.META).write_text(json.dumps({"format": 1, "step": 8}))  # even with meta.json
    assert committed_steps(tmp_path) == [2]
    assert resolve(tmp_path) == find_latest(tmp_path) == step_dir(tmp_path, 2)
    with pytest.raises(FileNotFoundError, match="unfinished"):
        resolve(newer)
    # a .tmp folder alone: nothing complete
    only_tmp = tmp_path / "other"
    d = fake_checkpoint(only_tmp, 4, tmp=True)
    (d / files.META).write_text("{}")
    assert find_latest(only_tmp) is None


def test_latest_naming_a_tmp_or_outside_folder_is_not_followed(tmp_path):
    """A hand-edited or corrupted ``latest`` naming a ``.tmp`` folder (even one holding
    meta.json) is not followed: the newest complete ``step_N`` folder of the root is."""
    fake_checkpoint(tmp_path, 2)
    unfinished = fake_checkpoint(tmp_path, 8, tmp=True)
    (unfinished / files.META).write_text(json.dumps({"format": 1, "step": 8}))
    (tmp_path / "latest").write_text("step_000008.tmp\n")
    assert resolve(tmp_path) == find_latest(tmp_path) == step_dir(tmp_path, 2)


def test_empty_or_missing_root(tmp_path):
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "nope") is None
    assert committed_steps(tmp_path / "nope") == []
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve(tmp_path)
    (tmp_path / "step_000003").mkdir()  # a step folder without meta.json is not complete
    assert find_latest(tmp_path) is None


def test_prune_keeps_what_latest_names(tmp_path):
    for s in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, s, latest=True)
    (tmp_path / "latest").write_text("step_000004\n")
    assert prune(tmp_path, keep_last=1, keep_every=0) == [2, 6]
    assert committed_steps(tmp_path) == [4, 8]
    assert prune(tmp_path, keep_last=1, keep_every=0) == []
    (tmp_path / "latest").write_text("step_000008\n")
    assert prune(tmp_path, keep_last=1, keep_every=0) == [4]
    assert committed_steps(tmp_path) == [8] and find_latest(tmp_path) == step_dir(tmp_path, 8)


def test_prune_with_keep_every_and_tmp_untouched(tmp_path):
    for s in range(1, 7):
        fake_checkpoint(tmp_path, s, latest=True)
    fake_checkpoint(tmp_path, 7, tmp=True)
    assert prune(tmp_path, keep_last=2, keep_every=3) == [1, 2, 4]
    assert committed_steps(tmp_path) == [3, 5, 6] and step_dir(tmp_path, 7, tmp=True).is_dir()


def test_remove_unfinished_only_removes_step_tmp_and_old(tmp_path):
    fake_checkpoint(tmp_path, 1, latest=True)
    fake_checkpoint(tmp_path, 2, tmp=True)
    (tmp_path / "step_000001.old").mkdir()
    keep = ["logs.tmp", "foo.old", "step_abc.tmp", "step_000001", "latest"]
    (tmp_path / "logs.tmp").mkdir()
    (tmp_path / "foo.old").mkdir()
    (tmp_path / "step_abc.tmp").mkdir()
    (tmp_path / "step_000009.tmp").write_text("a file, not a folder")
    gone = remove_unfinished(tmp_path)
    assert sorted(p.name for p in gone) == ["step_000001.old", "step_000002.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep + ["step_000009.tmp"])
    assert remove_unfinished(tmp_path / "missing") == []


# ============================================================ saver.py

def nested_state(seed: float) -> dict:
    return {"model": {"w": torch.full((3, 4), seed), "b": torch.arange(5, dtype=torch.float64) + seed,
                      "half": torch.full((2,), seed, dtype=torch.bfloat16)},
            "optim": {"state": {0: {"exp_avg": torch.full((4,), seed), "step": torch.tensor(seed)}},
                      "param_groups": [{"lr": 0.1 * seed, "params": [0]}],
                      "pair": (torch.ones(2) * seed, 3), "history": [seed, 2 * seed],
                      "n": int(seed)}}


def mutate_(state: dict, value: float) -> None:
    """In place, like an optimizer step: every tensor of ``state`` is set to ``value`` (ints/lists too)."""
    for t in (state["model"]["w"], state["model"]["b"], state["model"]["half"], state["optim"]["state"][0]["exp_avg"],
              state["optim"]["state"][0]["step"], state["optim"]["pair"][0]):
        t.fill_(value)
    state["optim"]["history"].append(value)
    state["optim"]["param_groups"][0]["lr"] = value
    state["optim"]["n"] = -1


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple, collections.deque)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def clone_state(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    if isinstance(obj, collections.deque):
        return collections.deque((clone_state(v) for v in obj), maxlen=obj.maxlen)
    return obj


def save_state(ck: Checkpointer, step: int, state: dict, rank_state=None) -> None:
    ck.save(step, state["model"], state["optim"], rank_state if rank_state is not None else {"step": step},
            {"world": 1, "tp": 1, "pp": 1})


@pytest.fixture
def gated_save(monkeypatch):
    """``_save`` that blocks (before writing) until the returned event is set."""
    gate, orig = threading.Event(), saver_mod._save

    def slow(obj, path):
        assert gate.wait(30), "test gate never opened"
        return orig(obj, path)

    monkeypatch.setattr(saver_mod, "_save", slow)
    yield gate
    gate.set()


def test_host_snapshot_reuses_buffers_and_reallocates_on_change():
    snap = HostSnapshot()
    live = {"a": torch.ones(3, 2), "l": [torch.zeros(4), 7], "t": (torch.arange(2),), "s": "x"}
    first = snap.take(live)
    assert first["l"][1] == 7 and first["s"] == "x" and isinstance(first["t"], tuple) and isinstance(first["l"], list)
    assert first["a"].data_ptr() != live["a"].data_ptr() and torch.equal(first["a"], live["a"])
    assert snap.bytes == 3 * 2 * 4 + 4 * 4 + 2 * 8
    ptrs = {"a": first["a"].data_ptr(), "l0": first["l"][0].data_ptr(), "t0": first["t"][0].data_ptr()}
    live["a"].mul_(5)
    second = snap.take(live)
    assert second["a"].data_ptr() == ptrs["a"] and second["l"][0].data_ptr() == ptrs["l0"]
    assert second["t"][0].data_ptr() == ptrs["t0"]
    assert torch.equal(second["a"], torch.full((3, 2), 5.0))
    live["a"] = torch.ones(4, 2)  # shape change
    live["l"][0] = torch.zeros(4, dtype=torch.float64)  # dtype change
    third = snap.take(live)
    assert third["a"].shape == (4, 2) and third["a"].data_ptr() != ptrs["a"]
    assert third["l"][0].dtype == torch.float64 and third["l"][0].data_ptr() != ptrs["l0"]
    assert third["t"][0].data_ptr() == ptrs["t0"]
    snap.ready()  # no-op on CPU


def test_host_snapshot_does_not_alias_live_non_tensor_state():
    snap = HostSnapshot()
    live = {"d": collections.deque([1.0, 2.0], maxlen=3), "cfg": {"lr": [0.1]}}
    out = snap.take(live)
    live["d"].append(3.0)
    live["cfg"]["lr"].append(0.2)
    assert list(out["d"]) == [1.0, 2.0] and out["d"].maxlen == 3 and out["cfg"]["lr"] == [0.1]


def test_an_async_save_whose_host_copy_does_not_fit_in_memory_is_written_synchronously(tmp_path, monkeypatch, caplog):
    """With less memory left than the host copy needs (10% of the machine kept free), save()
    writes the live state before it returns, holds no copy, and warns once; with room again the
    next save is asynchronous."""
    import psutil

    state = nested_state(1.0)
    need = saver_mod._tensor_bytes(state)
    room = {"available": 1000 + need // 2}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=10_000, available=room["available"]))
    ck = Checkpointer(tmp_path, 0, "tp0_pp0", async_save=True)
    at1 = clone_state(state)
    with caplog.at_level(logging.WARNING, logger="yatt"):
        save_state(ck, 1, state)
        assert ck.committed == step_dir(tmp_path, 1) and ck.snapshot.held_bytes() == 0  # written, nothing copied
        mutate_(state, 2.0)
        save_state(ck, 2, state)
        assert ck.committed == step_dir(tmp_path, 2)
    assert sum("written synchronously" in r.getMessage() for r in caplog.records) == 1
    assert_same(load_part(step_dir(tmp_path, 1), "model", "tp0_pp0"), at1["model"])
    room["available"] = 1000 + 2 * need
    save_state(ck, 3, state)
    assert ck.snapshot.held_bytes() == need
    assert ck.wait() == step_dir(tmp_path, 3)


def test_ranks_agree_to_write_synchronously_when_one_ranks_copy_does_not_fit(shared_job):
    """tests/mpi/checkpoint_memory.py in the shared 2-rank job: only rank 0 is short of memory,
    both ranks write synchronously (no rank waits in a collective for a peer that went on), and
    the files hold the state at save time."""
    out = shared_job("ranks_2")
    assert out.count("checkpoint_memory OK") == 2, out[-3000:]


def test_async_save_holds_the_values_at_save_time(tmp_path):
    ck = Checkpointer(tmp_path, 0, "tp0_pp0", async_save=True)
    state = nested_state(1.0)
    at1 = clone_state(state)
    save_state(ck, 1, state, rank_state={"counters": [1, 2], "t": torch.tensor([5])})
    mutate_(state, 2.0)  # the optimizer step right after save() returns
    at2 = clone_state(state)
    assert ck.wait() == step_dir(tmp_path, 1) == ck.committed
    f1 = step_dir(tmp_path, 1)
    assert_same(load_part(f1, "model", "tp0_pp0"), at1["model"])
    assert_same(load_part(f1, "optim", "tp0_pp0"), at1["optim"])
    rank = load_part(f1, "rank", "00000")
    assert rank["counters"] == [1, 2] and torch.equal(rank["t"], torch.tensor([5]))

    save_state(ck, 2, state)  # the same host buffers, new values
    mutate_(state, 3.0)
    assert ck.wait() == step_dir(tmp_path, 2)
    f2 = step_dir(tmp_path, 2)
    assert_same(load_part(f2, "model", "tp0_pp0"), at2["model"])
    assert_same(load_part(f2, "optim", "tp0_pp0"), at2["optim"])
    assert not torch.equal(load_part(f2, "model", "tp0_pp0")["w"], load_part(f1, "model", "tp0_pp0")["w"])
    assert_same(load_part(f1, "model", "tp0_pp0"), at1["model"])  # step 1's files untouched
    meta = files.read_meta(f2)
    assert {k: v for k, v in meta.items() if k != "files"} == {"format": 2, "step": 2, "world": 1, "tp": 1, "pp": 1}
    assert sorted(meta["files"]) == ["model/tp0_pp0.pt", "optim/tp0_pp0.pt", "rank/00000.pt"]
    assert (tmp_path / "latest").read_text() == "step_000002\n"
    assert ck.wait() is None and ck.poll() is None  # nothing pending


def test_next_save_waits_for_the_previous_write_before_reusing_buffers(tmp_path, gated_save):
    """save(k+1) while step k's writer has not written yet: it blocks, step k keeps its values."""
    ck = Checkpointer(tmp_path, 0, "tp0_pp0")
    state = nested_state(1.0)
    at1 = clone_state(state)
    save_state(ck, 1, state)
    mutate_(state, 2.0)
    at2 = clone_state(state)
    timer = threading.Timer(0.3, gated_save.set)
    timer.start()
    t0 = time.monotonic()
    save_state(ck, 2, state)
    assert time.monotonic() - t0 >= 0.25  # blocked on step 1's write
    assert ck.committed == step_dir(tmp_path, 1)
    mutate_(state, 3.0)
    ck.wait()
    assert_same(load_part(step_dir(tmp_path, 1), "model", "tp0_pp0"), at1["model"])
    assert_same(load_part(step_dir(tmp_path, 2), "optim", "tp0_pp0"), at2["optim"])


def test_poll_commits_only_after_the_writer_finished(tmp_path, gated_save):
    fake_checkpoint(tmp_path, 1, latest=True)
    ck = Checkpointer(tmp_path, 0, "tp0_pp0")
    save_state(ck, 2, nested_state(1.0))
    for _ in range(3):
        assert ck.poll() is None and ck.committed is None
    assert not step_dir(tmp_path, 2).exists()
    assert (tmp_path / "latest").read_text() == "step_000001\n" and find_latest(tmp_path) == step_dir(tmp_path, 1)
    gated_save.set()
    ck._thread.join(10)
    assert not step_dir(tmp_path, 2).exists()  # written, not yet agreed on
    assert sorted(p.name for p in step_dir(tmp_path, 2, tmp=True).iterdir()) == ["model", "optim", "rank"]
    assert ck.poll() == step_dir(tmp_path, 2) == ck.committed
    assert not step_dir(tmp_path, 2, tmp=True).exists() and (tmp_path / "latest").read_text() == "step_000002\n"
    assert ck.poll() is None  # committed once


def test_a_failed_write_is_dropped_and_training_goes_on(tmp_path, monkeypatch, caplog):
    ck = Checkpointer(tmp_path, 0, "tp0_pp0")
    save_state(ck, 1, nested_state(1.0))
    assert ck.wait() == step_dir(tmp_path, 1)
    orig = saver_mod._save

    def broken(obj, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saver_mod, "_save", broken)
    save_state(ck, 2, nested_state(2.0))
    ck._thread.join(10)
    with caplog.at_level(logging.ERROR, logger="yatt"):
        assert ck.poll() is None
    assert ck.failures == 1 and "No space left" in caplog.text
    assert not step_dir(tmp_path, 2, tmp=True).exists() and not step_dir(tmp_path, 2).exists()
    assert (tmp_path / "latest").read_text() == "step_000001\n" and ck.committed == step_dir(tmp_path, 1)
    assert ck.wait() is None
    monkeypatch.setattr(saver_mod, "_save", orig)
    save_state(ck, 3, nested_state(3.0))
    assert ck.wait() == step_dir(tmp_path, 3) and ck.failures == 1
    assert committed_steps(tmp_path) == [1, 3]


def test_commit_records_each_file_and_resume_falls_back_past_a_damaged_checkpoint(tmp_path, caplog):
    """meta.json lists every file's size and CRC-32 as written; a truncated file and a flipped byte
    are named by verify(); resume=auto takes the newest checkpoint that verifies (loudly), an
    explicit resume path that does not verify stops with the file's name; export refuses it."""
    from yatt.checkpoint.run_state import CheckpointDamaged, resolve_resume

    ck = Checkpointer(tmp_path, 0, "tp0_pp0", async_save=False, keep_last=3)
    for step in (1, 2, 3):
        save_state(ck, step, nested_state(float(step)))
    for step in (1, 2, 3):
        folder = step_dir(tmp_path, step)
        recorded = files.read_meta(folder)["files"]
        assert sorted(recorded) == ["model/tp0_pp0.pt", "optim/tp0_pp0.pt", "rank/00000.pt"]
        for name, rec in recorded.items():
            assert files.crc32_file(folder / name) == (rec["bytes"], rec["crc32"])
        assert files.verify(folder) == []
    optim3 = step_dir(tmp_path, 3) / "optim" / "tp0_pp0.pt"
    optim3.write_bytes(optim3.read_bytes()[:-100])  # truncated by a copy
    model2 = step_dir(tmp_path, 2) / "model" / "tp0_pp0.pt"
    data = bytearray(model2.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bad byte, same size
    model2.write_bytes(bytes(data))
    assert files.verify(step_dir(tmp_path, 3)) == [f"{optim3}: {optim3.stat().st_size} bytes, "
                                                   f"{optim3.stat().st_size + 100} when written (truncated or replaced)"]
    assert files.verify(step_dir(tmp_path, 3), under="model/") == []
    assert files.verify(step_dir(tmp_path, 2)) == [f"{model2}: CRC-32 differs from the one recorded when it was "
                                                   "written (damaged)"]
    with caplog.at_level(logging.WARNING, logger="yatt"):
        assert resolve_resume("auto", tmp_path) == step_dir(tmp_path, 1)
    assert f"{optim3}: " in caplog.text and f"{model2}: CRC-32" in caplog.text
    assert f"FALLING BACK to {step_dir(tmp_path, 1)}" in caplog.text
    with pytest.raises(CheckpointDamaged, match=r"config key 'resume'.*optim/tp0_pp0\.pt: .* bytes"):
        resolve_resume(str(step_dir(tmp_path, 3)), tmp_path)
    (step_dir(tmp_path, 1) / "rank" / "00000.pt").unlink()
    with pytest.raises(CheckpointDamaged, match="no checkpoint under .* verifies"):
        resolve_resume("auto", tmp_path)
    from yatt.export import export_checkpoint

    with pytest.raises(ValueError, match=r"does not verify: .*model/tp0_pp0\.pt: CRC-32"):
        export_checkpoint(step_dir(tmp_path, 2), tmp_path / "hf")


def test_a_checkpoint_without_checksums_is_refused_by_name(tmp_path):
    """A format-1 checkpoint (before checksums, numpy in its rank files) is not loaded half-trusted."""
    folder = fake_checkpoint(tmp_path, 4, latest=True)
    (folder / files.META).write_text(json.dumps({"format": 1, "step": 4}))
    assert files.verify(folder) == [f"{folder / files.META}: written by an earlier YATT (checkpoint format 1, "
                                    "without file checksums, rank files not loadable with weights_only=True); "
                                    "resume it with that version or start fresh"]


def test_a_full_disk_is_named_the_save_not_started_and_the_last_good_checkpoint_kept(tmp_path, monkeypatch, caplog):
    """Too little free space: the save is not started (nothing partial), the failure names ENOSPC with
    the bytes needed and free and the last good checkpoint; a write that fails on a full disk with
    torch's zip-writer error is named as a full disk too."""
    ck = Checkpointer(tmp_path, 0, "tp0_pp0")
    save_state(ck, 1, nested_state(1.0))
    assert ck.wait() == step_dir(tmp_path, 1)
    full = types.SimpleNamespace(total=1 << 30, used=(1 << 30) - 4096, free=4096)
    monkeypatch.setattr(saver_mod.shutil, "disk_usage", lambda path: full)
    save_state(ck, 2, nested_state(2.0))
    assert ck._thread is None and not step_dir(tmp_path, 2, tmp=True).exists()  # not started
    with caplog.at_level(logging.ERROR, logger="yatt"):
        assert ck.poll() is None
    assert ck.failures == 1 and "rank 0: no space left on the device" in ck.last_failure
    assert "(ENOSPC)" in ck.last_failure and "0.00 GiB free" in ck.last_failure
    assert f"the last good checkpoint is {step_dir(tmp_path, 1)}" in caplog.text

    monkeypatch.setattr(saver_mod.shutil, "disk_usage", lambda path: types.SimpleNamespace(total=1 << 40, used=0,
                                                                                         free=1 << 40))

    def zip_error(obj, path):  # what torch.save raises when the disk fills mid-write
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
        monkeypatch.setattr(saver_mod.shutil, "disk_usage", lambda p: full)  # ... the disk is full by then
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1216 vs 1108")

    monkeypatch.setattr(saver_mod, "_save", zip_error)
    save_state(ck, 3, nested_state(3.0))
    ck._thread.join(10)
    assert ck.poll() is None and ck.failures == 2
    assert "no space left" in ck.last_failure and "unexpected pos 1216" in ck.last_failure
    assert not step_dir(tmp_path, 3, tmp=True).exists() and committed_steps(tmp_path) == [1]


def test_a_failed_final_save_ends_the_run_with_the_last_good_checkpoint(tmp_path, monkeypatch):
    """finish(): the final checkpoint failed -> CheckpointWriteError naming the cause and the last
    good checkpoint (launch exits with EXIT_SAVE_FAILED, not 0)."""
    from yatt.checkpoint.run_state import RunCheckpoints
    from yatt.checkpoint.saver import CheckpointWriteError
    from yatt.config import Config

    config = Config(output_dir=str(tmp_path / "out"), checkpoint={"every_steps": 1, "every_minutes": 0})
    ck = RunCheckpoints(config, 0, None, 0, parts={}, meta={"world": 1, "tp": 1, "pp": 1})
    try:
        ck.step_end(1)
        ck.saver.wait()
        monkeypatch.setattr(saver_mod, "_save", lambda obj, path: (_ for _ in ()).throw(OSError(28, "No space left")))
        with pytest.raises(CheckpointWriteError, match=r"the final checkpoint \(step 2\) could not be written: rank 0: "
                           r"no space left.*the last good checkpoint is .*step_000001"):
            ck.begin_final(2)
            ck.finish(2)
    finally:
        ck.triggers.close()
    assert triggers_mod.EXIT_SAVE_FAILED == 74


def test_a_failed_synchronous_write_does_not_raise(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, 0, "tp0_pp0", async_save=False)
    monkeypatch.setattr(saver_mod, "_save", lambda obj, path: (_ for _ in ()).throw(OSError("disk gone")))
    save_state(ck, 1, nested_state(1.0))
    assert ck.failures == 1 and ck.committed is None and find_latest(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_synchronous_save_returns_committed(tmp_path):
    ck = Checkpointer(tmp_path, 0, "tp0_pp0", async_save=False)
    state = nested_state(4.0)
    save_state(ck, 3, state)
    assert ck.committed == step_dir(tmp_path, 3) and find_latest(tmp_path) == step_dir(tmp_path, 3)
    assert not ck._thread.is_alive() and ck.poll() is None
    assert_same(load_part(ck.committed, "model", "tp0_pp0"), state["model"])
    assert not ck.snapshot._buffers  # the live states were written: no host copy is kept (less memory)
    critic = nested_state(5.0)  # another role's shard travels beside the model's
    ck.save(4, state["model"], state["optim"], {"step": 4}, {"world": 1}, roles={"critic": (critic["model"], critic["optim"])})
    assert_same(load_part(ck.committed, "model", "critic_tp0_pp0"), critic["model"])
    assert_same(load_part(ck.committed, "optim", "critic_tp0_pp0"), critic["optim"])


def test_retention_and_cleanup_through_the_checkpointer(tmp_path):
    fake_checkpoint(tmp_path, 9, tmp=True)  # left by a killed run
    ck = Checkpointer(tmp_path, 0, "tp0_pp0", async_save=False, keep_last=2, keep_every=3)
    assert not step_dir(tmp_path, 9, tmp=True).exists()
    for s in range(1, 8):
        save_state(ck, s, nested_state(float(s)))
    assert committed_steps(tmp_path) == [3, 6, 7]


def test_rank_without_model_key_writes_only_its_rank_file(tmp_path):
    ck = Checkpointer(tmp_path, 0, None, async_save=False)
    ck.save(5, None, None, {"pos": 17}, {"world": 1})
    assert sorted(p.name for p in ck.committed.iterdir()) == ["meta.json", "rank"]
    assert load_part(ck.committed, "rank", "00000") == {"pos": 17}


def test_load_part_round_trip_and_missing_part(tmp_path):
    ck = Checkpointer(tmp_path, 0, "tp0_pp0", async_save=False)
    state = nested_state(1.5)
    save_state(ck, 1, state)
    assert_same(load_part(ck.committed, "optim", "tp0_pp0"), state["optim"])
    with pytest.raises(FileNotFoundError, match=r"tp1_pp0\.pt is missing.*world size or TP/PP"):
        load_part(ck.committed, "model", "tp1_pp0")
    with pytest.raises(FileNotFoundError, match=r"00003\.pt"):
        load_part(ck.committed, "rank", "00003")


def test_checkpointer_without_torch_distributed(tmp_path, monkeypatch):
    """Collectives are skipped when torch.distributed is not initialised (forced here)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for name in ("barrier", "all_reduce"):
        monkeypatch.setattr(torch.distributed, name, lambda *a, **k: pytest.fail("collective without a group"))
    ck = Checkpointer(tmp_path, 0, "tp0_pp0")
    save_state(ck, 1, nested_state(1.0))
    assert ck.wait() == step_dir(tmp_path, 1)
    trig = SaveTriggers(every_steps=2)
    assert trig.check(2) == (True, None) and trig.check(3) == (False, None)


# ============================================================ triggers.py

def test_every_steps():
    trig = SaveTriggers(every_steps=3)
    assert [s for s in range(1, 10) if trig.check(s)[0]] == [3, 6, 9]
    assert all(trig.check(s) == (False, None) for s in range(1, 10) if s % 3)
    never = SaveTriggers(every_steps=0, every_minutes=0)
    assert not any(never.check(s)[0] for s in range(1, 10))


def test_every_minutes_with_a_fake_clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(triggers_mod, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    trig = SaveTriggers(every_steps=0, every_minutes=2)
    now[0] = 1000 + 119
    assert trig.check(1) == (False, None)
    now[0] = 1000 + 120
    assert trig.check(2) == (True, None)
    assert trig.check(3) == (True, None)  # still due until a save restarts the interval
    trig.saved()
    now[0] = 1120 + 100
    assert trig.check(4) == (False, None)
    now[0] = 1120 + 121
    assert trig.check(5) == (True, None)
    off = SaveTriggers(every_minutes=0)
    now[0] = 1e9
    assert off.check(1) == (False, None)


def test_sigusr1_asks_for_a_save_and_a_stop_and_close_restores_the_handler():
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    before = signal.signal(signal.SIGUSR1, previous)
    try:
        trig = SaveTriggers(every_steps=100, signals=("SIGUSR1",))
        assert trig.check(1) == (False, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while trig.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert trig.received == "SIGUSR1" and seen == []
        assert trig.check(7) == (True, "SIGUSR1")
        trig.close()
        assert signal.getsignal(signal.SIGUSR1) is previous
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGUSR1]
        trig.close()  # twice: harmless
        assert signal.getsignal(signal.SIGUSR1) is previous
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert EXIT_PREEMPTED == 75
    err = triggers_mod.Preempted(4, "SIGTERM")
    assert err.step == 4 and err.signal_name == "SIGTERM" and "SIGTERM" in str(err)


# ============================================================ metrics.jsonl on resume

def test_metrics_writer_resume_keeps_records_up_to_the_checkpoint(tmp_path):
    from yatt.controller.metrics import MetricsWriter

    lines = [{"step": 0, "eval_accuracy": 0.1}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
             {"step": 2, "eval_accuracy": 0.5}, {"step": 3, "loss": 3.0}, {"step": 4, "loss": 4.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 2, "lo')  # crash mid-line
    assert MetricsWriter(tmp_path, rank=1, resume_step=2).enabled is False
    assert path.read_text().endswith('{"step": 2, "lo')  # other ranks leave it alone
    w = MetricsWriter(tmp_path, rank=0, resume_step=2)
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:4]
    w.write({"step": 3, "loss": float("nan")})
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:4] + [{"step": 3, "loss": None}]


def test_metrics_writer_last_line_without_newline_and_fresh_start(tmp_path):
    from yatt.controller.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}')  # complete, newline lost
    w = MetricsWriter(tmp_path, rank=0, resume_step=5)
    w.write({"step": 3})
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
                                                                     {"step": 3}]
    MetricsWriter(tmp_path, rank=0, resume_step=0)
    assert path.read_text() == ""
    MetricsWriter(tmp_path / "new", rank=0, resume_step=3)  # resumed, but no file: starts empty
    assert (tmp_path / "new" / "metrics.jsonl").read_text() == ""


# ============================================================ guard / dynamic sampler state

def test_stability_guard_state_round_trip():
    from yatt.algos.guard import StabilityGuard

    guard = StabilityGuard(spike_factor=3.0, window=4, min_history=2)
    for x in (1.0, 2.0, math.nan, 1.5, 100.0, 0.0, 2.5, math.inf):
        guard(x)
    state = guard.state_dict()
    assert state == {"history": [1.0, 2.0, 1.5, 2.5], "skipped_non_finite": 2, "skipped_spike": 1}
    state = pickle.loads(pickle.dumps(state))  # through the rank file
    guard(2.0)  # the original moves on: the saved state must not follow
    assert state["history"] == [1.0, 2.0, 1.5, 2.5]

    a = StabilityGuard(spike_factor=3.0, window=4, min_history=2)
    b = StabilityGuard(spike_factor=3.0, window=4, min_history=2)
    a.load_state_dict(state)
    b.load_state_dict(state)
    b.load_state_dict(state)  # loading twice does not append twice
    assert a.state_dict() == b.state_dict() == state and a.history.maxlen == 4
    fresh = StabilityGuard(spike_factor=3.0, window=4, min_history=2)
    after = (5.5, 6.0, 1.0, math.nan, 4.0, 20.0, 3.0)
    decisions = [a(x) for x in after]
    assert decisions == [b(x) for x in after]
    assert decisions != [fresh(x) for x in after]  # the history matters (5.5 is a spike only with it)
    assert a.state_dict() == b.state_dict()


def test_dynamic_sampler_state_round_trip():
    from yatt.controller.dynamic_sampling import DynamicSampler

    sampler = DynamicSampler(target=2, max_rounds=0)
    for _ in range(3):  # every group uninformative: the cap is hit each step
        sampler.fill([0, 1], [[1.0, 1.0], [0.0, 0.0]], lambda r: pytest.fail("no extra rounds"))
    state = pickle.loads(pickle.dumps(sampler.state_dict()))
    assert state == {"cap_hits": 3}
    restored = DynamicSampler(target=2, max_rounds=0)
    restored.load_state_dict(state)
    _, _, stats = restored.fill([0], [[1.0, 1.0]], lambda r: pytest.fail("no extra rounds"))
    assert stats["dynamic_sampling_cap_hits"] == (4.0, 1.0) and restored.cap_hits == 4


# ============================================================ RunCheckpoints save points (no policy)

def test_run_checkpoints_save_points_preemption_and_resume_without_a_policy(tmp_path):
    """A rank that does not train (actor None): step_end saves every N steps, SIGUSR1 ends the
    loop with the step committed, finish saves the last step; resume restores its parts."""
    from yatt.checkpoint.run_state import RunCheckpoints, StatsPart
    from yatt.config import Config

    @dataclasses.dataclass
    class Stats:
        bad_rows: int = 0
        seen: int = 0

    def make(stats, **cfg):
        config = Config(output_dir=str(tmp_path / "out"), **cfg,
                        checkpoint={"every_steps": 2, "every_minutes": 0, "on_signals": ["SIGUSR1"]})
        return RunCheckpoints(config, 0, None, 0, parts={"stats": StatsPart(stats)}, meta={"world": 1, "tp": 1, "pp": 1})

    before = signal.getsignal(signal.SIGUSR1)
    stats = Stats()
    ck = make(stats)
    try:
        assert ck.root == tmp_path / "out" / "checkpoints" and ck.model_key is None
        assert ck.resume() == 0 and ck.rollback() is False
        for step in (1, 2, 3):
            stats.seen = step
            ck.step_end(step)
            if ck.saver._thread is not None:
                ck.saver._thread.join(10)
        assert committed_steps(ck.root) == [2] and ck.saver.committed == step_dir(ck.root, 2)
        stats.seen, stats.bad_rows = 4, 1
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while ck.triggers.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ck.step_end(5) == "SIGUSR1"  # not a multiple of 2: saved because of the signal
        assert find_latest(ck.root) == step_dir(ck.root, 5) and committed_steps(ck.root) == [2, 5]
        assert files.read_meta(step_dir(ck.root, 5))["step"] == 5
    finally:
        ck.triggers.close()
    assert signal.getsignal(signal.SIGUSR1) is before

    restored = Stats()
    again = make(restored)
    assert again.resume() == 5 and restored == Stats(bad_rows=1, seen=4)
    assert again.rollback() is True  # nothing to load on a rank without a policy, but a checkpoint exists
    again.begin_final(6)  # save_final
    again.finish(6)
    assert find_latest(again.root) == step_dir(again.root, 6) and committed_steps(again.root) == [5, 6]
    assert signal.getsignal(signal.SIGUSR1) is before


# ============================================================ RunCheckpoints on a tiny Megatron policy

@pytest.fixture(scope="module")
def tiny_llama(world1, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    ref.save_tiny_hf(path, "llama", vocab_size=100, tied=True)
    return path


def _policy(path):
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    return MegatronPolicy(path, optim=OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, total_steps=6))


def _batches(seed: int) -> list[dict]:
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids, "mask": torch.ones(2, 12)}]


def _policy_state(policy) -> dict:
    """Clones of everything rollback/resume must restore: model, optimizer (incl. param groups), scheduler."""
    model = {k: v.clone() for k, v in policy.module.state_dict().items() if isinstance(v, torch.Tensor)}
    optim = policy.optimizer.state_dict()
    return {"model": model, "state": clone_state(optim["state"]),
            "lr": [g["lr"] for g in optim["param_groups"]], "sched": dict(policy.scheduler.state_dict())}


def _assert_policy_state(policy, want: dict, schedule: bool = True) -> None:
    got = _policy_state(policy)
    assert got["model"].keys() == want["model"].keys()
    bad = [k for k in want["model"] if not torch.equal(got["model"][k], want["model"][k])]
    assert not bad, bad
    assert got["state"].keys() == want["state"].keys() and len(want["state"]) > 0
    for i, s in want["state"].items():
        assert set(s) >= {"exp_avg", "exp_avg_sq", "step"}
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    if not schedule:
        return
    assert got["lr"] == want["lr"]
    assert got["sched"] == want["sched"]
    assert policy.scheduler.num_steps == want["sched"]["num_steps"]


def _differs(policy, want: dict) -> bool:
    got = _policy_state(policy)
    return (any(not torch.equal(got["model"][k], v) for k, v in want["model"].items())
            and any(not torch.equal(got["state"][i]["exp_avg"], s["exp_avg"]) for i, s in want["state"].items())
            and got["sched"]["num_steps"] != want["sched"]["num_steps"])


@pytest.fixture
def make_ckpt(tmp_path):
    """``make_ckpt(actor, parts, world=1, **cfg) -> RunCheckpoints``; signal handlers restored after."""
    from yatt.checkpoint.run_state import RunCheckpoints
    from yatt.config import Config

    made = []

    def make(actor, parts, world: int = 1, **cfg):
        config = Config(output_dir=str(tmp_path / "out"), checkpoint={"dir": str(tmp_path / "ckpt")}, **cfg)
        ck = RunCheckpoints(config, 0, actor, 0, parts=parts,
                            meta={"world": world, "tp": 1, "pp": 1, "dtype": "float32"})
        made.append(ck)
        return ck

    yield make
    for ck in made:
        ck.triggers.close()


def test_rollback_restores_model_optimizer_and_schedule(tiny_llama, make_ckpt):
    """Rollback into a policy that has moved on restores the saved step count and LR. Megatron's
    ``OptimizerParamScheduler.load_state_dict`` ends in ``self.step(increment=num_steps)`` (it
    adds the saved count to the live one), so the live count must be zeroed first; without that
    the LR here jumps to 1e-4 = min_lr instead of 9.1e-4."""
    from yatt.algos.guard import StabilityGuard

    policy = _policy(tiny_llama)
    policy.train_step(_batches(0), ref.sum_logprob_loss)  # warmup step (lr 0): Adam state exists
    policy.train_step(_batches(1), ref.sum_logprob_loss)
    ck = make_ckpt(policy, {"guard": StabilityGuard(), "nothing": None})
    assert ck.model_key == "tp0_pp0" and set(ck.parts) == {"guard"}
    assert ck.root == Path(ck.cfg.checkpoint.dir)
    assert ck.rollback() is False and ck.rollbacks == 0  # nothing saved yet

    at_save = _policy_state(policy)
    ck.save(1)
    assert ck.saver.wait() == step_dir(ck.root, 1)
    stats = policy.train_step(_batches(2), ref.sum_logprob_loss)
    assert stats["update_skipped"] == 0 and stats["lr"] > 0
    after_one = _policy_state(policy)
    assert _differs(policy, at_save)
    policy.train_step(_batches(3), ref.sum_logprob_loss)

    assert ck.rollback() is True and ck.rollbacks == 1
    _assert_policy_state(policy, at_save, schedule=False)  # model + Adam state: restored exactly
    assert policy.scheduler.num_steps == at_save["sched"]["num_steps"], "LR schedule not rolled back"
    _assert_policy_state(policy, at_save)  # incl. the optimizer's lr
    # the same step from the restored state gives the same update, and training goes on
    again = policy.train_step(_batches(2), ref.sum_logprob_loss)
    assert again["lr"] == stats["lr"] and again["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-6)
    got = _policy_state(policy)
    for k, v in after_one["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-5, atol=1e-7)
    assert got["sched"] == after_one["sched"]
    # a second rollback still finds the checkpoint as written (in-place updates did not reach the file)
    assert ck.rollback() is True and ck.rollbacks == 2
    _assert_policy_state(policy, at_save)


def test_rollback_weights_and_adam_state(tiny_llama, make_ckpt):
    """Repeated rollbacks restore the model, Adam moments and step counts each time; in-place
    optimizer updates after a rollback do not reach the checkpoint's files (they are loaded
    memory-mapped, copy-on-write)."""
    policy = _policy(tiny_llama)
    policy.train_step(_batches(0), ref.sum_logprob_loss)
    policy.train_step(_batches(1), ref.sum_logprob_loss)
    ck = make_ckpt(policy, {})
    at_save = _policy_state(policy)
    ck.save(1)
    ck.saver.wait()
    policy.train_step(_batches(2), ref.sum_logprob_loss)
    assert _differs(policy, at_save)
    assert ck.rollback() is True
    _assert_policy_state(policy, at_save, schedule=False)
    policy.train_step(_batches(3), ref.sum_logprob_loss)
    policy.train_step(_batches(4), ref.sum_logprob_loss)
    assert ck.rollback() is True and ck.rollbacks == 2
    _assert_policy_state(policy, at_save, schedule=False)
    assert_same(load_part(ck.saver.committed, "model", "tp0_pp0")["decoder.final_layernorm.weight"],
                at_save["model"]["decoder.final_layernorm.weight"])


def test_resume_restores_policy_parts_and_rng(tiny_llama, make_ckpt):
    import random

    import numpy as np

    from yatt.algos.guard import StabilityGuard
    from yatt.controller.dynamic_sampling import DynamicSampler

    policy = _policy(tiny_llama)
    policy.train_step(_batches(0), ref.sum_logprob_loss)
    policy.train_step(_batches(1), ref.sum_logprob_loss)
    guard, sampler = StabilityGuard(), DynamicSampler(target=2, max_rounds=0)
    guard(3.0), guard(4.0), guard(math.nan)
    sampler.cap_hits = 2
    ck = make_ckpt(policy, {"guard": guard, "sampler": sampler})
    assert ck.resume() == 0 and ck.resumed_from is None  # resume=auto, nothing there: a fresh start
    at_save = _policy_state(policy)
    ck.save(1)
    draws = (torch.rand(4), np.random.rand(2), random.random())
    ck.saver.wait()
    ck.triggers.close()
    folder = step_dir(ck.root, 1)
    next_step = policy.train_step(_batches(2), ref.sum_logprob_loss)  # the run goes on, then dies
    torch.rand(10), np.random.rand(3), random.random()

    for resume in (str(folder), str(ck.root), "auto"):
        fresh = _policy(tiny_llama)  # a resumed job builds its policy from the base model
        fresh_guard, fresh_sampler = StabilityGuard(), DynamicSampler(target=2, max_rounds=0)
        again = make_ckpt(fresh, {"guard": fresh_guard, "sampler": fresh_sampler}, resume=resume)
        assert again.resume() == 1 and again.resumed_from == folder
        _assert_policy_state(fresh, at_save)
        assert fresh_guard.state_dict() == {"history": [3.0, 4.0], "skipped_non_finite": 1, "skipped_spike": 0}
        assert fresh_sampler.cap_hits == 2
        assert torch.equal(torch.rand(4), draws[0]) and np.array_equal(np.random.rand(2), draws[1])
        assert random.random() == draws[2]
    # step 2 of the resumed run is step 2 of the interrupted one
    resumed_step = fresh.train_step(_batches(2), ref.sum_logprob_loss)
    assert resumed_step["lr"] == next_step["lr"]
    assert resumed_step["grad_norm"] == pytest.approx(next_step["grad_norm"], rel=1e-6)
    # rollback of a resumed run that saved nothing yet goes to the checkpoint it resumed from
    assert again.saver.committed is None and again.rollback() is True
    _assert_policy_state(fresh, at_save, schedule=False)

    assert make_ckpt(policy, {}, resume="none").resume() == 0
    with pytest.raises(FileNotFoundError):
        make_ckpt(policy, {}, resume=str(ck.root / "step_000099")).resume()
    assert make_ckpt(policy, {}, world=2).resume() == 1  # another world size, same TP and PP: resumed
    # saved with TP 1 into a job of "TP 2": the shards are rebuilt (yatt/checkpoint/relayout.py), here
    # into the same TP 1 policy, so they must be the saved ones
    other_tp = make_ckpt(policy, {})
    other_tp.meta["tp"] = 2
    policy.train_step(_batches(3), ref.sum_logprob_loss)
    assert _differs(policy, at_save)
    assert other_tp.resume() == 1
    _assert_policy_state(policy, at_save)


def test_bf16_policy_rollback_restores_weights_and_fp32_main_params(tiny_llama, make_ckpt):
    """bf16: Megatron's Float16 optimizer keeps fp32 main params beside the bf16 model; both come back."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig

    policy = MegatronPolicy(tiny_llama, optim=OptimConfig(lr=1e-3, total_steps=6), dtype=torch.bfloat16)
    policy.train_step(_batches(0), ref.sum_logprob_loss)
    model = {k: v.clone() for k, v in policy.module.state_dict().items() if isinstance(v, torch.Tensor)}
    main = [p.clone() for group in policy.optimizer.state_dict()["fp32_from_fp16_params"] for p in group]
    ck = make_ckpt(policy, {})
    ck.save(1)
    ck.saver.wait()
    policy.train_step(_batches(1), ref.sum_logprob_loss)
    assert any(not torch.equal(v, model[k]) for k, v in policy.module.state_dict().items() if k in model)
    assert ck.rollback() is True
    assert all(torch.equal(v, model[k]) for k, v in policy.module.state_dict().items() if k in model)
    now = [p for group in policy.optimizer.state_dict()["fp32_from_fp16_params"] for p in group]
    assert len(now) == len(main) > 0 and all(torch.equal(a, b) for a, b in zip(now, main))


def test_signals_before_the_loop_are_recorded_and_taken_over():
    """catch_early: SIGTERMs before the step loop's triggers exist (models loading) do not kill the
    process; the triggers built later report the first, and closing them restores the original
    handler. A second SIGTERM (e.g. during a save) is recorded again, never fatal."""
    before = signal.getsignal(signal.SIGTERM)
    triggers_mod.catch_early(("SIGTERM",))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while triggers_mod._Early.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert triggers_mod.early_stop_requested() == "SIGTERM"  # the start-up check before models load
        trig = SaveTriggers(signals=("SIGTERM",))
        assert trig.received == "SIGTERM" and trig.stop_requested() == "SIGTERM"
        trig.close()
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        triggers_mod.release_early()
    assert signal.getsignal(signal.SIGTERM) is before
    assert str(triggers_mod.Preempted(0, "SIGTERM", saved=False)) == (
        "SIGTERM received during start-up, nothing to save yet (no step done); stopped")
    assert str(triggers_mod.Preempted(None, "SIGTERM", saved=False)) == (
        "SIGTERM received during start-up, nothing to save yet (no step done in this job); stopped")
    assert triggers_mod.early_stop_requested() is None  # released: nothing recorded


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs (root and mount(8) needed; skipped where mounting is not allowed: the injected
    ENOSPC test above covers the same logic)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_real_full_disk_is_named_and_the_last_good_checkpoint_kept(small_tmpfs, monkeypatch):
    """On a real 8 MiB filesystem: a 2 MiB save commits; a 12 MiB one is not started (too little
    free space); a 2 MiB one during which another writer fills the disk fails inside torch.save
    (``unexpected pos``) and is still named ENOSPC; step 1 stays the committed, verified checkpoint."""
    ck = Checkpointer(small_tmpfs, 0, "tp0_pp0", async_save=False, keep_last=5)
    ck.save(1, {"w": torch.zeros(512 * 1024)}, {"s": torch.zeros(1)}, {"step": 1}, {"world": 1})
    assert ck.committed == step_dir(small_tmpfs, 1) and files.verify(ck.committed) == []
    ck.save(2, {"w": torch.zeros(3 * 1024 * 1024)}, {"s": torch.zeros(1)}, {"step": 2}, {"world": 1})
    assert ck.failures == 1 and "not started: too little free space" in ck.last_failure
    orig = saver_mod._save

    def disk_fills_meanwhile(obj, path):
        with open(small_tmpfs / "other_writer", "ab") as f:  # someone else takes the free space
            try:
                f.write(b"\0" * (8 << 20))
            except OSError:
                pass
        return orig(obj, path)

    monkeypatch.setattr(saver_mod, "_save", disk_fills_meanwhile)
    ck.save(3, {"w": torch.zeros(512 * 1024)}, {"s": torch.zeros(1)}, {"step": 3}, {"world": 1})
    assert ck.failures == 2 and "no space left on the device" in ck.last_failure, ck.last_failure
    assert "not started" not in ck.last_failure  # this time the write itself failed
    assert committed_steps(small_tmpfs) == [1] and find_latest(small_tmpfs) == step_dir(small_tmpfs, 1)
    assert not step_dir(small_tmpfs, 3, tmp=True).exists() and files.verify(step_dir(small_tmpfs, 1)) == []


def test_resume_from_a_damaged_only_checkpoint_stops_before_training(tmp_path):
    """RunCheckpoints.resume with resume=auto and no checkpoint that verifies raises CheckpointDamaged
    (launch turns it into exit 2 with the message) instead of loading it or starting over silently."""
    from yatt.checkpoint.run_state import CheckpointDamaged, RunCheckpoints
    from yatt.config import Config

    config = Config(output_dir=str(tmp_path / "out"), checkpoint={"every_steps": 1, "every_minutes": 0})
    ck = RunCheckpoints(config, 0, None, 0, parts={}, meta={"world": 1, "tp": 1, "pp": 1})
    ck.begin_final(1)  # the final save of step 1
    ck.finish(1)
    rank_file = step_dir(ck.root, 1) / "rank" / "00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-10])
    again = RunCheckpoints(config, 0, None, 0, parts={}, meta={"world": 1, "tp": 1, "pp": 1})
    try:
        with pytest.raises(CheckpointDamaged, match="resume=auto: no checkpoint under .* verifies"):
            again.resume()
    finally:
        again.triggers.close()


@pytest.mark.parametrize("dtype,lora", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_optimizer_state_is_named_by_parameter(world1, tmp_path, dtype, lora):
    """A checkpoint's optimizer file names the parameter behind every optimizer state index (bf16:
    the fp32 main copies under their model parameter's name), so a resume can match them by name."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.lora import LoraSpec

    ref.save_tiny_hf(tmp_path, "qwen2", vocab_size=100, tied=False)
    policy = MegatronPolicy(tmp_path, optim=OptimConfig(lr=1e-2, total_steps=2), dtype=getattr(torch, dtype),
                            lora=LoraSpec(rank=2) if lora else None)
    policy.train_step(ref.padded_micro_batches([[6, 10]], 100, seed=2), ref.sum_logprob_loss)
    (groups,) = policy.optimizer_param_names()
    names = [n for g in groups for n in g]
    trained = {n: p for n, p in policy.module.named_parameters() if p.requires_grad}
    assert sorted(names) == sorted(trained) and len(set(names)) == len(names)
    state = policy.optimizer.state_dict()
    inner = state.get("optimizer", state)
    for k, name in enumerate(names):  # each index's moments have its parameter's shape
        assert inner["state"][k]["exp_avg"].shape == trained[name].shape, name
