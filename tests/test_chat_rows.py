"""Chat-format rows (``data.messages_key``, yatt/assets/data.py): a conversation instead of a
question string, prompted through the tokenizer's chat template in every stage; malformed
conversations skipped and counted by reason; SFT, DPO and RM samples from chat rows; and one short
RL and one SFT job on a chat jsonl with malformed rows."""
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from conftest import JobSpec, TinyModels, hosted_jobs, metric_records, write_jsonl
from yatt.assets.data import SKIP_REASONS, PromptStream, _check, load_prompts
from yatt.assets.model import SMOLLM2, resolve_model
from yatt.config import DataConfig, SftConfig
from yatt.controller.shard import PromptShard
from yatt.reward.reward_model import chat_ids
from yatt.stages.dpo import pair_samples
from yatt.stages.pairs import make_pairs
from yatt.stages.rm import rm_samples
from yatt.stages.sft import sft_samples


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))


def _template(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


SYS = {"role": "system", "content": "Answer in <answer> tags."}
USER = {"role": "user", "content": "What is 2 + 3?"}


def _turn(role, content):
    return {"role": role, "content": content}


def test_chat_rows_are_prompted_by_the_chat_template(tok, tmp_path):
    """A conversation's prompt ids are the chat template of its turns (generation prompt added);
    the question is its last user turn; ``data.system_prompt`` goes first only when the
    conversation has no system turn; a row without the messages key (or with null) is a question row."""
    multi = [SYS, _turn("user", "What is 1 + 1?"), _turn("assistant", "<answer>2</answer>"), USER]
    tool = [USER, _turn("assistant", "calc(2 + 3)"), _turn("tool", "5")]
    rows = [{"messages": [USER], "answer": "5"}, {"messages": multi, "answer": 5}, {"messages": tool, "answer": "5"},
            {"messages": None, "question": "What is 4 + 4?", "answer": "8"}]
    cfg = DataConfig(source="file", eval_files=[write_jsonl(tmp_path / "chat.jsonl", rows)], system_prompt="Be brief.")
    kept, stats = load_prompts(cfg, tok, "eval")
    assert stats.kept == 4 and not any(stats.skipped.values())
    brief = _turn("system", "Be brief.")
    expected = [[brief, USER], multi, [brief, *tool], [brief, _turn("user", "What is 4 + 4?")]]
    assert [r.prompt_ids for r in kept] == [_template(tok, m) for m in expected]
    assert [r.messages for r in kept] == expected
    assert [r.question for r in kept] == ["What is 2 + 3?", "What is 2 + 3?", "What is 2 + 3?", "What is 4 + 4?"]
    assert [r.answer for r in kept] == ["5", "5", "5", "8"] and kept[1].entry["messages"] == multi
    assert all(r.target is None for r in kept)
    plain, _ = load_prompts(cfg.model_copy(update={"system_prompt": ""}), tok, "eval")
    assert plain[0].prompt_ids == _template(tok, [USER])  # the chat template's own default system turn


def test_parquet_chat_rows_beside_question_rows(tok, tmp_path):
    """A parquet file mixing chat and question rows (the question rows' ``messages`` read back as
    null, the chat rows' ``question``): each row is prompted as what it holds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [SYS, USER], "question": None, "answer": "5"},
            {"messages": None, "question": "What is 4 + 4?", "answer": "8"}]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    kept, stats = load_prompts(DataConfig(source="file", eval_files=[str(path)]), tok, "eval")
    assert stats.kept == 2 and [r.question for r in kept] == ["What is 2 + 3?", "What is 4 + 4?"]
    assert [r.prompt_ids for r in kept] == [_template(tok, [SYS, USER]), _template(tok, [_turn("user", "What is 4 + 4?")])]


def test_malformed_conversations_are_skipped_and_counted(tok, tmp_path, caplog):
    """Each malformed conversation is one ``bad_messages`` skip (warned once per file, naming what is
    wrong); a final assistant turn is a target for stage sft (``targets``) and a bad prompt otherwise."""
    answer = {"answer": "5"}
    rows = [
        {"messages": [USER], **answer},
        {"messages": "What is 2 + 3?", **answer},                             # 2: not a list
        {"messages": [USER, "hi"], **answer},                                 # 3: not a message object
        {"messages": [_turn("bot", "hi"), USER], **answer},                   # 4: unknown role
        {"messages": [{"content": "hi"}], **answer},                          # 5: no role
        {"messages": [_turn("user", ["What", "is"])], **answer},              # 6: content not a string
        {"messages": [{"role": "user"}], **answer},                           # 7: no content
        {"messages": [], **answer},                                           # 8: no user turn
        {"messages": [SYS], **answer},                                        # 9: no user turn
        {"messages": [_turn("user", "  ")], **answer},                        # 10: empty last user turn
        {"messages": [USER, _turn("assistant", "<answer>5</answer>")], **answer},  # 11: ends with assistant
        {"messages": [USER]},                                                 # 12: missing_field (answer)
        {"messages": [USER], "answer": ["5"]},                                # 13: wrong_type (answer)
        {"chat": [USER], **answer},                                           # 14: missing_field (no question)
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = DataConfig(source="file", train_files=[path], eval_files=[path])
    with caplog.at_level("WARNING", logger="yatt"):
        kept, stats = load_prompts(cfg, tok, "train")
    assert len(kept) == 1 and stats.rows == 14
    assert stats.skipped == {r: {"bad_messages": 10, "missing_field": 2, "wrong_type": 1}.get(r, 0) for r in SKIP_REASONS}
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: skipping")]
    assert len(warned) == 3  # one per reason in this file
    assert any(f"{path}, line 2 (bad_messages: 'messages' is a str, not a list of messages)" in m for m in warned)
    assert _check(cfg, rows[13]) == ("missing_field", "no 'question' (nor 'messages')")
    details = [_detail(cfg, r) for r in rows[1:11]]
    assert details == ["'messages' is a str, not a list of messages", "messages[1] is a str, not a message object",
                       "messages[0] has role 'bot', not one of system/user/assistant/tool",
                       "messages[0] has role None, not one of system/user/assistant/tool",
                       "messages[0] has content of type list, not a string",
                       "messages[0] has content of type NoneType, not a string",
                       "'messages' has no user turn", "'messages' has no user turn",
                       "'messages' has an empty last user turn",
                       "'messages' ends with a 'assistant' turn; a prompt ends with a user or tool turn (a final "
                       "assistant turn is a target: stage sft only)"]
    sft, sft_stats = load_prompts(cfg, tok, "eval", targets=True)  # stage sft: row 11's last turn is its target
    assert len(sft) == 2 and sft_stats.skipped["bad_messages"] == 9
    assert sft[1].target == "<answer>5</answer>" and sft[1].prompt_ids == _template(tok, [USER])
    assert _detail(cfg, {"messages": [_turn("assistant", "5")], **answer}, targets=True) == \
        "'messages' has no user turn before its final assistant turn"
    off = cfg.model_copy(update={"messages_key": None})  # conversations are not read at all
    assert load_prompts(off, tok, "train")[1].skipped["missing_field"] == 14


def _detail(cfg, row, targets=False) -> str:
    """The detail of the ``bad_messages`` skip of ``row`` (what is wrong with its conversation)."""
    reason, detail = _check(cfg, row, targets)
    assert reason == "bad_messages"
    return detail


def test_a_template_that_rejects_a_conversation_is_a_bad_messages_skip(tok, tmp_path):
    """A chat template that raises on a conversation (as many do for roles out of order) skips the
    row (``bad_messages``), not the job."""
    from copy import deepcopy

    strict = deepcopy(tok)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}"
                            "{% endif %}{{ m['content'] }}{% endfor %}")
    rows = [{"messages": [USER], "answer": "5"}, {"messages": [USER, _turn("tool", "5")], "answer": "5"}]
    kept, stats = load_prompts(DataConfig(source="file", eval_files=[write_jsonl(tmp_path / "t.jsonl", rows)]), strict, "eval")
    assert len(kept) == 1 and stats.skipped["bad_messages"] == 1


def test_a_file_of_only_bad_conversations_stops_the_job_naming_messages_key(tok, tmp_path):
    """A file none of whose conversations is usable (here: ShareGPT's role names) is a wrong file or
    key: its first whole epoch stops the job, the message naming data.messages_key."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": [USER], "answer": "5"}] * 3)
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"messages": [_turn("human", "hi")], "answer": "1"}] * 3)
    shard = PromptShard(PromptStream(DataConfig(source="file", train_files=[good, wrong]), tok), batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"no usable row in .*wrong\.jsonl.*bad_messages.*messages_key='messages'"):
        for _ in range(3):
            shard.next_batch()


