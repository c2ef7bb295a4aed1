"""One run (RL, or another ``stage``) as seen from one rank: the step loop, top to bottom.

Every rank runs this same function (SPMD) on what :func:`yatt.job.build_job` built for it. Per
step (:func:`_step`): its controller shard draws prompts; the placement (:mod:`yatt.placement`)
rolls them out and scores them with the GenRM judge (one phase after another on every rank, or
sampler and GenRM ranks side by side) and hands each rank the groups it trains on; the rule reward
scores them; the outcome estimator gives each group's advantages; the samples are balanced over
the DP ranks; the Megatron trainer computes old/ref logprobs and the critic values, the token
stage of the estimator finishes the advantages, the actor and then the critic update; the new
weights go into the rollout engines; the step's metrics are reduced and written; a save point
may checkpoint it. :meth:`yatt.job.Job.close` is the one teardown. With ``stage: sft`` a step
trains on its rows' target responses instead of sampling and scoring (:mod:`yatt.stages.sft`),
with ``stage: dpo`` on their chosen and rejected responses (:mod:`yatt.stages.dpo`), with
``stage: rm`` the critic learns a reward model from them (:mod:`yatt.stages.rm`); the sync,
evals, metrics and save points are the same.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from yatt.algos.estimators import outcome_advantages
from yatt.algos.reward_norm import normalize_rewards
from yatt.algos.update import compute_logprobs, compute_values, critic_update, finish_advantages, policy_update
from yatt.algos.zero_signal import trained_mask
from yatt.checkpoint.run_state import CheckpointDamaged, RunCheckpoints
from yatt.checkpoint.saver import CheckpointWriteError
from yatt.checkpoint.triggers import Preempted
from yatt.config import Config
from yatt.controller.batch import (make_mini_batches, make_samples, mini_batch_bounds, pack_micro_batches,
                                   skipped_counts)
from yatt.controller.evaluate import evaluate
from yatt.controller.metrics import MetricsWriter, PhaseTimer, global_means
from yatt.controller.rebalance import DpBalancer
from yatt.dist import RankInfo
from yatt.job import Job, build_job
from yatt.reward.scorer import COUNTER_SUFFIXES
from yatt.stages.dpo import dpo_eval, dpo_update, pair_micro_batches, pair_samples
from yatt.stages.rm import rm_eval, rm_samples, rm_update
from yatt.stages.sft import sft_samples, sft_update

log = logging.getLogger("yatt")
# summed over ranks, not averaged
_COUNTERS = ("tokens_total", "genrm_unparsable", "genrm_timed_out", "dynamic_sampling_groups_dropped",
             "dynamic_sampling_groups_trimmed", "data_rows_skipped", "samples_skipped", "tokens_skipped",
             "sft_rows_skipped", "dpo_rows_skipped", "rm_rows_skipped")
_MAXIMA = ("genrm_queue_tokens_max", "genrm_queue_groups_max", "checkpoint_failures")  # max over ranks


def run(cfg: Config, info: RankInfo, watchdog=None) -> list[dict]:
    """Train for ``cfg.trainer.total_steps`` steps; returns rank 0's metric records. ``watchdog``
    (a :class:`yatt.watchdog.Watchdog`) is told each phase, so a hang is reported with it."""
    # The libraries' objects live as long as the job: full collections stop walking them (an engine's
    # build and teardown leave this freeze alone: yatt.rollout.vllm_engine._no_heap_wide_gc).
    # Unfrozen at the end, for callers whose interpreter goes on or exits normally (the Python API).
    _import_libraries()
    gc.freeze()
    try:
        job = build_job(cfg, info, watchdog)
        with _teardown(job):
            return _train(job)
    finally:
        gc.unfreeze()


def _import_libraries() -> None:
    """Import the libraries the roles use (vLLM, Megatron-Core, transformers) before :func:`run`
    freezes the heap, so that the freeze covers their objects: automatic full collections and the
    one after each engine teardown then skip them. They load here instead of at first use; nothing
    else changes."""
    import megatron.core  # noqa: F401
    import transformers  # noqa: F401

    from yatt.rollout.vllm_engine import VLLMEngine  # noqa: F401  (sets vLLM's environment first)
    from vllm import LLM  # noqa: F401
    from yatt.trainer.actor import MegatronPolicy  # noqa: F401


@contextlib.contextmanager
def _teardown(job: Job) -> Iterator[None]:
    """Close the run (:meth:`Job.close`) when it ends, and when every rank stops together (a signal,
    a save the run must have that failed, a checkpoint to resume that does not verify) before the
    exception leaves :func:`run`; another exception is left alone (under MPI the job is aborted,
    and closing engines could wait on a dead peer)."""
    try:
        yield
    except (Preempted, CheckpointWriteError, CheckpointDamaged):
        job.close()
        raise
    job.close()


def _train(job: Job) -> list[dict]:
    """Resume, evaluate, run the steps with their save points, evaluate and save at the end."""
    cfg, ckpt, total = job.cfg, job.ckpt, job.cfg.trainer.total_steps
    start = ckpt.resume()  # 0: a fresh run; a damaged checkpoint stops every rank here, named
    _stop_if_signalled(ckpt, start)  # a signal while models and engines loaded
    if start >= total:
        log.info("the checkpoint is at step %d of trainer.total_steps=%d: nothing left to train", start, total)
        return []
    job.writer = MetricsWriter(cfg.output_dir, job.info.rank, resume_step=start, tensorboard=cfg.log.tensorboard)
    records = [] if start else _evaluate(job, 0)
    if start:
        job.placement.sync(job.actor)  # the engines serve the resumed policy
    _stop_if_signalled(ckpt, start)  # a signal during the step-0 eval or the sync
    for step in tqdm(range(start + 1, total + 1), desc="steps", initial=start, total=total,
                     disable=not (job.info.rank == 0 and cfg.log.progress), dynamic_ncols=True):
        records.append(_step(job, step))
        if cfg.eval.every and step % cfg.eval.every == 0 and step != total:
            records.extend(_evaluate(job, step))
        if step != total:
            job.phase("checkpoint", step)
            if stop := ckpt.step_end(step):  # a signal's checkpoint is committed: every rank stops here
                raise Preempted(step, stop)
    ckpt.begin_final(total)  # written while the final eval runs
    records.extend(_evaluate(job, total))
    ckpt.finish(total)
    return records


def _step(job: Job, step: int) -> dict:
    """One step on this rank (RL, or the ``stage`` the config names); returns its record (reduced
    over the ranks)."""
    timer = PhaseTimer(on_enter=lambda name: job.phase(name, step), released_bytes=job.placement.released_bytes)
    t0, sums = time.perf_counter(), {}
    {"rl": _rl_phases, "sft": _sft_phases, "dpo": _pair_phases, "rm": _pair_phases}[job.cfg.stage](job, step, timer, sums)
    sums["data_rows_skipped"] = (float(sum(job.train_rows.stats.skipped.values())), 1.0)  # so far, bad rows
    sums["checkpoint_failures"] = (float(job.ckpt.saver.failures), 1.0)  # so far, saves that failed (agreed)
    timer.merge(job.placement.sync(job.actor, timer.on_enter))
    job.phase("step end", step)
    return _record(job, step, timer, t0, sums)


def _rl_phases(job: Job, step: int, timer: PhaseTimer, sums: dict) -> None:
    """An RL step's phases up to the weight sync; metrics merged into ``sums``."""
    cfg = job.cfg
    job.phase("rollout", step)
    groups, rewards = _rollout_and_score(job, step, timer, sums)
    if not job.trains:
        return
    mini_batches, skipped = _experience(job, groups, rewards, timer, sums)
    with timer("logprob"):
        logprob_sums = compute_logprobs(job.actor, job.ref, mini_batches, cfg.algo.recompute_old_logprobs)
        if job.critic is not None:
            compute_values(job.critic, mini_batches)
        sums.update(finish_advantages(mini_batches, cfg.algo, job.dp_group, job.kl_ctrl))  # token-level stage
    if step > cfg.critic.freeze_actor_steps:  # 0 unless a critic warms up alone
        with timer("train"):
            sums.update(policy_update(job.actor, mini_batches, cfg.algo, job.dp_group, job.guard,
                                      cfg.rollout.max_tokens, skipped))
    if job.critic is not None:
        with timer("critic"):
            sums.update(critic_update(job.critic, mini_batches, cfg.critic, cfg.algo.ppo_epochs, job.dp_group,
                                      job.critic_guard))
    if cfg.trainer.guard.action == "rollback" and sums.get("guard_skipped_updates", (0.0,))[0]:
        sums["guard_rollbacks"] = (float(job.ckpt.rollback()), 1.0)
    sums.update(logprob_sums)  # full-batch entropy/diff when the old logprobs were recomputed


