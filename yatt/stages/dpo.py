"""Direct preference optimisation (``stage: dpo``): the policy against its frozen start.

A step draws ``trainer.prompts_per_rank`` rows per rank, each a prompt with a chosen and a rejected
response (``data.chosen_key``, ``data.rejected_key``; :mod:`yatt.stages.pairs` makes them from a
policy's own samples), and makes two samples per row, chosen then rejected, each response followed
by EOS. The prompt is the row's templated question or conversation (``data.messages_key``); a
response is a string or, in the chat format, a list of messages whose final assistant turn it is. Micro-batches hold whole pairs (no DP balancing: a pair's loss needs both of its
sequences), packed as RL's (``trainer.packing``; with ``shared_prompt`` a pair's prompt runs
once). The frozen reference (the model at ``model.path``) gives each sequence's logprob without
grad; one optimizer step takes the configured preference loss (:data:`yatt.algos.preference.PREFERENCE_LOSSES`)
summed over the step's pairs on every DP rank and divided by their number. A row without both
responses, or too long for ``rollout.max_model_len``, is skipped and counted (``dpo_rows_skipped``).
Each eval also scores the held-out pairs: ``eval_pair_accuracy`` (the implicit reward of the
chosen response above the rejected one's), ``eval_reward_margin`` and ``eval_dpo_loss``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from yatt.algos.preference import PREFERENCE_LOSSES, PairTerms, sequence_logprobs
from yatt.config import DpoConfig
from yatt.controller.batch import Sample, pack_micro_batches


def response_text(value) -> str | None:
    """A preference response's text: a string, or the content of the final message of a list of
    messages (``[..., {"role": "assistant", "content": str}]``, as preference datasets in the chat
    format hold it); None for anything else (an empty text included)."""
    if isinstance(value, list) and value and isinstance(value[-1], dict) and value[-1].get("role") == "assistant":
        value = value[-1].get("content")
    return value if isinstance(value, str) and value.strip() else None


def pair_texts(row, data) -> list[str] | None:
    """``[chosen, rejected]`` of a row (fields ``data.chosen_key``, ``data.rejected_key``, each a
    :func:`response_text`), or None when either is missing or not a usable response."""
    texts = [response_text(row.entry.get(data.chosen_key)), response_text(row.entry.get(data.rejected_key))]
    return texts if None not in texts else None


def pair_samples(rows, data, tokenizer, max_len: int) -> tuple[list[Sample], int]:
    """Two Samples per usable row of ``data`` (:class:`~yatt.config.DataConfig`), chosen then
    rejected; returns (samples, rows skipped: no pair (:func:`pair_texts`), or a sequence longer
    than ``max_len`` tokens)."""
    samples, skipped = [], 0
    for row in rows:
        texts = pair_texts(row, data)
        if texts is None:
            skipped += 1
            continue
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        if len(row.prompt_ids) + max(map(len, ids)) > max_len:
            skipped += 1
            continue
        samples += [Sample(list(row.prompt_ids), r, [0.0] * len(r), "stop") for r in ids]
    return samples, skipped


def pair_micro_batches(samples: list[Sample], token_budget: int, pad_id: int, packing: str) -> list[dict]:
    """Micro-batches of whole pairs (``samples[2k]``, ``samples[2k + 1]``), filled in order up to
    ``token_budget`` tokens each (a pair over the budget gets its own); rows chosen, rejected, ..."""
    groups, current, tokens = [], [], 0
    for k in range(0, len(samples), 2):
        size = samples[k].length + samples[k + 1].length
        if current and tokens + size > token_budget:
            groups.append(current)
            current, tokens = [], 0
        current += [k, k + 1]
        tokens += size
    if current:
        groups.append(current)
    return pack_micro_batches(samples, groups, pad_id, packing)


def _pair_terms(seq: torch.Tensor, ref: torch.Tensor, cfg: DpoConfig) -> PairTerms:
    return PREFERENCE_LOSSES[cfg.loss_type](seq[0::2], seq[1::2], ref[0::2], ref[1::2], cfg.beta, cfg.label_smoothing)


def _ref_logprobs(ref, micro_batches: list[dict]) -> None:
    """Each micro-batch's ``ref_seq`` float ``[B]``: the reference's sequence logprobs."""
    for mb, (logprobs, _) in zip(micro_batches, ref.compute_logprobs(micro_batches)):
        mb["ref_seq"] = sequence_logprobs(logprobs.float(), mb["response_mask"].to(logprobs.device)).cpu()


def pairs_total(micro_batches: list[dict], dp_group) -> float:
    """The pairs in ``micro_batches`` (two rows each) summed over ``dp_group`` (one all-reduce)."""
    count = torch.tensor([sum(mb["input_ids"].shape[0] // 2 for mb in micro_batches)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(count, group=dp_group)
    return float(count)


def dpo_update(actor, ref, micro_batches: list[dict], cfg: DpoConfig, dp_group=None) -> dict[str, tuple[float, float]]:
    """One optimizer step on the mean preference loss of the step's pairs over ``dp_group`` (a rank
    with no micro-batch still takes part). Returns (sum, count) pairs: ``dpo_loss``,
    ``pair_accuracy`` and ``reward_margin`` (implicit rewards, before the step) per pair,
    ``grad_norm`` and ``lr``."""
    _ref_logprobs(ref, micro_batches)
    pairs = max(pairs_total(micro_batches, dp_group), 1.0)

    def loss_fn(logprobs, entropy, mb):
        terms = _pair_terms(sequence_logprobs(logprobs, mb["response_mask"]), mb["ref_seq"], cfg)
        return pair_loss(terms, pairs)

    return pair_step_sums(actor.train_step(micro_batches, loss_fn), "dpo_loss")


def pair_loss(terms: PairTerms, pairs: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A pairwise ``loss_fn``'s result: the loss summed over this micro-batch's pairs over the step's
    ``pairs``, and the sums :func:`pair_step_sums` reads."""
    return terms.loss.sum() / pairs, {**terms.stats(), "pairs": torch.tensor(float(terms.loss.numel()))}


