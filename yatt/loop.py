"""One GRPO run as seen from one rank: the step loop, top to bottom.

Every rank runs this same function (SPMD). Per step: its controller shard draws prompts; the
placement (:mod:`yatt.placement`) rolls them out and scores them with the GenRM judge (one
phase after another on every rank, or sampler and GenRM ranks side by side) and hands each
rank the groups it trains on; the rule reward scores them; the Megatron trainer computes
old/ref logprobs and updates; the new weights go into the rollout engines.
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

from yatt.algos.estimators import estimator_for, group_informative
from yatt.algos.guard import StabilityGuard
from yatt.algos.kl_control import KLController
from yatt.algos.update import (compute_logprobs, compute_values, critic_update, finish_advantages, make_mini_batches,
                               policy_update)
from yatt.assets.data import load_prompts
from yatt.assets.model import resolve_model
from yatt.checkpoint.run_state import CheckpointDamaged, RunCheckpoints, StatsPart
from yatt.checkpoint.saver import CheckpointWriteError
from yatt.checkpoint.triggers import Preempted, early_stop_requested
from yatt.config import Config
from yatt.controller.batch import make_samples, pack_micro_batches
from yatt.controller.dynamic_sampling import DynamicSampler
from yatt.controller.evaluate import evaluate
from yatt.controller.metrics import MetricsWriter, PhaseTimer, global_means
from yatt.controller.rebalance import DpBalancer
from yatt.controller.shard import PromptShard
from yatt.dist import RankInfo
from yatt.placement.runner import Placement
from yatt.reward.scorer import StepScorer

log = logging.getLogger("yatt")
# summed over ranks, not averaged
_COUNTERS = ("tokens_total", "genrm_unparsable", "genrm_timed_out", "dynamic_sampling_groups_dropped",
             "dynamic_sampling_groups_trimmed", "data_rows_skipped")
_MAXIMA = ("genrm_queue_tokens_max", "genrm_queue_groups_max", "checkpoint_failures")  # max over ranks


def run(cfg: Config, info: RankInfo, watchdog=None) -> list[dict]:
    """Train for ``cfg.trainer.total_steps`` steps; returns rank 0's metric records. ``watchdog``
    (a :class:`yatt.watchdog.Watchdog`) is told each phase, so a hang is reported with it."""
    # The libraries' objects live as long as the job: full collections stop walking them (vLLM's engine
    # does the same at start-up; yatt.rollout.vllm_engine freezes again after its teardown unfroze).
    # Unfrozen at the end, so that interpreter exit frees them (nanobind reports what it does not).
    _import_libraries()
    gc.freeze()
    try:
        return _run(cfg, info, watchdog)
    finally:
        gc.unfreeze()


def _import_libraries() -> None:
    """Import the libraries the roles use (vLLM, Megatron-Core, transformers) before :func:`run`
    freezes the heap, so that the freeze covers their objects: vLLM runs four full collections per
    engine build and teardown, each ~0.5 s on the dev machine while its own modules were left out.
    They load here instead of at first use; nothing else changes."""
    import megatron.core  # noqa: F401
    import transformers  # noqa: F401

    from yatt.rollout.vllm_engine import VLLMEngine  # noqa: F401  (sets vLLM's environment first)
    from vllm import LLM  # noqa: F401
    from yatt.trainer.actor import MegatronPolicy  # noqa: F401


def _run(cfg: Config, info: RankInfo, watchdog) -> list[dict]:
    """:func:`run`'s body."""
    from transformers import AutoTokenizer

    from yatt.rollout.vllm_engine import SamplingSpec, VLLMEngine
    from yatt.trainer.actor import MegatronPolicy, OptimConfig, init_parallel_state
    from yatt.trainer.critic import MegatronCritic

    model_path = _resolve_model_once(cfg.model.path, info)
    critic_path = _resolve_model_once(cfg.critic.model, info) if cfg.critic.model else model_path
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    judge_path = _resolve_model_once(cfg.reward.genrm.model, info) if cfg.reward.type != "rule" else None
    bars = info.rank == 0 and cfg.log.progress  # progress bars on rank 0
    scorer = StepScorer(cfg.reward, cfg.data.task, cfg.data.task_config, judge_path,
                        progress="genrm" if bars else None)

    def build_engine():
        return VLLMEngine(str(model_path), tp=cfg.rollout.tp, max_model_len=cfg.rollout.max_model_len,
                          kv_cache_memory_bytes=cfg.rollout.kv_cache_memory_bytes, seed=cfg.seed * 7919 + info.rank,
                          dtype=cfg.model.dtype, progress="rollout" if bars else None)

    placement = Placement(cfg, info.rank, info.world_size, build_engine, scorer,
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    log.info("%s", placement.roles.describe())
    train_rows, eval_rows, eval_total = _load_data(cfg, tokenizer, info, placement.eval_ranks)
    if stop := early_stop_requested():  # a signal so far: stop before the models and engines load
        raise Preempted(None, stop, saved=False)
    shard = PromptShard(train_rows, cfg.trainer.prompts_per_rank, seed=cfg.seed * 7919 + info.rank)
    t = cfg.trainer
    optim_steps = t.total_steps * cfg.algo.ppo_epochs * cfg.algo.mini_batches
    optim = OptimConfig(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                        adam_beta2=t.adam_beta2, clip_grad=t.clip_grad, warmup_steps=t.warmup_steps, total_steps=optim_steps)
    dtype = getattr(torch, cfg.model.dtype)
    init_parallel_state(t.tp, t.pp)  # collective, also on ranks that never train
    actor = ref = critic = None
    if placement.trains:
        actor = MegatronPolicy(model_path, tp=t.tp, pp=t.pp, optim=optim, dtype=dtype, dp_group=placement.train_group)
        ref = (MegatronPolicy(model_path, tp=t.tp, pp=t.pp, optim=None, dtype=dtype)
               if cfg.algo.kl_coef > 0 or cfg.algo.kl_in_reward > 0 else None)
        if cfg.critic.enabled:
            c = cfg.critic
            critic_optim = OptimConfig(lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay, adam_beta1=t.adam_beta1,
                                       adam_beta2=t.adam_beta2, clip_grad=c.clip_grad, warmup_steps=c.warmup_steps,
                                       total_steps=optim_steps)
            critic = MegatronCritic(critic_path, tp=t.tp, pp=t.pp, optim=critic_optim, dtype=dtype,
                                    dp_group=placement.train_group)
    mp_group, dp_group = _groups()
    dp_group = placement.train_group or dp_group
    balancer = DpBalancer(t.balance, t.micro_batch_tokens, dp_group) if placement.trains and t.balance.enabled else None
    g = t.guard
    guard = StabilityGuard(g.spike_factor, g.window, g.min_history) if g.enabled else None
    critic_guard = StabilityGuard(g.spike_factor, g.window, g.min_history) if g.enabled and critic else None
    estimator = estimator_for(cfg.algo.estimator, cfg.algo.norm_adv_by_std)
    sampler = (DynamicSampler(t.prompts_per_rank * info.world_size, cfg.algo.max_sampling_rounds,
                              keep=lambda rewards: group_informative(cfg.algo.estimator, estimator, rewards))
               if cfg.algo.dynamic_sampling else None)
    kl_ctrl = (KLController(cfg.algo.kl_in_reward, cfg.algo.kl_target, cfg.algo.kl_horizon)
               if cfg.algo.kl_target > 0 else None)  # the adaptive KL-in-reward coefficient (a fixed one has no state)
    phase = watchdog.phase if watchdog is not None else lambda name, step: None
    phase("engines", 0)
    placement.start()
    ckpt = RunCheckpoints(cfg, info.rank, actor, _dp_rank(placement.train_group),
                          parts={"shard": shard, "data_stats": StatsPart(train_rows.stats), "guard": guard,
                                 "critic_guard": critic_guard, "sampler": sampler, "placement": placement,
                                 "kl_ctrl": kl_ctrl},
                          meta={"world": info.world_size, "tp": t.tp, "pp": t.pp, "dtype": cfg.model.dtype,
                                "model_path": str(model_path), "config": cfg.model_dump(),
                                **({"critic_model_path": str(critic_path)} if cfg.critic.enabled else {})},
                          critic=critic)
    with _closing_on_stop(placement):  # a damaged checkpoint stops every rank here, named
        start = ckpt.resume()  # 0: a fresh run
        _stop_if_signalled(ckpt, start)  # a signal while models and engines loaded
    if start >= t.total_steps:
        log.info("the checkpoint is at step %d of trainer.total_steps=%d: nothing left to train", start, t.total_steps)
        ckpt.triggers.close()
        placement.close()
        return []
    writer = MetricsWriter(cfg.output_dir, info.rank, resume_step=start, tensorboard=cfg.log.tensorboard)

    def evaluate_at(step: int) -> list[dict]:
        """The eval record of ``step`` (none when there are no eval rows: an accuracy of nothing is not 0)."""
        if not eval_total:
            return []
        return [_eval_record(step, placement, actor, eval_rows, scorer.rule, tokenizer, cfg, writer, phase)]

    records = [] if start else evaluate_at(0)
    if start:
        placement.sync(actor, PhaseTimer())  # the engines serve the resumed policy
    with _closing_on_stop(placement, writer):
        _stop_if_signalled(ckpt, start)  # a signal during the step-0 eval or the sync
    spec = SamplingSpec(n=cfg.rollout.n, max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p)

    def sample_round(step: int, round_: int, timer: PhaseTimer, sums: dict):
        """This rank's next prompts rolled out, judged and scored; metrics merged into ``sums``.
        Returns (the groups this rank trains on, their rewards, one list of ``n`` per group)."""
        spec.seed = ((cfg.seed * 1_000_003 + step) * 4099 + info.rank) + round_ * 1_000_000_007  # reproducible
        groups, more = placement.rollout_and_score(shard.next_batch(), spec, actor, timer)
        rewards = []
        if placement.trains:
            with timer("reward"):
                rule = scorer.rule_scores([g.row for g in groups], [g.texts for g in groups])
                flat = scorer.combine(rule, [s for g in groups for s in g.genrm] if scorer.uses_genrm else None)
            more.update(_sample_sums(groups, flat, rule))
            if scorer.uses_genrm:
                more.update(scorer.genrm_sums(groups))
            rewards = [flat[i * cfg.rollout.n:(i + 1) * cfg.rollout.n] for i in range(len(groups))]
        _merge(sums, more)
        return groups, rewards

    for step in tqdm(range(start + 1, t.total_steps + 1), desc="steps", initial=start, total=t.total_steps,
                     disable=not bars, dynamic_ncols=True):
        timer, t0, sums = PhaseTimer(on_enter=lambda name: phase(name, step)), time.perf_counter(), {}
        phase("rollout", step)
        groups, rewards = sample_round(step, 0, timer, sums)
        if sampler is not None:  # DAPO: drop groups with equal rewards, sample more until the batch is full
            groups, rewards, more = sampler.fill(groups, rewards, lambda r: sample_round(step, r, timer, sums))
            sums.update(more)
        if placement.trains:
            samples = make_samples([g.row for g in groups], [g.completions for g in groups],
                                   [x for r in rewards for x in r], estimator)
            if t.tp * t.pp > 1:  # the ranks of one model replica (TP x PP) train on the same data
                samples = _gather(samples, mp_group, t.tp * t.pp)
            with timer("balance"):
                mini_batches = _mini_batches(samples, balancer, cfg, tokenizer.pad_token_id, sums)
            with timer("logprob"):
                logprob_sums = compute_logprobs(actor, ref, mini_batches, cfg.algo.recompute_old_logprobs)
                if critic is not None:
                    compute_values(critic, mini_batches)
                sums.update(finish_advantages(mini_batches, cfg.algo, dp_group, kl_ctrl))  # token-level (REINFORCE++, GAE)
            if step > cfg.critic.freeze_actor_steps:  # 0 unless a critic warms up alone
                with timer("train"):
                    sums.update(policy_update(actor, mini_batches, cfg.algo, dp_group, guard, cfg.rollout.max_tokens))
            if critic is not None:
                with timer("critic"):
                    sums.update(critic_update(critic, mini_batches, cfg.critic, cfg.algo.ppo_epochs, dp_group,
                                              critic_guard))
            if t.guard.action == "rollback" and sums.get("guard_skipped_updates", (0.0,))[0]:
                sums["guard_rollbacks"] = (float(ckpt.rollback()), 1.0)
            sums.update(logprob_sums)  # full-batch entropy/diff when the old logprobs were recomputed
        sums["data_rows_skipped"] = (float(sum(train_rows.stats.skipped.values())), 1.0)  # so far, bad rows
        sums["checkpoint_failures"] = (float(ckpt.saver.failures), 1.0)  # so far, saves that failed (agreed)
        placement.sync(actor, timer)
        phase("step end", step)
        idle = sums.pop("idle_s")[0] + _wait_for_peers()  # a rank with nothing left waits here
        timer.times["time_step_s"] = time.perf_counter() - t0
        sums.update({k: (v, 1.0) for k, v in {**timer.times, **timer.peaks}.items()})
        record = {"step": step, **global_means(sums, op_max=_MAXIMA, op_sum=_COUNTERS,
                                                      max_prefixes=("time_", "mem_peak_"))}
        record["tokens_per_s"] = record.pop("tokens_total") / record["time_step_s"]
        record.update(_idle_record(idle))
        placement.end_step(record)
        writer.write(record)
        records.append(record)
        if info.rank == 0:
            tqdm.write(_line(record))
        if cfg.eval.every and step % cfg.eval.every == 0 and step != t.total_steps:
            records.extend(evaluate_at(step))
        if step != t.total_steps:
            phase("checkpoint", step)
            with _closing_on_stop(placement, writer):
                if stop := ckpt.step_end(step):  # a signal's checkpoint is committed: every rank stops here
                    raise Preempted(step, stop)
    ckpt.begin_final(t.total_steps)  # written while the final eval runs
    records.extend(evaluate_at(t.total_steps))
    with _closing_on_stop(placement, writer):
        ckpt.finish(t.total_steps)
    placement.close()
    writer.close()
    return records


@contextlib.contextmanager
def _closing_on_stop(placement: Placement, writer=None) -> Iterator[None]:
    """Close the engines and the metrics writer when every rank stops together (a signal, a save
    the run must have that failed, a checkpoint to resume that does not verify) before the
    exception leaves the loop; another exception is left alone (under MPI the job is aborted, and
    closing engines could wait on a dead peer)."""
    try:
        yield
    except (Preempted, CheckpointWriteError, CheckpointDamaged):
        placement.close()
        if writer is not None:
            writer.close()
        raise


def _stop_if_signalled(ckpt: RunCheckpoints, start: int) -> None:
    """Start-up check (collective): a SIGTERM/SIGUSR1 before the first step ends the run with
    nothing saved (there is no new step to save) and the requeue exit code; call it inside
    :func:`_closing_on_stop`.

    Raises:
        Preempted: with ``saved=False``.
    """
    if stop := ckpt.triggers.stop_requested():
        raise Preempted(start, stop, saved=False)


def _resolve_model_once(name: str, info: RankInfo):
    """Rank 0 materialises a packaged model; the others wait, then use the finished cache."""
    if info.rank == 0:
        path = resolve_model(name)
    if dist.is_initialized():
        dist.barrier()
    return path if info.rank == 0 else resolve_model(name)


def _load_data(cfg: Config, tokenizer, info: RankInfo, eval_ranks: tuple[int, ...]):
    """This rank's train stream (every rank draws prompts; read lazily, never materialised) and
    eval rows (a small held-out list, over ``eval_ranks``). Train rows are validated as they are
    drawn, so there are no train totals up front: skips are warned about and counted in
    ``stream.stats`` as they happen. Returns (train stream, this rank's eval rows, eval rows of
    all ranks)."""
    from yatt.assets.data import LoadStats, PromptStream

    train = PromptStream(cfg.data, tokenizer, info.rank, info.world_size)
    if info.rank in eval_ranks:
        evals, estats = load_prompts(cfg.data, tokenizer, "eval", eval_ranks.index(info.rank), len(eval_ranks))
    else:
        evals, estats = [], LoadStats()
    counts = {f"eval_{k}": (float(v), 1.0) for k, v in
              {"rows": estats.rows, "kept": estats.kept, **{f"skipped_{r}": n for r, n in estats.skipped.items()}}.items()}
    totals = {k: round(v * info.world_size) for k, v in global_means(counts).items()}
    if info.rank == 0:
        log.info("data: train streamed per rank (%s); %s", cfg.data.source, totals)
        if not totals["eval_kept"]:
            log.warning("eval: no eval rows (data.eval_size=%d, data.eval_files=%s, %d skipped): the evals are "
                        "skipped, no eval record is written", cfg.data.eval_size, cfg.data.eval_files,
                        totals["eval_rows"])
    return train, evals, totals["eval_kept"]


def _dp_rank(train_group) -> int:
    """This rank's index among the data-parallel trainers."""
    from megatron.core import parallel_state as mpu

    return dist.get_rank(train_group) if train_group is not None else mpu.get_data_parallel_rank()


def _groups():
    from megatron.core import parallel_state as mpu

    return mpu.get_model_parallel_group(), mpu.get_data_parallel_group()


def _gather(samples, group, size: int):
    parts = [None] * size
    dist.all_gather_object(parts, samples, group=group)
    return [s for part in parts for s in part]


def _mini_batches(samples, balancer: DpBalancer | None, cfg: Config, pad_id: int, sums: dict) -> list[list[dict]]:
    """This rank's micro-batches per mini-batch: after DP balancing (which adds ``dp_imbalance_before``,
    ``dp_imbalance_after`` and ``update_skipped`` to ``sums``), or of its own samples when balancing is off."""
    if balancer is None:
        return make_mini_batches(samples, cfg.algo.mini_batches, cfg.trainer.micro_batch_tokens, pad_id)
    bal = balancer.balance(samples, cfg.algo.mini_batches)
    if not bal.splits:
        log.warning("fewer samples than DP ranks this step (dynamic sampling cap?): no update")
    sums["update_skipped"] = (float(not bal.splits), 1.0)
    sums.update(dp_imbalance_before=(bal.imbalance_before, 1.0), dp_imbalance_after=(bal.imbalance_after, 1.0))
    return [pack_micro_batches(bal.samples, split, pad_id) for split in bal.splits]


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


def _sample_sums(groups, rewards: list[float], rule: list[float]) -> dict[str, tuple[float, float]]:
    """(sum, count) metrics of every response of ``groups`` (``rewards``/``rule``: prompt-major)."""
    pairs = [(g.row, c) for g in groups for c in g.completions]
    n = float(len(pairs))
    return {
        "reward_mean": (sum(rewards), n),
        "reward_rule_mean": (sum(rule), n),
        "accuracy": (sum(float(r == 1.0) for r in rule), n),
        "response_len_mean": (sum(len(c.token_ids) for _, c in pairs), n),
        "truncated_frac": (sum(float(c.finish_reason == "length") for _, c in pairs), n),
        "tokens_total": (sum(len(row.prompt_ids) + len(c.token_ids) for row, c in pairs), 1.0),
    }


def _merge(sums: dict, more: dict) -> None:
    """Add one sampling round's (sum, count) pairs into the step's (maxima: the larger)."""
    for k, (v, c) in more.items():
        a, b = sums.get(k, (0.0, 0.0))
        sums[k] = (max(a, v), 1.0) if k in _MAXIMA else (a + v, b + c)


def _eval_record(step, placement, actor, rows, reward_fn, tokenizer, cfg: Config, writer: MetricsWriter,
                 phase=lambda name, step: None) -> dict:
    phase("eval", step)
    with placement.eval_engine(actor) as engine:
        record = {"step": step, **evaluate(engine, rows, reward_fn, tokenizer, cfg.eval.max_tokens)}
    writer.write(record)
    log.info("eval step %d: accuracy %.3f reward %.3f", step, record["eval_accuracy"], record["eval_reward_mean"])
    return record


def _line(r: dict) -> str:
    def v(key: str, fmt: str) -> str:  # "-": not measured this step (e.g. the actor frozen while the critic warms up)
        return format(r[key], fmt) if key in r else "-"

    genrm = f" genrm {r['reward_genrm_mean']:.3f} unparsable {r['genrm_unparsable']:.0f}" if "reward_genrm_mean" in r else ""
    critic = f" | vloss {r['value_loss']:.4f} ev {r['explained_variance']:.3f}" if "value_loss" in r else ""
    phases = " ".join(f"{name} {r[f'time_{key}_s']:.1f}" for name, key in _PHASES if f"time_{key}_s" in r)
    return (f"step {r['step']:>4} | reward {r['reward_mean']:.3f} acc {r['accuracy']:.3f}{genrm} | kl {v('kl', '.4f')} "
            f"ent {v('entropy', '.3f')} clip {v('clip_frac', '.3f')} gnorm {v('grad_norm', '.3f')}{critic} "
            f"| len {r['response_len_mean']:.1f} | lpdiff {v('logprob_diff_rollout_vs_train', '.1e')} | "
            f"{r['time_step_s']:.1f}s ({phases} idle {r['idle_s']:.1f}) {r['tokens_per_s']:.0f} tok/s")


_PHASES = (("roll", "rollout"), ("genrm", "genrm"), ("lp", "logprob"), ("train", "train"), ("critic", "critic"),
           ("sync", "sync"), ("engines", "engines"))