def test_sft_learns_a_conversations_final_assistant_turn(tok, tmp_path):
    """stage sft: the target of a chat row that ends with an assistant turn is that turn (the prompt
    the turns before it), ahead of the template; a chat row ending with a user turn falls back to
    ``sft.response_template``; an empty final turn is no target."""
    rows = [{"messages": [SYS, USER, _turn("assistant", "It is 5.")], "answer": "5"},
            {"messages": [USER], "answer": "5"},
            {"messages": [USER, _turn("assistant", " ")], "answer": "5"}]
    cfg = DataConfig(source="file", train_files=[write_jsonl(tmp_path / "sft.jsonl", rows)])
    kept, _ = load_prompts(cfg, tok, "train", targets=True)
    samples, skipped = sft_samples(kept, SftConfig(), tok, max_len=256)
    assert skipped == 1 and len(samples) == 2
    assert samples[0].prompt_ids == _template(tok, [SYS, USER])
    assert tok.decode(samples[0].response_ids) == "It is 5." + tok.eos_token
    assert tok.decode(samples[1].response_ids) == "<answer>5</answer>" + tok.eos_token


def _pair_row(tok, prompt, chosen, rejected):
    return SimpleNamespace(prompt_ids=_template(tok, prompt), question=prompt[-1]["content"], answer="5",
                           messages=prompt, entry={"answer": "5", "chosen": chosen, "rejected": rejected})


