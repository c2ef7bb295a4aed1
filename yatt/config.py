"""Typed run configuration: a YAML recipe plus dotted ``key=value`` overrides.

The schema is a tree of pydantic models with ``extra="forbid"``: an unknown key or a value of
the wrong type raises :class:`ConfigError` naming the dotted key (and, for unknown keys, the
closest valid one) before any model is loaded. Override values are parsed as YAML scalars, so
``trainer.total_steps=2`` is an int and ``rollout.temperature=0.7`` a float.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


# algo.estimator's registered names (yatt/algos/estimators.py registers each; listed here so that
# validating a config imports no torch: c10 reads its log level when torch is first imported).
ESTIMATOR_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # need rollout.n >= 2
# their token stage runs once the logprobs (and values) exist: yatt/algos/token_advantages.py, yatt/algos/gae.py
TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")


class ConfigError(ValueError):
    """A recipe or override is malformed; the message names the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field("smollm2-135m-instruct", description="packaged model name or local HF folder")
    dtype: Literal["float32", "bfloat16"] = Field("float32",
        description="parameter dtype of the trainer and the rollout engine")


class DataConfig(_Section):
    source: Literal["reasoning_gym", "file"] = Field("reasoning_gym",
        description="reasoning_gym: generated task rows; file: jsonl/parquet files")
    task: str = Field("basic_arithmetic", description="reasoning-gym task: generator and scorer")
    task_config: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reasoning-gym task")
    train_size: int = Field(1000, gt=0, description="reasoning-gym rows generated for training")
    eval_size: int = Field(64, ge=0,
        description="reasoning-gym rows generated for the held-out eval (those also in training are dropped)")
    seed: int = Field(0, description="seed of the generated rows")
    train_files: list[str] = Field(default_factory=list, description="jsonl/parquet train files, source=file")
    eval_files: list[str] = Field(default_factory=list, description="jsonl/parquet eval files, source=file")
    question_key: str = Field("question", description="field of a file row holding the prompt")
    messages_key: str | None = Field("messages",
        description="field of a file row holding the prompt as a conversation (a list of {role, content} "
                    "messages, OpenAI chat format), used instead of question_key when the row has it; "
                    "None: rows are read by question_key only")
    answer_key: str = Field("answer", description="field of a file row holding the reference answer")
    system_prompt: str = Field("",
        description="system message before each prompt, unless its conversation has one (empty: the chat "
                    "template's default)")
    max_prompt_len: int = Field(256, gt=0,
        description="most prompt tokens after the chat template (longer rows are skipped)")
    chosen_key: str = Field("chosen",
        description="stage: dpo and rm: the row field of the preferred response (a string, or messages ending "
                    "with an assistant turn)")
    rejected_key: str = Field("rejected",
        description="stage: dpo and rm: the row field of the dispreferred response (as chosen_key's)")


class RolloutConfig(_Section):
    n: int = Field(4, gt=0, description="samples per prompt (GRPO group size)")
    max_tokens: int = Field(64, gt=0, description="most response tokens per sample")
    temperature: float = Field(1.0, ge=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold")
    tp: int = Field(1, ge=1, description="ranks per rollout engine: k consecutive ranks serve one vLLM engine with "
                    "TP k (each holds 1/k of its weights; their prompts share its calls; the weight sync writes "
                    "each its own shard; a judge engine runs at TP k on the same ranks). Must divide the world size and "
                    "the policy's and the judge's heads, KV heads, MLP size and padded vocabulary; "
                    "placement.mode=colocate for now")
    max_model_len: int = Field(512, gt=0, description="vLLM context length (prompt + response tokens)")
    kv_cache_memory_bytes: int = Field(256 << 20, gt=0, description="vLLM KV-cache size per engine, bytes")
    max_staleness: int = Field(0, ge=0,
        description="placement.mode=rollout_apart: the samplers generate the batches of steps s+1..s+K while the "
                    "trainers train step s, so a sample is at most K updates old (its policy version is recorded); "
                    "0: synchronous, the samplers wait for each step's weights")
    env: str | None = Field(None,
        description="multi-turn rollouts: the environment each episode runs in, 'tools' (the tool-calling "
                    "environment, yatt/env) or 'package.module:Class'; every active episode advances one turn per "
                    "engine call, and only the model's tokens are trained (docs/agentic.md). None: one response")
    env_args: dict[str, Any] = Field(default_factory=dict,
        description="keyword arguments of the environment's constructor (tools: {tools: [...], ...})")
    max_turns: int = Field(4, gt=0, description="rollout.env: model turns per episode at most")
    episode_max_tokens: int = Field(1024, gt=0,
        description="rollout.env: tokens after the prompt per episode at most, the model's and the environment's")
    env_error_score: float = Field(0.0,
        description="rollout.env: the reward of an episode whose environment raised (counted as turns_end_env_error)")


class GenRMConfig(_Section):
    model: str = Field("qwen2.5-coder-0.5b-instruct", description="packaged judge name or local HF folder")
    template: str = Field("correctness_yesno", description="built-in template name or a file path")
    mode: Literal["verdict", "prob"] = Field("prob", description="parse the judge's text, or P(yes) of its first token")
    k: int = Field(1, gt=0, description="judgements per response, averaged")
    max_tokens: int = Field(64, gt=0, description="most tokens of one judgement")
    temperature: float = Field(0.0, ge=0, description="judge sampling temperature (0: greedy)")
    timeout_s: float = Field(120.0, gt=0, description="unfinished judge requests are aborted, scored unparsable")
    unparsable_score: float = Field(0.0, ge=0, le=1, description="score of a judgement with no usable verdict")
    weight: float = Field(0.5, ge=0, le=1, description="genrm_with_rule: (1 - weight) * rule + weight * genrm")
    max_model_len: int = Field(1024, gt=0, description="judge engine context length")
    kv_cache_memory_bytes: int = Field(256 << 20, gt=0, description="judge engine KV-cache size, bytes")


class _Source(_Section):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$",
        description="the source's name: its metrics are reward_<name>_mean, reward_<name>_errors, ...")
    weight: float = Field(1.0, ge=0,
        description="its weight in the training reward (the weighted sum of the sources)")
    error_score: float = Field(0.0,
        description="score of a response the source could not score (counted as an error)")


