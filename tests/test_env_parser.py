"""The Hermes / Qwen2.5 tool-call parser (yatt/env/tool_parser.py): well-formed calls, and every
kind of malformed one, each with a structured error (no model)."""
import pytest

from yatt.env.tool_parser import ERROR_KINDS, ToolCall, ToolCallError, format_tool_call, parse_tool_calls

TOOLS = {"calculator", "search"}


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_one_call_and_the_text_around_it():
    text = "Let me compute.\n" + block('{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}') + "\nDone?"
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == [ToolCall("calculator", {"expression": "12*(3+4)"},
                                     '{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}')]
    assert parsed.errors == [] and parsed.text == "Let me compute.\n\nDone?"


def test_several_calls_keep_their_order_and_arguments_may_be_a_json_string():
    text = (block('{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}') + " and "
            + block('{"name": "calculator", "arguments": {"expression": "1+1"}}')
            + block('{"name": "calculator"}'))  # no arguments: {}
    calls = parse_tool_calls(text, TOOLS).calls
    assert [(c.name, c.arguments) for c in calls] == [("search", {"query": "x"}),
                                                      ("calculator", {"expression": "1+1"}), ("calculator", {})]


def test_no_tags_no_items_and_a_stray_close_tag_stays_text():
    assert parse_tool_calls("The answer is 84.").items == ()
    parsed = parse_tool_calls("84 </tool_call>", TOOLS)
    assert parsed.items == () and parsed.text == "84 </tool_call>"


def test_the_template_format_round_trips_and_any_name_passes_without_a_tool_list():
    text = format_tool_call("lookup", {"word": "é", "n": 2})
    assert text == '<tool_call>\n{"name": "lookup", "arguments": {"word": "é", "n": 2}}\n</tool_call>'
    assert parse_tool_calls(text).calls[0].arguments == {"word": "é", "n": 2}
    # the Hermes variant's "parameters" key, and whitespace inside the tags
    assert parse_tool_calls('<tool_call>  {"name": " search ", "parameters": {"q": 1}}</tool_call>').calls[0] \
        .arguments == {"q": 1}


@pytest.mark.parametrize("text, kind, name", [
    ("<tool_call>\n" + '{"name": "calculator", "arguments": {"expression": "1"}}', "unclosed_tag", None),
    (block('{"name": "calculator", "arguments": {"expression": "1"}'), "invalid_json", None),
    (block("calculator(1+1)"), "invalid_json", None),
    (block(""), "invalid_json", None),
    (block("[" * 100_000), "invalid_json", None),
    (block('["calculator", {"expression": "1"}]'), "not_an_object", None),
    (block('"calculator"'), "not_an_object", None),
    (block('{"arguments": {"expression": "1"}}'), "missing_name", None),
    (block('{"name": "", "arguments": {}}'), "missing_name", None),
    (block('{"name": 7, "arguments": {}}'), "missing_name", None),
    (block('{"name": "calculator", "arguments": ["1+1"]}'), "bad_arguments", "calculator"),
    (block('{"name": "calculator", "arguments": "1+1"}'), "bad_arguments", "calculator"),
    (block('{"name": "calculator", "arguments": "[1]"}'), "bad_arguments", "calculator"),
    (block('{"name": "calculator", "arguments": null}'), "bad_arguments", "calculator"),
    (block('{"name": "python", "arguments": {"code": "1"}}'), "unknown_tool", "python"),
])
def test_every_malformed_kind_is_a_structured_error(text, kind, name):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == [] and len(parsed.errors) == 1
    error = parsed.errors[0]
    assert isinstance(error, ToolCallError) and error.kind == kind and error.kind in ERROR_KINDS
    assert error.name == name and 0 < len(error.message) < 200


def test_messages_say_what_was_expected():
    errors = parse_tool_calls(block("not json") + block('{"name": "nope"}'), TOOLS).errors
    assert "not valid JSON" in errors[0].message and '"name"' in errors[0].message
    assert errors[1].message == "unknown tool 'nope' (available: calculator, search)"


def test_an_unclosed_block_before_another_call_loses_only_itself():
    text = "<tool_call>\n{\"name\": \"calculator\"\n" + block('{"name": "search", "arguments": {"q": "a"}}')
    items = parse_tool_calls(text, TOOLS).items
    assert [type(i) for i in items] == [ToolCallError, ToolCall]
    assert items[0].kind == "unclosed_tag" and items[1].name == "search"


def test_good_and_bad_calls_mix_in_order():
    text = block('{"name": "calculator", "arguments": {"expression": "2"}}') + block("{oops") \
        + block('{"name": "search", "arguments": {}}')
    items = parse_tool_calls(text, TOOLS).items
    assert [type(i).__name__ for i in items] == ["ToolCall", "ToolCallError", "ToolCall"]