def test_dpo_and_rm_pairs_from_chat_rows(tok):
    """DPO and RM: chosen/rejected as strings or as messages (the final assistant turn's content);
    DPO's prompt is the row's templated conversation, RM's layout the conversation and the response
    through the template; a list that does not end with an assistant turn is no response."""
    prompt = [SYS, USER]
    as_messages = _pair_row(tok, prompt, [USER, _turn("assistant", "<answer>5</answer>")],
                            [USER, _turn("assistant", "<answer>6</answer>")])
    as_text = _pair_row(tok, prompt, "<answer>5</answer>", "<answer>6</answer>")
    bad = [_pair_row(tok, prompt, [USER], "6"), _pair_row(tok, prompt, [USER, _turn("assistant", "")], "6"),
           _pair_row(tok, prompt, [USER, _turn("assistant", 5)], "6"), _pair_row(tok, prompt, ["5"], "6")]
    dpo, skipped = pair_samples([as_messages, as_text, *bad], DataConfig(), tok, max_len=256)
    assert skipped == 4 and len(dpo) == 4
    assert [s.prompt_ids for s in dpo] == [_template(tok, prompt)] * 4
    assert [tok.decode(s.response_ids) for s in dpo] == [f"<answer>{a}</answer>{tok.eos_token}" for a in (5, 6, 5, 6)]
    rm, skipped = rm_samples([as_messages, *bad], DataConfig(), tok, max_len=256)
    assert skipped == 4 and len(rm) == 2
    for s, a in zip(rm, (5, 6)):
        layout = list(tok.apply_chat_template([*prompt, _turn("assistant", f"<answer>{a}</answer>")], tokenize=True,
                                              return_dict=False))
        assert s.prompt_ids == layout == chat_ids(tok, prompt, f"<answer>{a}</answer>", 256)
    question_row = SimpleNamespace(question="What is 2 + 3?", answer="5", entry={"chosen": "5", "rejected": "6"})
    assert rm_samples([question_row], DataConfig(), tok, 256)[0][0].prompt_ids == chat_ids(tok, "What is 2 + 3?", "5", 256)