def _sft_phases(job: Job, step: int, timer: PhaseTimer, sums: dict) -> None:
    """A supervised fine-tuning step (:mod:`yatt.stages.sft`): this rank's rows with their target
    responses, shared over the model replica and balanced over the DP ranks, one optimizer step."""
    cfg = job.cfg
    job.phase("train", step)
    samples, rows = _stage_samples(job, *sft_samples(job.shard.next_batch(), cfg.sft, job.tokenizer,
                                                     cfg.rollout.max_model_len))
    sums.update(rows)
    with timer("balance"):
        minis, _ = _mini_batches(samples, None, job.balancer, cfg, job.tokenizer.pad_token_id, sums, mini_batches=1)
    if minis:
        with timer("train"):
            sums.update(sft_update(job.actor, minis[0], job.dp_group))


def _pair_phases(job: Job, step: int, timer: PhaseTimer, sums: dict) -> None:
    """A DPO step (:mod:`yatt.stages.dpo`: the policy against the reference) or a reward-model step
    (:mod:`yatt.stages.rm`: one Bradley-Terry step of the critic): this rank's rows as (chosen,
    rejected) pairs in the stage's layout, shared over the model replica, micro-batches of whole pairs."""
    job.phase("train", step)
    micro_batches, rows = _pair_batches(job, job.shard.next_batch())
    sums.update(rows)
    with timer("train"):
        sums.update(dpo_update(job.actor, job.ref, micro_batches, job.cfg.dpo, job.dp_group) if job.cfg.stage == "dpo"
                    else rm_update(job.critic, micro_batches, job.dp_group))