class RuleSourceConfig(_Source):
    type: Literal["rule"] = Field(description="data.task's reasoning-gym scorer on the answer reward.extract reads")


class FunctionSourceConfig(_Source):
    type: Literal["function"] = Field(description="a Python function of your own (yatt/reward/function.py)")
    path: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'package.module:function'; (prompt, response, row) -> float, or with batched lists -> list")
    batched: bool = Field(False, description="call it once per step on lists (prompts, responses, rows)")
    timeout_s: float = Field(30.0, ge=0,
        description="seconds one call may take (0: no limit, called on the main thread)")


class MathVerifySourceConfig(_Source):
    type: Literal["math_verify"] = Field(description="math answer equivalence with the math-verify package")
    timeout_s: int = Field(5, ge=0, description="seconds math-verify may spend parsing or comparing (0: no limit)")


class MatchSourceConfig(_Source):
    type: Literal["match"] = Field(description="exact match of the extracted answer, or a regex search")
    pattern: str | None = Field(None,
        description="None: the extracted answer equals the row's (whitespace-normalised); else a regex searched "
                    "in the response, '{answer}' standing for the row's answer (escaped)")
    ignore_case: bool = Field(True, description="compare or search case-insensitively")


class HttpSourceConfig(_Source):
    type: Literal["http"] = Field(description="a remote reward server (yatt/reward/http.py gives the protocol)")
    url: str = Field(description="the server's http(s) URL, POSTed batches of items")
    batch_size: int = Field(32, gt=0, description="items per request")
    max_concurrency: int = Field(4, gt=0, description="requests in flight per rank")
    timeout_s: float = Field(30.0, gt=0, description="seconds per request attempt")
    retries: int = Field(3, ge=0,
        description="attempts after the first (time-outs, 5xx, 429, bad JSON, dropped connections)")
    backoff_s: float = Field(0.5, ge=0,
        description="sleep before the k-th retry: backoff_s * 2**(k-1), plus up to 10% jitter")


class GenRMSourceConfig(_Source):
    type: Literal["genrm"] = Field(description="the generative reward model (judge), set up by reward.genrm")
    model: str | None = Field(None, description="the judge model (None: reward.genrm.model)")


class RewardModelSourceConfig(_Source):
    type: Literal["reward_model"] = Field(
        description="a discriminative reward model: a one-label sequence-classification HF folder (Llama, Qwen2)")
    model: str = Field(description="the reward model's HF folder (or a packaged model name)")
    batch_size: int = Field(16, gt=0, description="most sequences per engine step (vLLM pooling runner)")
    max_length: int = Field(1024, gt=0, description="most tokens of prompt + response (longer: the last ones kept)")
    kv_cache_memory_bytes: int = Field(256 << 20, gt=0, description="the reward model engine's KV-cache size, "
                                       "bytes (CPU; it must hold max_length tokens)")


RewardSourceConfig = Annotated[Union[RuleSourceConfig, FunctionSourceConfig, MathVerifySourceConfig,
                                     MatchSourceConfig, HttpSourceConfig, GenRMSourceConfig,
                                     RewardModelSourceConfig], Field(discriminator="type")]
# source types scored without an engine, on the trainer ranks (yatt/reward/sources.py); the others
# (genrm, reward_model) are the job's judge, held and placed by yatt/placement/runner.py
LOCAL_SOURCES = ("rule", "function", "math_verify", "match", "http")


class RewardConfig(_Section):
    type: Literal["rule", "genrm", "genrm_with_rule"] = Field("rule",
        description="without reward.sources: rule (the task's scorer), genrm (the judge) or genrm_with_rule "
                    "(their weighted sum, reward.genrm.weight)")
    sources: list[RewardSourceConfig] = Field(default_factory=list,
        description="the reward as a weighted sum of named sources (rule, function, math_verify, match, http, "
                    "genrm, reward_model); replaces reward.type")
    accuracy: str | None = Field(None,
        description="the source whose score 1 counts as correct (accuracy, eval_accuracy; eval scores with it); "
                    "default: the first source that is not a judge, else the task's rule scorer")
    extract: Literal["answer_tag", "answer_tag_or_last_number"] = Field("answer_tag_or_last_number",
        description="how the answer is read from a response for the rule and exact-match sources "
                    "(math_verify reads the last <answer> tag, else the whole response)")
    genrm: GenRMConfig = Field(default_factory=GenRMConfig, description="the generative reward model (judge)")

    @model_validator(mode="after")
    def _check_sources(self) -> "RewardConfig":
        if self.sources and self.type != "rule":
            raise ValueError(f"reward.type: {self.type} and reward.sources both given; reward.sources replaces "
                             "reward.type (name a genrm source there)")
        names = [s.name for s in self.sources]
        for name in {n for n in names if names.count(n) > 1}:
            raise ValueError(f"reward.sources: the name {name!r} is used twice")
        if self.sources and not any(s.weight > 0 for s in self.sources):
            raise ValueError("reward.sources: every weight is 0; give at least one source a positive weight")
        judges = [s for s in self.sources if s.type not in LOCAL_SOURCES]
        if len(judges) > 1:
            raise ValueError(f"reward.sources: {' and '.join(s.name for s in judges)} both need a judge engine; a "
                             "job has one judge (a genrm or a reward_model source)")
        if judges and judges[0].type == "genrm" and judges[0].model is not None:
            self.genrm.model = judges[0].model
        if self.accuracy is not None and self.accuracy not in [s.name for s in self.resolved_sources()]:
            raise ValueError(f"reward.accuracy: {self.accuracy!r} names no source of reward.sources")
        if self.accuracy is not None and self.accuracy in [s.name for s in judges]:
            raise ValueError(f"reward.accuracy: the {judges[0].type} source cannot score the evaluation (no judge "
                             "runs then); name another source")
        return self

    def resolved_sources(self) -> list:
        """The sources the reward is made of: ``sources``, or the ones ``type`` stands for (``rule``;
        ``genrm``: the judge, with the rule scorer at weight 0 for accuracy; ``genrm_with_rule``: both,
        weighted ``1 - genrm.weight`` and ``genrm.weight``). Without ``accuracy`` and without a source
        besides the judge (genrm or reward_model), the task's rule scorer is added at weight 0."""
        if not self.sources:
            w = {"rule": 0.0, "genrm": 1.0, "genrm_with_rule": self.genrm.weight}[self.type]
            rule = RuleSourceConfig(name="rule", type="rule", weight=1.0 - w)
            return [rule] if self.type == "rule" else [rule, GenRMSourceConfig(name="genrm", type="genrm", weight=w)]
        if self.accuracy is None and all(s.type not in LOCAL_SOURCES for s in self.sources):
            return [*self.sources, RuleSourceConfig(name="rule", type="rule", weight=0.0)]
        return list(self.sources)

    @property
    def judge(self):
        """The source scored on the judge's engine (genrm or reward_model), or None."""
        return next((s for s in self.resolved_sources() if s.type not in LOCAL_SOURCES), None)

    @property
    def judge_model(self) -> str | None:
        """The judge's model: ``reward.genrm.model`` or the reward_model source's ``model``."""
        judge = self.judge
        return None if judge is None else self.genrm.model if judge.type == "genrm" else judge.model

    @property
    def accuracy_source(self) -> str:
        """The name of the source whose score 1 counts as correct (see ``accuracy``)."""
        return self.accuracy or next(s.name for s in self.resolved_sources() if s.type in LOCAL_SOURCES)


