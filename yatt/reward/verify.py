"""Built-in verifiers: math answer equivalence (math-verify) and exact or regex match.

Both read the row's reference answer (``row["answer"]``) and score 1.0 (right) or 0.0.
"""
from __future__ import annotations

import logging
import re

from yatt.reward.item import RewardItem, Scored
from yatt.reward.rule import extract_answer

log = logging.getLogger("yatt")
_SPACE = re.compile(r"\s+")


class MathVerifyReward:
    """1.0 when the response's final answer is mathematically equal to the reference.

    Uses Hugging Face's math-verify (``parse`` then ``verify``): LaTeX and plain expressions,
    fractions against decimals (``\\frac{1}{2}`` = ``0.5``), percentages, sets, units dropped. The
    reference is parsed as written, or inside ``$...$`` when that finds nothing. The answer
    parsed is the content of the last ``<answer>`` tag when there is one (math-verify
    does not read those tags), else the whole response, where math-verify takes the last
    ``\\boxed{}`` or expression. A parse or comparison that fails or runs past ``timeout_s``
    (math-verify's own ``signal.alarm`` limit, main thread only) scores ``error_score`` and
    counts as an error; no answer found scores 0.0 (a wrong response, not an error).

    Args:
        timeout_s: seconds for each parse and for the comparison (0: no limit).
        error_score: the score when math-verify fails.
    """

    def __init__(self, timeout_s: int = 5, error_score: float = 0.0) -> None:
        import math_verify

        self._mv, self.timeout_s, self.error_score = math_verify, timeout_s or None, error_score
        self._gold: dict[str, list] = {}  # reference answer -> parsed (a group shares one)

    def score(self, items: list[RewardItem]) -> Scored:
        scores, errors = [], 0
        for item in items:
            try:
                scores.append(self._one(item))
            except Exception as e:  # noqa: BLE001 - math-verify's own failures (time-outs included)
                if not errors:
                    log.warning("math_verify failed on a response (%s: %s); scored %s and counted",
                                type(e).__name__, e, self.error_score)
                errors += 1
                scores.append(self.error_score)
        if len(self._gold) > 4096:
            self._gold.clear()
        return Scored(scores, errors)

    def _one(self, item: RewardItem) -> float:
        mv, reference = self._mv, str(item.row["answer"])
        if reference not in self._gold:  # LaTeX without delimiters (\sqrt{4}) parses inside $...$
            self._gold[reference] = (mv.parse(reference, parsing_timeout=self.timeout_s, raise_on_error=True)
                                     or mv.parse(f"${reference}$", parsing_timeout=self.timeout_s, raise_on_error=True))
        tagged = extract_answer(item.response, "answer_tag")
        answer = mv.parse(item.response if tagged is None else tagged, parsing_timeout=self.timeout_s,
                          raise_on_error=True)
        if not answer or not self._gold[reference]:
            return 0.0
        return float(mv.verify(self._gold[reference], answer, timeout_seconds=self.timeout_s, raise_on_error=True))


class MatchReward:
    """Exact match of the extracted answer, or a regex search of the response.

    Args:
        pattern: None: the answer read by ``extract`` equals ``row["answer"]`` after collapsing
            whitespace; else a regex searched in the response, where ``{answer}`` stands for the
            row's answer (``re.escape``-d). ``ignore_case``: compare or search case-insensitively.
        extract: ``reward.extract``'s mode for the exact match.
    Raises:
        re.error: ``pattern`` is not a valid regex (checked here, before any response).
    """

    def __init__(self, pattern: str | None = None, ignore_case: bool = True,
                 extract: str = "answer_tag_or_last_number") -> None:
        self.pattern, self.extract = pattern, extract
        self.flags = re.IGNORECASE | re.DOTALL if ignore_case else re.DOTALL
        if pattern is not None:
            re.compile(pattern.replace("{answer}", "x"), self.flags)

    def score(self, items: list[RewardItem]) -> Scored:
        return Scored([float(self._one(i)) for i in items])

    def _one(self, item: RewardItem) -> bool:
        reference = str(item.row["answer"])
        if self.pattern is not None:
            pattern = self.pattern.replace("{answer}", re.escape(reference))
            return re.search(pattern, item.response, self.flags) is not None
        answer = extract_answer(item.response, self.extract)
        if answer is None:
            return False
        a, b = _SPACE.sub(" ", answer).strip(), _SPACE.sub(" ", reference).strip()
        return a.casefold() == b.casefold() if self.flags & re.IGNORECASE else a == b
