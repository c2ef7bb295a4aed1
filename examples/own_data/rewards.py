"""Reward functions for this folder's data, given to YATT by import path
(``reward.sources: [{name: correct, type: function, path: examples.own_data.rewards:correct}]``)."""
import re

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+")


def correct(prompt: str, response: str, row: dict) -> float:
    """1.0 when the response's answer (its last ``<answer>`` tag, else its last integer) is the row's
    ``solution``, else 0.0. ``row`` is the jsonl row as written, so ``solution`` is an int here."""
    tags = _TAG.findall(response)
    numbers = _NUMBER.findall(tags[-1] if tags else response)
    return float(bool(numbers) and int(numbers[-1]) == row["solution"])