class PlacementConfig(_Section):
    mode: Literal["colocate", "partial_colocate", "disaggregated", "rollout_apart"] = Field("colocate",
        description="colocate: every phase on every rank in turn; partial_colocate: samplers and GenRM "
                    "ranks work at the same time, training on all ranks; disaggregated: GenRM ranks only judge; "
                    "rollout_apart: the last placement.rollout_ranks ranks only sample (and judge), the others "
                    "only train (rollout.max_staleness: how far ahead the samplers run)")
    rollout_ranks: int = Field(1, gt=0,
        description="placement.mode=rollout_apart: how many ranks only sample (and judge); the rest train")
    trainer_judge_share: float = Field(0.0, ge=0, lt=1,
        description="placement.mode=rollout_apart with a judge reward: the fraction of each batch's groups that the "
                    "trainers judge (on a judge engine of their own, before their logprobs) instead of the samplers; "
                    "balances the two sides when sampling and judging outweigh training (docs/async.md)")
    genrm_ranks: int | Literal["auto"] = Field(1,
        description="GenRM ranks of a split placement; auto: ternary search of the split (partial_colocate)")
    auto_repeats: int = Field(1, gt=0, description="steps measured per candidate split under auto")
    keep_engines: Literal["auto", "always", "never"] = Field("auto",
        description="CPU, colocate with GenRM and partial_colocate: keep engines built between the phases that use "
                    "them instead of tearing them down and rebuilding them; auto: after the first step, if the "
                    "machine's memory holds them with 10% to spare (GPU: vLLM sleep mode, always)")


