"""Rewards of one step's responses, by ``reward.type``: rule, GenRM, or their weighted sum.

The rule reward (reasoning-gym's scorer) is always computed: it is the ground truth behind the
``accuracy`` metric even when the policy is trained on the judge's score. The GenRM judge runs
on its own vLLM engine; when it is built and shut down is the placement's business
(:mod:`yatt.placement.runner`).
"""
from __future__ import annotations

from yatt.config import RewardConfig
from yatt.reward.rule import RuleReward


class StepScorer:
    """Scores a step's ``G x n`` responses on this rank.

    Args:
        cfg: the ``reward`` section. task, task_config: the reasoning-gym task of the rule reward.
        judge_path: HF folder of the judge model (needed when ``cfg.type`` uses GenRM).
        progress: label of the judge engine's progress bar (None: no bar; see ``VLLMEngine``).
    """

    def __init__(self, cfg: RewardConfig, task: str, task_config: dict, judge_path=None, progress: str | None = None):
        self.cfg = cfg
        self.progress = progress
        self.rule = RuleReward(task, cfg.extract, task_config)
        self.uses_genrm = cfg.type in ("genrm", "genrm_with_rule")
        if self.uses_genrm and judge_path is None:
            raise ValueError(f"reward.type={cfg.type} needs a judge model")
        self.judge_path = judge_path

    def rule_scores(self, rows, texts: list[list[str]]) -> list[float]:
        """Rule reward of each response, prompt-major (``G * n`` floats in [0, 1])."""
        return [self.rule(t, row.entry) for row, group in zip(rows, texts) for t in group]

    def make_judge(self, seed: int):
        """Build the judge: a vLLM engine of the judge model (collective, see
        :mod:`yatt.rollout.vllm_engine`) wrapped in a :class:`~yatt.reward.genrm.GenRMJudge`.
        Shut it down with ``judge.engine.shutdown()``."""
        from transformers import AutoTokenizer

        from yatt.reward.genrm import GenRMJudge
        from yatt.rollout.vllm_engine import VLLMEngine

        g = self.cfg.genrm
        engine = VLLMEngine(str(self.judge_path), max_model_len=g.max_model_len,
                            kv_cache_memory_bytes=g.kv_cache_memory_bytes, seed=seed, progress=self.progress)
        return GenRMJudge(engine, AutoTokenizer.from_pretrained(self.judge_path), template=g.template,
                          mode=g.mode, k=g.k, max_tokens=g.max_tokens, temperature=g.temperature,
                          timeout_s=g.timeout_s, unparsable_score=g.unparsable_score, seed=seed)

    def judge_groups(self, judge, groups) -> None:
        """Judge every response of ``groups`` (SampleGroup-like: ``row``, ``texts``) in one batch.

        Sets each group's ``genrm`` (one score in [0, 1] per response), ``unparsable`` and
        ``timed_out`` (judgements counted as such; a timed-out one is also unparsable).
        """
        from yatt.reward.genrm import JudgeItem

        items = [JudgeItem(g.row.question, t, g.row.answer) for g in groups for t in g.texts]
        results = iter(judge.score(items))
        for g in groups:
            mine = [next(results) for _ in g.texts]
            g.genrm = [r.score for r in mine]
            g.unparsable = sum(r.unparsable for r in mine)
            g.timed_out = sum(r.timed_out for r in mine)

    @staticmethod
    def genrm_sums(groups) -> dict[str, tuple[float, float]]:
        """(sum, count) pairs of judged groups: ``reward_genrm_mean`` and the counters
        ``genrm_unparsable``, ``genrm_timed_out``."""
        scores = [s for g in groups for s in g.genrm]
        return {
            "reward_genrm_mean": (sum(scores), len(scores)),
            "genrm_unparsable": (sum(g.unparsable for g in groups), 1.0),
            "genrm_timed_out": (sum(g.timed_out for g in groups), 1.0),
        }

    def combine(self, rule: list[float], genrm: list[float] | None) -> list[float]:
        """The training reward by ``reward.type`` (``genrm_with_rule``: weighted sum)."""
        from yatt.reward.genrm import combine

        if self.cfg.type == "rule":
            return rule
        if self.cfg.type == "genrm":
            return genrm
        return [float(combine(r, j, self.cfg.genrm.weight)) for r, j in zip(rule, genrm)]