def test_pairs_of_chat_rows_keep_their_conversation():
    """``yatt.stages.pairs``: a chat row's pairs carry its prompt conversation, so DPO and RM prompt
    them as its samples were; a question row's pairs do not."""
    chat = SimpleNamespace(question="What is 2 + 3?", answer="5", messages=[SYS, USER], entry={"messages": [USER]})
    plain = SimpleNamespace(question="q", answer="1", messages=[_turn("user", "q")], entry={})
    pairs = make_pairs([chat, plain], [["5", "6"], ["1", "2"]], [[1.0, 0.0], [1.0, 0.0]], messages_key="messages")
    assert pairs == [{"prompt": "What is 2 + 3?", "messages": [SYS, USER], "chosen": "5", "rejected": "6", "answer": "5"},
                     {"prompt": "q", "chosen": "1", "rejected": "2", "answer": "1"}]


# -- one short RL and one SFT job on a chat jsonl ------------------------------------------------

GOOD = [{"messages": [SYS, _turn("user", f"Calculate {i} + 1.")], "answer": str(i + 1)} for i in range(4)]
BAD = ["not json", {"messages": [_turn("bot", "hi")], "answer": "1"}, {"messages": [SYS], "answer": "1"},
       {"messages": [_turn("user", 7)], "answer": "1"}]  # not_json, then three bad_messages


TRAILING = {"messages": [_turn("user", "Calculate 1 + 1."), _turn("assistant", "2")], "answer": "2"}
SFT_ROWS = [{**r, "messages": [*r["messages"], _turn("assistant", f"<answer>{r['answer']}</answer>")]} for r in GOOD]


@hosted_jobs
def chat_jobs(root: Path, models: TinyModels) -> dict[str, JobSpec]:
    """2-rank jobs on the tiny policy with chat train and eval rows (conftest's ``hosted`` fixture
    runs them with the other modules' jobs): ``chat_rl`` (GRPO) and ``chat_sft``."""
    data = {"rl": ("configs/grpo_smollm2.yaml", GOOD + BAD + [TRAILING], GOOD + BAD[1:],
                   ["rollout.n=2", "rollout.max_tokens=8"]),
            "sft": ("configs/sft_smollm2.yaml", SFT_ROWS + BAD, SFT_ROWS, [])}
    return {f"chat_{name}": JobSpec(recipe, [
        f"model.path={models.policy}", "data.source=file",
        f"data.train_files=[{write_jsonl(root / f'chat_{name}_train.jsonl', train)}]",
        f"data.eval_files=[{write_jsonl(root / f'chat_{name}_eval.jsonl', evals)}]", "trainer.total_steps=2",
        "trainer.prompts_per_rank=2", "eval.max_tokens=4", "log.progress=false", "checkpoint.every_steps=0", *extra])
        for name, (recipe, train, evals, extra) in data.items()}


@pytest.mark.slow
@pytest.mark.mpi
def test_rl_job_on_chat_rows_counts_the_bad_ones(hosted):
    """Two GRPO steps on a chat jsonl, 2 ranks: 8 prompts drawn from 4 good rows cross the epoch, so
    every bad row (one not JSON, three bad conversations, one that ends with an assistant turn) has
    been counted (and those of epoch 1 drawn so far); the eval split's bad conversations are
    counted by reason at start."""
    job = hosted("chat_rl")
    records, log = metric_records(job.out, drop=()), job.log
    train = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["reward_mean"]) for r in train)
    assert 5 <= train[-1]["data_rows_skipped"] <= 10, train  # all of epoch 0's, and epoch 1's drawn so far
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
    assert "'eval_kept': 4" in log and "'eval_skipped_bad_messages': 3" in log, log[-3000:]
    assert "(bad_messages: messages[0] has role 'bot'" in log and "(not_json:" in log


@pytest.mark.slow
@pytest.mark.mpi
def test_sft_job_learns_chat_targets_and_counts_the_bad_rows(hosted):
    """Two SFT steps on a chat jsonl whose rows end with the assistant turn to learn, 2 ranks: the
    loss is finite and every bad row is counted (8 rows drawn from 4 good ones cross the epoch); the
    held-out chat rows (with their final turns) are evaluated."""
    records = metric_records(hosted("chat_sft").out, drop=())
    train = [r for r in records if "sft_loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["sft_loss"]) and r["grad_norm"] > 0
                                                        for r in train)
    assert 4 <= train[-1]["data_rows_skipped"] <= 8 and sum(r["sft_rows_skipped"] for r in train) == 0, train
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
