"""Prompt datasets, the controller shard and the rule reward on real inputs."""
import json

import pytest

from yatt.assets.data import PromptStream, load_prompts
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


def _write(path, rows):
    """rows -> a jsonl or parquet file at ``path``."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_parquet_files(tokenizer, tmp_path):
    path = _write(tmp_path / "d.parquet", [{"q": "What is 5 - 1?", "a": "4"}] * 4)
    cfg = DataConfig(source="file", train_files=[path], question_key="q", answer_key="a")
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


def _epoch_zero(shard):
    """Questions of the shard's first epoch, drawn one at a time."""
    out = []
    while not (batch := shard.next_batch()) or shard.epoch == 0:
        out += [r.question for r in batch]
    return out


GOOD = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
BAD = [{"question": "", "answer": "1"}, {"answer": "3"}, {"question": "What is 1 + 1?"}, {"question": "word " * 500, "answer": "5"}]


@pytest.mark.parametrize("names", [["t.jsonl"], ["a.parquet", "b.parquet"], ["a.jsonl", "b.jsonl", "c.jsonl"]])
def test_stream_files_rank_shards_disjoint_bad_rows_counted(tokenizer, tmp_path, names):
    """Two ranks stream disjoint parts (whole files when they divide, else every other row) that
    cover every good row once per epoch; bad rows are skipped and counted, epochs reshuffle."""
    rows = GOOD + BAD
    files = [_write(tmp_path / name, rows[i::len(names)]) for i, name in enumerate(names)]
    cfg = DataConfig(source="file", train_files=files, max_prompt_len=64)
    seen, skipped = [], {"missing_field": 0, "too_long": 0}
    for rank in (0, 1):
        stream = PromptStream(cfg, tokenizer, rank, 2, buffer_size=8)
        shard = PromptShard(stream, batch_size=1, seed=rank)
        seen.append(_epoch_zero(shard))
        counted = PromptStream(cfg, tokenizer, rank, 2)
        assert sum(counted.prepare(raw) is not None for raw in counted.rows(0, 0)) == len(seen[-1])
        skipped = {k: v + counted.stats.skipped[k] for k, v in skipped.items()}
        again = _epoch_zero(PromptShard(stream, batch_size=1, seed=rank + 10))
        assert sorted(again) == sorted(seen[-1]) and again != seen[-1]  # same rows, other order
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == sorted(r["question"] for r in GOOD)
    assert skipped == {"missing_field": 3, "too_long": 1}  # every bad row, on one rank


def test_stream_reasoning_gym_generates_only_its_rows(tokenizer):
    cfg = DataConfig(task="basic_arithmetic", train_size=20, seed=3)
    idx = []
    for rank in (0, 1):
        stream = PromptStream(cfg, tokenizer, rank, 2)
        rows = PromptShard(stream, batch_size=10, seed=rank).next_batch()
        assert stream.stats.rows == 10 and tokenizer.decode(rows[0].prompt_ids).rstrip().endswith("assistant")
        idx.append({r.entry["metadata"]["source_index"] for r in rows})
    assert idx[0] == set(range(0, 20, 2)) and idx[1] == set(range(1, 20, 2))


@pytest.mark.parametrize("source", ["file", "reasoning_gym"])
def test_stream_resume_is_exact_across_epochs(tokenizer, tmp_path, source):
    """A shard rebuilt from its state dict serves the same batches as the uninterrupted one,
    from mid-epoch into the next epoch (13 good rows per epoch here, batches of 5)."""
    if source == "file":
        cfg = DataConfig(source="file", train_files=[_write(tmp_path / "t.jsonl", GOOD[:13] + BAD)], max_prompt_len=64)
    else:
        cfg = DataConfig(task="basic_arithmetic", train_size=13, seed=1)

    def shard():
        return PromptShard(PromptStream(cfg, tokenizer, buffer_size=4), batch_size=5, seed=7)

    run = shard()
    run.next_batch(), run.next_batch()
    state = run.state_dict()
    assert state["epoch"] == 0
    expected = [[r.question for r in run.next_batch()] for _ in range(3)]
    assert run.epoch == 1
    resumed = shard()
    resumed.load_state_dict(state)
    assert [[r.question for r in resumed.next_batch()] for _ in range(3)] == expected
    mid_next = shard()  # and from a state inside the next epoch
    mid_next.load_state_dict(run.state_dict())
    assert [r.question for r in mid_next.next_batch()] == [r.question for r in run.next_batch()]


def test_stream_empty_shard_errors(tokenizer, tmp_path):
    one = DataConfig(source="file", train_files=[_write(tmp_path / "t.jsonl", GOOD[:1])])
    PromptShard(PromptStream(one, tokenizer, 0, 2), 2, 0)
    with pytest.raises(ValueError, match="empty"):
        PromptShard(PromptStream(one, tokenizer, 1, 2), 2, 0)
    with pytest.raises(ValueError, match="empty"):
        PromptShard(PromptStream(DataConfig(train_size=1), tokenizer, 1, 2), 2, 0)
    bad = DataConfig(source="file", train_files=[_write(tmp_path / "bad.jsonl", BAD)], max_prompt_len=64)
    with pytest.raises(ValueError, match="skipped"):
        PromptShard(PromptStream(bad, tokenizer), 2, 0).next_batch()
    with pytest.raises(ValueError, match="train_files"):
        PromptStream(DataConfig(source="file"), tokenizer)


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
