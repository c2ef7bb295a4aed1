"""Reward-model training (``stage: rm``): a Bradley-Terry reward model on preference pairs.

The model is the critic of the algorithm layer (:class:`yatt.trainer.critic.MegatronCritic`: the
policy's architecture from ``model.path`` with a scalar head drawn from N(0,
``critic.head_init_std``^2), by default the model's ``initializer_range`` as transformers starts a
classification head; through a zero head, PPO's critic's start, the body would get no gradient
until the head grew). A row's chosen and rejected responses (``data.chosen_key``,
``data.rejected_key``: strings, or messages whose final assistant turn is the response) are laid
out exactly as the ``reward_model`` source scores them (:func:`yatt.reward.reward_model.chat_ids`:
the row's prompt conversation, ``data.system_prompt`` included, and the response through the
model's template), and a response's reward is the head's value at the last token of that layout.
The critic values a position from the hidden state of the token before it, so each sample is the
layout followed by one more token (EOS) whose value is read; causal attention keeps that token out
of every earlier state. One optimizer step per step takes the Bradley-Terry loss
(:func:`yatt.algos.preference.bradley_terry_loss`) summed over the step's pairs on every DP rank
and divided by their number. Exported with ``python -m yatt.export CKPT OUT --role critic``, the
model is a one-label sequence-classification folder whose logit is that reward, which a
``reward_model`` source serves with vLLM (tested equal). A row without both responses, or longer
than ``rollout.max_model_len``, is skipped and counted (``rm_rows_skipped``). Evals add the held-out
pairs' ``eval_pair_accuracy``, ``eval_reward_margin`` and ``eval_rm_loss``.
"""
from __future__ import annotations

import torch

from yatt.algos.preference import bradley_terry_loss
from yatt.controller.batch import Sample
from yatt.reward.reward_model import chat_ids
from yatt.stages.dpo import pair_eval_sums, pair_loss, pair_step_sums, pair_texts, pairs_total


def rm_samples(rows, data, tokenizer, max_len: int) -> tuple[list[Sample], int]:
    """Two Samples per usable row, chosen then rejected: ``prompt_ids`` the scored layout,
    ``response_ids`` one EOS (the position whose value is the reward); returns (samples, rows
    skipped)."""
    samples, skipped = [], 0
    for row in rows:
        texts = pair_texts(row, data)
        prompt = getattr(row, "messages", None) or row.question  # the conversation the policy is prompted with
        ids = None if texts is None else [chat_ids(tokenizer, prompt, t, max_len) for t in texts]
        if ids is None or max(map(len, ids)) >= max_len:
            skipped += 1
            continue
        samples += [Sample(x, [tokenizer.eos_token_id], [0.0], "stop") for x in ids]
    return samples, skipped


def _rewards(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(dim=-1)  # one masked position per row


def rm_update(critic, micro_batches: list[dict], dp_group=None) -> dict[str, tuple[float, float]]:
    """One optimizer step on the mean Bradley-Terry loss of the step's pairs over ``dp_group``.
    Returns (sum, count) pairs: ``rm_loss``, ``pair_accuracy`` and ``reward_margin`` per pair
    (before the step), ``grad_norm`` and ``lr``."""
    pairs = max(pairs_total(micro_batches, dp_group), 1.0)

    def loss_fn(values, mb):
        r = _rewards(values, mb["response_mask"])
        terms = bradley_terry_loss(r[0::2], r[1::2])
        return pair_loss(terms, pairs)

    return pair_step_sums(critic.train_step(micro_batches, loss_fn), "rm_loss")


def rm_eval(critic, micro_batches: list[dict]) -> dict[str, tuple[float, float]]:
    """The held-out pairs' (sum, count) of ``eval_rm_loss``, ``eval_pair_accuracy`` and
    ``eval_reward_margin`` (no grad; collective over the model replica)."""
    rewards = [_rewards(values.float().cpu(), mb["response_mask"])
               for mb, values in zip(micro_batches, critic.compute_values(micro_batches))]
    return pair_eval_sums([bradley_terry_loss(r[0::2], r[1::2]) for r in rewards], "rm_loss")
