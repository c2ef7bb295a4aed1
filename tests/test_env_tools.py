"""The tool-calling environment (yatt/env/tools.py) and its tools (registry, execution with time
limits): scripted turns call -> result -> final answer -> done, errors counted per tool, a raising
and a timing-out tool, tools registered by import path (no model)."""
import asyncio
import json
import threading
import time

import pytest

from yatt.env import ToolEnv, load_env, step_all, sum_counts
from yatt.env.invoke import arun_tool, run_tool
from yatt.env.prompt import tools_prompt
from yatt.env.registry import Tool, ToolError, resolve_tool, resolve_tools, tool
from yatt.env.tool_parser import format_tool_call

RELEASE = threading.Event()  # lets the hung tools' threads end when the session ends


def call(name: str, **arguments) -> str:
    return format_tool_call(name, arguments)


# tools loaded by import path ({__name__}:attr)
@tool(description="Repeat a word n times.")
def repeat(word: str, n: int = 2) -> str:
    return " ".join([word] * n)


def explode(reason: str) -> str:
    """Always raises.

    Args:
        reason: what to say.
    """
    raise RuntimeError(f"boom: {reason}")


def refuse() -> str:
    raise ToolError("no can do")


def hang() -> str:
    RELEASE.wait(30)
    return "late"


async def ahang() -> str:
    while not RELEASE.is_set():
        await asyncio.sleep(0.05)
    return "late"


async def aecho(text: str) -> dict:
    await asyncio.sleep(0.01)
    return {"echo": text}


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


SLOW = Tool("slow", "Sleep.", {"type": "object", "properties": {"seconds": {"type": "number"}}}, slow)
NOT_A_TOOL = 42


def path(name: str) -> str:
    return f"{__name__}:{name}"


@pytest.fixture(scope="module", autouse=True)
def _release_hung_threads():
    yield
    RELEASE.set()


def make_env(**kwargs) -> ToolEnv:
    tools = ["calculator", path("repeat"), path("explode"), path("refuse"), path("hang"), path("aecho")]
    return ToolEnv(tools=kwargs.pop("tools", tools), tool_timeout_s=kwargs.pop("tool_timeout_s", 0.3), **kwargs)


# --- the episode ---------------------------------------------------------------------------------

def test_an_episode_call_result_answer_done():
    env = make_env()
    messages = env.reset({"question": "What is 12*(3+4)?", "answer": "84"})
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("You are a helpful assistant.\n\n# Tools")
    assert '"name": "calculator"' in messages[0]["content"] and messages[1]["content"] == "What is 12*(3+4)?"

    response = "Let me compute it.\n" + call("calculator", expression="12*(3+4)")
    turn = env.step(messages, response)
    assert not turn.done and turn.reward is None
    assert turn.observation == [{"role": "user", "content": "<tool_response>\n84\n</tool_response>"}]
    assert turn.info == {"tool_calls": 1, "tool_errors": 0, "tool_calls_calculator": 1}
    messages = messages + [{"role": "assistant", "content": response}] + turn.observation

    final = env.step(messages, "The answer is 84.")
    assert final.done and final.observation == [] and final.info == {"end_reason": "answer"}
    assert sum_counts([turn.info, final.info]) == {"tool_calls": 1, "tool_errors": 0, "tool_calls_calculator": 1}


def test_several_calls_in_one_turn_answer_in_order_in_one_user_turn():
    env = make_env()
    turn = env.step([], call("calculator", expression="2**5") + call("repeat", word="ab", n=3)
                    + call("aecho", text="hi"))
    assert turn.observation == [{"role": "user", "content": "<tool_response>\n32\n</tool_response>\n"
                                 "<tool_response>\nab ab ab\n</tool_response>\n"
                                 '<tool_response>\n{"echo": "hi"}\n</tool_response>'}]
    assert turn.info["tool_calls"] == 3 and turn.info["tool_errors"] == 0


def test_tool_role_gives_one_tool_message_per_result():
    env = make_env(tool_role="tool")
    turn = env.step([], call("calculator", expression="1+1") + "<tool_call>\n{bad\n</tool_call>")
    assert turn.observation[0] == {"role": "tool", "name": "calculator", "content": "2"}
    assert turn.observation[1]["role"] == "tool"
    assert turn.observation[1]["content"].startswith("Error: tool call is not valid JSON")


