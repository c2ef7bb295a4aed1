"""A rank's rollout samples and their packing into trainer micro-batches.

One :class:`Sample` is one response to one prompt. Micro-batches are right-padded
``prompt + response`` rows (what the losses read), and with ``trainer.packing`` also the packed
rows the model body runs instead (:mod:`yatt.trainer.packing`); which samples share one is decided
by the C++ balancer (:func:`yatt.balance.split_micro_batches` or :func:`yatt.balance.dp_balance`), or
with ``shared_prompt`` packing by :func:`yatt.balance.dp_balance_groups` (a group's samples together).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from yatt.balance import dp_balance_groups, split_micro_batches
from yatt.controller import wire
from yatt.trainer.packing import pack_rows


@dataclass
class Sample:
    """One response to one prompt and what the step knows about it. Each field declares how it
    travels between DP ranks (:mod:`yatt.controller.wire`), so a field added here (or in a
    subclass) moves with the sample when the balancer re-partitions a step."""

    prompt_ids: list[int] = field(metadata=wire.TOKENS)
    response_ids: list[int] = field(metadata=wire.TOKENS)
    rollout_logprobs: list[float] = field(metadata=wire.PER_TOKEN)  # engine's logprob of each response token
    finish_reason: str = field(metadata=wire.choice("stop", "length"))
    reward: float = field(default=0.0, metadata=wire.SCALAR)
    advantage: float = field(default=0.0, metadata=wire.SCALAR)
    # per response token: 1.0 trained (the model's), 0.0 not (an environment's, in a multi-turn
    # episode: yatt.rollout.episodes); empty at construction means every token is the model's
    loss_mask: list[float] = field(default_factory=list, metadata=wire.PER_TOKEN)

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [1.0] * len(self.response_ids)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def pack_micro_batches(samples: list[Sample], groups, pad_id: int, packing: str = "padded") -> list[dict]:
    """Pack samples into one micro-batch per group of indices.

    Args:
        samples: the samples the indices point into.
        groups: index lists/arrays into ``samples``, one per micro-batch (empty ones are skipped).
        pad_id: token id filling each row after its sequence.
        packing: ``trainer.packing``: ``"padded"`` (the model runs the padded rows), ``"packed"`` or
            ``"shared_prompt"`` (it runs packed rows, :func:`yatt.trainer.packing.pack_rows`).
    Returns:
        list of dicts with ``input_ids`` long ``[B, T]`` (pad: ``pad_id``), ``response_mask``
        float ``[B, T]`` (the trained tokens: each sample's ``loss_mask``), ``rollout_logprobs``
        float ``[B, T]`` (aligned with the token they score, 0 outside responses), ``advantages``
        float ``[B, 1]``, ``index`` long ``[B]``
        (positions in ``samples``) and ``body_tokens`` long ``[2]`` (the sample tokens and the
        tensor size the model body runs: padding is their difference); when packed, also
        :func:`~yatt.trainer.packing.pack_rows`' ``packed_*`` tensors.
    """
    out = []
    for idx in groups:
        idx = [int(i) for i in idx]
        if not idx:
            continue
        rows = [samples[i] for i in idx]
        width = max(s.length for s in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        lps = torch.zeros((len(rows), width), dtype=torch.float32)
        for b, s in enumerate(rows):
            p, r = len(s.prompt_ids), len(s.response_ids)
            ids[b, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
            lps[b, p : p + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        mb = {
            "input_ids": ids,
            "response_mask": response_mask([len(s.prompt_ids) for s in rows], [len(s.response_ids) for s in rows], width,
                                           [s.loss_mask for s in rows]),
            "rollout_logprobs": lps,
            "advantages": torch.tensor([[s.advantage] for s in rows], dtype=torch.float32),
            "index": torch.tensor(idx, dtype=torch.long),
        }
        if packing == "padded":
            mb["body_tokens"] = torch.tensor([sum(s.length for s in rows), ids.numel()])
        else:
            mb.update(pack_rows([s.prompt_ids for s in rows], [s.response_ids for s in rows], width, packing))
            mb["body_tokens"] = torch.tensor([mb["packed_ids"].numel()] * 2)  # no padding
        out.append(mb)
    return out


def make_samples(rows, completions, rewards: list[float], advantages: list[float]) -> list[Sample]:
    """Turn each prompt's ``n`` scored completions into samples.

    Args:
        rows: the step's :class:`~yatt.assets.data.PromptRow` list (``G`` prompts).
        completions: ``G`` lists of ``n`` engine completions (token ids, logprobs, finish reason;
            a multi-turn episode's ``mask`` becomes the sample's ``loss_mask``, and its
            ``prompt_ids`` the sample's prompt).
        rewards, advantages: ``G * n`` floats each, prompt-major (``rewards[g * n + k]`` scores
            completion k of g): the scores and their outcome advantages
            (:func:`yatt.algos.estimators.outcome_advantages`).
    Returns:
        ``G * n`` samples, prompt-major.
    Raises:
        ValueError: the number of rewards or advantages is not ``G * n``.
    """
    samples = [Sample(list(getattr(c, "prompt_ids", None) or row.prompt_ids), list(c.token_ids), list(c.logprobs),
                      c.finish_reason, loss_mask=[float(m) for m in getattr(c, "mask", None) or []])
               for row, group in zip(rows, completions) for c in group]
    if not len(rewards) == len(advantages) == len(samples):
        raise ValueError(f"{len(rewards)} rewards and {len(advantages)} advantages for {len(samples)} samples")
    for s, r, a in zip(samples, rewards, advantages):
        s.reward, s.advantage = float(r), float(a)
    return samples


def mini_batch_bounds(n: int, mini_batches: int) -> list[int]:
    """``mini_batches + 1`` bounds cutting ``n`` samples into contiguous, near-equal chunks (a chunk
    is empty only when ``n < mini_batches``)."""
    return [round(i * n / mini_batches) for i in range(mini_batches + 1)]


def make_mini_batches(samples: list[Sample], mini_batches: int, token_budget: int, pad_id: int,
                      keep: list[bool] | None = None, packing: str = "padded") -> list[list[dict]]:
    """Split samples into ``mini_batches`` contiguous chunks, each split into micro-batches of at
    most ``token_budget`` tokens and packed: by :func:`yatt.balance.split_micro_batches` over the
    samples' lengths, or with ``packing="shared_prompt"`` by :func:`yatt.balance.dp_balance_groups`
    on one rank, which keeps each group's samples (a run of one prompt) in one micro-batch where
    the budget allows, so its prompt runs once (the cost: response tokens plus each prompt once).

    Args:
        keep: per sample, whether it is trained (None: every one; see
            :func:`yatt.algos.zero_signal.trained_mask`). The chunks are cut over every sample, as
            without skipping, and the left-out ones then dropped, so each optimizer step sees the
            samples it would see in the full batch (a chunk may become empty: no micro-batch).
        packing: as :func:`pack_micro_batches`.
    Returns:
        per mini-batch, its micro-batch dicts (:func:`~yatt.controller.batch.pack_micro_batches`;
        ``index`` points into ``samples``).
    Raises:
        ValueError: fewer samples than mini-batches.
    """
    if len(samples) < mini_batches:
        raise ValueError(f"{len(samples)} samples on this rank cannot fill algo.mini_batches={mini_batches}")
    bounds = mini_batch_bounds(len(samples), mini_batches)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = [i for i in range(a, b) if keep is None or keep[i]]
        split = _micro_batch_split(samples, idx, token_budget, packing)
        out.append(pack_micro_batches(samples, split, pad_id, packing))
    return out


def _micro_batch_split(samples: list[Sample], idx: list[int], token_budget: int, packing: str) -> list[list[int]]:
    """``idx`` (indices into ``samples``) cut into micro-batches, as :func:`make_mini_batches` says."""
    if packing != "shared_prompt" or not idx:
        return [[idx[j] for j in g] for g in split_micro_batches([samples[i].length for i in idx], token_budget)]
    group = prompt_runs([samples[i] for i in idx])
    plan = dp_balance_groups([len(samples[i].prompt_ids) for i in idx], [len(samples[i].response_ids) for i in idx],
                             group, 1, token_budget)
    return [[idx[j] for j in mb.tolist()] for mb in plan.rank_micro_batches(0)]


def prompt_runs(samples: list[Sample]) -> np.ndarray:
    """Group labels ``[n]`` int64, ascending from 1: one label per run of adjacent samples with the
    same ``prompt_ids`` (a group's samples are adjacent, as :func:`make_samples` lays them out)."""
    return np.cumsum([i == 0 or s.prompt_ids != samples[i - 1].prompt_ids for i, s in enumerate(samples)],
                     dtype=np.int64)


def skipped_counts(samples: list[Sample], keep: list[bool] | None, bounds: list[int]) -> list[tuple[float, float]]:
    """Per chunk ``samples[bounds[m]:bounds[m + 1]]``, the response tokens and the sequences (with at
    least one response token) of the samples ``keep`` leaves out: what the loss normaliser of that
    mini-batch still counts for them (:func:`yatt.algos.update.mini_batch_norm`). All 0 for ``keep=None``."""
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lens = [int(sum(samples[i].loss_mask)) for i in range(a, b) if keep is not None and not keep[i]]
        out.append((float(sum(lens)), float(sum(n > 0 for n in lens))))
    return out


def response_mask(prompt_lens: list[int], response_lens: list[int], total_len: int,
                  token_masks: list[list[float]] | None = None) -> torch.Tensor:
    """Loss mask over right-padded ``prompt + response`` rows.

    Position ``t`` of row ``b`` is set iff it holds a response token:
    ``prompt_lens[b] <= t < prompt_lens[b] + response_lens[b]``, and with ``token_masks`` (one
    value per response token of each row) iff that token's value is 1 (a multi-turn episode's
    environment tokens are 0). Built from lengths, never from token ids, so an EOS at the end of a
    response is trained on, padding is excluded even when pad id == EOS id, and a response cut at
    ``max_tokens`` (no EOS) is masked exactly.

    Returns:
        float32 ``[B, total_len]``.
    """
    pos = torch.arange(total_len).unsqueeze(0)
    start = torch.tensor(prompt_lens).unsqueeze(1)
    end = start + torch.tensor(response_lens).unsqueeze(1)
    mask = ((pos >= start) & (pos < end)).to(torch.float32)
    if token_masks is not None and not all(all(m) for m in token_masks):
        for b, (p, m) in enumerate(zip(prompt_lens, token_masks)):
            mask[b, p:p + len(m)] = torch.tensor(m, dtype=torch.float32)
    return mask