class AlgoConfig(_Section):
    name: Literal["grpo"] = Field("grpo", description="RL algorithm")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: ratio floor 1 - clip_ratio_low")
    clip_ratio_high: float = Field(0.28, ge=0,
        description="PPO clip: ratio ceiling 1 + clip_ratio_high (DAPO's clip-higher)")
    kl_coef: float = Field(0.0, ge=0,
        description="weight of the KL term to the reference model (0: no reference model is loaded)")
    recompute_old_logprobs: bool = Field(True,
        description="false: old logprobs are the engine's rollout logprobs (exact on-policy when the synced engine "
                    "matches the trainer, see logprob_diff_rollout_vs_train) and the trainer's extra forward pass is "
                    "skipped")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3",
        description="KL estimator of the KL term (Schulman's k1/k2/k3)")
    estimator: str = Field("grpo",
        description="advantage estimator: grpo, dr_grpo (no std division), rloo (leave-one-out baseline), "
                    "reinforce_pp (KL-shaped token rewards, discounted returns whitened over the step), "
                    "reinforce_pp_baseline (the same on rewards minus their group mean), gae (PPO: GAE over the "
                    "critic's values; needs critic.enabled), or "
                    "'package.module:function' (rewards [G, n] -> advantages [G, n]; yatt/algos/estimators.py)")
    kl_in_reward: float = Field(0.0, ge=0,
        description="reinforce_pp and gae estimators only: KL coefficient beta of the token rewards "
                    "r_t = -beta * KL_t (+ the score at the last token; > 0 loads the reference model)")
    kl_target: float = Field(0.0, ge=0,
        description="reinforce_pp and gae estimators only: per-token KL (nats) that adapts the kl_in_reward "
                    "coefficient after each step (Ziegler et al. 2019; yatt/algos/kl_control.py); 0 keeps it fixed")
    kl_horizon: int = Field(10000, gt=0,
        description="with kl_target: samples over which the adaptive KL coefficient makes a full correction")
    gamma: float = Field(1.0, gt=0, le=1,
        description="reinforce_pp and gae estimators only: discount of the token returns")
    lam: float = Field(0.95, ge=0, le=1,
        description="gae only: GAE's lambda (0: one-step TD advantages, 1: Monte Carlo returns minus values)")
    norm_adv_by_std: bool = Field(True,
        description="estimator grpo only: divide group-centred rewards by the group's std (false: dr_grpo's form)")
    policy_loss: Literal["ppo_clip", "dual_clip", "gspo"] = Field("ppo_clip",
        description="policy loss (yatt/algos/policy_loss.py): ppo_clip (PPO's clipped surrogate, DAPO's decoupled "
                    "clip), dual_clip (also bounds a negative-advantage token's loss by -clip_ratio_c * A), gspo "
                    "(one length-normalised ratio per sequence, clipped by seq_clip_ratio_low/high)")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field("token_mean",
        description="per-token loss to scalar: token_mean (every token of the mini-batch weighs the same; DAPO), "
                    "seq_mean_token_mean (each sequence's token mean, then the mean over sequences; GRPO, GSPO), "
                    "seq_mean_token_sum_norm (token sums over rollout.max_tokens, mean over sequences; Dr. GRPO)")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual_clip only: a negative-advantage token's loss is at most "
                                                       "-clip_ratio_c * A")
    seq_clip_ratio_low: float = Field(3e-4, ge=0, description="gspo only: sequence ratio floor 1 - seq_clip_ratio_low")
    seq_clip_ratio_high: float = Field(4e-4, ge=0,
        description="gspo only: sequence ratio ceiling 1 + seq_clip_ratio_high")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus (loss - entropy_coef * entropy)")
    reward_norm: Literal["none", "group", "batch"] = Field("none",
        description="rewards as the estimator sees them (yatt/algos/reward_norm.py): none, group (each prompt's "
                    "rewards whitened) or batch (whitened over the whole step, every rank); metrics keep the raw ones")
    reward_clip: float = Field(0.0, ge=0,
        description="clip the (normalised) rewards to [-reward_clip, reward_clip] before the estimator (0: no clip)")
    ppo_epochs: int = Field(1, gt=0, description="passes over the step's rollout batch")
    mini_batches: int = Field(1, gt=0, description="optimizer steps per epoch over the rollout batch")
    dynamic_sampling: bool = Field(False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the "
                    "step has trainer.prompts_per_rank * world groups")
    max_sampling_rounds: int = Field(2, ge=0, description="dynamic sampling: extra rounds per step at most")
    skip_zero_signal: bool = Field(True,
        description="leave samples whose advantage is exactly 0 out of the logprob and train passes when nothing "
                    "else in the loss reads them (an outcome estimator, kl_coef 0, entropy_coef 0); they still count in "
                    "the loss normaliser, so the update is the full batch's (yatt/algos/zero_signal.py)")
    rollout_correction: Literal["none", "tis", "mis_token", "mis_seq"] = Field("none",
        description="importance sampling between the engine that sampled (rollout logprobs) and the trainer's old "
                    "logprobs, r = pi_old / pi_rollout, weighting each token's policy loss (yatt/algos/"
                    "rollout_correction.py; Yao et al. 2025): none; tis (min(r, cap)); mis_token (r inside "
                    "[1/cap, cap], else the token is dropped); mis_seq (the sequence's ratio, the sequence dropped "
                    "outside [1/cap, cap]). Needs recompute_old_logprobs")
    rollout_correction_cap: float = Field(2.0, gt=1,
        description="C of algo.rollout_correction: tis truncates at C, mis_* keep ratios in [1/C, C]")


class LoraConfig(_Section):
    """LoRA adapters (Hu et al. 2021) on the frozen model (:mod:`yatt.trainer.lora`): only the
    adapters train, checkpoints hold them alone, the engines get the merged weights."""

    rank: int = Field(16, gt=0, description="adapter rank r")
    alpha: float = Field(32.0, gt=0, description="scale numerator: the adapter's output is multiplied by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training (trainer.tp=1 only)")
    targets: list[Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]] = Field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], min_length=1,
        description="Megatron layers to adapt: attention QKV (HF q/k/v_proj), attention output (o_proj), MLP input "
                    "(gate/up_proj), MLP output (down_proj)")


class CriticConfig(_Section):
    """PPO's value model (:class:`yatt.trainer.critic.MegatronCritic`): the policy's architecture
    with a scalar head, on the actor's TP x PP x DP layout, with its own AdamW and schedule; trained
    after the actor in every step on the clipped value loss (yatt/algos/gae.py)."""

    enabled: bool = Field(False, description="train a critic (algo.estimator=gae needs it; no other estimator reads it)")
    model: str | None = Field(None,
        description="HF folder or packaged model the critic starts from: a causal LM (its value head starts at 0) "
                    "or a sequence-classification model with one label (its score head). Default: model.path")
    head_init_std: float | None = Field(None, ge=0,
        description="std of the normal draw the scalar head starts from when the model has none (seeded by seed; "
                    "a sequence-classification model keeps its own). Default: 0 (zeros) for PPO's critic, so its "
                    "first advantages are the rewards'; the model's initializer_range (transformers' init of a "
                    "classification head, 0.02 for SmolLM2) for stage rm, whose body gets no gradient through a zero head")
    lr: float = Field(1e-5, gt=0, description="peak learning rate of the critic (AdamW)")
    min_lr: float = Field(0.0, ge=0, description="the critic's learning rate at the end of the cosine decay")
    warmup_steps: int = Field(0, ge=0, description="the critic's optimizer steps of linear LR warmup")
    weight_decay: float = Field(0.0, ge=0, description="the critic's AdamW weight decay")
    clip_grad: float = Field(1.0, gt=0, description="the critic's global grad-norm clipping threshold")
    value_clip: float = Field(0.5, ge=0,
        description="clipped value loss: a value moves at most this far from the step's old value in the clipped "
                    "branch (0: unclipped squared error)")
    freeze_actor_steps: int = Field(0, ge=0,
        description="critic-only warm-up: the first N steps train the critic alone (the policy is not updated)")
    lora: LoraConfig | None = Field(None,
        description="train the critic's body as LoRA adapters (its value head whole); null: all of it")


class BalanceConfig(_Section):
    """DP balancing after rollout: each mini-batch's sequences are re-partitioned across the
    data-parallel ranks by cost ``cost_linear * L + cost_quadratic * L**2`` (L = prompt + response
    tokens; (1, 0) balances tokens, a small quadratic term models attention FLOPs)."""

    enabled: bool = Field(True, description="re-partition each mini-batch's sequences across DP ranks by cost")
    cost_linear: float = Field(1.0, ge=0, description="cost per token (a in a*L + b*L^2)")
    cost_quadratic: float = Field(0.0, ge=0, description="cost per squared length (b; models attention FLOPs)")
    equal_count: bool = Field(False, description="equal sequence counts per rank (fixed micro-batch shapes)")


