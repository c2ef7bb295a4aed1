"""What one rank builds for a run (:func:`build_job`): its data shard, the roles (placement with
the rollout and GenRM engines, the scorer, the actor, the frozen reference, the critic), the
step's helpers (balancer, stability guards, dynamic sampler, KL controller) and its checkpoints.
:mod:`yatt.loop` runs the steps on it; :meth:`Job.close` is the one teardown.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from yatt.algos.estimators import estimator_for, group_informative
from yatt.algos.guard import StabilityGuard
from yatt.algos.kl_control import KLController
from yatt.assets.data import load_prompts
from yatt.assets.model import resolve_model_once
from yatt.checkpoint.run_state import RunCheckpoints, StatsPart
from yatt.checkpoint.triggers import Preempted, early_stop_requested
from yatt.config import Config
from yatt.controller.dynamic_sampling import DynamicSampler
from yatt.controller.eval_sets import resolve_sets, shard_sets
from yatt.controller.metrics import MetricsWriter, global_means
from yatt.controller.rebalance import DpBalancer
from yatt.controller.shard import PromptShard
from yatt.dist import RankInfo
from yatt.placement.runner import Placement
from yatt.reward.scorer import StepScorer
from yatt.rollout.episodes import make_generate

log = logging.getLogger("yatt")


@dataclass
class Job:
    """One rank's run: the objects :func:`build_job` made. Roles a rank does not have are None
    (``actor``/``ref``/``critic`` on ranks that only judge; ``ref`` without a KL term; ``critic``
    without PPO's critic); ``writer`` is set once the run knows its first step."""

    cfg: Config
    info: RankInfo
    phase: Callable[[str, int], None]  # the watchdog's current phase (name, step)
    tokenizer: object
    scorer: StepScorer
    placement: Placement
    train_rows: object  # the rank's prompt stream (yatt.assets.data.PromptStream)
    eval_rows: list
    eval_total: int  # eval rows over all ranks
    shard: PromptShard
    actor: object
    ref: object
    critic: object
    balancer: DpBalancer | None
    guard: StabilityGuard | None
    critic_guard: StabilityGuard | None
    estimator: Callable
    sampler: DynamicSampler | None
    kl_ctrl: KLController | None
    mp_group: object  # this rank's model replica (TP x PP)
    dp_group: object  # the data-parallel trainers
    ckpt: RunCheckpoints
    writer: MetricsWriter | None = None
    eval_sets: list = field(default_factory=list)  # (set, this rank's rows, score_fn) of each of eval.sets

    @property
    def trains(self) -> bool:
        return self.placement.trains

    def close(self) -> None:
        """Restore the signal handlers, release the engines and close the metrics (collective:
        every rank ends the run here, also on a stop they agreed on)."""
        self.ckpt.triggers.close()
        self.placement.close()
        if self.writer is not None:
            self.writer.close()


def build_job(cfg: Config, info: RankInfo, watchdog=None) -> Job:
    """Build this rank's run (collective: every rank calls it). Loads the models, starts the
    engines (the placement's), and checks for a start-up signal once the data is loaded.

    Raises:
        Preempted: a SIGTERM/SIGUSR1 arrived before the models loaded (nothing is saved).
    """
    from transformers import AutoTokenizer

    from yatt.rollout.vllm_engine import VLLMEngine
    from yatt.trainer.actor import init_parallel_state

    model_path = resolve_model_once(cfg.model.path, info.rank)
    critic_path = resolve_model_once(cfg.critic.model, info.rank) if cfg.critic.model else model_path
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    judge_path = resolve_model_once(cfg.reward.judge_model, info.rank) if cfg.reward.judge else None
    bars = info.rank == 0 and cfg.log.progress  # progress bars on rank 0
    scorer = StepScorer(cfg.reward, cfg.data.task, cfg.data.task_config, judge_path,
                        progress="genrm" if bars else None)

    def build_engine():
        return VLLMEngine(str(model_path), tp=cfg.rollout.tp, max_model_len=cfg.rollout.max_model_len,
                          kv_cache_memory_bytes=cfg.rollout.kv_cache_memory_bytes, seed=cfg.seed * 7919 + info.rank,
                          dtype=cfg.model.dtype, progress="rollout" if bars else None)

    placement = Placement(cfg, info.rank, info.world_size, build_engine, scorer,
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), policy_path=model_path,
                          generate=make_generate(cfg.rollout, tokenizer, _env_factory(cfg)))
    log.info("%s", placement.roles.describe())
    train_rows, eval_rows, eval_total = _load_data(cfg, tokenizer, info, placement.eval_ranks)
    eval_rank = placement.eval_ranks.index(info.rank) if info.rank in placement.eval_ranks else None
    eval_sets = shard_sets(cfg, resolve_sets(cfg, None), tokenizer, eval_rank, len(placement.eval_ranks)) \
        if cfg.eval.sets else []
    if stop := early_stop_requested():  # a signal so far: stop before the models and engines load
        raise Preempted(None, stop, saved=False)
    shard = PromptShard(train_rows, cfg.trainer.prompts_per_rank, seed=cfg.seed * 7919 + info.rank)
    t, a = cfg.trainer, cfg.algo
    init_parallel_state(t.tp, t.pp)  # collective, also on ranks that never train
    actor, ref, critic = _models(cfg, placement, model_path, critic_path) if placement.trains else (None, None, None)
    mp_group, dp_group = _groups()
    dp_group = placement.train_group or dp_group
    balancer = (DpBalancer(t.balance, t.micro_batch_tokens, dp_group, shared_prompt=t.packing == "shared_prompt")
                if placement.trains and t.balance.enabled else None)
    g = t.guard
    estimator = estimator_for(a.estimator, a.norm_adv_by_std)
    guard = StabilityGuard(g.spike_factor, g.window, g.min_history) if g.enabled else None
    critic_guard = StabilityGuard(g.spike_factor, g.window, g.min_history) if g.enabled and critic else None
    sampler = (DynamicSampler(t.prompts_per_rank * info.world_size, a.max_sampling_rounds, group=placement.sampler_group,
                              keep=lambda rewards: group_informative(a.estimator, estimator, rewards))
               if a.dynamic_sampling else None)
    kl_ctrl = (KLController(a.kl_in_reward, a.kl_target, a.kl_horizon)
               if a.kl_target > 0 else None)  # the adaptive KL-in-reward coefficient (a fixed one has no state)
    phase = watchdog.phase if watchdog is not None else lambda name, step: None
    phase("engines", 0)
    if cfg.stage != "rm":  # a reward model is trained alone: no policy, no rollout engine
        placement.start()
    ckpt = RunCheckpoints(cfg, info.rank, actor, _dp_rank(placement.train_group),
                          parts={"shard": shard, "data_stats": StatsPart(train_rows.stats), "guard": guard,
                                 "critic_guard": critic_guard, "sampler": sampler, "placement": placement,
                                 "kl_ctrl": kl_ctrl},
                          meta={"world": info.world_size, "tp": t.tp, "pp": t.pp, "dtype": cfg.model.dtype,
                                "model_path": str(model_path), "config": cfg.model_dump(), "lora": _lora_meta(cfg),
                                **({"critic_model_path": str(critic_path)}
                                   if cfg.critic.enabled or cfg.stage == "rm" else {})},
                          critic=critic)
    return Job(cfg, info, phase, tokenizer, scorer, placement, train_rows, eval_rows, eval_total, shard, actor, ref,
               critic, balancer, guard, critic_guard, estimator, sampler, kl_ctrl, mp_group, dp_group, ckpt,
               eval_sets=eval_sets)


