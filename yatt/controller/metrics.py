"""Per-step metrics: phase timers, cross-rank reductions, and the ``metrics.jsonl`` writer.

No rank holds the global batch: each rank contributes (sum, count) pairs and the global mean
is one all-reduce of a small tensor.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from yatt.config import LogConfig

log = logging.getLogger("yatt")
LOW_MEMORY_FRACTION = 0.05  # of the machine's memory left available: warn before the OOM killer acts
LOW_MEMORY_REWARN_BYTES = 1 << 29  # warn again in a phase only when this much less is left than at its last warning
_low_memory_warned: dict[str, int] = {}  # phase -> bytes available at its last warning (this process)


class PhaseTimer:
    """Wall-clock seconds (``time_<phase>_s``) and peak resident memory in GiB
    (``mem_peak_<phase>_gib``, sampled every ``interval_s`` by a background thread) per phase.

    The same sampler keeps the machine's lowest available memory over all phases, less what
    ``released_bytes()`` says this rank has released at that moment (``avail_min``, bytes: what
    would have been left had it kept everything), and warns when it falls under
    :data:`LOW_MEMORY_FRACTION` of its total, naming the phase, this rank's resident memory and
    what is left (once per phase and process, again only when :data:`LOW_MEMORY_REWARN_BYTES`
    less is left than at that phase's last warning): the kernel's OOM killer ends a process
    without a word of its own (mpirun then reports only "Killed (signal 9)").
    """

    def __init__(self, interval_s: float = 0.05, on_enter=None, released_bytes=None) -> None:
        self.times: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.avail_min = math.inf
        self.released_bytes = released_bytes  # () -> bytes this rank released and could keep, or None
        self.interval_s = interval_s
        self.on_enter = on_enter  # called with the phase name as it starts (e.g. the watchdog's phase)

    def merge(self, other: "PhaseTimer") -> None:
        """Add ``other``'s phase times to these and keep the larger peak of each phase (a role's
        measurements, e.g. the placement's, into the step's)."""
        for k, v in other.times.items():
            self.times[k] = self.times.get(k, 0.0) + v
        for k, v in other.peaks.items():
            self.peaks[k] = max(self.peaks.get(k, 0.0), v)
        self.avail_min = min(self.avail_min, other.avail_min)

    @contextmanager
    def __call__(self, phase: str):
        if self.on_enter is not None:
            self.on_enter(phase)
        proc, peak, done = psutil.Process(), [0], threading.Event()

        def sample() -> None:
            warned = False
            while True:
                peak[0] = max(peak[0], proc.memory_info().rss)
                vm = psutil.virtual_memory()
                held = self.released_bytes() if self.released_bytes is not None else 0
                self.avail_min = min(self.avail_min, vm.available - held)
                if not warned:
                    warned = _warn_if_memory_low(phase, peak[0], vm)
                if done.wait(self.interval_s):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time_{phase}_s"] = self.times.get(f"time_{phase}_s", 0.0) + time.perf_counter() - t0
            done.set()
            sampler.join()
            peak[0] = max(peak[0], proc.memory_info().rss)
            key = f"mem_peak_{phase}_gib"
            self.peaks[key] = max(self.peaks.get(key, 0.0), peak[0] / 2**30)


def _warn_if_memory_low(phase: str, rss: int, vm) -> bool:
    """Log a warning if the machine's available memory (``vm``: ``psutil.virtual_memory()``) is
    under :data:`LOW_MEMORY_FRACTION` of its total and this phase has not warned at a level less
    than :data:`LOW_MEMORY_REWARN_BYTES` above it; returns whether it did."""
    if vm.available >= LOW_MEMORY_FRACTION * vm.total:
        return False
    if vm.available > _low_memory_warned.get(phase, vm.total) - LOW_MEMORY_REWARN_BYTES:
        return True  # said already for this phase
    _low_memory_warned[phase] = vm.available
    log.warning("memory nearly exhausted during phase %s: this rank holds %.1f GiB, the machine has %.1f of %.1f GiB "
                "left; the kernel may kill a rank (signal 9). Fewer ranks per machine, a smaller "
                "trainer.micro_batch_tokens or rollout.kv_cache_memory_bytes, or checkpoint.async_save: false need less",
                phase, rss / 2**30, vm.available / 2**30, vm.total / 2**30)
    return True


def global_means(sums: dict[str, tuple[float, float]], group=None, op_max: tuple[str, ...] = (),
                 op_sum: tuple[str, ...] = (), max_prefixes: tuple[str, ...] = (),
                 sum_suffixes: tuple[str, ...] = (), sum_prefixes: tuple[str, ...] = ()) -> dict[str, float]:
    """Reduce ``{name: (sum, count)}`` over ``group`` and return ``{name: sum/count}``.

    Names in ``op_max`` or starting with one of ``max_prefixes`` give the max over ranks of
    their sum, names in ``op_sum``, ending with one of ``sum_suffixes`` or starting with one of
    ``sum_prefixes`` the global sum (counts ignored for both). A name with global count 0 gives
    0.0, never NaN. Ranks may pass different names (a GenRM-only rank has no training metrics): a
    name missing on a rank counts as ``(0, 0)`` there.
    """
    names = sorted(sums)
    if dist.is_initialized():
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, names, group=group)
        names = sorted(set().union(*every))
    if not names:
        return {}
    sums = {k: sums.get(k, (0.0, 0.0)) for k in names}
    t = torch.tensor([[float(sums[k][0]), float(sums[k][1])] for k in names], dtype=torch.float64)
    mx = torch.tensor([float(sums[k][0]) for k in names], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    out = {}
    for i, k in enumerate(names):
        if k in op_max or k.startswith(max_prefixes):
            out[k] = float(mx[i])
        elif k in op_sum or k.endswith(sum_suffixes) or k.startswith(sum_prefixes):
            out[k] = float(t[i, 0])
        else:
            out[k] = float(t[i, 0] / t[i, 1]) if t[i, 1] > 0 else 0.0
    return out


def _records_up_to(path: Path, step: int) -> list[str]:
    """Lines of ``path`` whose record has ``step <= step`` (a line cut short by a crash is dropped)."""
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except ValueError:
            continue
    return kept


class MetricsWriter:
    """Writes one JSON object per record to ``<output_dir>/metrics.jsonl`` (rank 0 only).

    The file is started empty: a run never appends to an older run's records (the launcher
    refuses an output_dir that holds one unless ``overwrite=true`` or it resumes). A run resumed
    from the checkpoint of step ``resume_step`` keeps the records up to that step and drops the
    later ones (the interrupted run's, which the resumed run writes again). With ``log`` the
    records also go to the experiment trackers of ``log.trackers`` (TensorBoard, W&B, MLflow:
    :mod:`yatt.controller.trackers`), with ``config`` (the resolved config,
    ``Config.model_dump(mode="json")``) as their run's parameters.
    """

    def __init__(self, output_dir: str | Path, rank: int, resume_step: int = 0, log: LogConfig | None = None,
                 config: dict | None = None) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = rank == 0
        self.trackers = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = _records_up_to(self.path, resume_step) if resume_step and self.path.exists() else []
            self.path.write_text("".join(kept))
            if log is not None and log.trackers:
                from yatt.controller.trackers import Trackers

                self.trackers = Trackers(self.path.parent, resume_step, log, config)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean, sort_keys=False) + "\n")
        if self.trackers is not None:
            self.trackers.log(clean)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
