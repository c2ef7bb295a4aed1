"""A step's record: its metrics reduced over the ranks, written, and rank 0's console line.

Each rank gathers ``(sum, count)`` pairs through the step (:func:`merge`, :func:`sample_sums`);
:func:`report_step` reduces them over the ranks (:func:`yatt.controller.metrics.global_means`: the
slowest rank's phase times and memory peaks, the :data:`COUNTERS` summed, the :data:`MAXIMA` the
largest, the rest means), adds the ranks' idle times, tells the placement and writes the record.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from yatt.controller.metrics import PhaseTimer, global_means
from yatt.reward.scorer import COUNTER_SUFFIXES

if TYPE_CHECKING:
    from yatt.job import Job

COUNTERS = ("tokens_total", "genrm_unparsable", "genrm_timed_out", "dynamic_sampling_groups_dropped",
            "dynamic_sampling_groups_trimmed", "data_rows_skipped", "samples_skipped", "tokens_skipped",
            "sft_rows_skipped", "dpo_rows_skipped", "rm_rows_skipped")  # summed over ranks, not averaged
MAXIMA = ("genrm_queue_tokens_max", "genrm_queue_groups_max", "checkpoint_failures", "is_ratio_max",
          "is_weight_max", "staleness_max", "turns_max")  # max over ranks
COUNTER_PREFIXES = ("turns_end_", "tool_")  # episodes: end reasons and an environment's tool counters, summed


def report_step(job: Job, step: int, timer: PhaseTimer, t0: float, sums: dict) -> dict:
    """Reduce the step's metrics over the ranks (the slowest rank's phase times, idle times),
    tell the placement, write them and print rank 0's line."""
    idle = sums.pop("idle_s", (0.0,))[0] + job.placement.pop_idle() + _wait_for_peers()  # waits for the others
    timer.times["time_step_s"] = time.perf_counter() - t0
    if job.placement.roles.apart:  # each group's busy and idle seconds (means over the group's ranks)
        role = "trainer" if job.trains else "sampler"
        sums.update({f"{role}_busy_s": (timer.times["time_step_s"] - idle, 1.0), f"{role}_idle_s": (idle, 1.0)})
    sums.update({k: (v, 1.0) for k, v in {**timer.times, **timer.peaks}.items()})
    record = {"step": step, **global_means(sums, op_max=MAXIMA, op_sum=COUNTERS, sum_suffixes=COUNTER_SUFFIXES,
                                           max_prefixes=("time_", "mem_peak_"), sum_prefixes=COUNTER_PREFIXES)}
    record["tokens_per_s"] = record.pop("tokens_total") / record["time_step_s"]
    record.update(_idle_record(idle))
    job.placement.end_step(record.get("time_rollout_genrm_s", 0.0), timer.avail_min)  # none in sft
    job.writer.write(record)
    if job.info.rank == 0:
        tqdm.write(_line(record) if job.cfg.stage == "rl" else _stage_line(record, f"{job.cfg.stage}_loss"))
    return record


def _wait_for_peers() -> float:
    """Seconds this rank waits for the slowest rank at the end of the step (idle time)."""
    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - t0


def _idle_record(idle: float) -> dict:
    """``idle_s`` (mean over ranks), ``idle_max_s`` and ``idle_rank_s`` (per rank, ms rounded)."""
    every = torch.tensor([idle], dtype=torch.float64)
    if dist.is_initialized():
        every = torch.zeros(dist.get_world_size(), dtype=torch.float64)
        dist.all_gather_single(every, torch.tensor([idle], dtype=torch.float64))
    return {"idle_s": float(every.mean()), "idle_max_s": float(every.max()),
            "idle_rank_s": [round(v, 3) for v in every.tolist()]}