def _pair_batches(job: Job, rows) -> tuple[list[dict], dict[str, tuple[float, float]]]:
    """Micro-batches of whole (chosen, rejected) pairs of ``rows`` as the stage lays them out
    (DPO: prompt + response; RM: the reward model's chat layout), shared over the model replica,
    and this rank's row metrics."""
    cfg, t = job.cfg, job.cfg.trainer
    make = rm_samples if cfg.stage == "rm" else pair_samples
    samples, sums = _stage_samples(job, *make(rows, cfg.data, job.tokenizer, cfg.rollout.max_model_len))
    return pair_micro_batches(samples, t.micro_batch_tokens, job.tokenizer.pad_token_id, t.packing), sums


def _stage_samples(job: Job, samples: list, skipped: int) -> tuple[list, dict[str, tuple[float, float]]]:
    """A stage's samples made from this rank's rows, shared over the model replica (its TP x PP
    ranks train on the same data), and this rank's row metrics: ``<stage>_rows_skipped``,
    ``tokens_total``, ``response_len_mean``."""
    t = job.cfg.trainer
    sums = {f"{job.cfg.stage}_rows_skipped": (float(skipped), 1.0),
            "tokens_total": (float(sum(s.length for s in samples)), 1.0),
            "response_len_mean": (float(sum(len(s.response_ids) for s in samples)), float(len(samples)))}
    if t.tp * t.pp > 1:
        samples = _gather(samples, job.mp_group, t.tp * t.pp)
    return samples, sums