def _env_factory(cfg: Config):
    """``rollout.env``'s factory of one environment per episode (None without one).

    Raises:
        ValueError: naming ``rollout.env``: a bad import path or ``rollout.env_args``.
    """
    if cfg.rollout.env is None:
        return None
    from yatt.env import load_env

    return load_env(cfg.rollout.env, **cfg.rollout.env_args)


def _lora_meta(cfg: Config) -> dict:
    """Each trained role's LoRA settings (None: trained whole), for ``meta.json``: the exporter
    reads them. Stage rm trains its reward model (the critic role) with ``trainer.lora``."""
    def dump(section):
        return None if section is None else section.model_dump()

    if cfg.stage == "rm":
        return {"actor": None, "critic": dump(cfg.trainer.lora)}
    return {"actor": dump(cfg.trainer.lora), "critic": dump(cfg.critic.lora)}


def _lora_spec(section, seed: int):
    """A :class:`~yatt.trainer.lora.LoraSpec` of a ``trainer.lora`` / ``critic.lora`` section (None: off)."""
    if section is None:
        return None
    from yatt.trainer.lora import LoraSpec

    return LoraSpec(rank=section.rank, alpha=section.alpha, dropout=section.dropout, targets=tuple(section.targets),
                    seed=seed)


def _models(cfg: Config, placement: Placement, model_path, critic_path) -> tuple:
    """(actor or None, reference or None, critic or None) on a rank that trains; stage rm trains
    the critic alone (no actor)."""
    from yatt.trainer.actor import MegatronPolicy, OptimConfig
    from yatt.trainer.critic import MegatronCritic
    from yatt.trainer.lora import BaseReference
    from yatt.trainer.model import read_hf_config

    t, c = cfg.trainer, cfg.critic
    dtype = getattr(torch, cfg.model.dtype)
    per_step = cfg.algo.ppo_epochs * cfg.algo.mini_batches if cfg.stage == "rl" else 1  # sft: one
    optim_steps = t.total_steps * per_step
    optim = OptimConfig(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                        adam_beta2=t.adam_beta2, clip_grad=t.clip_grad, warmup_steps=t.warmup_steps, total_steps=optim_steps)
    recompute = t.recompute == "full"
    lora = _lora_spec(t.lora, cfg.seed)
    if cfg.stage == "rm":  # the reward model is the critic's model, trained with the trainer's settings
        std = c.head_init_std
        if std is None:  # as transformers starts a classification head
            std = read_hf_config(critic_path).get("initializer_range", 0.02)
        return None, None, MegatronCritic(critic_path, tp=t.tp, pp=t.pp, optim=optim, dtype=dtype, recompute=recompute,
                                          head_init_std=std, head_seed=cfg.seed, lora=lora)
    actor = MegatronPolicy(model_path, tp=t.tp, pp=t.pp, optim=optim, dtype=dtype, dp_group=placement.train_group,
                           recompute=recompute, lora=lora)
    ref = None
    if cfg.algo.kl_coef > 0 or cfg.algo.kl_in_reward > 0 or cfg.stage == "dpo":  # with LoRA: the base, adapters off
        ref = BaseReference(actor) if lora is not None else MegatronPolicy(model_path, tp=t.tp, pp=t.pp, optim=None,
                                                                           dtype=dtype)
    critic = None
    if c.enabled:  # PPO's critic: its head starts at zero unless critic.head_init_std says otherwise
        head = dict(head_init_std=c.head_init_std or 0.0, head_seed=cfg.seed)
        critic_optim = OptimConfig(lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay, adam_beta1=t.adam_beta1,
                                   adam_beta2=t.adam_beta2, clip_grad=c.clip_grad, warmup_steps=c.warmup_steps,
                                   total_steps=optim_steps)
        critic = MegatronCritic(critic_path, tp=t.tp, pp=t.pp, optim=critic_optim, dtype=dtype,
                                dp_group=placement.train_group, recompute=recompute,
                                lora=_lora_spec(c.lora, cfg.seed), **head)
    return actor, ref, critic