def pair_step_sums(out: dict, loss_name: str) -> dict[str, tuple[float, float]]:
    """A pairwise optimizer step's ``train_step`` output as (sum, count) metrics per pair
    (``loss_name``, ``pair_accuracy``, ``reward_margin``), with ``grad_norm`` and ``lr``."""
    n = out.get("pairs", 0.0)
    return {loss_name: (out.get("pair_loss", 0.0), n), "pair_accuracy": (out.get("pair_accuracy", 0.0), n),
            "reward_margin": (out.get("reward_margin", 0.0), n), "grad_norm": (out["grad_norm"], 1.0),
            "lr": (out["lr"], 1.0)}


def dpo_eval(actor, ref, micro_batches: list[dict], cfg: DpoConfig) -> dict[str, tuple[float, float]]:
    """The held-out pairs' (sum, count) of ``eval_dpo_loss``, ``eval_pair_accuracy`` and
    ``eval_reward_margin`` under the current policy (no grad; collective over the model replica)."""
    _ref_logprobs(ref, micro_batches)
    return pair_eval_sums([_pair_terms(sequence_logprobs(logprobs.float().cpu(), mb["response_mask"]), mb["ref_seq"], cfg)
                           for mb, (logprobs, _) in zip(micro_batches, actor.compute_logprobs(micro_batches))],
                          "dpo_loss")


def pair_eval_sums(terms: list[PairTerms], loss_name: str) -> dict[str, tuple[float, float]]:
    """Held-out pairs' (sum, count) metrics per pair: ``eval_<loss_name>``, ``eval_pair_accuracy``
    and ``eval_reward_margin``, over every micro-batch's :class:`PairTerms`."""
    n = float(sum(t.loss.numel() for t in terms))
    sums = {f"eval_{loss_name}": 0.0, "eval_pair_accuracy": 0.0, "eval_reward_margin": 0.0}
    for t in terms:
        for k, v in t.stats().items():
            sums["eval_" + {"pair_loss": loss_name}.get(k, k)] += float(v)
    return {k: (v, n) for k, v in sums.items()}