class GuardConfig(_Section):
    """Stability guard (:class:`yatt.algos.guard.StabilityGuard`): an optimizer step whose pre-clip
    grad norm is non-finite, or above ``spike_factor`` x the median of the last ``window`` applied
    steps (once ``min_history`` exist), is skipped and counted (``guard_skipped_updates``). With
    ``action: rollback`` the policy (model, optimizer, LR schedule) is then reloaded from the newest
    complete checkpoint (``guard_rollbacks``); data position and RNG go on."""

    enabled: bool = Field(True, description="skip optimizer steps with a non-finite or spiking grad norm")
    action: Literal["skip", "rollback"] = Field("skip",
        description="skip: skip the update; rollback: also reload the newest checkpoint's policy")
    spike_factor: float = Field(10.0, gt=1, description="a grad norm above this x the running median is a spike")
    window: int = Field(20, gt=0, description="applied steps the running median covers")
    min_history: int = Field(5, gt=0, description="applied steps needed before spikes are judged")


class TrainerConfig(_Section):
    total_steps: int = Field(20, gt=0, description="RL steps of the run")
    prompts_per_rank: int = Field(4, gt=0, description="controller shard's prompts per step")
    tp: int = Field(1, gt=0, description="tensor-parallel size of the trainer")
    pp: int = Field(1, gt=0, description="pipeline stages (must divide the layers); DP = world / (tp * pp)")
    micro_batch_tokens: int = Field(4096, gt=0, description="token budget of one micro-batch")
    packing: Literal["padded", "packed", "shared_prompt"] = Field("shared_prompt",
        description="what the model body runs per micro-batch: padded rows; one packed row without padding (the "
                    "samples back to back, attention kept inside each); or that row with each prompt once, followed by "
                    "its responses in the micro-batch (each attending to the prompt and itself). Same logprobs to fp32 rounding")
    recompute: Literal["none", "full"] = Field("none",
        description="activation recomputation: full keeps only each transformer layer's input in the forward pass "
                    "and recomputes the layer in the backward pass (less memory, one more forward pass per micro-batch)")
    lr: float = Field(1e-6, gt=0, description="peak learning rate (AdamW)")
    min_lr: float = Field(0.0, ge=0, description="learning rate at the end of the cosine decay")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, description="AdamW beta1")
    adam_beta2: float = Field(0.999, description="AdamW beta2")
    clip_grad: float = Field(1.0, gt=0, description="global grad-norm clipping threshold")
    sync_bucket_mb: float = Field(512, gt=0,
        description="weight sync: MiB of HF tensors resharded and pushed at a time")
    balance: BalanceConfig = Field(default_factory=BalanceConfig, description="DP balancing")
    guard: GuardConfig = Field(default_factory=GuardConfig, description="stability guard")
    lora: LoraConfig | None = Field(None,
        description="train LoRA adapters on the frozen policy instead of all of it (null: full fine-tuning)")


class CheckpointConfig(_Section):
    """Async checkpoints (:mod:`yatt.checkpoint`): save points, retention, where."""

    dir: str | None = Field(None,
        description="checkpoint folder, shared by all ranks (default <output_dir>/checkpoints)")
    every_steps: int = Field(0, ge=0, description="save every N steps (0: not by count)")
    every_minutes: float = Field(30.0, ge=0,
        description="save when this many minutes passed since the last save (0: not by time)")
    save_final: bool = Field(True, description="save after the last step")
    on_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGINT"]] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"],
        description="signals that stop the run after the step's checkpoint is committed: exit code 75 (SIGTERM, "
                    "SIGUSR1: requeue and resume) or 130 (SIGINT, Ctrl-C; a second Ctrl-C stops at once)")
    keep_last: int = Field(2, gt=0, description="retention: keep the newest K checkpoints")
    keep_every: int = Field(0, ge=0,
        description="retention: also keep every checkpoint at a multiple of M steps (0: none)")
    async_save: bool = Field(True,
        description="write in a background thread from a host copy of the model and optimizer states, kept for the "
                    "next save (false: the step waits for the write, and no copy is held: less memory); a save whose "
                    "copy does not fit in the machine's memory left is written that way, with a warning")


class FaultConfig(_Section):
    """Dead or hung ranks (:class:`yatt.watchdog.Watchdog`): every rank sends heartbeats; a rank
    silent for ``timeout_s`` (or, with ``stall_s``, stuck in one phase that long) ends the job
    with a message naming it and its last phase."""

    watchdog: bool = Field(True, description="heartbeats between ranks; a dead or hung rank ends the job")
    timeout_s: float = Field(60.0, gt=0, description="a rank silent this long ends the job (seconds)")
    stall_s: float | None = Field(None, gt=0,
        description="also end the job when a rank's phase has not changed for this long (alive but stuck, e.g. a "
                    "deadlock); must exceed the longest phase. None: off")


class _EvalSet(_Section):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$",
        description="the set's name in reports and metrics ('eval' is the data section's eval split)")

    @model_validator(mode="after")
    def _not_eval(self) -> "_EvalSet":
        if self.name == "eval":
            raise ValueError("eval.sets[].name: 'eval' names the data section's eval split; pick another name")
        return self


class TaskEvalSetConfig(_EvalSet):
    """A reasoning-gym task's rows, prompted as the data section says, scored by reward.accuracy's
    source (a rule source scores with this task)."""

    type: Literal["task"] = Field(description="rows generated by a reasoning-gym task")
    task: str = Field(description="the reasoning-gym task")
    task_config: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the task")
    size: int = Field(64, gt=0,
        description="rows generated (seed data.seed as data.eval_size's; those also in training are dropped)")


class FilesEvalSetConfig(_EvalSet):
    """Rows of jsonl/parquet files (data.question_key or data.messages_key / data.answer_key), prompted
    as the data section says, scored by reward.accuracy's source (a rule source scores with data.task)."""

    type: Literal["files"] = Field(description="rows read from files")
    files: list[str] = Field(min_length=1, description="jsonl/parquet files")


