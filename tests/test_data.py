"""Prompt datasets, the controller shard and the rule reward on real inputs."""
import json

import pytest

from yatt.assets.data import load_prompts
from yatt.assets.model import resolve_model
from yatt.config import DataConfig
from yatt.controller.shard import PromptShard
from yatt.reward.rule import RuleReward, extract_answer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


def test_reasoning_gym_shards_are_disjoint_and_templated(tokenizer):
    cfg = DataConfig(task="basic_arithmetic", train_size=20, eval_size=10, seed=3)
    r0, s0 = load_prompts(cfg, tokenizer, "train", 0, 2)
    r1, s1 = load_prompts(cfg, tokenizer, "train", 1, 2)
    assert s0.kept + s1.kept == 20 and s0.skipped == {"missing_field": 0, "too_long": 0}
    assert not {r.entry["metadata"]["source_index"] for r in r0} & {r.entry["metadata"]["source_index"] for r in r1}
    text = tokenizer.decode(r0[0].prompt_ids)
    assert r0[0].question in text and text.rstrip().endswith("assistant")


def test_eval_split_is_held_out(tokenizer):
    cfg = DataConfig(task="basic_arithmetic", train_size=200, eval_size=200, seed=0,
                     task_config={"min_terms": 2, "max_terms": 2, "max_digits": 1})
    train, _ = load_prompts(cfg, tokenizer, "train")
    evals, stats = load_prompts(cfg, tokenizer, "eval")
    assert evals and not {r.question for r in train} & {r.question for r in evals}
    assert stats.rows == len(evals)


def test_bad_file_rows_are_skipped_and_counted(tokenizer, tmp_path):
    rows = [
        {"question": "What is 2 + 2?", "answer": "4"},
        {"question": "", "answer": "1"},
        {"answer": "3"},
        {"question": "What is 1 + 1?"},
        {"question": "word " * 500, "answer": "5"},
        {"question": "What is 3 + 3?", "answer": 6},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(source="file", train_files=[str(path)], max_prompt_len=64)
    kept, stats = load_prompts(cfg, tokenizer, "train")
    assert [r.answer for r in kept] == ["4", "6"]
    assert stats.rows == 6 and stats.kept == 2 and stats.skipped == {"missing_field": 3, "too_long": 1}


def test_parquet_files(tokenizer, tmp_path):
    import datasets

    datasets.Dataset.from_list([{"q": "What is 5 - 1?", "a": "4"}] * 4).to_parquet(str(tmp_path / "d.parquet"))
    cfg = DataConfig(source="file", train_files=[str(tmp_path / "d.parquet")], question_key="q", answer_key="a")
    kept, stats = load_prompts(cfg, tokenizer, "train", 1, 2)
    assert len(kept) == 2 and stats.kept == 2


def test_shard_epochs_cover_every_row_and_resume():
    shard = PromptShard(list(range(10)), batch_size=4, seed=1)
    first = shard.next_batch() + shard.next_batch()
    state = shard.state_dict()
    rest = shard.next_batch()
    assert sorted(first + rest[:2]) == list(range(10))  # epoch 0 is a permutation
    resumed = PromptShard(list(range(10)), batch_size=4, seed=1)
    resumed.load_state_dict(state)
    assert resumed.next_batch() == rest
    with pytest.raises(ValueError, match="empty"):
        PromptShard([], 2, 0)


@pytest.mark.parametrize("text, expected", [
    ("so <answer>12</answer>", "12"),
    ("<answer>1</answer> no wait <answer> 7 </answer>", "7"),
    ("3 + 4 = 7.", "7"),
    ("The result is -15", "-15"),
    ("no digits here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_rule_reward_uses_reasoning_gym_scorer():
    reward = RuleReward("basic_arithmetic")
    entry = {"question": "Calculate 3 + 4.", "answer": "7", "metadata": {}}
    assert reward("3 + 4 = 7", entry) == 1.0
    assert reward("3 + 4 = 8", entry) == 0.0
    assert reward("<answer>7</answer>", entry) == 1.0
    assert extract_answer("3 + 4 = 7", "answer_tag") is None
    assert RuleReward("basic_arithmetic", extract="answer_tag")("3 + 4 = 7", entry) == 0.0
