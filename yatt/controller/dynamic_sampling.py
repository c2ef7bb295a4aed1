"""DAPO dynamic sampling over the SPMD controller shards.

A GRPO group whose rewards are all equal has zero advantage for every response: it costs a
training pass and carries no gradient. Which groups carry none is the estimator's to say
(:func:`yatt.algos.estimators.group_informative`: with ``reinforce_pp`` or ``gae`` every group
carries some). Dynamic sampling (Q. Yu et al., "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", 2025, section 3.2 and Algorithm 1) drops such groups and
samples more prompts until the batch holds ``target`` informative groups. Here every rank filters
its own groups; the ranks agree on whether to sample another round from one all-gather of their
kept-group counts (scalars), so every rank runs the same number of rounds. After at most
``max_rounds`` extra rounds the step trains on what it has, with a warning and a counter. A full
batch is trimmed to exactly ``target`` groups, taken from the ranks holding the most.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger("yatt")


def informative(rewards: Sequence[float]) -> bool:
    """True when a group's rewards are not all equal (its GRPO advantages are not all zero): the
    default test; a run asks its estimator (:func:`yatt.algos.estimators.group_informative`)."""
    return max(rewards) > min(rewards) if len(rewards) else False


def trim_quotas(counts: Sequence[int], target: int) -> list[int]:
    """How many kept groups each rank trains on so that the total is ``min(sum(counts), target)``.

    Removes the excess one group at a time from the rank holding the most (ties: the higher rank),
    which keeps the ranks as even as possible. Deterministic, so every rank computes the same.

    Args:
        counts: kept groups per rank, ``>= 0``.
        target: groups the batch needs, ``>= 0``.
    Returns:
        per rank, ``0 <= quota[r] <= counts[r]``.
    """
    quota = list(counts)
    for _ in range(max(0, sum(quota) - target)):
        r = max(range(len(quota)), key=lambda i: (quota[i], i))
        quota[r] -= 1
    return quota


class DynamicSampler:
    """Refills a step's batch with informative groups; one instance per run (its counter persists).

    Args:
        target: informative groups a step trains on, over all ranks (the step's prompt count).
        max_rounds: extra generation rounds per step at most (``algo.max_sampling_rounds``).
        group: process group of every rank that runs the step loop (None: the default group).
        keep: ``rewards of one group -> bool``, whether the group can move the policy (the
            algorithm's answer; default :func:`informative`).
    """

    def __init__(self, target: int, max_rounds: int, group=None,
                 keep: Callable[[Sequence[float]], bool] = informative):
        self.target, self.max_rounds, self.group, self.keep = target, max_rounds, group, keep
        self.cap_hits = 0  # steps so far that trained on a smaller batch

    def fill(self, groups: list, rewards: list[list[float]], draw: Callable[[int], tuple[list, list[list[float]]]]
             ) -> tuple[list, list[list[float]], dict[str, tuple[float, float]]]:
        """Filter this rank's groups and draw more rounds until the ranks together hold ``target``.

        Collective: every rank of ``group`` calls it once per step, and ``draw`` once per round
        (the same rounds on every rank, so collectives inside ``draw`` line up).

        Args:
            groups: this rank's groups of the first round (any objects; none on ranks that do
                not train).
            rewards: per group, its ``n`` rewards.
            draw: ``draw(round)`` (round 1, 2, ...) samples and scores one more round of this
                rank's prompts and returns ``(groups, rewards)`` like the first round.
        Returns:
            (kept groups, their rewards, (sum, count) metrics: ``dynamic_sampling_rounds`` (extra
            rounds), ``dynamic_sampling_groups_dropped`` (uninformative, this step),
            ``dynamic_sampling_groups_trimmed`` (informative beyond ``target``),
            ``dynamic_sampling_cap_hit`` (1 when the step trains on fewer than ``target``) and
            ``dynamic_sampling_cap_hits`` (steps so far)).
        """
        kept, dropped, rounds = [], 0, 0
        while True:
            for g, r in zip(groups, rewards):
                if self.keep(r):
                    kept.append((g, r))
                else:
                    dropped += 1
            counts = self._all_counts(len(kept))
            if sum(counts) >= self.target or rounds == self.max_rounds:
                break
            rounds += 1
            groups, rewards = draw(rounds)
        short = sum(counts) < self.target
        if short:
            self.cap_hits += 1
            log.warning("dynamic sampling: %d of %d informative groups after %d extra rounds (the cap); "
                        "training on the smaller batch", sum(counts), self.target, rounds)
        quota = trim_quotas(counts, self.target)[self._rank()]
        trimmed = len(kept) - quota
        kept = kept[:quota]
        stats = {"dynamic_sampling_rounds": (rounds, 1.0), "dynamic_sampling_groups_dropped": (dropped, 1.0),
                 "dynamic_sampling_groups_trimmed": (trimmed, 1.0), "dynamic_sampling_cap_hit": (float(short), 1.0),
                 "dynamic_sampling_cap_hits": (float(self.cap_hits), 1.0)}
        return [g for g, _ in kept], [r for _, r in kept], stats

    def state_dict(self) -> dict:
        return {"cap_hits": self.cap_hits}

    def load_state_dict(self, state: dict) -> None:
        self.cap_hits = state["cap_hits"]

    def _rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _all_counts(self, count: int) -> list[int]:
        if not dist.is_initialized():
            return [count]
        out = torch.zeros(dist.get_world_size(self.group), dtype=torch.int64)
        dist.all_gather_single(out, torch.tensor([count], dtype=torch.int64), group=self.group)
        return out.tolist()