def _load_data(cfg: Config, tokenizer, info: RankInfo, eval_ranks: tuple[int, ...]):
    """This rank's train stream (every rank draws prompts; read lazily, never materialised) and
    eval rows (a small held-out list, over ``eval_ranks``). Train rows are validated as they are
    drawn, so there are no train totals up front: skips are warned about and counted in
    ``stream.stats`` as they happen. Returns (train stream, this rank's eval rows, eval rows of
    all ranks)."""
    from yatt.assets.data import LoadStats, PromptStream

    targets = cfg.stage == "sft"  # a conversation's final assistant turn is the target
    train = PromptStream(cfg.data, tokenizer, info.rank, info.world_size, targets=targets)
    if info.rank in eval_ranks:
        evals, estats = load_prompts(cfg.data, tokenizer, "eval", eval_ranks.index(info.rank), len(eval_ranks),
                                     targets=targets)
    else:
        evals, estats = [], LoadStats()
    counts = {f"eval_{k}": (float(v), 1.0) for k, v in
              {"rows": estats.rows, "kept": estats.kept, **{f"skipped_{r}": n for r, n in estats.skipped.items()}}.items()}
    totals = {k: round(v * info.world_size) for k, v in global_means(counts).items()}
    if info.rank == 0:
        log.info("data: train streamed per rank (%s); %s", cfg.data.source, totals)
        if not totals["eval_kept"]:
            log.warning("eval: no eval rows (data.eval_size=%d, data.eval_files=%s, %d skipped): %s",
                        cfg.data.eval_size, cfg.data.eval_files, totals["eval_rows"],
                        "only eval.sets are evaluated" if cfg.eval.sets else
                        "the evals are skipped, no eval record is written")
    return train, evals, totals["eval_kept"]


def _dp_rank(train_group) -> int:
    """This rank's index among the data-parallel trainers."""
    from megatron.core import parallel_state as mpu

    return dist.get_rank(train_group) if train_group is not None else mpu.get_data_parallel_rank()


def _groups():
    from megatron.core import parallel_state as mpu

    return mpu.get_model_parallel_group(), mpu.get_data_parallel_group()
