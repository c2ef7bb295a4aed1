"""Multi-turn episodes (:mod:`yatt.rollout.episodes`) on a scripted engine and environment: the
token sequence and its masks, the limits that end an episode, and what reaches the sample."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from yatt.controller.batch import make_samples, pack_micro_batches
from yatt.env import StepResult as Result
from yatt.rollout.episodes import Limits, answer_ids, episode_rewards, episode_sums, run_episodes
from yatt.rollout.vllm_engine import Completion, SamplingSpec


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from yatt.assets.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


class ScriptedEngine:
    """Answers each context with the next scripted text of its episode (found by the question in
    the context), logprob -0.5 per token, ending with the end-of-turn token unless the cap cuts it."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tok, self.scripts, self.calls = tokenizer, scripts, []

    def generate(self, prompts, spec, max_tokens=None):
        self.calls.append((list(map(list, prompts)), spec, max_tokens))
        out = []
        for i, p in enumerate(prompts):
            text = self.tok.decode(p)
            key = next(q for q in sorted(self.scripts, key=len, reverse=True) if f"user\n{q}<|im_end|>" in text)
            cap = spec.max_tokens if max_tokens is None else max_tokens[i]
            assert spec.n == 1  # one call per turn, one response per active episode
            ids = self.tok.encode(self.scripts[key].pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
            cut = ids[:cap]
            out.append([Completion(cut, [-0.5] * len(cut), "stop" if len(cut) == len(ids) else "length")])
        return out


class CalcEnv:
    """Replies 'result: 42' to a response containing 'CALL', ends the episode otherwise; raises on
    'BOOM'."""

    def reset(self, row):
        return [{"role": "user", "content": row["question"]}]

    def step(self, messages, response):
        assert messages[-1]["role"] != "assistant"  # the conversation before the model's turn
        if "BOOM" in response:
            raise RuntimeError("boom")
        if "CALL" in response:
            return Result([{"role": "tool", "content": "result: 42"}], reward=0.25, info={"tool_calls_calc": 1})
        return Result(done=True, info={"end_reason": "answer"})


def _row(tok, question: str):
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return SimpleNamespace(prompt_ids=list(ids), question=question, answer="42",
                           entry={"question": question, "answer": "42"})


def test_an_episode_is_the_prompt_turns_and_observations_with_only_model_tokens_trained(tokenizer):
    tok = tokenizer
    row = _row(tok, "what is 6*7?")
    engine = ScriptedEngine(tok, {"what is 6*7?": ["CALL calc 6*7", "the answer is 42"]})
    (ep,), = run_episodes(engine, CalcEnv, [row], SamplingSpec(n=1, max_tokens=32, seed=5), tok, Limits(4, 512, 1024))
    turn1 = tok.encode("CALL calc 6*7", add_special_tokens=False) + [tok.eos_token_id]
    obs = tok.encode("\n<|im_start|>tool\nresult: 42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    turn2 = tok.encode("the answer is 42", add_special_tokens=False) + [tok.eos_token_id]
    assert ep.token_ids == turn1 + obs + turn2
    assert ep.mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert ep.logprobs == [-0.5] * len(turn1) + [0.0] * len(obs) + [-0.5] * len(turn2)
    assert ep.final_ids == turn2 and answer_ids(ep) == turn2 and ep.finish_reason == "stop"
    assert ep.episode == {"turns": 2, "end": "done", "env_reward": 0.25, "tool_calls_calc": 1.0}
    # turn 2 was sampled from exactly the tokens the trainer will see before it
    assert engine.calls[1][0] == [row.prompt_ids + turn1 + obs]
    assert engine.calls[0][1].seed == 5 and engine.calls[1][1].seed != 5  # each turn its own seed
    assert ep.prompt_ids == row.prompt_ids  # the environment's first messages, templated

    # the sample trains the model's tokens only
    (sample,) = make_samples([row], [[ep]], [1.0], [0.5])
    mb = pack_micro_batches([sample], [[0]], pad_id=0)[0]
    p = len(row.prompt_ids)
    assert mb["response_mask"][0, p:p + len(ep.mask)].tolist() == [float(m) for m in ep.mask]
    assert mb["response_mask"][0, :p].sum() == 0


def test_limits_end_episodes_with_their_reason(tokenizer):
    tok = tokenizer
    rows = [_row(tok, "q" * k) for k in range(1, 6)]
    scripts = {"q": ["CALL"] * 3,                   # max_turns (3)
               "qq": ["CALL " + "x " * 40],         # cut at max_tokens: length
               "qqq": ["BOOM"],                     # the environment raises
               "qqqq": ["done now"],                # done
               "qqqqq": ["CALL", "CALL", "CALL"]}   # budget, with a smaller limit below
    engine = ScriptedEngine(tok, scripts)
    out = run_episodes(engine, CalcEnv, rows[:4], SamplingSpec(n=1, max_tokens=16), tok, Limits(3, 512, 1024))
    assert [g[0].episode["end"] for g in out] == ["max_turns", "length", "env_error", "done"]
    assert [g[0].episode["turns"] for g in out] == [3, 1, 1, 1]
    assert out[1][0].finish_reason == "length"
    # each later engine call holds only the episodes still running
    assert [len(c[0]) for c in engine.calls] == [4, 1, 1]

    budget = run_episodes(engine, CalcEnv, rows[4:], SamplingSpec(n=1, max_tokens=16), tok, Limits(8, 30, 1024))
    (ep,), = budget
    assert ep.episode["end"] == "token_budget" and len(ep.token_ids) <= 30
    sums = episode_sums([g[0] for g in out] + [ep])
    assert sums["turns_end_max_turns"] == (1.0, 1.0) and sums["turns_end_env_error"] == (1.0, 1.0)
    assert sums["turns_mean"] == (3 + 1 + 1 + 1 + ep.episode["turns"], 5.0)
    assert sums["tool_calls_calc"][0] == 3 + ep.episode["tool_calls_calc"]  # the cut turn made no call
    # an environment error scores error_score; others their reward plus the environment's
    assert episode_rewards([g[0] for g in out], [1.0] * 4, -1.0) == [1.75, 1.0, -1.0, 1.0]  # 3 calls x 0.25


def test_context_length_ends_an_episode_before_the_engine_sees_an_overlong_context(tokenizer):
    tok = tokenizer
    row = _row(tok, "q")
    engine = ScriptedEngine(tok, {"q": ["CALL " + "y " * 10, "CALL"]})
    limit = len(row.prompt_ids) + 16  # the first turn fits, the observation after it does not
    (ep,), = run_episodes(engine, CalcEnv, [row], SamplingSpec(n=1, max_tokens=16), tok, Limits(4, 512, limit))
    assert ep.episode["end"] == "context" and len(engine.calls) == 1


def test_a_tool_transcript_trains_every_assistant_turn_in_the_rollout_layout(tokenizer):
    """SFT on a tool-use transcript (yatt.env.transcripts): the prompt is the turns before the first
    assistant turn; the response lays out the rest as an episode does (the same text as the chat
    template of the whole conversation), with only the two assistant turns in the loss."""
    from yatt.config import SftConfig
    from yatt.env.tools import ToolEnv
    from yatt.env.transcripts import transcript
    from yatt.stages.sft import sft_samples

    tok = tokenizer
    row = {"question": "Calculate 241 * 468.", "answer": "112788", "metadata": {"expression": "241 * 468"}}
    convo = transcript(row, ToolEnv())["messages"]
    assert [m["role"] for m in convo] == ["system", "user", "assistant", "user", "assistant"]
    assert "<tool_response>\n112788\n</tool_response>" in convo[3]["content"]
    prompt_row = SimpleNamespace(prompt_ids=[], messages=convo[:-1], target=convo[-1]["content"], answer="112788",
                                 entry={})
    (s,), skipped = sft_samples([prompt_row], SftConfig(), tok, max_len=2048)
    assert skipped == 0
    full = tok.apply_chat_template(convo, tokenize=False)
    assert tok.decode(s.prompt_ids + s.response_ids) == full[:full.rindex("<|im_end|>") + len("<|im_end|>")]
    assert s.prompt_ids == tok.apply_chat_template(convo[:2], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    trained = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m])
    assert trained == convo[2]["content"] + "<|im_end|>" + convo[4]["content"] + "<|im_end|>"
    # the rollout appends the same tokens after the model's call as SFT trains around
    engine = ScriptedEngine(tok, {"Calculate 241 * 468.": [convo[2]["content"], convo[4]["content"]]})
    (ep,), = run_episodes(engine, ToolEnv, [SimpleNamespace(entry=row)], SamplingSpec(n=1, max_tokens=64), tok,
                          Limits(4, 512, 2048))
    assert (ep.prompt_ids, ep.token_ids, ep.mask) == (s.prompt_ids, s.response_ids, [int(m) for m in s.loss_mask])
    assert ep.episode["end"] == "done" and ep.episode["tool_calls_calculator"] == 1