@pytest.mark.parametrize("response, says, key", [
    ("<tool_call>\nnot json\n</tool_call>", "Error: tool call is not valid JSON", "tool_errors_malformed"),
    ("<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}}", "is not closed",
     "tool_errors_malformed"),
    (call("python", code="1"), "Error: unknown tool 'python'", "tool_errors_malformed"),
    (call("calculator", expression="9**9**9"), "Error: exponent 387420489 is too large", "tool_errors_calculator"),
    (call("calculator", expression="(1).__class__"), "Error: attribute access", "tool_errors_calculator"),
    (call("calculator", expr="1+1"), "Error: missing argument(s) 'expression'", "tool_errors_calculator"),
    (call("calculator", expression="1", x=2), "Error: unknown argument(s) 'x'", "tool_errors_calculator"),
    (call("calculator", expression=12), "must be of type string", "tool_errors_calculator"),
    (call("repeat", word="a", n="3"), "argument 'n' of tool 'repeat' must be of type integer", "tool_errors_repeat"),
    (call("explode", reason="x"), "Error: RuntimeError: boom: x", "tool_errors_explode"),
    (call("refuse"), "Error: no can do", "tool_errors_refuse"),
    (call("hang"), "Error: tool 'hang' timed out after 0.3 s", "tool_errors_hang"),
])
def test_errors_come_back_as_results_are_counted_and_the_episode_goes_on(response, says, key):
    for run in ("step", "astep"):
        env = make_env()
        turn = env.step([], response) if run == "step" else asyncio.run(env.astep([], response))
        assert not turn.done, run
        assert says in turn.observation[0]["content"], (run, turn.observation)
        assert turn.info["tool_calls"] == 1 and turn.info["tool_errors"] == 1 and turn.info[key] == 1, run


def test_a_timed_out_tool_is_counted_as_a_timeout_and_does_not_hold_the_turn():
    env = make_env()
    start = time.perf_counter()
    turn = env.step([], call("hang") + call("calculator", expression="6*7"))
    assert time.perf_counter() - start < 2
    assert turn.info["tool_timeouts_hang"] == 1 and turn.info["tool_calls_calculator"] == 1
    assert "<tool_response>\n42\n</tool_response>" in turn.observation[0]["content"]


def test_an_async_tool_is_cancelled_at_its_time_limit():
    env = ToolEnv(tools=[path("ahang")], tool_timeout_s=0.2)
    start = time.perf_counter()
    for turn in (env.step([], call("ahang")), asyncio.run(env.astep([], call("ahang")))):
        assert turn.info["tool_timeouts_ahang"] == 1 and "timed out after 0.2 s" in turn.observation[0]["content"]
    assert time.perf_counter() - start < 2


def test_astep_runs_a_turns_calls_concurrently_and_step_all_runs_episodes_concurrently():
    env = ToolEnv(tools=[SLOW], tool_timeout_s=5)
    start = time.perf_counter()
    turn = asyncio.run(env.astep([], call("slow", seconds=0.5) * 3))  # 1.5 s one after another
    assert time.perf_counter() - start < 1.2 and turn.info["tool_calls_slow"] == 3
    start = time.perf_counter()
    results = step_all([ToolEnv(tools=[SLOW]) for _ in range(8)], [[]] * 8, [call("slow", seconds=0.5)] * 8)
    assert time.perf_counter() - start < 2.5  # 4 s one after another
    assert all(r.observation[0]["content"] == "<tool_response>\nslept\n</tool_response>" for r in results)


def test_calls_past_the_per_turn_limit_are_errors():
    env = make_env(max_calls_per_turn=2)
    turn = env.step([], call("calculator", expression="1") * 3)
    assert turn.info == {"tool_calls": 3, "tool_errors": 1, "tool_calls_calculator": 2, "tool_errors_malformed": 1}
    assert "too many tool calls in one turn (at most 2)" in turn.observation[0]["content"]


def test_long_results_are_cut():
    env = ToolEnv(tools=[path("repeat")], max_result_chars=50)
    content = env.step([], call("repeat", word="abcdefghij", n=100)).observation[0]["content"]
    assert content.endswith(" ...[truncated]\n</tool_response>")
    assert len(content) == 50 + len("<tool_response>\n\n</tool_response>")


# --- reset ---------------------------------------------------------------------------------------