def _rollout_and_score(job: Job, step: int, timer: PhaseTimer, sums: dict) -> tuple[list, list[list[float]]]:
    """This rank's groups of the step and their rewards (one list of ``n`` per group); with DAPO
    dynamic sampling, the groups that carry no signal are dropped and more are sampled until the
    batch is full."""
    groups, rewards = _sample_round(job, step, 0, timer, sums)
    if job.sampler is not None:
        groups, rewards, more = job.sampler.fill(groups, rewards, lambda r: _sample_round(job, step, r, timer, sums))
        sums.update(more)
    return groups, rewards


def _sample_round(job: Job, step: int, round_: int, timer: PhaseTimer, sums: dict):
    """This rank's next prompts rolled out, judged and scored; metrics merged into ``sums``.
    Returns (the groups this rank trains on, their rewards, one list of ``n`` per group)."""
    from yatt.rollout.vllm_engine import SamplingSpec

    cfg, n = job.cfg, job.cfg.rollout.n
    seed = ((cfg.seed * 1_000_003 + step) * 4099 + job.info.rank) + round_ * 1_000_000_007  # reproducible
    spec = SamplingSpec(n=n, max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p, seed=seed)
    groups, more, measured = job.placement.rollout_and_score(job.shard.next_batch(), spec, job.actor, timer.on_enter)
    timer.merge(measured)
    rewards = []
    if job.trains:
        with timer("reward"):
            flat, accuracy, reward_sums = job.scorer.score(groups)
        more.update(_sample_sums(groups, flat, accuracy), **reward_sums)
        rewards = [flat[i * n:(i + 1) * n] for i in range(len(groups))]
    _merge(sums, more)
    return groups, rewards


def _experience(job: Job, groups, rewards: list[list[float]], timer: PhaseTimer,
                sums: dict) -> tuple[list[list[dict]], list[tuple[float, float]]]:
    """The step's samples with their outcome advantages (on the rank that owns each whole group, of
    the rewards as ``algo.reward_norm`` and ``algo.reward_clip`` make them; collective over the
    trainers), shared over the model replica, the zero-signal ones left out
    (:func:`yatt.algos.zero_signal.trained_mask`) and the rest balanced over the DP ranks. Returns
    this rank's micro-batches per mini-batch and, per mini-batch, its left-out (response tokens,
    sequences) for the loss normaliser."""
    t, a = job.cfg.trainer, job.cfg.algo
    scores = normalize_rewards(rewards, a.reward_norm, a.reward_clip, job.placement.train_group)
    samples = make_samples([g.row for g in groups], [g.completions for g in groups], [x for r in rewards for x in r],
                           outcome_advantages(job.estimator, scores))
    counts = True  # this rank counts its replica's left-out samples (its first rank does)
    if t.tp * t.pp > 1:  # the ranks of one model replica (TP x PP) train on the same data
        samples, counts = _gather(samples, job.mp_group, t.tp * t.pp), dist.get_rank(job.mp_group) == 0
    keep = trained_mask(a, [s.advantage for s in samples])
    if keep is not None:
        left = [s for s, k in zip(samples, keep) if not k] if counts else []
        sums.update(samples_skipped=(float(len(left)), 1.0), tokens_skipped=(float(sum(s.length for s in left)), 1.0))
    with timer("balance"):
        return _mini_batches(samples, keep, job.balancer, job.cfg, job.tokenizer.pad_token_id, sums)


