"""Reward sources (``reward.sources``): user functions by import path, math-verify, exact and regex
match, the weighted mix with per-source metrics, and the migration of ``reward.type`` recipes."""
from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest

from yatt.config import ConfigError, load_config
from yatt.reward.function import FunctionReward
from yatt.reward.item import RewardItem
from yatt.reward.scorer import StepScorer
from yatt.reward.verify import MatchReward, MathVerifyReward

RECIPE = "configs/grpo_smollm2.yaml"


def _items(responses, row=None):
    return [RewardItem("q", r, row or {"answer": "7"}) for r in responses]


@pytest.mark.parametrize("path", ["reward_fns:length", "reward_fns:async_length"])
def test_per_response_function(path):
    out = FunctionReward(path).score(_items(["ab", "abcd", ""]))
    assert (out.scores, out.errors, out.counters) == ([2.0, 4.0, 0.0], 0, {"timeouts": 0.0})


@pytest.mark.parametrize("path", ["reward_fns:lengths", "reward_fns:async_lengths"])
def test_batched_function_is_called_once_on_lists(path):
    out = FunctionReward(path, batched=True).score(_items(["ab", "abcd", ""]))
    assert (out.scores, out.errors) == ([2.0, 4.0, 0.0], 0)


def test_a_batch_of_the_wrong_length_is_an_error_for_every_response():
    out = FunctionReward("reward_fns:short_batch", batched=True, error_score=-1.0).score(_items(["a", "b"]))
    assert (out.scores, out.errors) == ([-1.0, -1.0], 2)


def test_failures_get_the_error_score_and_are_counted():
    """An exception, non-finite and non-numeric values and a time-out: error_score each, the rest
    scored; the slow call is left behind (the score returns in about the time-out)."""
    import time

    fn = FunctionReward("reward_fns:odd_values", timeout_s=0.2, error_score=-0.5)
    t0 = time.perf_counter()
    out = fn.score(_items(["raise", "nan", "inf", "str", "bool", "none", "sleep", "fine"]))
    assert time.perf_counter() - t0 < 4.0  # not the 5 s of the slow call
    assert out.scores == [-0.5] * 7 + [0.25] and out.errors == 7 and out.counters == {"timeouts": 1.0}


def test_async_time_out_is_cancelled_and_counted():
    out = FunctionReward("reward_fns:async_slow", timeout_s=0.1).score(_items(["sleep", "x"]))
    assert (out.scores, out.errors, out.counters) == ([0.0, 0.75], 1, {"timeouts": 1.0})


