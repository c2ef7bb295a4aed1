"""Rewards of one step's responses: the weighted sum of ``reward.sources`` (or of what
``reward.type`` stands for), with per-source metrics.

Every source is scored, also at weight 0: ``reward_<name>_mean`` and ``reward_<name>_errors``
(responses given the source's ``error_score``) for each, plus a source's own counters
(``reward_<name>_timeouts``, ``_retries``, ...). The accuracy source (``reward.accuracy``) is the
ground truth behind ``accuracy`` and the evaluation, even when the policy trains on a judge's
score. The GenRM judge runs on its own vLLM engine; when it is built and shut down is the
placement's business (:mod:`yatt.placement.runner`); :meth:`StepScorer.score` adds its scores
(set on the groups by :meth:`StepScorer.judge_groups`) to the local sources'.
"""
from __future__ import annotations

from yatt.config import LOCAL_SOURCES, RewardConfig
from yatt.reward.http import COUNTERS as HTTP_COUNTERS
from yatt.reward.item import RewardItem
from yatt.reward.sources import build_source

# metric name endings of source counters (errors, and the counters of the HTTP source, a superset of
# the function source's): summed over ranks, not averaged
COUNTER_SUFFIXES = ("_errors", *(f"_{k}" for k in HTTP_COUNTERS))


class StepScorer:
    """Scores a step's ``G x n`` responses on this rank.

    Args:
        cfg: the ``reward`` section. task, task_config: the reasoning-gym task of the rule reward.
        judge_path: HF folder of the judge model (needed with a genrm source).
        progress: label of the judge engine's progress bar (None: no bar; see ``VLLMEngine``).
    """

    def __init__(self, cfg: RewardConfig, task: str, task_config: dict, judge_path=None, progress: str | None = None):
        self.cfg = cfg
        self.progress = progress
        self.local = [build_source(s, i, cfg.extract, task, task_config)
                      for i, s in enumerate(cfg.resolved_sources()) if s.type in LOCAL_SOURCES]
        self.judge_source = cfg.judge  # genrm or reward_model: scored on the judge's engine
        self.uses_judge = self.judge_source is not None
        self.accuracy = cfg.accuracy_source
        if self.uses_judge and judge_path is None:
            raise ValueError(f"the {self.judge_source.type} reward source needs its model")
        self.judge_path = judge_path

    def score(self, groups) -> tuple[list[float], list[float], dict[str, tuple[float, float]]]:
        """The training reward of every response of ``groups`` (SampleGroup-like: ``row``,
        ``texts``, and ``genrm`` once judged), prompt-major.

        Returns:
            (rewards: the weighted sum of the sources, accuracy: the accuracy source's scores,
            sums: (sum, count) metrics, see the module docstring).
        """
        items = [RewardItem(g.row.question, t, g.row.entry) for g in groups for t in g.texts]
        total, by_name, sums = [0.0] * len(items), {}, {}
        for src in self.local:
            out = src.score(items)
            by_name[src.name] = out.scores
            sums[f"reward_{src.name}_errors"] = (float(out.errors), 1.0)
            sums.update({f"reward_{src.name}_{k}": (float(v), 1.0) for k, v in out.counters.items()})
            total = [t + src.weight * x for t, x in zip(total, out.scores)]
        if self.uses_judge:
            judged = by_name[self.judge_source.name] = [s for g in groups for s in g.genrm]
            sums.update(self.judge_sums(groups))
            total = [t + self.judge_source.weight * x for t, x in zip(total, judged)]
        sums.update({f"reward_{name}_mean": (sum(x), float(len(x))) for name, x in by_name.items()})
        return total, by_name[self.accuracy], sums

    def accuracy_scores(self, rows, texts: list[str]) -> list[float]:
        """The accuracy source's score of each response (``texts[i]`` answers ``rows[i]``)."""
        src = next(s for s in self.local if s.name == self.accuracy)
        return src.score([RewardItem(r.question, t, r.entry) for r, t in zip(rows, texts)]).scores

    def make_judge(self, seed: int, tp: int = 1):
        """Build the judge: for a genrm source a vLLM engine of the judge model (collective, see
        :mod:`yatt.rollout.vllm_engine`) wrapped in a :class:`~yatt.reward.genrm.GenRMJudge`, for a
        reward_model source a :class:`~yatt.reward.reward_model.RewardModelScorer` (a vLLM pooling
        engine, as collective). ``tp``: ranks per judge engine (consecutive ranks, as
        ``rollout.tp``; :mod:`yatt.rollout.tp_group`). Shut it down with ``judge.engine.shutdown()``."""
        from transformers import AutoTokenizer

        from yatt.reward.genrm import GenRMJudge
        from yatt.reward.reward_model import RewardModelScorer
        from yatt.rollout.vllm_engine import VLLMEngine

        src = self.judge_source
        if src.type == "reward_model":
            return RewardModelScorer(str(self.judge_path), src.batch_size, src.max_length,
                                     src.kv_cache_memory_bytes, progress=self.progress, tp=tp)

        g = self.cfg.genrm
        engine = VLLMEngine(str(self.judge_path), tp=tp, max_model_len=g.max_model_len,
                            kv_cache_memory_bytes=g.kv_cache_memory_bytes, seed=seed, progress=self.progress)
        return GenRMJudge(engine, AutoTokenizer.from_pretrained(self.judge_path), template=g.template,
                          mode=g.mode, k=g.k, max_tokens=g.max_tokens, temperature=g.temperature,
                          timeout_s=g.timeout_s, unparsable_score=g.unparsable_score, seed=seed)

    def judge_groups(self, judge, groups) -> None:
        """Judge every response of ``groups`` (SampleGroup-like: ``row``, ``texts``) in one batch.

        Sets each group's ``genrm`` (one score per response: in [0, 1] from a GenRM, a reward
        model's logit), ``unparsable`` and ``timed_out`` (GenRM judgements counted as such; a
        timed-out one is also unparsable).
        """
        from yatt.reward.genrm import JudgeItem

        items = [JudgeItem(g.row.question, t, g.row.answer, getattr(g.row, "messages", None))
                 for g in groups for t in g.texts]
        results = iter(judge.score(items))
        for g in groups:
            mine = [next(results) for _ in g.texts]
            g.genrm = [r.score for r in mine]
            g.unparsable = sum(r.unparsable for r in mine)
            g.timed_out = sum(r.timed_out for r in mine)

    def judge_sums(self, groups) -> dict[str, tuple[float, float]]:
        """(sum, count) counters of judged groups: ``reward_<judge>_errors`` (a GenRM's
        unparsable judgements; a reward model has none), and for a GenRM ``genrm_unparsable``
        and ``genrm_timed_out``."""
        unparsable = float(sum(g.unparsable for g in groups))
        sums = {f"reward_{self.judge_source.name}_errors": (unparsable, 1.0)}
        if self.judge_source.type == "genrm":
            sums.update(genrm_unparsable=(unparsable, 1.0),
                        genrm_timed_out=(float(sum(g.timed_out for g in groups)), 1.0))
        return sums
