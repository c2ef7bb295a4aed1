"""Tool episodes through real chat templates (yatt/env/prompt.py, template.py): Qwen2.5's renders
tools and the tool role, SmolLM2-135M-Instruct's does not; the plain form (tools in the system
turn, results in user turns) renders on Qwen2.5 exactly like the native one; a turn's observation
text appends cleanly. Needs only the tokenizers of the packaged models (skipped when absent)."""
import pytest

from yatt.assets.model import QWEN_CODER, SMOLLM2, cache_root
from yatt.env import ToolEnv
from yatt.env.template import observation_text, renders_tools, tool_options
from yatt.env.tool_parser import format_tool_call

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def tokenizer(name: str):
    folder = cache_root() / "models" / name
    if not (folder / ".yatt_complete").exists():
        pytest.skip(f"{name} is not materialised (python -m yatt.assets.model {name})")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def qwen():
    return tokenizer(QWEN_CODER)


@pytest.fixture(scope="module")
def smol():
    return tokenizer(SMOLLM2)


def episode(env: ToolEnv, row: dict) -> list[dict]:
    """Two turns of calls (two results in the first) and a final answer."""
    messages = env.reset(row)
    for response in (format_tool_call("calculator", {"expression": "12*7"})
                     + format_tool_call("calculator", {"expression": "1/0"}),
                     "Let me check.\n" + format_tool_call("calculator", {"expression": "84+1"})):
        turn = env.step(messages, response)
        messages = messages + [{"role": "assistant", "content": response}] + turn.observation
    return messages + [{"role": "assistant", "content": "The answer is 85."}]


def render(tok, messages, tools=None, generation=False) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)


def test_which_templates_render_tools(qwen, smol):
    assert renders_tools(qwen) and not renders_tools(smol)
    assert tool_options(qwen) == {"tools_in": "template", "tool_role": "tool"}
    assert tool_options(smol) == {"tools_in": "system", "tool_role": "user"}
    # SmolLM2 takes a tool message but renders an unknown role header, which is why it gets user turns
    assert "<|im_start|>tool\n4<|im_end|>" in render(smol, [{"role": "user", "content": "q"},
                                                           {"role": "tool", "content": "4"}])


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12*7+1?"}]},
    {"question": "What is 12*7+1?"},
])
def test_on_qwen_the_plain_form_renders_like_the_native_one(qwen, row):
    native = ToolEnv(tools_in="template", tool_role="tool", system_prompt=QWEN_SYSTEM)
    plain = ToolEnv(tools_in="system", tool_role="user", system_prompt=QWEN_SYSTEM)
    text = render(qwen, episode(native, row), native.chat_template_tools)
    assert text == render(qwen, episode(plain, row))
    assert "# Tools" in text and text.count("<tool_response>") == 3
    assert "<tool_response>\n84\n</tool_response>\n<tool_response>\nError: division by zero\n</tool_response>" in text
    if "question" in row:  # the template's default system prompt, which the plain form must be given
        assert render(qwen, episode(ToolEnv(tools_in="template", tool_role="tool"), row),
                      native.chat_template_tools) == text


def test_on_smollm2_the_plain_form_shows_tools_and_results(smol):
    text = render(smol, episode(ToolEnv(), {"question": "What is 12*7+1?"}))
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<|im_start|>tool" not in text and "named SmolLM" not in text
    assert "<|im_start|>user\n<tool_response>\n85\n</tool_response><|im_end|>" in text


@pytest.mark.parametrize("which", ["qwen", "smol"])
def test_observation_text_appends_a_turn_at_a_clean_token_boundary(which, request):
    tok = request.getfixturevalue(which)
    env = ToolEnv()
    history = env.reset({"question": "What is 12*7?"})
    response = format_tool_call("calculator", {"expression": "12*7"})
    observation = env.step(history, response).observation
    text = observation_text(tok, history, response, observation, generated_stop="<|im_end|>")
    assert text == "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    before = render(tok, history, generation=True) + response + "<|im_end|>"
    full = render(tok, history + [{"role": "assistant", "content": response}] + observation, generation=True)
    assert before + text == full
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert encode(before) + encode(text) == encode(full)


class Rewriting:
    """A template that drops earlier assistant turns (as reasoning templates do with thoughts)."""

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        kept = [m for i, m in enumerate(messages) if m["role"] != "assistant" or i == last]
        return "".join(f"[{m['role']}]{m['content']}" for m in kept) + ("[assistant]" if add_generation_prompt else "")


def test_observation_text_refuses_a_template_that_rewrites_earlier_turns():
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
               {"role": "user", "content": "r"}]
    with pytest.raises(ValueError, match="does not extend the conversation"):
        observation_text(Rewriting(), history, "a2", [{"role": "user", "content": "r2"}])
