"""The reward sources scored without an engine (``reward.sources`` types rule, function,
math_verify, match, http), built from their config sections.

A source has ``name``, ``weight`` and ``score(items: list[RewardItem]) -> Scored``. The GenRM
judge runs on its own engine, placed by :mod:`yatt.placement.runner`; :mod:`yatt.reward.scorer`
adds its scores to these.
"""
from __future__ import annotations

from yatt.reward.item import RewardItem, Scored
from yatt.reward.rule import RuleReward


class RuleScorer:
    """``data.task``'s reasoning-gym scorer on the answer ``extract`` reads (scores in [0, 1])."""

    def __init__(self, task: str, extract: str, task_config: dict) -> None:
        self.rule = RuleReward(task, extract, task_config)

    def score(self, items: list[RewardItem]) -> Scored:
        return Scored([self.rule(i.response, i.row) for i in items])


class Source:
    """A named, weighted source around a scorer (``score(items) -> Scored``)."""

    def __init__(self, name: str, weight: float, scorer) -> None:
        self.name, self.weight, self.scorer = name, weight, scorer

    def score(self, items: list[RewardItem]) -> Scored:
        """The scorer's :class:`Scored` for ``items``, one finite score per item."""
        out = self.scorer.score(items)
        if len(out.scores) != len(items):  # a scorer of ours broke its contract: not the user's fault
            raise RuntimeError(f"reward source {self.name}: {len(out.scores)} scores for {len(items)} responses")
        return out


def build_source(src, index: int, extract: str, task: str, task_config: dict) -> Source:
    """The :class:`Source` of ``reward.sources[index]`` (a local type: see :data:`yatt.config.LOCAL_SOURCES`).

    Raises:
        ValueError: a function source's path cannot be loaded, or a match pattern is not a regex
            (the message names the key).
    """
    import re

    key = f"reward.sources[{index}]"
    if src.type == "rule":
        scorer = RuleScorer(task, extract, task_config)
    elif src.type == "function":
        from yatt.reward.function import FunctionReward

        scorer = FunctionReward(src.path, src.batched, src.timeout_s, src.error_score, key=f"{key}.path")
    elif src.type == "math_verify":
        from yatt.reward.verify import MathVerifyReward

        scorer = MathVerifyReward(src.timeout_s, src.error_score)
    elif src.type == "match":
        from yatt.reward.verify import MatchReward

        try:
            scorer = MatchReward(src.pattern, src.ignore_case, extract)
        except re.error as e:
            raise ValueError(f"{key}.pattern: not a regular expression ({e})") from None
    elif src.type == "http":
        from yatt.reward.http import HttpReward

        scorer = HttpReward(src.url, src.batch_size, src.max_concurrency, src.timeout_s, src.retries, src.backoff_s,
                            src.error_score)
    else:
        raise ValueError(f"{key}.type: {src.type!r} is not scored locally")
    return Source(src.name, src.weight, scorer)