EvalSetConfig = Annotated[Union[TaskEvalSetConfig, FilesEvalSetConfig], Field(discriminator="type")]


class EvalConfig(_Section):
    max_tokens: int = Field(64, gt=0, description="most response tokens per eval prompt (greedy and sampled)")
    every: int = Field(0, ge=0, description="also evaluate every N steps (0: before and after only)")
    k: int = Field(1, ge=1,
        description="sampled answers per eval prompt besides the greedy one: k > 1 also reports mean@k "
                    "(eval_mean_at_<k>) and the unbiased pass@j (eval_pass_at_<j>, j = 1, 2, 4, ... and k) of the k "
                    "samples; 1: the greedy answer only")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of the k answers (k > 1)")
    sets: list[EvalSetConfig] = Field(default_factory=list,
        description="named eval sets besides the data section's eval split: a run's evals also report "
                    "eval_<name>_accuracy, ... for each; python -m yatt.eval evaluates them (empty: the eval split, "
                    "named 'eval')")

    @model_validator(mode="after")
    def _unique_sets(self) -> "EvalConfig":
        names = [s.name for s in self.sets]
        for name in {n for n in names if names.count(n) > 1}:
            raise ValueError(f"eval.sets: the name {name!r} is used twice")
        return self


class SftConfig(_Section):
    """Supervised fine-tuning (``stage: sft``): the target response of each data row."""

    response_key: str | None = Field(None,
        description="the row field holding the target response (file data); None: response_template. "
                    "A conversation (data.messages_key) that ends with an assistant turn has that turn as "
                    "its target instead")
    response_template: str = Field("<answer>{answer}</answer>",
        description="the target response built from the row's answer (data.answer_key); {answer} stands for it")


class DpoConfig(_Section):
    """Direct preference optimisation (``stage: dpo``) on rows holding a chosen and a rejected response."""

    beta: float = Field(0.1, gt=0, description="KL strength: the implicit reward is beta * (logp - ref_logp)")
    loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid",
        description="sigmoid: DPO (Rafailov et al. 2023); ipo: IPO (Azar et al. 2023)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="sigmoid only: the chance a preference label is flipped")


class WandbConfig(_Section):
    """Weights & Biases (``wandb`` in ``log.trackers``; the ``wandb`` package): one W&B run per YATT
    run, continued when the run resumes (its id is kept in <output_dir>/trackers.json)."""

    project: str = Field("yatt", description="W&B project")
    entity: str | None = Field(None, description="W&B user or team (None: your default entity)")
    name: str | None = Field(None, description="run name shown by W&B (None: the output_dir's folder name)")
    tags: list[str] = Field(default_factory=list, description="tags of the W&B run")
    mode: Literal["online", "offline"] | None = Field(None,
        description="offline: written to disk only (upload later with `wandb sync <dir>/wandb/offline-run-*`); "
                    "None: the WANDB_MODE environment variable, else online")
    dir: str | None = Field(None,
        description="folder W&B writes its wandb/ folder in (None: output_dir, so <output_dir>/wandb)")


class MlflowConfig(_Section):
    """MLflow (``mlflow`` in ``log.trackers``; the ``mlflow-skinny`` package): one MLflow run per YATT
    run, continued when the run resumes (its id is kept in <output_dir>/trackers.json)."""

    tracking_uri: str | None = Field(None,
        description="tracking server or store, e.g. http://host:5000 (None: the file store file:<output_dir>/mlruns; "
                    "browse it with the full mlflow package: MLFLOW_ALLOW_FILE_STORE=true mlflow ui "
                    "--backend-store-uri <output_dir>/mlruns)")
    experiment: str = Field("yatt", description="experiment name (created if missing)")
    run_name: str | None = Field(None, description="run name (None: the output_dir's folder name)")
    tags: dict[str, str] = Field(default_factory=dict, description="tags of the MLflow run (name: value)")


