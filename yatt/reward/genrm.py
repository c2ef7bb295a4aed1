"""Generative reward model (GenRM): an LLM judge run through this rank's vLLM engine.

Two ways to read a judgement (``GenRMJudge(mode=...)``):

* ``"verdict"`` -- LLM-as-a-judge (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and
  Chatbot Arena"): the judge writes text ending with a verdict line, read by :func:`parse_verdict`.
* ``"prob"`` -- generative verifiers' P(yes) scoring (Zhang et al. 2024, "Generative Verifiers:
  Reward Modeling as Next-Token Prediction"): the judge is asked for a one-word yes/no answer and
  the score is P(yes) / (P(yes) + P(no)) over the first generated token (:func:`prob_yes`).

Prompt templates are files in ``yatt/reward/templates/`` (or any path) with the fields
``{question}``, ``{response}`` and ``{reference}``: ``correctness_*`` are reference-guided
correctness checks for verifiable tasks, ``quality_*`` pointwise quality ratings for open
prompts with no reference. ``*_yesno`` suit ``mode="prob"``, ``correctness_verdict`` (``Verdict:
yes|no``) and ``quality_score`` (``Score: N/10``) suit ``mode="verdict"``. The judged response
sits between the markers ``<<<RESPONSE>>>`` and ``<<<END RESPONSE>>>``; markers inside the
response are removed before it is inserted, so a response cannot close its block early.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATE_DIR = Path(__file__).parent / "templates"
BLOCK_OPEN, BLOCK_CLOSE = "<<<RESPONSE>>>", "<<<END RESPONSE>>>"
YES_FORMS = ("yes", "Yes", "YES", " yes", " Yes", " YES")
NO_FORMS = ("no", "No", "NO", " no", " No", " NO")

# One verdict line: optional markdown decoration, "Verdict: yes|no" or "Score: N/10" (N may be
# fractional; "/10" optional), nothing else on the line but punctuation / markdown.
_VERDICT_LINE = re.compile(
    r"^[\s>*_#`\-]*(?:final\s+)?(?P<key>verdict|score)[\s*_`]*:[\s*_`]*"
    r"(?:(?P<yesno>yes|no)|(?P<num>\d+(?:\.\d+)?)\s*(?:/\s*(?P<den>\d+(?:\.\d+)?))?)"
    r"[\s*_`.!\"']*$",
    re.IGNORECASE)


def parse_verdict(text: str | None) -> float | None:
    """Score in [0, 1] read from the judge's own output text, or None when unparsable.

    Rule: (1) if the judge echoed the judged block, only the text after the last
    ``<<<END RESPONSE>>>`` marker counts; (2) of that text, the **last** line that is a verdict
    line wins: ``Verdict: yes`` -> 1.0, ``Verdict: no`` -> 0.0, ``Score: N/10`` -> N/10 (``Score:
    N`` alone is read out of 10; any ``/D`` with D > 0 is honoured). A verdict line holds
    nothing else (case-insensitive, markdown ``**``/``#``/``>`` and trailing punctuation
    allowed), so prose that merely mentions "verdict: yes" mid-sentence does not count. A
    score outside [0, D] is unparsable. The judge's output never contains the prompt, so a fake
    verdict planted in the judged response only reaches this text if the judge quotes it;
    rules (1) and (2) then still pick the judge's own final line.

    Args:
        text: decoded judge output (special tokens skipped); None or "" allowed.
    Returns:
        float in [0, 1], or None.
    """
    if not text:
        return None
    tail = text.rsplit(BLOCK_CLOSE, 1)[-1]
    for line in reversed(tail.splitlines()):
        m = _VERDICT_LINE.match(line)
        if not m:
            continue
        if m["yesno"]:
            return 1.0 if m["yesno"].lower() == "yes" else 0.0
        if m["key"].lower() != "score":
            return None  # "Verdict: 7" is malformed
        num, den = float(m["num"]), float(m["den"]) if m["den"] else 10.0
        return num / den if den > 0 and 0 <= num <= den else None
    return None


def prob_yes(first_token_logprobs: Mapping[int, float], yes_ids, no_ids) -> float | None:
    """P(yes) / (P(yes) + P(no)) from the first generated token's top logprobs.

    P(yes) sums the probabilities of every yes-token id present (several surface forms:
    "yes", " yes", "Yes", ...), likewise P(no). A form missing from the top-K dict counts as 0
    (its true mass is below the K-th token's). Method: Zhang et al. 2024, Generative Verifiers.

    Args:
        first_token_logprobs: ``{token_id: logprob}`` (nats) of the first response position.
        yes_ids, no_ids: iterables of token ids.
    Returns:
        float in [0, 1]; None when no yes- and no no-token appears (or all are -inf).
    """
    def mass(ids) -> float:
        lps = [first_token_logprobs[t] for t in set(ids) if t in first_token_logprobs]
        lps = [lp for lp in lps if lp > -math.inf]
        if not lps:
            return -math.inf
        top = max(lps)
        return top + math.log(sum(math.exp(lp - top) for lp in lps))

    y, n = mass(yes_ids), mass(no_ids)
    if y == -math.inf and n == -math.inf:
        return None
    hi = max(y, n)
    return math.exp(y - hi) / (math.exp(y - hi) + math.exp(n - hi))


def yes_no_token_ids(tokenizer) -> tuple[set[int], set[int]]:
    """Token ids of the single-token surface forms of yes/no (``YES_FORMS``/``NO_FORMS``)."""
    def ids(forms):
        out = set()
        for f in forms:
            toks = tokenizer.encode(f, add_special_tokens=False)
            if len(toks) == 1:
                out.add(toks[0])
        return out

    yes, no = ids(YES_FORMS), ids(NO_FORMS)
    if not yes or not no:
        raise ValueError("tokenizer has no single-token 'yes'/'no' form: mode='prob' cannot be used")
    return yes, no


def load_template(template: str) -> str:
    """Template text from a built-in name (``correctness_yesno``, ...) or a file path.

    Raises:
        FileNotFoundError: neither a built-in template nor an existing file.
        ValueError: the template lacks ``{question}`` or ``{response}``.
    """
    path = TEMPLATE_DIR / f"{template}.txt"
    if not path.exists():
        path = Path(template).expanduser()
    if not path.is_file():
        names = sorted(p.stem for p in TEMPLATE_DIR.glob("*.txt"))
        raise FileNotFoundError(f"judge template {template!r}: not a file nor one of {names}")
    text = path.read_text()
    if "{question}" not in text or "{response}" not in text:
        raise ValueError(f"judge template {path} must contain {{question}} and {{response}}")
    return text


@dataclass
class JudgeItem:
    """One response to judge. ``reference`` is None for open prompts. ``messages``: the prompt
    conversation the response answers (a reward model lays it out; a GenRM judge reads ``question``)."""

    question: str
    response: str
    reference: str | None = None
    messages: list[dict] | None = None


@dataclass
class JudgeResult:
    """Judgement of one item.

    score: float in [0, 1], mean of the k judgements (an unparsable or timed-out judgement
        counts as ``unparsable_score``). judgements: the k per-judgement scores used.
    unparsable: judgements without a usable verdict, timed-out ones included (0..k).
    timed_out: judgements aborted at the timeout (0..k, <= unparsable).
    """

    score: float
    unparsable: int
    timed_out: int
    judgements: list[float] = field(default_factory=list)


class GenRMJudge:
    """LLM judge on a :class:`~yatt.rollout.VLLMEngine` (local to this rank's engine).

    Args:
        engine: this rank's judge engine (``VLLMEngine``).
        tokenizer: the judge model's HF tokenizer (chat template applied to the prompt).
        template: built-in template name or file path (see :func:`load_template`).
        mode: ``"verdict"`` (parse the generated text, k samples at ``temperature``) or
            ``"prob"`` (P(yes) of the first token; deterministic, so one request is scored
            and its value stands for all k judgements).
        k: judgements per item, averaged.
        max_tokens: judge response cap in tokens (``mode="prob"`` generates 1 token).
        temperature: judge sampling temperature (verdict mode; 0 = greedy).
        timeout_s: seconds from submission after which unfinished judge requests are aborted.
        unparsable_score: score in [0, 1] given to an unparsable or timed-out judgement.
        top_logprobs: top-K logprobs read at the first token in prob mode.
        seed: None = the engine's private stream; an int makes verdict sampling reproducible.
    Raises:
        ValueError: bad mode, k < 1, max_tokens < 1, unparsable_score outside [0, 1], or (prob
            mode) a tokenizer without single-token yes/no.
    """

    def __init__(self, engine, tokenizer, *, template: str, mode: str = "verdict", k: int = 1,
                 max_tokens: int, temperature: float, timeout_s: float, unparsable_score: float = 0.0,
                 top_logprobs: int = 20, seed: int | None = None):
        if mode not in ("verdict", "prob"):
            raise ValueError(f"mode must be 'verdict' or 'prob', got {mode!r}")
        if k < 1 or max_tokens < 1:
            raise ValueError("k and max_tokens must be >= 1")
        if not 0.0 <= unparsable_score <= 1.0:
            raise ValueError("unparsable_score must be in [0, 1]")
        self.engine, self.tokenizer, self.template = engine, tokenizer, load_template(template)
        self.mode, self.k, self.max_tokens, self.temperature = mode, k, max_tokens, temperature
        self.timeout_s, self.unparsable_score = timeout_s, unparsable_score
        self.top_logprobs, self.seed = top_logprobs, seed
        self.yes_ids, self.no_ids = yes_no_token_ids(tokenizer) if mode == "prob" else (set(), set())
        self.last_time_s = 0.0  # wall time of the last score() call's engine phase

    def prompt_ids(self, item: JudgeItem | Mapping[str, Any]) -> list[int]:
        """Chat-formatted judge prompt for one item as token ids.

        The response is cleared of the block markers, and its head is cut (tail kept, where the
        final answer is) so that prompt + ``max_tokens`` fits the engine's ``max_model_len``.
        Raises ValueError when the template needs ``{reference}`` and the item has none.
        """
        q, r, ref = _fields(item)
        if "{reference}" in self.template and ref is None:
            raise ValueError("judge template is reference-guided but the item has no reference")
        r = r.replace(BLOCK_OPEN, "").replace(BLOCK_CLOSE, "")
        budget = self.engine.max_model_len - 1 - (1 if self.mode == "prob" else self.max_tokens)
        ids = self._render(q, r, ref)
        if len(ids) > budget:
            r_ids = self.tokenizer.encode(r, add_special_tokens=False)
            keep = max(0, len(r_ids) - (len(ids) - budget) - 8)
            ids = self._render(q, "[...]" + self.tokenizer.decode(r_ids[len(r_ids) - keep:]) if keep else "[...]", ref)
        return ids

    def _render(self, q: str, r: str, ref: str | None) -> list[int]:
        text = (self.template.replace("{question}", q).replace("{reference}", ref or "")
                .replace("{response}", r))
        enc = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, return_dict=True)
        return list(enc["input_ids"])

    def score(self, items: Sequence[JudgeItem | Mapping[str, Any]]) -> list[JudgeResult]:
        """Judge this rank's items (possibly ``[]``).

        Args:
            items: JudgeItem or mappings with ``question``, ``response``, optional ``reference``.
        Returns:
            One JudgeResult per item, in order.
        Raises:
            ValueError: a reference-guided template and an item without reference.
        """
        from yatt.rollout import SamplingSpec

        prompts = [self.prompt_ids(it) for it in items]
        prob = self.mode == "prob"
        spec = SamplingSpec(n=1 if prob else self.k, max_tokens=1 if prob else self.max_tokens,
                            temperature=0.0 if prob else self.temperature, seed=self.seed)
        t0 = time.perf_counter()
        outs = self.engine.generate_within(prompts, spec, self.timeout_s,
                                           top_logprobs=self.top_logprobs if prob else 0)
        self.last_time_s = time.perf_counter() - t0
        results = []
        for comps in outs:
            scores: list[float | None] = []
            timed_out = 0
            for c in comps:
                if c.finish_reason == "timeout":
                    timed_out += 1
                    scores.append(None)
                elif prob:
                    scores.append(prob_yes(c.top_logprobs[0], self.yes_ids, self.no_ids)
                                  if c.top_logprobs else None)
                else:
                    scores.append(parse_verdict(self.tokenizer.decode(c.token_ids, skip_special_tokens=True)))
            if prob:  # one deterministic judgement stands for all k
                scores, timed_out = scores * self.k, timed_out * self.k
            used = [self.unparsable_score if s is None else s for s in scores]
            results.append(JudgeResult(sum(used) / len(used), sum(s is None for s in scores), timed_out, used))
        return results


def _fields(item) -> tuple[str, str, str | None]:
    if isinstance(item, Mapping):
        return str(item["question"]), str(item["response"]), item.get("reference")
    return item.question, item.response, item.reference