def test_the_row_carries_every_field_of_a_file_row(tmp_path):
    """A jsonl row's own fields (beyond question and answer) reach the function as written."""
    from transformers import AutoTokenizer

    from yatt.assets.data import load_prompts
    from yatt.assets.model import resolve_model

    path = tmp_path / "own.jsonl"
    path.write_text(json.dumps({"problem": "Say hi", "solution": "hi", "expected": "hello", "scale": 0.5}) + "\n")
    cfg = load_config(RECIPE, ["data.source=file", f"data.eval_files=[{path}]", f"data.train_files=[{path}]",
                               "data.question_key=problem", "data.answer_key=solution"]).data
    (row,), _ = load_prompts(cfg, AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")), "eval")
    assert row.entry["expected"] == "hello" and row.entry["answer"] == "hi" and row.question == "Say hi"
    out = FunctionReward("reward_fns:uses_row").score([RewardItem(row.question, t, row.entry) for t in ("hello", "hi")])
    assert out.scores == [0.5, 0.0]


@pytest.mark.parametrize("path, message", [
    ("reward_fns:nope", "has no attribute"), ("no_such_module:f", "No module named"),
    ("reward_fns:not_callable", "is a int, not callable")])
def test_a_function_that_cannot_be_loaded_names_the_key(path, message):
    with pytest.raises(ValueError, match=rf"reward.sources\[0\].path: .*{message}"):
        StepScorer(load_config(RECIPE, [f"reward.sources=[{{name: f, type: function, path: '{path}'}}]"]).reward,
                   "basic_arithmetic", {})


# the same value written differently (reference, response): math-verify scores 1
EQUAL = [("0.5", r"So the answer is $\frac{1}{2}$."), (r"\frac{1}{2}", "<answer>0.5</answer>"),
         ("1/2", r"\boxed{0.5}"), ("3", "3.0"), ("0.25", "<answer>25%</answer>"), ("12", "The total is 12 apples."),
         (r"\sqrt{4}", "2"), ("-4", "<answer> -4 </answer>")]
DIFFERENT = [("0.5", r"$\frac{1}{3}$"), ("12", "The total is 13."), ("3", "no number here"), ("2", "<answer></answer>")]


def test_math_verify_scores_equal_forms_right_and_others_wrong():
    mv = MathVerifyReward()
    right = mv.score([RewardItem("q", resp, {"answer": ref}) for ref, resp in EQUAL])
    wrong = mv.score([RewardItem("q", resp, {"answer": ref}) for ref, resp in DIFFERENT])
    assert right.scores == [1.0] * len(EQUAL) and right.errors == 0, right
    assert wrong.scores == [0.0] * len(DIFFERENT) and wrong.errors == 0, wrong


def test_math_verify_evaluates_an_expression_it_finds():
    """What docs/rewards.md warns of: math-verify takes an expression as an answer and compares its value,
    so on an arithmetic task a response that restates the question scores 1 (found in real SmolLM2
    samples on basic_arithmetic); the exact match does not credit it."""
    restated = _items(["Calculate 3 + 4.", "I think it is 3 + 4 but not sure"])
    assert MathVerifyReward().score(restated).scores == [1.0, 1.0]
    assert MatchReward().score(restated).scores == [0.0, 0.0]


def test_exact_and_regex_match():
    exact = MatchReward().score(_items(["<answer> 7 </answer>", "it is 7", "<answer>8</answer>", "none"]))
    assert exact.scores == [1.0, 1.0, 0.0, 0.0]
    cased = MatchReward(ignore_case=False).score(_items(["<answer>Paris</answer>"], {"answer": "paris"}))
    assert cased.scores == [0.0]
    tag = MatchReward(pattern=r"<answer>\s*{answer}\s*</answer>").score(_items(["<answer>7</answer>", "7"]))
    assert tag.scores == [1.0, 0.0]
    escaped = MatchReward(pattern="= {answer}$").score(_items(["1+1 = 2", "x = 1.5", "x = 1x5"], {"answer": "1.5"}))
    assert escaped.scores == [0.0, 1.0, 0.0]  # the answer's "." is matched literally


def _groups(texts, genrm=None, answer="7"):
    row = SimpleNamespace(question="Calculate 3 + 4.", entry={"question": "Calculate 3 + 4.", "answer": answer,
                                                              "metadata": {}})
    return [SimpleNamespace(row=row, texts=texts, genrm=genrm, unparsable=1 if genrm else 0, timed_out=0)]


def test_weighted_mix_with_per_source_metrics():
    cfg = load_config(RECIPE, ["reward.sources=[{name: correct, type: match, weight: 1.0}, "
                               "{name: tag, type: match, pattern: '<answer>', weight: 0.5}, "
                               "{name: size, type: function, path: 'reward_fns:length', weight: 0.0}]"]).reward
    scorer = StepScorer(cfg, "basic_arithmetic", {})
    rewards, accuracy, sums = scorer.score(_groups(["<answer>7</answer>", "7", "<answer>6</answer>"]))
    assert rewards == [1.5, 1.0, 0.5] and accuracy == [1.0, 1.0, 0.0]  # accuracy: the first source
    assert sums["reward_correct_mean"] == (2.0, 3.0) and sums["reward_tag_mean"] == (2.0, 3.0)
    assert sums["reward_size_mean"] == (37.0, 3.0) and sums["reward_size_errors"] == (0.0, 1.0)
    assert scorer.accuracy_scores([_groups([])[0].row] * 2, ["7", "6"]) == [1.0, 0.0]


@pytest.mark.parametrize("legacy, sources", [
    ("rule", "[{name: rule, type: rule}]"),
    ("genrm", "[{name: rule, type: rule, weight: 0.0}, {name: genrm, type: genrm}]"),
    ("genrm_with_rule", "[{name: rule, type: rule, weight: 0.75}, {name: genrm, type: genrm, weight: 0.25}]")])
def test_reward_type_recipes_are_the_same_sources(legacy, sources):
    """``reward.type`` keeps working: each value scores as the sources it stands for, bit for bit
    (``genrm_with_rule``: ``(1 - w) * rule + w * genrm`` with ``reward.genrm.weight`` = 0.25)."""
    groups = _groups(["<answer>7</answer>", "6", "7 or 8"], genrm=[0.2, 0.9, 0.6])
    scored = [StepScorer(load_config(RECIPE, ov).reward, "basic_arithmetic", {}, judge_path="judge").score(groups)
              for ov in ([f"reward.type={legacy}", "reward.genrm.weight=0.25"], [f"reward.sources={sources}"])]
    assert scored[0] == scored[1]
    rewards, accuracy, sums = scored[0]
    rule = [1.0, 0.0, 0.0]
    expected = {"rule": rule, "genrm": [0.2, 0.9, 0.6],
                "genrm_with_rule": [0.75 * r + 0.25 * j for r, j in zip(rule, [0.2, 0.9, 0.6])]}[legacy]
    assert rewards == expected and accuracy == rule and sums["reward_rule_mean"] == (1.0, 3.0)
    if legacy != "rule":
        assert sums["reward_genrm_errors"] == sums["genrm_unparsable"] == (1.0, 1.0)


def test_config_errors_name_the_key():
    cases = {
        "reward.sources=[{name: a, type: function, path: nocolon}]": "reward.sources[0].path",
        "reward.sources=[{name: a, type: rule}, {name: b, type: reward_modle}]": "reward.sources[1]",
        "reward.sources=[{name: a, type: rule}, {name: b, type: match, patern: x}]":
            "unknown config key 'reward.sources[1].patern' (did you mean 'reward.sources[1].pattern'?)",
        "reward.sources=[{name: a, type: rule}, {name: a, type: match}]": "the name 'a' is used twice",
        "reward.sources=[{name: a, type: rule, weight: 0}]": "every weight is 0",
        "reward.sources=[{name: j, type: genrm}, {name: k, type: genrm}]": "j and k both need a judge engine",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(RECIPE, [override])
    with pytest.raises(ConfigError, match="reward.sources replaces reward.type"):
        load_config(RECIPE, ["reward.type=genrm", "reward.sources=[{name: a, type: rule}]"])
    with pytest.raises(ConfigError, match="reward.accuracy: 'b' names no source"):
        load_config(RECIPE, ["reward.sources=[{name: a, type: rule}]", "reward.accuracy=b"])
    with pytest.raises(ConfigError, match="no reward source is a judge"):
        load_config(RECIPE, ["reward.sources=[{name: a, type: rule}]", "placement.mode=partial_colocate"])
    with pytest.raises(ValueError, match=r"reward.sources\[0\].pattern: not a regular expression"):
        StepScorer(load_config(RECIPE, ["reward.sources=[{name: a, type: match, pattern: '(x'}]"]).reward,
                   "basic_arithmetic", {})


def test_a_judge_alone_adds_the_rule_scorer_for_accuracy_and_takes_its_model():
    cfg = load_config(RECIPE, ["reward.sources=[{name: judge, type: genrm, model: my/judge}]"]).reward
    assert [(s.name, s.weight) for s in cfg.resolved_sources()] == [("judge", 1.0), ("rule", 0.0)]
    assert cfg.accuracy_source == "rule" and cfg.genrm.model == cfg.judge_model == "my/judge"
    assert math.isclose(cfg.resolved_sources()[0].weight, 1.0)


def test_math_verify_on_reasoning_gym_rows_credits_forms_the_task_scorer_misses():
    """Real rows of reasoning-gym's math tasks: an answer in another form (a decimal for a
    fraction, a thousands separator, LaTeX in prose) scores 1 with math-verify, where the task's
    own scorer gives its 0.01 for a malformed answer; wrong values score 0 with both."""
    import reasoning_gym as rg

    from yatt.reward.rule import RuleReward

    frac = rg.create_dataset("fraction_simplification", size=2, seed=0)
    gsm = rg.create_dataset("gsm_symbolic", size=1, seed=0)
    assert (frac[0]["answer"], frac[1]["answer"], gsm[0]["answer"]) == (r"$\dfrac{79}{173}$", "138/583", "28080")
    cases = [  # (task, row, response, math-verify's score, the task scorer's)
        ("fraction_simplification", frac[0], "<answer>0.4566473988</answer>", 1.0, 0.01),
        ("fraction_simplification", frac[1], r"The answer is $\frac{138}{583}$", 1.0, 0.01),
        ("fraction_simplification", frac[0], "<answer>79/173</answer>", 1.0, 1.0),
        ("fraction_simplification", frac[0], "<answer>138/583</answer>", 0.0, 0.05),
        ("gsm_symbolic", gsm[0], "<answer>28,080</answer>", 1.0, 0.01),
        ("gsm_symbolic", gsm[0], "<answer>28080.0</answer>", 1.0, 1.0),
        ("gsm_symbolic", gsm[0], "So he earns 28000.", 0.0, 0.01),
    ]
    mv = MathVerifyReward()
    for task, row, response, math_score, rule_score in cases:
        assert mv.score([RewardItem(row["question"], response, row)]).scores == [math_score], response
        assert RuleReward(task)(response, row) == rule_score, response


def test_reward_model_engine_scores_the_transformers_logit(tiny_rm):
    """A one-label sequence classifier served by vLLM's pooling runner gives, per response, the
    logit that transformers' forward of the same folder gives at the last token (fp32, within
    1e-4), alone or batched with longer and shorter ones, different for different responses."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from yatt.reward.genrm import JudgeItem
    from yatt.reward.reward_model import RewardModelScorer

    rm = RewardModelScorer(str(tiny_rm), batch_size=3)
    items = [JudgeItem("What is 3 + 4?", r, "7") for r in
             ["7", "It is seven.", "The answer is 7 because 3 + 4 = 7, as counting shows.", "8", ""]]
    batched = [r.score for r in rm.score(items)]
    alone = [rm.score([it])[0].score for it in items]
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_rm, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = [float(hf(input_ids=torch.tensor([rm._ids(it)])).logits[0, 0]) for it in items]
    assert all(math.isfinite(s) for s in batched) and len({round(s, 4) for s in batched}) == len(items)
    assert batched == pytest.approx(ref, abs=1e-4) and alone == pytest.approx(ref, abs=1e-4)
    assert rm.score([]) == []
    rm.engine.shutdown()


def test_a_reward_model_has_one_label_and_the_job_one_judge(tmp_path):
    from conftest import trainer_tp as ref
    from yatt.reward.reward_model import RewardModelScorer

    ref.save_tiny_reward_model(tmp_path, num_labels=2)
    with pytest.raises(ValueError, match="2 labels; a reward model has one"):
        RewardModelScorer(str(tmp_path))
    rm = "{name: rm, type: reward_model, model: /x}"
    with pytest.raises(ConfigError, match="j and rm both need a judge engine"):
        load_config(RECIPE, [f"reward.sources=[{{name: j, type: genrm}}, {rm}]"])
    with pytest.raises(ConfigError, match="the reward_model source cannot score the evaluation"):
        load_config(RECIPE, [f"reward.sources=[{rm}]", "reward.accuracy=rm"])
    cfg = load_config(RECIPE, [f"reward.sources=[{rm}]"]).reward
    assert (cfg.judge.name, cfg.judge_model, cfg.accuracy_source) == ("rm", "/x", "rule")