def _record(job: Job, step: int, timer: PhaseTimer, t0: float, sums: dict) -> dict:
    """Reduce the step's metrics over the ranks (the slowest rank's phase times, idle times),
    tell the placement, write them and print rank 0's line."""
    idle = sums.pop("idle_s", (0.0,))[0] + _wait_for_peers()  # a rank with nothing left waits here
    timer.times["time_step_s"] = time.perf_counter() - t0
    sums.update({k: (v, 1.0) for k, v in {**timer.times, **timer.peaks}.items()})
    record = {"step": step, **global_means(sums, op_max=_MAXIMA, op_sum=_COUNTERS, sum_suffixes=COUNTER_SUFFIXES,
                                                  max_prefixes=("time_", "mem_peak_"))}
    record["tokens_per_s"] = record.pop("tokens_total") / record["time_step_s"]
    record.update(_idle_record(idle))
    job.placement.end_step(record.get("time_rollout_genrm_s", 0.0), timer.avail_min)  # none in sft
    job.writer.write(record)
    if job.info.rank == 0:
        tqdm.write(_line(record) if job.cfg.stage == "rl" else _stage_line(record, f"{job.cfg.stage}_loss"))
    return record


def _evaluate(job: Job, step: int) -> list[dict]:
    """The eval record of ``step`` (none when there are no eval rows: an accuracy of nothing is not 0)."""
    if not job.eval_total:
        return []
    job.phase("eval", step)
    record = {"step": step}
    if job.cfg.stage != "rm":  # the policy's greedy answers (stage rm does not train the policy)
        with job.placement.eval_engine(job.actor) as engine:
            record.update(evaluate(engine, job.eval_rows, job.scorer.accuracy_scores, job.tokenizer,
                                   job.cfg.eval.max_tokens))
    if job.cfg.stage in ("dpo", "rm"):  # the held-out pairs' preference accuracy
        batches = _pair_batches(job, job.eval_rows)[0]
        record.update(global_means(dpo_eval(job.actor, job.ref, batches, job.cfg.dpo) if job.cfg.stage == "dpo"
                                   else rm_eval(job.critic, batches)))
    job.writer.write(record)
    parts = ([f"accuracy {record['eval_accuracy']:.3f} reward {record['eval_reward_mean']:.3f}"]
             if "eval_accuracy" in record else [])
    if "eval_pair_accuracy" in record:
        parts.append(f"pair accuracy {record['eval_pair_accuracy']:.3f} margin {record['eval_reward_margin']:.3f}")
    log.info("eval step %d: %s", step, " ".join(parts))
    return [record]


def _stop_if_signalled(ckpt: RunCheckpoints, start: int) -> None:
    """Start-up check (collective): a SIGTERM/SIGUSR1 before the first step ends the run with
    nothing saved (there is no new step to save) and the requeue exit code.

    Raises:
        Preempted: with ``saved=False``.
    """
    if stop := ckpt.triggers.stop_requested():
        raise Preempted(start, stop, saved=False)


def _gather(samples, group, size: int):
    parts = [None] * size
    dist.all_gather_object(parts, samples, group=group)
    return [s for part in parts for s in part]


def _mini_batches(samples, keep: list[bool] | None, balancer: DpBalancer | None, cfg: Config, pad_id: int,
                  sums: dict, mini_batches: int | None = None) -> tuple[list[list[dict]], list[tuple[float, float]]]:
    """This rank's micro-batches per mini-batch of the samples ``keep`` marks, and per mini-batch the
    (response tokens, sequences) of the left-out ones: after DP balancing (which adds
    ``dp_imbalance_before``, ``dp_imbalance_after`` and ``update_skipped`` to ``sums``), or of its
    own samples when balancing is off; ``mini_batches`` of them (default ``algo.mini_batches``)."""
    m = mini_batches or cfg.algo.mini_batches
    packing = cfg.trainer.packing
    if balancer is None:
        minis = make_mini_batches(samples, m, cfg.trainer.micro_batch_tokens, pad_id, keep, packing)
        skipped = skipped_counts(samples, keep, mini_batch_bounds(len(samples), m))
    else:
        bal = balancer.balance(samples, m, keep)
        if not bal.splits:
            log.warning("fewer samples than DP ranks this step (dynamic sampling cap?): no update")
        sums["update_skipped"] = (float(not bal.splits), 1.0)
        sums.update(dp_imbalance_before=(bal.imbalance_before, 1.0), dp_imbalance_after=(bal.imbalance_after, 1.0))
        minis, skipped = [pack_micro_batches(bal.samples, split, pad_id, packing) for split in bal.splits], bal.skipped
    sums.update(_body_sums([mb for mbs in minis for mb in mbs]))
    return minis, skipped