class LogConfig(_Section):
    """What a run shows and writes besides ``metrics.jsonl`` (rank 0 only)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["tensorboard"],
        description="experiment trackers that get every metric of each step (and the config as the run's "
                    "parameters): tensorboard (<output_dir>/tensorboard), wandb (log.wandb), mlflow (log.mlflow). "
                    "A tracker that fails (package missing, bad URI) is disabled with one warning; training "
                    "goes on. On the command line: 'log.trackers=[tensorboard,wandb,mlflow]'")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow")
    progress: bool = Field(True, description="progress bars: steps, and the samples of each rollout and judging call")
    level: Literal["quiet", "all"] = Field("quiet",
        description="quiet: library warnings that need no action are dropped (listed, each with why, in "
                    "yatt/logs.py: Megatron's Apex notes, vLLM's CPU and Triton notes, torch's C++ warnings); "
                    "all: they show. Other warnings and errors show at both")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tensorboard" in data:
            raise ValueError("log.tensorboard: replaced by log.trackers, a list: log.trackers=[tensorboard] "
                             "(true), log.trackers=[] (false)")
        return data

    @model_validator(mode="after")
    def _check(self) -> "LogConfig":
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"log.trackers: a tracker is listed twice: {self.trackers}")
        return self


class Config(_Section):
    seed: int = Field(0, description="seed of sampling, data order and engines")
    output_dir: str = Field("runs/default", description="metrics.jsonl, config.yaml and checkpoints go here")
    overwrite: bool = Field(False,
        description="start over in an output_dir that already holds a run (its checkpoints are deleted)")
    resume: str = Field("auto",
        description="auto: from the newest complete checkpoint if any; none: fresh; or a checkpoint path")
    threads_per_rank: int | None = Field(None, gt=0,
        description="torch/OpenMP threads per rank (default: cores / local ranks)")
    stage: Literal["rl", "sft", "dpo", "rm"] = Field("rl",
        description="rl: sample, score and update (algo); sft: supervised fine-tuning on each row's target "
                    "response (sft); dpo: preference optimisation on each row's chosen and rejected response "
                    "against the frozen model.path (dpo); rm: a Bradley-Terry reward model (the critic's value "
                    "head on model.path) on the same rows; the same data shards, checkpoints, evals and export")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy")
    data: DataConfig = Field(default_factory=DataConfig, description="prompts")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="sampling with vLLM")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="rule reward and GenRM")
    placement: PlacementConfig = Field(default_factory=PlacementConfig,
        description="where rollout, GenRM and training run")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="the RL algorithm")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Megatron-Core training")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO's value model (algo.estimator=gae)")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    sft: SftConfig = Field(default_factory=SftConfig, description="stage: sft's targets")
    dpo: DpoConfig = Field(default_factory=DpoConfig, description="stage: dpo's loss and pair fields")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
        description="async checkpoints and save points")
    fault: FaultConfig = Field(default_factory=FaultConfig, description="dead and hung ranks")
    log: LogConfig = Field(default_factory=LogConfig, description="experiment trackers (TensorBoard, W&B, MLflow), progress bars and library warnings")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.data.source == "file" and not self.data.train_files:
            raise ValueError("data.train_files: required when data.source is 'file'")
        if self.trainer.prompts_per_rank * self.rollout.n < self.algo.mini_batches:
            raise ValueError("algo.mini_batches: more mini-batches than samples per rank "
                             "(trainer.prompts_per_rank * rollout.n)")
        p = self.placement
        if self.stage != "rl" and (p.mode != "colocate" or self.critic.enabled):
            raise ValueError(f"stage: {self.stage} trains the policy alone on every rank "
                             "(placement.mode=colocate, no critic)")
        if self.stage == "dpo" and self.dpo.loss_type == "ipo" and self.dpo.label_smoothing:
            raise ValueError("dpo.label_smoothing: ipo has none (sigmoid only)")
        if self.stage == "sft" and "{answer}" not in self.sft.response_template and self.sft.response_key is None:
            raise ValueError("sft.response_template: must contain {answer} (or give sft.response_key)")
        if p.mode not in ("colocate", "rollout_apart") and self.reward.judge is None:
            raise ValueError(f"placement.mode: {p.mode} splits rollout and GenRM ranks, but no reward source "
                             "is a judge (genrm or reward_model)")
        if p.genrm_ranks != "auto" and p.genrm_ranks < 1:
            raise ValueError(f"placement.genrm_ranks: must be >= 1 or 'auto', got {p.genrm_ranks}")
        if p.genrm_ranks == "auto" and p.mode != "partial_colocate":
            raise ValueError("placement.genrm_ranks: 'auto' tunes the partial_colocate split; give a number")
        if p.mode in ("disaggregated", "rollout_apart") and self.trainer.tp != 1:
            raise ValueError(f"trainer.tp: placement.mode={p.mode} trains with trainer.tp=1 only")
        if p.mode in ("disaggregated", "rollout_apart") and self.trainer.pp != 1:
            raise ValueError(f"trainer.pp: placement.mode={p.mode} trains with trainer.pp=1 only")
        if self.rollout.tp > 1 and p.mode != "colocate":
            raise ValueError("rollout.tp: rollout TP > 1 runs with placement.mode=colocate for now "
                             "(its judge engine, if any, on the same ranks); use rollout.tp=1")
        if self.rollout.max_staleness and p.mode != "rollout_apart":
            raise ValueError(f"rollout.max_staleness: samplers run ahead of the trainers only with "
                             f"placement.mode=rollout_apart (got {p.mode})")
        if p.trainer_judge_share and (p.mode != "rollout_apart" or self.reward.judge is None):
            raise ValueError("placement.trainer_judge_share: trainers judge a share of the batch only with "
                             "placement.mode=rollout_apart and a judge reward (genrm or reward_model)")
        if p.trainer_judge_share and self.algo.dynamic_sampling:
            raise ValueError("placement.trainer_judge_share: dynamic sampling refills on the samplers from every "
                             "group's reward, so the samplers judge all of it (use 0 with algo.dynamic_sampling)")
        if p.mode == "rollout_apart" and self.trainer.guard.action == "rollback":
            raise ValueError("trainer.guard.action: rollback reloads a checkpoint on the trainers while the samplers "
                             "hold rollouts of later steps; use skip with placement.mode=rollout_apart")
        b = self.trainer.balance
        if b.enabled and not b.equal_count and b.cost_linear == b.cost_quadratic == 0:
            raise ValueError("trainer.balance.cost_linear: cost_linear and cost_quadratic are both 0")
        a, est = self.algo, self.algo.estimator  # a module:function is loaded at the job's start (yatt.launch)
        if est not in ESTIMATOR_NAMES and not re.fullmatch(r"[\w.]+:\w+", est):
            raise ValueError(f"algo.estimator: unknown estimator {est!r}; one of {sorted(ESTIMATOR_NAMES)}, or "
                             "'package.module:function' for your own")
        if self.algo.reward_norm == "group" and self.rollout.n < 2:
            raise ValueError("algo.reward_norm: group whitens each prompt's rewards, which needs rollout.n >= 2")
        if est in GROUP_RELATIVE and self.rollout.n < 2:  # refused before any model loads
            raise ValueError(f"rollout.n: the {self.algo.estimator} advantage is group-relative (a reward against "
                             "the other responses to its prompt), so a group of one response has advantage 0 and "
                             "nothing trains; use rollout.n >= 2")
        only = (("clip_ratio_c", "algo.policy_loss=dual_clip", a.policy_loss == "dual_clip"),
                ("seq_clip_ratio_low", "algo.policy_loss=gspo", a.policy_loss == "gspo"),
                ("seq_clip_ratio_high", "algo.policy_loss=gspo", a.policy_loss == "gspo"),
                ("clip_ratio_low", "algo.policy_loss ppo_clip or dual_clip", a.policy_loss != "gspo"),
                ("clip_ratio_high", "algo.policy_loss ppo_clip or dual_clip", a.policy_loss != "gspo"),
                ("kl_in_reward", "the reinforce_pp and gae estimators", est in TOKEN_ESTIMATORS),
                ("kl_target", "the reinforce_pp and gae estimators", est in TOKEN_ESTIMATORS),
                ("kl_horizon", "the reinforce_pp and gae estimators", est in TOKEN_ESTIMATORS),
                ("gamma", "the reinforce_pp and gae estimators", est in TOKEN_ESTIMATORS),
                ("lam", "algo.estimator=gae", est == "gae"))
        for key, reader, read in only:
            if not read and getattr(a, key) != type(a).model_fields[key].default:  # meant for another algorithm
                raise ValueError(f"algo.{key}: read by {reader} only, not policy_loss={a.policy_loss}, "
                                 f"estimator={est}")
        if a.rollout_correction != "none" and not a.recompute_old_logprobs:
            raise ValueError(f"algo.rollout_correction: {a.rollout_correction} weighs pi_old / pi_rollout, which is 1 "
                             "when the old logprobs are the rollout's; set algo.recompute_old_logprobs=true")
        if a.rollout_correction == "none" and "rollout_correction_cap" in a.model_fields_set:
            raise ValueError("algo.rollout_correction_cap: read by algo.rollout_correction tis, mis_token or mis_seq "
                             "only, not none")
        c = self.critic
        if est == "gae" and not c.enabled:
            raise ValueError("algo.estimator: gae needs the critic's values; set critic.enabled=true")
        if c.enabled and est != "gae":
            raise ValueError(f"critic.enabled: only algo.estimator=gae reads a critic's values, not estimator={est} "
                             "(a group estimator's baseline is the group's own rewards)")
        if not c.enabled and (set_keys := sorted(c.model_fields_set - {"enabled"})):
            raise ValueError(f"critic.{set_keys[0]}: the critic is off (critic.enabled=false); set it with "
                             "algo.estimator=gae and critic.enabled=true")
        if c.lr < c.min_lr:
            raise ValueError("critic.min_lr: must not exceed critic.lr")
        if c.freeze_actor_steps >= self.trainer.total_steps and c.enabled:
            raise ValueError(f"critic.freeze_actor_steps: {c.freeze_actor_steps} critic-only steps leave none of "
                             f"trainer.total_steps={self.trainer.total_steps} to train the policy")
        if a.kl_target > 0 and a.kl_in_reward == 0:
            raise ValueError("algo.kl_target: adapts the coefficient algo.kl_in_reward, which is 0 (no KL penalty); "
                             "set algo.kl_in_reward > 0 as its starting value")
        if "norm_adv_by_std" in self.algo.model_fields_set and self.algo.estimator != "grpo":
            raise ValueError(f"algo.norm_adv_by_std: read by algo.estimator=grpo only, not {self.algo.estimator}")
        if self.algo.dynamic_sampling and not b.enabled:
            raise ValueError("algo.dynamic_sampling: needs trainer.balance.enabled (it gives ranks left without "
                             "informative groups a share of the batch)")
        if self.trainer.guard.min_history > self.trainer.guard.window:
            raise ValueError("trainer.guard.min_history: must not exceed trainer.guard.window")
        if self.trainer.lora is not None and self.trainer.lora.dropout and self.trainer.tp > 1:
            raise ValueError("trainer.lora.dropout: LoRA dropout runs with trainer.tp=1 only")
        if self.critic.lora is not None and self.critic.lora.dropout and self.trainer.tp > 1:
            raise ValueError("critic.lora.dropout: LoRA dropout runs with trainer.tp=1 only")
        if self.trainer.lr < self.trainer.min_lr:
            raise ValueError("trainer.min_lr: must not exceed trainer.lr")
        return self


def tagged_members(ann) -> dict[str, type[BaseModel]] | None:
    """``{type tag: model}`` of a field annotated as a list of a discriminated union
    (``reward.sources``), else None."""
    if get_origin(ann) is not list or get_origin(get_args(ann)[0]) is not Annotated:
        return None
    members = get_args(get_args(get_args(ann)[0])[0])
    return {get_args(m.model_fields["type"].annotation)[0]: m for m in members}


def _walk(loc: tuple) -> tuple[str, type[BaseModel] | None]:
    """The dotted key of a pydantic error location (list items as ``[i]``, a discriminated union's
    tag dropped: ``reward.sources[0].path``) and the model it ends in (None past a leaf)."""
    key, model, union = "", Config, None
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
            continue
        if union is not None and part in union:  # the tag pydantic puts after a union item's index
            model, union = union[part], None
            continue
        field = model.model_fields.get(str(part)) if model is not None else None
        key += f"{'.' if key else ''}{part}"
        ann = getattr(field, "annotation", None)
        union = tagged_members(ann)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return key or "<root>", model


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key, _ = _walk(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            parent = _walk(tuple(e["loc"])[:-1])[1]
            near = difflib.get_close_matches(str(e["loc"][-1]), list(parent.model_fields) if parent else [], n=1)
            stem = key[: len(key) - len(str(e["loc"][-1]))]  # the parent's key and its dot
            hint = f" (did you mean '{stem}{near[0]}'?)" if near else ""
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
    set_key(raw, key, yaml.safe_load(text) if text.strip() else "", f"override {override!r}")


def set_key(raw: dict, key: str, value: Any, where: str = "") -> None:
    """Set the dotted ``key`` (``a.b.c``) of a nested dict to ``value`` (creating sections).

    Raises:
        ConfigError: the key walks through a non-mapping value.
    """
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where or key}: '{'.'.join(parts[: i + 1])}' is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = (), values: dict[str, Any] | None = None) -> Config:
    """Load a YAML recipe, apply dotted overrides and validate.

    Args:
        path: YAML file (None: defaults only).
        overrides: ``["trainer.total_steps=2", "output_dir=/tmp/run"]``.
        values: dotted keys set to Python values after the overrides (``{"trainer.lr": 1e-5}``).
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
    for key, value in (values or {}).items():
        set_key(raw, key, value)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format(e)) from None