def sample_sums(groups, rewards: list[float], accuracy: list[float]) -> dict[str, tuple[float, float]]:
    """(sum, count) metrics of every response of ``groups`` (``rewards``: the training reward,
    ``accuracy``: the accuracy source's scores, 1 = correct; both prompt-major)."""
    pairs = [(g.row, c) for g in groups for c in g.completions]
    n = float(len(pairs))
    return {
        "reward_mean": (sum(rewards), n),
        "accuracy": (sum(float(r == 1.0) for r in accuracy), n),
        "response_len_mean": (sum(len(c.token_ids) for _, c in pairs), n),
        "truncated_frac": (sum(float(c.finish_reason == "length") for _, c in pairs), n),
        "tokens_total": (sum(len(row.prompt_ids) + len(c.token_ids) for row, c in pairs), 1.0),
    }


def merge(sums: dict, more: dict) -> None:
    """Add one sampling round's (sum, count) pairs into the step's (maxima: the larger)."""
    for k, (v, c) in more.items():
        a, b = sums.get(k, (0.0, 0.0))
        sums[k] = (max(a, v), 1.0) if k in MAXIMA else (a + v, b + c)


def _line(r: dict) -> str:
    def v(key: str, fmt: str) -> str:  # "-": not measured this step (e.g. the actor frozen while the critic warms up)
        return format(r[key], fmt) if key in r else "-"

    means = [f"{k[7:-5]} {r[k]:.3f}" for k in sorted(r) if k.startswith("reward_") and k.endswith("_mean")
             and k != "reward_mean"]  # each source's
    errors = sum(r[k] for k in r if k.startswith("reward_") and k.endswith("_errors"))
    genrm = (f" ({' '.join(means)})" if len(means) > 1 else "") + (f" errors {errors:.0f}" if errors else "")
    critic = f" | vloss {r['value_loss']:.4f} ev {r['explained_variance']:.3f}" if "value_loss" in r else ""
    skipped = f" skip {r['samples_skipped']:.0f}" if "samples_skipped" in r else ""
    stale = f" stale {r['staleness_mean']:.1f}/{r['staleness_max']:.0f}" if "staleness_mean" in r else ""
    busy = (f" busy sampler {r['sampler_busy_s']:.1f} trainer {r['trainer_busy_s']:.1f}"
            if "sampler_busy_s" in r and "trainer_busy_s" in r else "")
    phases = " ".join(f"{name} {r[f'time_{key}_s']:.1f}" for name, key in _PHASES if f"time_{key}_s" in r)
    return (f"step {r['step']:>4} | reward {r['reward_mean']:.3f} acc {r['accuracy']:.3f}{genrm} | kl {v('kl', '.4f')} "
            f"ent {v('entropy', '.3f')} clip {v('clip_frac', '.3f')} gnorm {v('grad_norm', '.3f')}{critic} "
            f"| len {r['response_len_mean']:.1f}{skipped}{stale} | lpdiff {v('logprob_diff_rollout_vs_train', '.1e')} | "
            f"{r['time_step_s']:.1f}s ({phases} idle {r['idle_s']:.1f}{busy}) {r['tokens_per_s']:.0f} tok/s")


def _stage_line(r: dict, loss: str) -> str:
    acc = f" acc {r['pair_accuracy']:.3f} margin {r['reward_margin']:.3f}" if "pair_accuracy" in r else ""
    return (f"step {r['step']:>4} | {loss.replace('_', ' ')} {r.get(loss, float('nan')):.4f}{acc} "
            f"gnorm {r.get('grad_norm', float('nan')):.3f} "
            f"| len {r['response_len_mean']:.1f} | {r['time_step_s']:.1f}s (train {r.get('time_train_s', 0.0):.1f} "
            f"sync {r.get('time_sync_s', 0.0):.1f} idle {r['idle_s']:.1f}) {r['tokens_per_s']:.0f} tok/s")


_PHASES = (("roll", "rollout"), ("genrm", "genrm"), ("lp", "logprob"), ("train", "train"), ("critic", "critic"),
           ("sync", "sync"), ("engines", "engines"))
