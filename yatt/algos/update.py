"""The update of one RL step: old/ref logprobs and values, the token-level advantages, then
clipped updates of the policy and the critic per mini-batch.

Every data-parallel rank calls :func:`compute_logprobs` and :func:`policy_update` with its own
samples; the number of optimizer steps (``ppo_epochs * mini_batches``) is the same on all
ranks, so the trainer's gradient all-reduce lines up.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from yatt.algos.gae import gae_advantages
from yatt.algos.grpo import kl_penalty, masked, masked_sum
from yatt.algos.kl_control import KLController
from yatt.algos.loss import PolicyLoss, ValueLoss
from yatt.algos.policy_loss import LossNorm
from yatt.algos.rollout_correction import correction_for
from yatt.algos.token_advantages import reinforce_pp_advantages, whitening_moments
from yatt.config import TOKEN_ESTIMATORS, AlgoConfig, CriticConfig


def compute_logprobs(actor, ref, mini_batches: list[list[dict]], recompute_old: bool = True) -> dict[str, tuple[float, float]]:
    """Fill ``old_logprobs`` (and ``ref_logprobs`` if ``ref``) into every micro-batch.

    Args:
        recompute_old: old logprobs from a trainer forward pass; False reuses the engine's
            rollout logprobs (exact only while engine and trainer agree, which the on-policy
            ``logprob_diff_rollout_vs_train`` metric keeps measuring).
    Returns:
        (sum, count) pairs over response tokens when recomputed: ``entropy`` and
        ``logprob_diff_rollout_vs_train`` (mean |rollout logprob - trainer logprob|).
    """
    flat = [mb for mbs in mini_batches for mb in mbs]
    sums: dict[str, tuple[float, float]] = {}
    if recompute_old:
        ent = diff = count = 0.0
        for mb, (lp, en) in zip(flat, actor.compute_logprobs(flat)):
            mask = mb["response_mask"]
            mb["old_logprobs"] = lp
            ent += float(masked_sum(en, mask))
            diff += float(masked_sum((lp - mb["rollout_logprobs"]).abs(), mask))
            count += float(mask.sum())
        sums = {"entropy": (ent, count), "logprob_diff_rollout_vs_train": (diff, count)}
    else:
        for mb in flat:
            mb["old_logprobs"] = mb["rollout_logprobs"]
    if ref is not None:
        for mb, (lp, _) in zip(flat, ref.compute_logprobs(flat)):
            mb["ref_logprobs"] = lp
    return sums


def rollout_correction(mini_batches: list[list[dict]], cfg: AlgoConfig) -> dict[str, tuple[float, float]]:
    """Weigh each token's policy loss by ``cfg.rollout_correction`` of its old and rollout logprobs
    (:mod:`yatt.algos.rollout_correction`; fixed for the step: both are known before the update):
    writes ``is_weights`` ``[B, T]`` into every micro-batch unless the correction is ``none``.

    Returns:
        (sum, count) pairs over response tokens: ``rollout_kl`` (k3 estimate of
        KL(pi_rollout || pi_old) from the rollout's samples: the engine/trainer mismatch plus any
        staleness), and with a correction ``is_weight_mean`` (the applied weight),
        ``is_weight_max`` and ``is_ratio_max`` (this rank's largest applied weight and largest
        ratio; the step's record holds the max over ranks)
        and ``is_corrected_frac`` (tokens truncated or dropped). ``{}`` when the old logprobs are
        the rollout's (nothing to compare) or this rank has no response token (every group
        skipped: the step's record then omits them rather than report 0).
    """
    if not cfg.recompute_old_logprobs:
        return {}
    fn = correction_for(cfg.rollout_correction)
    kl = weight = corrected = tokens = 0.0
    ratio_max = weight_max = 0.0
    for mb in (mb for mbs in mini_batches for mb in mbs):
        mask = mb["response_mask"]
        kl += float(masked_sum(kl_penalty(mb["rollout_logprobs"], mb["old_logprobs"], "k3", mask), mask))
        tokens += float(mask.sum())
        if cfg.rollout_correction == "none":
            continue
        c = fn(mb["old_logprobs"], mb["rollout_logprobs"], mask, cfg.rollout_correction_cap)
        mb["is_weights"] = c.weights
        weight += float(c.weights.sum())
        corrected += float(c.corrected.sum())
        if c.ratio.numel():  # weights are 0 off the response
            ratio_max = max(ratio_max, float(masked(c.ratio, mask).max()))
            weight_max = max(weight_max, float(c.weights.max()))
    if not tokens:
        return {}
    sums = {"rollout_kl": (kl, tokens)}
    if cfg.rollout_correction != "none":
        sums.update({"is_weight_mean": (weight, tokens), "is_weight_max": (weight_max, 1.0),
                     "is_ratio_max": (ratio_max, 1.0), "is_corrected_frac": (corrected, tokens)})
    return sums


def compute_values(critic, mini_batches: list[list[dict]]) -> None:
    """Fill the critic's ``values`` ``[B, T]`` (before this step's updates) into every micro-batch."""
    flat = [mb for mbs in mini_batches for mb in mbs]
    for mb, values in zip(flat, critic.compute_values(flat)):
        mb["values"] = values


def finish_advantages(mini_batches: list[list[dict]], cfg: AlgoConfig, dp_group=None,
                      kl_ctrl: KLController | None = None) -> dict[str, tuple[float, float]]:
    """The token stage of ``cfg.estimator`` once the old and reference logprobs (and the critic's
    values) exist (collective over ``dp_group``): REINFORCE++'s advantages ``[B, T]``
    (:func:`~yatt.algos.token_advantages.reinforce_pp_advantages`) or GAE's with the critic's
    ``returns`` (:func:`~yatt.algos.gae.gae_advantages`), whitened over every mini-batch and DP
    rank of the step; nothing for an outcome estimator, whose ``[B, 1]`` advantage is final.

    With a KL penalty in the rewards (``cfg.kl_in_reward > 0``) its coefficient is ``kl_ctrl``'s
    (:class:`~yatt.algos.kl_control.KLController`; None: fixed at ``cfg.kl_in_reward``), and the
    step's KL over the DP ranks (one all-reduce) adapts it for the next step.

    Returns:
        metric sums ``{name: (sum, count)}``: with a KL penalty ``reward_kl`` (per-token k1 KL of
        the old to the reference logprobs) and ``kl_coef_current`` (the beta this step used);
        with ``gae`` ``values_mean``, ``returns_mean`` (over response tokens) and
        ``explained_variance`` (``1 - Var(R - V) / Var(R)`` over the step's response tokens: how
        much of the returns the old values explain); ``{}`` for an outcome estimator.
    """
    if cfg.estimator not in TOKEN_ESTIMATORS:
        return {}
    flat = [mb for mbs in mini_batches for mb in mbs]
    beta = kl_ctrl.value if kl_ctrl is not None else cfg.kl_in_reward
    sums = {}
    if cfg.estimator == "gae":
        gae_advantages(flat, beta, cfg.gamma, cfg.lam, dp_group)
        sums = _value_sums(flat, dp_group)
    else:
        reinforce_pp_advantages(flat, beta, cfg.gamma, dp_group)
    if cfg.kl_in_reward == 0:
        return sums
    acc = torch.zeros(3, dtype=torch.float64)  # KL sum, response tokens, samples
    for mb in flat:
        mask = mb["response_mask"].to(torch.float64)
        kl = (mb["old_logprobs"] - mb["ref_logprobs"]).to(torch.float64)
        acc += torch.stack([masked_sum(kl, mask), mask.sum(), torch.tensor(float(mask.shape[0]), dtype=torch.float64)])
    local = acc[:2].tolist()
    if dist.is_initialized():
        dist.all_reduce(acc, group=dp_group)
    if kl_ctrl is not None:
        kl_ctrl.update(float(acc[0] / acc[1]) if acc[1] > 0 else 0.0, int(acc[2]))
    return {**sums, "reward_kl": (local[0], local[1]), "kl_coef_current": (beta, 1.0)}


def _value_sums(micro_batches: list[dict], dp_group=None) -> dict[str, tuple[float, float]]:
    """``values_mean`` and ``returns_mean`` (this rank's sums) and ``explained_variance`` (over
    every DP rank: two all-reduces of moments) of micro-batches holding ``values`` and ``returns``."""
    masks = [mb["response_mask"] for mb in micro_batches]
    _, std_r = whitening_moments([mb["returns"] for mb in micro_batches], masks, dp_group)
    _, std_d = whitening_moments([mb["returns"] - mb["values"] for mb in micro_batches], masks, dp_group)
    tokens = float(sum(m.sum() for m in masks))
    def total(key: str) -> float:
        return float(sum(masked_sum(mb[key], mb["response_mask"]) for mb in micro_batches))

    return {"values_mean": (total("values"), tokens), "returns_mean": (total("returns"), tokens),
            "explained_variance": (1.0 - std_d ** 2 / (std_r ** 2 + 1e-8), 1.0)}


def mini_batch_norm(micro_batches: list[dict], max_tokens: int, dp_group=None,
                    skipped: tuple[float, float] = (0.0, 0.0)) -> LossNorm:
    """The loss normaliser of one mini-batch: its response tokens and sequences summed over its
    micro-batches, this rank's ``skipped`` (response tokens, sequences) of the samples left out of
    the passes (:mod:`yatt.algos.zero_signal`), and the ranks of ``dp_group`` (one all-reduce; every
    rank gets the same)."""
    counts = torch.tensor([[float(mb["response_mask"].sum()), float((mb["response_mask"].sum(-1) > 0).sum())]
                           for mb in micro_batches] + [list(skipped)], dtype=torch.float64).sum(0)
    if dist.is_initialized():
        dist.all_reduce(counts, group=dp_group)
    return LossNorm(tokens=float(counts[0]), seqs=float(counts[1]), max_tokens=float(max_tokens))


def policy_update(actor, mini_batches: list[list[dict]], cfg: AlgoConfig, dp_group=None,
                  guard=None, max_tokens: int = 1,
                  skipped: list[tuple[float, float]] | None = None) -> dict[str, tuple[float, float]]:
    """Run ``cfg.ppo_epochs`` passes of one optimizer step per mini-batch, each on the loss
    :class:`~yatt.algos.loss.PolicyLoss` normalised by the mini-batch's counts over ``dp_group``.
    A rank with no micro-batch in a mini-batch still takes part in its optimizer step.

    Args:
        max_tokens: the response length budget (``rollout.max_tokens``), read by
            ``loss_agg=seq_mean_token_sum_norm``.
        guard: optional ``(grad norm) -> skip?`` (:class:`~yatt.algos.guard.StabilityGuard`); a
            skipped step adds nothing to the metrics but ``guard_skipped_updates``.
        skipped: per mini-batch, this rank's (response tokens, sequences) of the zero-signal samples
            left out of ``mini_batches`` (:func:`yatt.controller.batch.skipped_counts`): counted in
            the normaliser, so the update is the full batch's. None: nothing left out.
    Returns:
        (sum, count) pairs: token means of ``pg_loss`` (over every response token, left-out ones
        included: they add 0), and of ``kl``, ``ppo_kl``, ``clip_frac``, ``ratio`` and ``entropy``
        (first epoch) over the trained response tokens; ``grad_norm`` and ``lr``
        averaged over the applied optimizer steps; ``guard_skipped_updates``; ``logprob_diff_rollout_vs_train`` from the first
        mini-batch (the one trained before any update). Without a reference model
        (``kl_coef == 0``) ``kl`` is the KL to this step's rollout policy (``ppo_kl``).
    """
    totals: dict[str, float] = {}  # over all optimizer steps
    first: dict[str, float] = {}  # over the first epoch (entropy of the policy that sampled)
    steps = skipped_steps = 0  # applied, skipped optimizer steps
    left_out = 0.0  # response tokens of the applied steps' left-out samples
    skipped = skipped or [(0.0, 0.0)] * len(mini_batches)
    for epoch in range(cfg.ppo_epochs):
        for i, mbs in enumerate(mini_batches):
            norm = mini_batch_norm(mbs, max_tokens, dp_group, skipped[i])
            out = actor.train_step(mbs, PolicyLoss(cfg, norm, on_policy=epoch == 0 and i == 0), guard)
            if out.pop("update_skipped", 0.0):
                skipped_steps += 1
                continue
            left_out += skipped[i][0]
            for k, v in out.items():
                totals[k] = totals.get(k, 0.0) + float(v)
                if epoch == 0:
                    first[k] = first.get(k, 0.0) + float(v)
            steps += 1
    tokens = totals.get("tokens", 0.0)
    result = {k: (totals.get(k, 0.0), tokens) for k in ("kl", "ppo_kl", "clip_frac", "ratio")}
    result["pg_loss"] = (totals.get("pg_loss", 0.0), tokens + left_out)
    result["entropy"] = (first.get("entropy", 0.0), first.get("tokens", 0.0))
    result["logprob_diff_rollout_vs_train"] = (totals.get("logprob_diff_rollout_vs_train", 0.0), totals.get("diff_tokens", 0.0))
    result.update({k: (totals.get(k, 0.0), steps) for k in ("grad_norm", "lr")})
    result["guard_skipped_updates"] = (float(skipped_steps), 1.0)
    if cfg.kl_coef == 0:
        result["kl"] = result["ppo_kl"]
    if cfg.entropy_coef > 0:  # the bonus's size in the loss: entropy_coef * entropy (token mean)
        result["entropy_bonus"] = (cfg.entropy_coef * result["entropy"][0], result["entropy"][1])
    return result


def critic_update(critic, mini_batches: list[list[dict]], cfg: CriticConfig, ppo_epochs: int, dp_group=None,
                  guard=None) -> dict[str, tuple[float, float]]:
    """Train the critic on the step's ``returns`` after the actor's update: ``ppo_epochs`` passes of
    one optimizer step per mini-batch on :class:`~yatt.algos.loss.ValueLoss` (clip
    ``cfg.value_clip``), normalised by the mini-batch's response tokens over ``dp_group``.

    Args:
        critic: this rank's :class:`~yatt.trainer.critic.MegatronCritic`.
        mini_batches: the actor's micro-batches per mini-batch, with ``values`` and ``returns``.
        guard: optional ``(grad norm) -> skip?``, the critic's own stability guard.
    Returns:
        (sum, count) pairs: token means of ``value_loss`` and ``value_clip_frac``;
        ``critic_grad_norm`` and ``critic_lr`` averaged over the applied optimizer steps;
        ``critic_guard_skipped_updates``.
    """
    totals: dict[str, float] = {}
    steps = skipped = 0
    for _ in range(ppo_epochs):
        for mbs in mini_batches:
            out = critic.train_step(mbs, ValueLoss(cfg.value_clip, mini_batch_norm(mbs, 1, dp_group)), guard)
            if out.pop("update_skipped", 0.0):
                skipped += 1
                continue
            for k, v in out.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            steps += 1
    tokens = totals.get("tokens", 0.0)
    return {"value_loss": (totals.get("value_loss", 0.0), tokens),
            "value_clip_frac": (totals.get("value_clip_frac", 0.0), tokens),
            "critic_grad_norm": (totals.get("grad_norm", 0.0), steps), "critic_lr": (totals.get("lr", 0.0), steps),
            "critic_guard_skipped_updates": (float(skipped), 1.0)}
