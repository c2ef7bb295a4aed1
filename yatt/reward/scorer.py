"""Rewards of one step's responses, by ``reward.type``: rule, GenRM, or their weighted sum.

The rule reward (reasoning-gym's scorer) is always computed: it is the ground truth behind the
``accuracy`` metric even when the policy is trained on the judge's score. The GenRM judge runs
on its own vLLM engine, built for the scoring phase and shut down after it (full colocation on
CPU, where vLLM has no sleep mode: the phase owns the memory while it runs).
"""
from __future__ import annotations

from yatt.config import RewardConfig
from yatt.reward.rule import RuleReward


class StepScorer:
    """Scores a step's ``G x n`` responses on this rank.

    Args:
        cfg: the ``reward`` section. task, task_config: the reasoning-gym task of the rule reward.
        judge_path: HF folder of the judge model (needed when ``cfg.type`` uses GenRM).
    """

    def __init__(self, cfg: RewardConfig, task: str, task_config: dict, judge_path=None):
        self.cfg = cfg
        self.rule = RuleReward(task, cfg.extract, task_config)
        self.uses_genrm = cfg.type in ("genrm", "genrm_with_rule")
        if self.uses_genrm and judge_path is None:
            raise ValueError(f"reward.type={cfg.type} needs a judge model")
        self.judge_path = judge_path

    def rule_scores(self, rows, texts: list[list[str]]) -> list[float]:
        """Rule reward of each response, prompt-major (``G * n`` floats in [0, 1])."""
        return [self.rule(t, row.entry) for row, group in zip(rows, texts) for t in group]

    def genrm_scores(self, rows, texts: list[list[str]], seed: int) -> tuple[list[float], dict]:
        """Judge every response (collective: every rank calls, the judge engine lives for this call).

        Returns:
            (``G * n`` judge scores in [0, 1], prompt-major; (sum, count) metric pairs
            ``reward_genrm_mean`` and the counters ``genrm_unparsable``, ``genrm_timed_out``).
        """
        from transformers import AutoTokenizer

        from yatt.reward.genrm import GenRMJudge, JudgeItem
        from yatt.rollout.vllm_engine import VLLMEngine

        g = self.cfg.genrm
        engine = VLLMEngine(str(self.judge_path), max_model_len=g.max_model_len,
                            kv_cache_memory_bytes=g.kv_cache_memory_bytes, seed=seed)
        try:
            judge = GenRMJudge(engine, AutoTokenizer.from_pretrained(self.judge_path), template=g.template,
                               mode=g.mode, k=g.k, max_tokens=g.max_tokens, temperature=g.temperature,
                               timeout_s=g.timeout_s, unparsable_score=g.unparsable_score, seed=seed)
            items = [JudgeItem(row.question, t, row.answer) for row, group in zip(rows, texts) for t in group]
            results = judge.score(items)
        finally:
            engine.shutdown()
        scores = [r.score for r in results]
        sums = {
            "reward_genrm_mean": (sum(scores), len(scores)),
            "genrm_unparsable": (sum(r.unparsable for r in results), 1.0),
            "genrm_timed_out": (sum(r.timed_out for r in results), 1.0),
        }
        return scores, sums

    def combine(self, rule: list[float], genrm: list[float] | None) -> list[float]:
        """The training reward by ``reward.type`` (``genrm_with_rule``: weighted sum)."""
        from yatt.reward.genrm import combine

        if self.cfg.type == "rule":
            return rule
        if self.cfg.type == "genrm":
            return genrm
        return [float(combine(r, j, self.cfg.genrm.weight)) for r, j in zip(rule, genrm)]
