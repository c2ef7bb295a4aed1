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

from tqdm import tqdm

from yatt.algos.update import (compute_logprobs, compute_values, critic_update, finish_advantages, policy_update,
                               rollout_correction)
from yatt.checkpoint.run_state import CheckpointDamaged, RunCheckpoints
from yatt.checkpoint.saver import CheckpointWriteError
from yatt.checkpoint.triggers import Preempted
from yatt.config import Config
from yatt.controller.evaluate import evaluate
from yatt.controller.experience import balanced_mini_batches, rl_experience, stage_samples
from yatt.controller.metrics import MetricsWriter, PhaseTimer, global_means
from yatt.controller.step_report import merge, report_step, sample_sums
from yatt.dist import RankInfo
from yatt.job import Job, build_job
from yatt.rollout.episodes import episode_rewards, episode_sums
from yatt.stages.dpo import dpo_eval, dpo_update, pair_micro_batches, pair_samples
from yatt.stages.rm import rm_eval, rm_samples, rm_update
from yatt.stages.sft import sft_samples, sft_update

log = logging.getLogger("yatt")


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
    job.writer = MetricsWriter(cfg.output_dir, job.info.rank, resume_step=start, log=cfg.log,
                               config=cfg.model_dump(mode="json"))
    records = [] if start else _evaluate(job, 0)
    if start:
        job.placement.sync(job.actor, version=start)  # the engines serve the resumed policy
        job.placement.pop_idle()  # a wait before the first step belongs to no step
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
    timer.merge(job.placement.sync(job.actor, timer.on_enter, version=step))
    job.phase("step end", step)
    return report_step(job, step, timer, t0, sums)


def _rl_phases(job: Job, step: int, timer: PhaseTimer, sums: dict) -> None:
    """An RL step's phases up to the weight sync; metrics merged into ``sums``."""
    cfg = job.cfg
    job.phase("rollout", step)
    groups, rewards = _rollout_and_score(job, step, timer, sums)
    if not job.trains:
        return
    mini_batches, skipped = rl_experience(job, groups, rewards, timer, sums)
    with timer("logprob"):
        logprob_sums = compute_logprobs(job.actor, job.ref, mini_batches, cfg.algo.recompute_old_logprobs)
        sums.update(rollout_correction(mini_batches, cfg.algo))  # IS weights of the rollout vs the trainer
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
    samples, rows = stage_samples(job, *sft_samples(job.shard.next_batch(), cfg.sft, job.tokenizer,
                                                    cfg.rollout.max_model_len))
    sums.update(rows)
    with timer("balance"):
        minis, _ = balanced_mini_batches(samples, None, job.balancer, cfg, job.tokenizer.pad_token_id, sums,
                                         mini_batches=1)
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
    samples, sums = stage_samples(job, *make(rows, cfg.data, job.tokenizer, cfg.rollout.max_model_len))
    return pair_micro_batches(samples, t.micro_batch_tokens, job.tokenizer.pad_token_id, t.packing), sums


def _rollout_and_score(job: Job, step: int, timer: PhaseTimer, sums: dict) -> tuple[list, list[list[float]]]:
    """This rank's groups of the step and their rewards (one list of ``n`` per group); with DAPO
    dynamic sampling, the groups that carry no signal are dropped and more are sampled until the
    batch is full. With ``rollout_apart`` the samplers made them, up to ``rollout.max_staleness``
    steps earlier (:mod:`yatt.placement.ahead`; none on sampler ranks)."""
    if (ahead := job.placement.ahead) is not None:
        groups, rewards, more = ahead.take(step, job.shard.next_batch, lambda b, prompts: _produce(job, b, prompts, timer))
        merge(sums, more)
        return groups, _score_left(job, step, groups, rewards, timer, sums)
    groups, rewards = _sample_round(job, step, 0, timer, sums)
    if job.sampler is not None:
        groups, rewards, more = job.sampler.fill(groups, rewards, lambda r: _sample_round(job, step, r, timer, sums))
        sums.update(more)
    return groups, rewards


def _sample_round(job: Job, step: int, round_: int, timer: PhaseTimer, sums: dict):
    """This rank's next prompts rolled out, judged and scored; metrics merged into ``sums``.
    Returns (the groups this rank trains on, their rewards, one list of ``n`` per group)."""
    groups, more, measured = job.placement.rollout_and_score(job.shard.next_batch(), _spec(job, step, round_), job.actor,
                                                             timer.on_enter)
    timer.merge(measured)
    rewards = _score(job, groups, timer, more) if job.trains else []
    merge(sums, more)
    return groups, rewards


