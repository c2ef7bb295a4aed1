"""Typed run configuration: a YAML recipe plus dotted ``key=value`` overrides.

The schema is a tree of pydantic models with ``extra="forbid"``: an unknown key or a value of
the wrong type raises :class:`ConfigError` naming the dotted key (and, for unknown keys, the
closest valid one) before any model is loaded. Override values are parsed as YAML scalars, so
``trainer.total_steps=2`` is an int and ``rollout.temperature=0.7`` a float.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A recipe or override is malformed; the message names the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = "smollm2-135m-instruct"  # packaged model name or local HF folder
    dtype: Literal["float32", "bfloat16"] = "float32"


class DataConfig(_Section):
    source: Literal["reasoning_gym", "file"] = "reasoning_gym"
    task: str = "basic_arithmetic"  # reasoning-gym task: generator and scorer
    task_config: dict[str, Any] = Field(default_factory=dict)
    train_size: int = Field(1000, gt=0)
    eval_size: int = Field(64, ge=0)
    seed: int = 0
    train_files: list[str] = Field(default_factory=list)  # jsonl/parquet, source=file
    eval_files: list[str] = Field(default_factory=list)
    question_key: str = "question"
    answer_key: str = "answer"
    system_prompt: str = ""
    max_prompt_len: int = Field(256, gt=0)  # tokens after the chat template


class RolloutConfig(_Section):
    n: int = Field(4, gt=0)  # samples per prompt (GRPO group size)
    max_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    tp: Literal[1] = 1  # each rank's engine serves its own prompts (rollout TP > 1: not yet)
    max_model_len: int = Field(512, gt=0)
    kv_cache_memory_bytes: int = Field(256 << 20, gt=0)


class GenRMConfig(_Section):
    model: str = "qwen2.5-coder-0.5b-instruct"  # packaged judge name or local HF folder
    template: str = "correctness_yesno"  # built-in template name or a file path
    mode: Literal["verdict", "prob"] = "prob"  # parse the judge's text, or P(yes) of its first token
    k: int = Field(1, gt=0)  # judgements per response, averaged
    max_tokens: int = Field(64, gt=0)
    temperature: float = Field(0.0, ge=0)
    timeout_s: float = Field(120.0, gt=0)  # unfinished judge requests are aborted, scored unparsable
    unparsable_score: float = Field(0.0, ge=0, le=1)
    weight: float = Field(0.5, ge=0, le=1)  # genrm_with_rule: (1 - weight) * rule + weight * genrm
    max_model_len: int = Field(1024, gt=0)
    kv_cache_memory_bytes: int = Field(256 << 20, gt=0)


class RewardConfig(_Section):
    type: Literal["rule", "genrm", "genrm_with_rule"] = "rule"
    extract: Literal["answer_tag", "answer_tag_or_last_number"] = "answer_tag_or_last_number"
    genrm: GenRMConfig = Field(default_factory=GenRMConfig)


class PlacementConfig(_Section):
    # colocate: every phase on every rank in turn; partial_colocate: samplers and GenRM ranks
    # work at the same time, training on all ranks; disaggregated: GenRM ranks only judge.
    mode: Literal["colocate", "partial_colocate", "disaggregated"] = "colocate"
    genrm_ranks: int | Literal["auto"] = 1  # auto: ternary search (partial_colocate)
    auto_repeats: int = Field(1, gt=0)  # steps measured per candidate split under auto


class AlgoConfig(_Section):
    name: Literal["grpo"] = "grpo"
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.28, ge=0)  # DAPO's clip-higher
    kl_coef: float = Field(0.0, ge=0)  # 0: no reference model is loaded
    # False: old logprobs are the engine's rollout logprobs (exact on-policy when the synced
    # engine matches the trainer, see logprob_diff_rollout_vs_train) and the trainer's extra
    # forward pass is skipped.
    recompute_old_logprobs: bool = True
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    norm_adv_by_std: bool = True
    ppo_epochs: int = Field(1, gt=0)
    mini_batches: int = Field(1, gt=0)  # optimizer steps per epoch over the rollout batch
    # DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until
    # the step has trainer.prompts_per_rank * world groups, at most max_sampling_rounds extra rounds.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = Field(2, ge=0)


class BalanceConfig(_Section):
    """DP balancing after rollout: each mini-batch's sequences are re-partitioned across the
    data-parallel ranks by cost ``cost_linear * L + cost_quadratic * L**2`` (L = prompt + response
    tokens; (1, 0) balances tokens, a small quadratic term models attention FLOPs)."""

    enabled: bool = True
    cost_linear: float = Field(1.0, ge=0)
    cost_quadratic: float = Field(0.0, ge=0)
    equal_count: bool = False  # equal sequence counts per rank (fixed micro-batch shapes)


class GuardConfig(_Section):
    """Stability guard (:class:`yatt.algos.guard.StabilityGuard`): an optimizer step whose pre-clip
    grad norm is non-finite, or above ``spike_factor`` x the median of the last ``window`` applied
    steps (once ``min_history`` exist), is skipped and counted (``guard_skipped_updates``). With
    ``action: rollback`` the policy (model, optimizer, LR schedule) is then reloaded from the newest
    complete checkpoint (``guard_rollbacks``); data position and RNG go on."""

    enabled: bool = True
    action: Literal["skip", "rollback"] = "skip"  # rollback: also reload the last checkpoint's policy
    spike_factor: float = Field(10.0, gt=1)
    window: int = Field(20, gt=0)
    min_history: int = Field(5, gt=0)


class TrainerConfig(_Section):
    total_steps: int = Field(20, gt=0)
    prompts_per_rank: int = Field(4, gt=0)  # controller shard's prompts per step
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)  # pipeline stages (must divide the layers); DP = world / (tp * pp)
    micro_batch_tokens: int = Field(4096, gt=0)  # token budget of one micro-batch
    lr: float = Field(1e-6, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = Field(1.0, gt=0)
    sync_bucket_mb: float = Field(512, gt=0)  # weight sync: MiB of HF tensors resharded and pushed at a time
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)


class CheckpointConfig(_Section):
    """Async checkpoints (:mod:`yatt.checkpoint`): save points, retention, where."""

    dir: str | None = None  # default <output_dir>/checkpoints; shared by all ranks
    every_steps: int = Field(0, ge=0)  # save every N steps (0: not by count)
    every_minutes: float = Field(30.0, ge=0)  # and when this much time passed since the last save (0: not by time)
    save_final: bool = True  # save after the last step
    on_signals: list[Literal["SIGTERM", "SIGUSR1"]] = Field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    keep_last: int = Field(2, gt=0)  # retention: the newest K ...
    keep_every: int = Field(0, ge=0)  # ... plus every checkpoint at a multiple of M steps (0: none)
    async_save: bool = True  # write in a background thread (false: the step waits for the write)


class FaultConfig(_Section):
    """Dead or hung ranks (:class:`yatt.watchdog.Watchdog`): every rank sends heartbeats; a rank
    silent for ``timeout_s`` (or, with ``stall_s``, stuck in one phase that long) ends the job
    with a message naming it and its last phase."""

    watchdog: bool = True
    timeout_s: float = Field(60.0, gt=0)
    # also end the job when a rank's phase has not changed for this long (alive but stuck, e.g. a
    # deadlock); must exceed the longest phase. None: off
    stall_s: float | None = Field(None, gt=0)


class EvalConfig(_Section):
    max_tokens: int = Field(64, gt=0)
    every: int = Field(0, ge=0)  # also evaluate every N steps (0: before and after only)


class Config(_Section):
    seed: int = 0
    output_dir: str = "runs/default"
    overwrite: bool = False  # start over in an output_dir that already holds a run (its checkpoints are deleted)
    resume: str = "auto"  # auto: from the newest complete checkpoint if any; none: fresh; or a checkpoint path
    threads_per_rank: int | None = Field(None, gt=0)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.data.source == "file" and not self.data.train_files:
            raise ValueError("data.train_files: required when data.source is 'file'")
        if self.trainer.prompts_per_rank * self.rollout.n < self.algo.mini_batches:
            raise ValueError("algo.mini_batches: more mini-batches than samples per rank "
                             "(trainer.prompts_per_rank * rollout.n)")
        p = self.placement
        if p.mode != "colocate" and self.reward.type == "rule":
            raise ValueError(f"placement.mode: {p.mode} splits rollout and GenRM ranks, but reward.type is 'rule'")
        if p.genrm_ranks != "auto" and p.genrm_ranks < 1:
            raise ValueError(f"placement.genrm_ranks: must be >= 1 or 'auto', got {p.genrm_ranks}")
        if p.genrm_ranks == "auto" and p.mode != "partial_colocate":
            raise ValueError("placement.genrm_ranks: 'auto' tunes the partial_colocate split; give a number")
        if p.mode == "disaggregated" and self.trainer.tp != 1:
            raise ValueError("trainer.tp: placement.mode=disaggregated trains with trainer.tp=1 only")
        if p.mode == "disaggregated" and self.trainer.pp != 1:
            raise ValueError("trainer.pp: placement.mode=disaggregated trains with trainer.pp=1 only")
        b = self.trainer.balance
        if b.enabled and not b.equal_count and b.cost_linear == b.cost_quadratic == 0:
            raise ValueError("trainer.balance.cost_linear: cost_linear and cost_quadratic are both 0")
        if self.algo.dynamic_sampling and self.rollout.n < 2:
            raise ValueError("algo.dynamic_sampling: needs rollout.n >= 2 (a group of one has equal rewards)")
        if self.algo.dynamic_sampling and not b.enabled:
            raise ValueError("algo.dynamic_sampling: needs trainer.balance.enabled (it gives ranks left without "
                             "informative groups a share of the batch)")
        if self.trainer.guard.min_history > self.trainer.guard.window:
            raise ValueError("trainer.guard.min_history: must not exceed trainer.guard.window")
        if self.trainer.lr < self.trainer.min_lr:
            raise ValueError("trainer.min_lr: must not exceed trainer.lr")
        return self


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not isinstance(p, int)) or ("<root>",)
        key = ".".join(map(str, loc))
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            near = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields) if parent else [], n=1)
            hint = f" (did you mean '{'.'.join(map(str, loc[:-1] + (near[0],)))}'?)" if near else ""
            lines.append(f"unknown config key '{key}'{hint}")
        elif e["type"] == "value_error":
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"config key '{key}': {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def apply_override(raw: dict, override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as a YAML scalar.

    Raises:
        ConfigError: the override has no ``=`` or walks through a non-mapping key.
    """
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value")
    key, text = override.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: '{'.'.join(parts[: i + 1])}' is not a section")
    node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML recipe, apply dotted overrides and validate.

    Args:
        path: YAML file (None: defaults only).
        overrides: ``["trainer.total_steps=2", "output_dir=/tmp/run"]``.
    Returns:
        The validated :class:`Config`.
    Raises:
        ConfigError: unreadable YAML, unknown key, wrong type or inconsistent values.
    """
    raw: Any = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path}: top level must be a mapping")
    for ov in overrides:
        apply_override(raw, ov)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format(e)) from None
