"""Prompt datasets, the controller shard and the rule reward on real inputs."""
import json

import pytest

from yatt.assets.data import SKIP_REASONS, PromptStream, load_prompts
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
    assert s0.kept + s1.kept == 20 and not any(s0.skipped.values()) and set(s0.skipped) == set(SKIP_REASONS)
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


def _counts(**nonzero) -> dict[str, int]:
    return {reason: nonzero.get(reason, 0) for reason in SKIP_REASONS}


def test_bad_file_rows_are_skipped_and_counted(tokenizer, tmp_path, caplog):
    """Every kind of malformed jsonl row is skipped and counted by reason; each reason is warned
    about once per file, naming the file and the line."""
    lines = [
        json.dumps({"question": "What is 2 + 2?", "answer": "4"}),
        json.dumps({"question": "", "answer": "1"}),            # 2: empty_field
        json.dumps({"answer": "3"}),                            # 3: missing_field
        json.dumps({"question": "What is 1 + 1?"}),             # 4: missing_field
        json.dumps({"question": "word " * 500, "answer": "5"}),  # 5: too_long
        '{"question": "What is 5 + 5?", "answer": "10"',        # 6: not_json (cut short)
        json.dumps(["What is 7 + 7?", "14"]),                   # 7: not_json (not an object)
        json.dumps({"question": 12, "answer": "12"}),           # 8: wrong_type
        json.dumps({"question": "What is 9 + 9?", "answer": {"v": 18}}),  # 9: wrong_type
        json.dumps({"question": "   ", "answer": "0"}),         # 10: empty_field
        '{"question": "caf@", "answer": "1"}',                  # 11: not_json (Latin-1, not UTF-8)
        json.dumps({"question": "What is 3 + 3?", "answer": 6}),
        "not json at all",                                      # 13: not_json
    ]
    path = tmp_path / "train.jsonl"
    path.write_bytes("\n".join(lines).encode().replace(b"caf@", b"caf\xe9"))
    cfg = DataConfig(source="file", train_files=[str(path)], max_prompt_len=64)
    with caplog.at_level("WARNING", logger="yatt"):
        kept, stats = load_prompts(cfg, tokenizer, "train")
    assert [r.answer for r in kept] == ["4", "6"]
    assert stats.rows == 13 and stats.kept == 2
    assert stats.skipped == _counts(not_json=4, missing_field=2, wrong_type=2, empty_field=2, too_long=1)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: skipping")]
    assert len(warned) == 5  # one per reason in this file
    assert any(f"{path}, line 6 (not_json:" in m for m in warned), warned
    assert any(f"{path}, line 8 (wrong_type: 'question' has type int)" in m for m in warned), warned
    assert any(f"{path}, line 2 (empty_field" in m for m in warned), warned


def test_unreadable_parquet_batch_is_skipped_and_counted(tokenizer, tmp_path):
    """A parquet file cut short (its footer gone) is one ``unreadable`` skip; the healthy file
    beside it is read whole."""
    good = tmp_path / "good.parquet"
    _write(good, GOOD[:8])
    damaged = tmp_path / "damaged.parquet"
    data = good.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])  # the footer is gone: the file cannot be opened
    cfg = DataConfig(source="file", train_files=[str(good), str(damaged)], max_prompt_len=64)
    kept, stats = load_prompts(cfg, tokenizer, "train")
    assert len(kept) == 8 and stats.skipped == _counts(unreadable=1)


def test_a_file_with_no_usable_row_stops_the_job(tokenizer, tmp_path):
    """A few bad rows are skipped; a file none of whose rows is usable (here: the wrong key) is a
    mistake, and drawing its first whole epoch stops with a message naming the file and the keys."""
    good = _write(tmp_path / "good.jsonl", GOOD[:4])
    wrong = _write(tmp_path / "wrong.jsonl", [{"prompt": r["question"], "answer": r["answer"]} for r in GOOD[:4]])
    cfg = DataConfig(source="file", train_files=[good, wrong], max_prompt_len=64)
    shard = PromptShard(PromptStream(cfg, tokenizer), batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"no usable row in .*wrong\.jsonl.*missing_field.*question_key='question'"):
        for _ in range(5):
            shard.next_batch()


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
    seen, skipped = [], _counts()
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
    assert skipped == _counts(empty_field=1, missing_field=2, too_long=1)  # every bad row, on one rank


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