def _produce(job: Job, step: int, prompts: list, timer: PhaseTimer) -> tuple[list, list[list[float]], dict]:
    """``rollout_apart`` samplers: the scored batch of ``step`` from ``prompts`` (``(gid, origin,
    row)``, routed here from every rank); with dynamic sampling refilled from this rank's own
    prompts, as many per round as every rank draws in the other modes. Returns (groups, rewards,
    (sum, count) metrics)."""
    sums: dict = {}
    groups, rewards = _sample_here(job, step, 0, prompts, timer, sums)
    if job.sampler is not None:
        per_round = -(-job.info.world_size // len(job.placement.roles.samplers))

        def draw(round_: int):
            rows = [row for _ in range(per_round) for row in job.shard.next_batch()]
            base = round_ * 1_000_000 + job.info.rank * len(rows)  # gids apart from the first round's
            return _sample_here(job, step, round_, [(base + i, job.info.rank, row) for i, row in enumerate(rows)],
                                timer, sums)

        groups, rewards, more = job.sampler.fill(groups, rewards, draw)
        sums.update(more)
    return groups, rewards, sums


def _sample_here(job: Job, step: int, round_: int, prompts: list, timer: PhaseTimer, sums: dict):
    """``prompts`` rolled out, judged and scored on this (sampler) rank: (groups, rewards); the
    groups left to the trainers' judges (``placement.trainer_judge_share``) have None for rewards."""
    groups, here = job.placement.sample_here(prompts, _spec(job, step, round_), timer)
    more: dict = {}
    rewards = (_score(job, groups[:here], timer, more) if here else []) + [None] * (len(groups) - here)
    merge(sums, more)
    return groups, rewards


def _score_left(job: Job, step: int, groups: list, rewards: list, timer: PhaseTimer, sums: dict) -> list:
    """``rollout_apart`` trainers: judge and score the groups the samplers left unjudged
    (reward None, ``placement.trainer_judge_share``); returns every group's rewards."""
    left = [i for i, r in enumerate(rewards) if r is None]
    if left:
        part = [groups[i] for i in left]
        job.placement.judge_here(part, _spec(job, step, 0).seed, timer)
        more: dict = {}
        for i, r in zip(left, _score(job, part, timer, more)):
            rewards[i] = r
        merge(sums, more)
    return rewards


def _spec(job: Job, step: int, round_: int):
    """The sampling parameters of ``step``'s round ``round_`` on this rank (a reproducible seed)."""
    from yatt.rollout.vllm_engine import SamplingSpec

    cfg = job.cfg
    seed = ((cfg.seed * 1_000_003 + step) * 4099 + job.info.rank) + round_ * 1_000_000_007
    return SamplingSpec(n=cfg.rollout.n, max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p, seed=seed)


def _score(job: Job, groups: list, timer: PhaseTimer, sums: dict) -> list[list[float]]:
    """The rewards of ``groups`` (one list of ``n`` per group); their metrics added to ``sums``."""
    rollout = job.cfg.rollout
    with timer("reward"):
        flat, accuracy, reward_sums = job.scorer.score(groups)
    if rollout.env is not None:  # episodes: the environment's rewards too, and their turn and tool metrics
        completions = [c for g in groups for c in g.completions]
        flat = episode_rewards(completions, flat, rollout.env_error_score)
        reward_sums.update(episode_sums(completions))
    sums.update(sample_sums(groups, flat, accuracy), **reward_sums)
    return [flat[i * rollout.n:(i + 1) * rollout.n] for i in range(len(groups))]


def _evaluate(job: Job, step: int) -> list[dict]:
    """The eval record of ``step`` (none when there are no eval rows: an accuracy of nothing is not 0)."""
    if not job.eval_total and not job.eval_sets:
        return []
    job.phase("eval", step)
    record = {"step": step}
    if job.cfg.stage != "rm":  # the policy's greedy answers (stage rm does not train the policy)
        with job.placement.eval_engine(job.actor) as engine:
            e = job.cfg.eval
            sample = dict(k=e.k, temperature=e.temperature, seed=job.cfg.seed * 1_000_003 + step,
                          generate=job.placement.generate)  # with rollout.env: episodes
            if job.eval_total:  # eval.sets run also without the data's own eval rows
                record.update(evaluate(engine, job.eval_rows, job.scorer.accuracy_scores, job.tokenizer,
                                       e.max_tokens, **sample))
            for s, rows, score in job.eval_sets:  # eval.sets: eval_<name>_accuracy, ...
                record.update(evaluate(engine, rows, score, job.tokenizer, e.max_tokens, prefix=f"eval_{s.name}_",
                                       **sample))
    if job.cfg.stage in ("dpo", "rm") and job.eval_total:  # the held-out pairs' preference accuracy
        batches = _pair_batches(job, job.eval_rows)[0]
        record.update(global_means(dpo_eval(job.actor, job.ref, batches, job.cfg.dpo) if job.cfg.stage == "dpo"
                                   else rm_eval(job.critic, batches)))
    job.writer.write(record)
    parts = ([f"accuracy {record['eval_accuracy']:.3f} reward {record['eval_reward_mean']:.3f}"]
             if "eval_accuracy" in record else [])
    if (k := job.cfg.eval.k) > 1 and "eval_accuracy" in record:
        parts.append(f"mean@{k} {record[f'eval_mean_at_{k}']:.3f} pass@{k} {record[f'eval_pass_at_{k}']:.3f}")
    if "eval_pair_accuracy" in record:
        parts.append(f"pair accuracy {record['eval_pair_accuracy']:.3f} margin {record['eval_reward_margin']:.3f}")
    parts += [f"{s.name} {record[f'eval_{s.name}_accuracy']:.3f}" for s, _, _ in job.eval_sets
              if f"eval_{s.name}_accuracy" in record]
    parts += [f"{name.removeprefix('eval_').replace('_', ' ')} {v:.2f}" for name, v in record.items()
              if name.endswith("tool_use")]  # episodes: the share of greedy answers that called a tool
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


