"""Rule reward: reasoning-gym's own scorer applied to the answer extracted from a response."""
from __future__ import annotations

import re
from typing import Any

_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_answer(response: str, mode: str = "answer_tag_or_last_number") -> str | None:
    """Final answer of a response.

    Args:
        response: decoded response text.
        mode: ``answer_tag`` (content of the last ``<answer>...</answer>``, the reasoning-gym
            convention) or ``answer_tag_or_last_number`` (falls back to the last number).
    Returns:
        The stripped answer, or None when nothing can be extracted.
    """
    tags = _TAG.findall(response)
    if tags:
        return tags[-1].strip()
    if mode == "answer_tag_or_last_number":
        numbers = _NUMBER.findall(response)
        return numbers[-1] if numbers else None
    return None


class RuleReward:
    """Scores responses with a reasoning-gym task's ``score_answer`` (reward in [0, 1]).

    A response is counted correct (``accuracy``) when its score is exactly 1.
    """

    def __init__(self, task: str, extract: str = "answer_tag_or_last_number", task_config: dict | None = None):
        import reasoning_gym as rg

        self.extract = extract
        self._scorer = rg.create_dataset(task, size=1, seed=0, **(task_config or {}))

    def __call__(self, response: str, entry: dict[str, Any]) -> float:
        """Score one response against its row's entry (question, answer, metadata)."""
        answer = extract_answer(response, self.extract)
        try:
            return float(self._scorer.score_answer(answer, entry))
        except Exception:  # a scorer that chokes on odd text: no credit, never a crash
            return 0.0