def test_reset_keeps_a_chat_rows_messages_and_adds_the_tools_to_its_system_turn():
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
           "question": "ignored"}
    env = make_env(tools=["calculator"])
    messages = env.reset(row)
    assert messages[0]["content"] == "Be brief." + tools_prompt([env.tools["calculator"].schema()])
    assert messages[1:] == row["messages"][1:] and row["messages"][0]["content"] == "Be brief."  # copied
    assert env.chat_template_tools is None


def test_reset_with_tools_left_to_the_template():
    env = make_env(tools=["calculator"], tools_in="template", system_prompt="Use tools.")
    user = {"role": "user", "content": "q"}
    assert env.reset({"question": "q"}) == [{"role": "system", "content": "Use tools."}, user]
    assert env.chat_template_tools == [env.tools["calculator"].schema()]
    assert make_env(tools=["calculator"], tools_in="template").reset({"question": "q"}) == [user]


@pytest.mark.parametrize("row", [{}, {"question": 3}, {"messages": [{"role": "user"}]}, {"messages": "hi"}])
def test_reset_refuses_a_row_without_a_conversation(row):
    with pytest.raises(ValueError):
        make_env().reset(row)


@pytest.mark.parametrize("kwargs, says", [
    ({"tools_in": "prompt"}, "tools_in must be one of"), ({"tool_role": "assistant"}, "tool_role must be one of"),
    ({"tools": []}, "no tool"), ({"tools": ["nope"]}, "not a built-in tool"),
    ({"tools": ["calculator", "calculator"]}, "a second tool named 'calculator'"),
    ({"tool_timeout_s": 0}, "tool_timeout_s"),
])
def test_bad_options(kwargs, says):
    with pytest.raises(ValueError, match=says):
        make_env(**kwargs)


def test_load_env_by_built_in_name_with_kwargs():
    factory = load_env("tools", tools=["calculator", path("repeat")], tool_role="tool")
    a, b = factory(), factory()
    assert a is not b and isinstance(a, ToolEnv) and list(a.tools) == ["calculator", "repeat"] and a.tool_role == "tool"
    with pytest.raises(ValueError, match=r"^rollout.env: 'tools' cannot be made .*tool_role must be one of"):
        load_env("tools", tool_role="robot")


# --- the registry --------------------------------------------------------------------------------

def test_tools_by_import_path():
    assert resolve_tool("calculator").name == "calculator"
    assert resolve_tool(path("repeat")).description == "Repeat a word n times."
    t = resolve_tool(path("explode"))  # a plain function: schema from its signature and docstring
    assert t.name == "explode" and t.description == "Always raises."
    assert t.parameters == {"type": "object", "required": ["reason"],
                            "properties": {"reason": {"type": "string", "description": "what to say."}}}
    assert resolve_tool(path("repeat")).parameters["required"] == ["word"]
    assert list(resolve_tools(["calculator", SLOW])) == ["calculator", "slow"]


@pytest.mark.parametrize("spec, says", [
    ("nope", "tools: 'nope' is not a built-in tool"),
    ("no_such_module_xyz:f", "tools: cannot load 'no_such_module_xyz:f' (ModuleNotFoundError"),
    (f"{__name__}:missing", "tools: cannot load"),
    (f"{__name__}:NOT_A_TOOL", "not callable"),
])
def test_bad_tool_paths(spec, says):
    with pytest.raises(ValueError) as e:
        resolve_tool(spec)
    assert says in str(e.value)


def test_tool_definitions_are_checked():
    schema = {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="tool name"):
        Tool("has space", "", schema, len)
    with pytest.raises(ValueError, match="type 'object'"):
        Tool("t", "", {"type": "string"}, len)
    with pytest.raises(ValueError, match=r"\*args"):
        tool(lambda *a: 1)
    with pytest.raises(ValueError, match="timeout_s"):
        Tool("t", "", schema, len, timeout_s=0)


def test_run_tool_results_and_its_own_timeout_wins():
    t = Tool("slow", "", SLOW.parameters, slow, timeout_s=0.1)
    assert run_tool(t, {"seconds": 1}, timeout_s=30).error == "timeout"
    assert run_tool(SLOW, {"seconds": 0}, timeout_s=1).content == "slept"
    as_json = Tool("j", "", {"type": "object"}, lambda: {"a": [1, 2.5, None]})
    assert run_tool(as_json, {}, 1).content == json.dumps({"a": [1, 2.5, None]})
    assert asyncio.run(arun_tool(as_json, {}, 1)).content == '{"a": [1, 2.5, null]}'