@pytest.mark.parametrize("overrides", [{"eval_size": 0}, {"source": "file", "eval_files": []}])
def test_no_eval_rows_means_no_eval(tokenizer, tmp_path, caplog, overrides):
    """``data.eval_size=0`` (or no eval files): the run has no eval rows and says so; the total of 0
    is what the loop's ``evaluate_at`` reads to write no eval record, not an accuracy of 0."""
    from yatt.config import Config
    from yatt.dist import RankInfo
    from yatt.job import _load_data

    train = _write(tmp_path / "t.jsonl", GOOD[:4])
    cfg = Config(data=DataConfig(train_files=[train], **overrides), output_dir=str(tmp_path / "run"))
    with caplog.at_level("WARNING", logger="yatt"):
        stream, evals, total = _load_data(cfg, tokenizer, RankInfo(0, 1, 0, "single"), (0,))
    assert evals == [] and total == 0 and isinstance(stream, PromptStream)
    assert any("eval: no eval rows" in r.getMessage() for r in caplog.records)


class _IndexSource:
    """Rows 0..n-1 dealt to ``rank`` of ``world`` as PromptStream deals a task's (``range(rank,
    n, world)``), each epoch a permutation; a row is its index."""

    def __init__(self, n: int, rank: int = 0, world: int = 1):
        self.n, self.indices = n, range(rank, n, world)

    def for_rank(self, rank: int, world: int) -> "_IndexSource":
        return _IndexSource(self.n, rank, world)

    def rows(self, seed: int, epoch: int):
        from yatt.assets.data import epoch_order

        return (self.indices[i] for i in epoch_order(len(self.indices), seed, epoch))

    def prepare(self, raw: int) -> int:
        return raw


@pytest.mark.parametrize("old,new,steps", [(2, 1, 4), (2, 3, 4), (3, 2, 8)])
def test_a_shard_resumed_on_another_world_size_draws_each_row_once_per_epoch(old, new, steps):
    """23 rows, shards of unequal size: after ``steps`` steps of 3 rows the old shards stand in
    different epochs. Resumed on ``new`` ranks, the rows left are drawn first, after which every row has been
    drawn exactly as often (the furthest shard's epoch count); then each new rank draws its own
    shard of the new world, each of its rows once per epoch. A checkpoint taken while the rows
    left are served resumes exactly on the new world size and is refused on yet another."""
    from collections import Counter

    from yatt.controller.shard import resharded_state

    n = 23
    shards = [PromptShard(_IndexSource(n, r, old), 3, seed=100 + r) for r in range(old)]
    drawn = Counter()
    for _ in range(steps):
        for shard in shards:
            drawn.update(shard.next_batch())
    states = [shard.state_dict() for shard in shards]
    assert len({st["epoch"] for st in states}) == 2  # one shard crossed into its next epoch
    furthest = max(st["epoch"] for st in states) + 1
    resumed = []
    for r in range(new):  # one row per draw: which rows came from the old shards is plain
        resumed.append(PromptShard(_IndexSource(n, r, new), 1, seed=200 + r))
        resumed[-1].load_state_dict(resharded_state(states, r, new, seed=200 + r))
    own = {r: [] for r in range(new)}  # each new rank's rows of its own first epoch
    draws = 0
    while any(shard.carry is not None for shard in resumed):
        if draws == 2:  # a checkpoint while the rows left are served
            mid = [shard.state_dict() for shard in resumed]
            again = [PromptShard(_IndexSource(n, r, new), 1, seed=200 + r) for r in range(new)]
            for shard, st in zip(again, mid):
                shard.load_state_dict(st)
            with pytest.raises(ValueError, match=f"resume it on {new} ranks"):
                resharded_state(mid, 0, new + 1, seed=0)
        for r, shard in enumerate(resumed):
            (row,) = shard.next_batch()
            if draws == 2:
                assert again[r].next_batch() == [row]
            (drawn.update([row]) if shard.carry is not None else own[r].append(row))
        draws += 1
    assert drawn == Counter({row: furthest for row in range(n)})
    for r, shard in enumerate(resumed):  # the rest of the new shard's first epoch
        assert shard.epoch == furthest
        own[r] += [shard.next_batch()[0] for _ in range(len(range(r, n, new)) - len(own[r]))]
        assert sorted(own[r]) == list(range(r, n, new))


def test_a_prompt_stream_for_another_rank_deals_that_ranks_rows(tokenizer):
    cfg = DataConfig(train_size=10)
    stream = PromptStream(cfg, tokenizer, 0, 2)
    other = stream.for_rank(1, 3)
    assert list(other.rows(5, 0)) == list(PromptStream(cfg, tokenizer, 1, 3).rows(5, 0))
    assert sorted(other.rows(5, 1)) == [1, 4, 7]