def _body_sums(micro_batches: list[dict]) -> dict[str, tuple[float, float]]:
    """``pad_frac`` (padding share of the rows the model body runs) and ``body_tokens_vs_padded``
    (their size against the padded rows': what ``trainer.packing`` saves) over this rank's micro-batches."""
    real, ran = (float(sum(int(mb["body_tokens"][i]) for mb in micro_batches)) for i in (0, 1))
    return {"pad_frac": (ran - real, ran), "body_tokens_vs_padded": (ran, float(sum(mb["input_ids"].numel()
                                                                                 for mb in micro_batches)))}


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


def _sample_sums(groups, rewards: list[float], accuracy: list[float]) -> dict[str, tuple[float, float]]:
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


def _merge(sums: dict, more: dict) -> None:
    """Add one sampling round's (sum, count) pairs into the step's (maxima: the larger)."""
    for k, (v, c) in more.items():
        a, b = sums.get(k, (0.0, 0.0))
        sums[k] = (max(a, v), 1.0) if k in _MAXIMA else (a + v, b + c)


def _line(r: dict) -> str:
    def v(key: str, fmt: str) -> str:  # "-": not measured this step (e.g. the actor frozen while the critic warms up)
        return format(r[key], fmt) if key in r else "-"

    means = [f"{k[7:-5]} {r[k]:.3f}" for k in sorted(r) if k.startswith("reward_") and k.endswith("_mean")
             and k != "reward_mean"]  # each source's
    errors = sum(r[k] for k in r if k.startswith("reward_") and k.endswith("_errors"))
    genrm = (f" ({' '.join(means)})" if len(means) > 1 else "") + (f" errors {errors:.0f}" if errors else "")
    critic = f" | vloss {r['value_loss']:.4f} ev {r['explained_variance']:.3f}" if "value_loss" in r else ""
    skipped = f" skip {r['samples_skipped']:.0f}" if "samples_skipped" in r else ""
    phases = " ".join(f"{name} {r[f'time_{key}_s']:.1f}" for name, key in _PHASES if f"time_{key}_s" in r)
    return (f"step {r['step']:>4} | reward {r['reward_mean']:.3f} acc {r['accuracy']:.3f}{genrm} | kl {v('kl', '.4f')} "
            f"ent {v('entropy', '.3f')} clip {v('clip_frac', '.3f')} gnorm {v('grad_norm', '.3f')}{critic} "
            f"| len {r['response_len_mean']:.1f}{skipped} | lpdiff {v('logprob_diff_rollout_vs_train', '.1e')} | "
            f"{r['time_step_s']:.1f}s ({phases} idle {r['idle_s']:.1f}) {r['tokens_per_s']:.0f} tok/s")


def _stage_line(r: dict, loss: str) -> str:
    acc = f" acc {r['pair_accuracy']:.3f} margin {r['reward_margin']:.3f}" if "pair_accuracy" in r else ""
    return (f"step {r['step']:>4} | {loss.replace('_', ' ')} {r.get(loss, float('nan')):.4f}{acc} "
            f"gnorm {r.get('grad_norm', float('nan')):.3f} "
            f"| len {r['response_len_mean']:.1f} | {r['time_step_s']:.1f}s (train {r.get('time_train_s', 0.0):.1f} "
            f"sync {r.get('time_sync_s', 0.0):.1f} idle {r['idle_s']:.1f}) {r['tokens_per_s']:.0f} tok/s")


_PHASES = (("roll", "rollout"), ("genrm", "genrm"), ("lp", "logprob"), ("train", "train"), ("critic", "critic"),
           ("sync", "sync"), ("engines", "engines"))
