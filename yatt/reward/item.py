"""What every reward source scores, and what it returns (:mod:`yatt.reward.sources`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardItem:
    """One response to score.

    prompt: the row's question text (before the chat template). response: the decoded response.
    row: every field of the data row (file data: the row as read, ground truth and metadata
    included; reasoning-gym: ``question``, ``answer``, ``metadata``).
    """

    prompt: str
    response: str
    row: dict[str, Any]


@dataclass
class Scored:
    """A source's scores of a list of items.

    scores: one finite float per item, in item order. errors: items that got the source's
    ``error_score`` (an exception, a non-finite or non-numeric value, a time-out, a failed
    request). counters: more counts of the source, reported as ``reward_<name>_<key>``
    (``timeouts``, ``retries``, ``requests`` ...).
    """

    scores: list[float]
    errors: int = 0
    counters: dict[str, float] = field(default_factory=dict)


def finite_score(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a finite number (a bool, a string or
    None are not scores; numpy scalars are)."""
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None
