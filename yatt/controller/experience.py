"""A rank's experience for the update: from the step's scored groups (or a stage's rows) to this
rank's micro-batches per mini-batch.

The outcome advantages of each whole group (:mod:`yatt.algos.estimators`), the samples shared over
the model replica (its TP x PP ranks train on the same data), the zero-signal samples left out
(:func:`yatt.algos.zero_signal.trained_mask`, still counted in the loss normaliser), the rest
balanced over the DP ranks (:class:`yatt.controller.rebalance.DpBalancer`) and packed
(:func:`yatt.controller.batch.pack_micro_batches`). Called by :mod:`yatt.loop`'s step.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

from yatt.algos.estimators import outcome_advantages
from yatt.algos.reward_norm import normalize_rewards
from yatt.algos.zero_signal import trained_mask
from yatt.config import Config
from yatt.controller.batch import (make_mini_batches, make_samples, mini_batch_bounds, pack_micro_batches,
                                   skipped_counts)
from yatt.controller.metrics import PhaseTimer
from yatt.controller.rebalance import DpBalancer

if TYPE_CHECKING:
    from yatt.job import Job

log = logging.getLogger("yatt")


def rl_experience(job: Job, groups, rewards: list[list[float]], timer: PhaseTimer,
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
        samples, counts = gather(samples, job.mp_group, t.tp * t.pp), dist.get_rank(job.mp_group) == 0
    keep = trained_mask(a, [s.advantage for s in samples])
    if keep is not None:
        left = [s for s, k in zip(samples, keep) if not k] if counts else []
        sums.update(samples_skipped=(float(len(left)), 1.0), tokens_skipped=(float(sum(s.length for s in left)), 1.0))
    with timer("balance"):
        return balanced_mini_batches(samples, keep, job.balancer, job.cfg, job.tokenizer.pad_token_id, sums)


def stage_samples(job: Job, samples: list, skipped: int) -> tuple[list, dict[str, tuple[float, float]]]:
    """A stage's samples made from this rank's rows, shared over the model replica (its TP x PP
    ranks train on the same data), and this rank's row metrics: ``<stage>_rows_skipped``,
    ``tokens_total``, ``response_len_mean``."""
    t = job.cfg.trainer
    sums = {f"{job.cfg.stage}_rows_skipped": (float(skipped), 1.0),
            "tokens_total": (float(sum(s.length for s in samples)), 1.0),
            "response_len_mean": (float(sum(len(s.response_ids) for s in samples)), float(len(samples)))}
    if t.tp * t.pp > 1:
        samples = gather(samples, job.mp_group, t.tp * t.pp)
    return samples, sums


def gather(samples, group, size: int) -> list:
    """Every rank's ``samples`` of ``group`` (``size`` ranks), in rank order, on every one of them."""
    parts = [None] * size
    dist.all_gather_object(parts, samples, group=group)
    return [s for part in parts for s in part]


def balanced_mini_batches(samples, keep: list[bool] | None, balancer: DpBalancer | None, cfg: Config,
                          pad_id: int, sums: dict, mini_batches: int | None = None
                          ) -> tuple[list[list[dict]], list[tuple[float, float]]]:
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
