"""Tool calls in a model response, in the Hermes / Qwen2.5 chat-template format.

A call is a JSON object between tags, several per response allowed::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*(3+4)"}}
    </tool_call>

``arguments`` may be a JSON object or a JSON string holding one (some models quote it); a missing
``arguments`` is ``{}``; ``parameters`` is read where ``arguments`` is absent (a Hermes variant).
A block that cannot be used becomes a :class:`ToolCallError` with one of :data:`ERROR_KINDS` and a
short message meant to go back to the model as the tool's result. Pure functions, no tokenizer.
"""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMAT_HINT = '{"name": <tool name>, "arguments": {<argument>: <value>, ...}}'
ERROR_KINDS = ("unclosed_tag", "invalid_json", "not_an_object", "missing_name", "bad_arguments",
               "unknown_tool")


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: ``name`` (str), ``arguments`` (dict, JSON values), ``raw`` (the text
    between the tags)."""
    name: str
    arguments: dict[str, Any]
    raw: str


@dataclass(frozen=True)
class ToolCallError:
    """A block that is not a usable call: ``kind`` (one of :data:`ERROR_KINDS`), ``message`` (short,
    for the model), ``raw`` (the block's text), ``name`` (the tool named, where one was read)."""
    kind: str
    message: str
    raw: str
    name: str | None = None


@dataclass(frozen=True)
class ParsedResponse:
    """``items``: calls and errors in the order they appear; ``text``: the response without them."""
    items: tuple[ToolCall | ToolCallError, ...]
    text: str

    @property
    def calls(self) -> list[ToolCall]:
        return [i for i in self.items if isinstance(i, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [i for i in self.items if isinstance(i, ToolCallError)]


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> ParsedResponse:
    """Every ``<tool_call>`` block of ``text``, parsed.

    Args:
        text: a model response (the assistant turn's text).
        tool_names: the tools that exist; a call naming another is an ``unknown_tool`` error.
            ``None`` accepts any name.
    Returns:
        :class:`ParsedResponse`. A block opened but not closed before the next ``<tool_call>`` or
        the end is ``unclosed_tag``; a stray ``</tool_call>`` is left in ``text``. Never raises.
    """
    items: list[ToolCall | ToolCallError] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        kept.append(text[pos:start])
        body_start = start + len(OPEN)
        close, reopen = text.find(CLOSE, body_start), text.find(OPEN, body_start)
        if close < 0 or 0 <= reopen < close:
            end = reopen if reopen >= 0 else len(text)
            raw = text[body_start:end]
            items.append(ToolCallError("unclosed_tag", f"{OPEN} is not closed by {CLOSE}", raw.strip()))
            pos = end
            continue
        items.append(parse_call(text[body_start:close], tool_names))
        pos = close + len(CLOSE)
    kept.append(text[pos:])
    return ParsedResponse(tuple(items), "".join(kept).strip())


def parse_call(body: str, tool_names: Collection[str] | None = None) -> ToolCall | ToolCallError:
    """One block's text (between the tags) as a :class:`ToolCall`, or the :class:`ToolCallError`
    saying why not (see :func:`parse_tool_calls`). Never raises."""
    raw = body.strip()
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
        return ToolCallError("invalid_json", f"tool call is not valid JSON ({reason}); expected {FORMAT_HINT}", raw)
    if not isinstance(obj, dict):
        return ToolCallError("not_an_object", f"tool call is a JSON {_json_type(obj)}, not an object; "
                                              f"expected {FORMAT_HINT}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError("missing_name", f'tool call has no "name" string; expected {FORMAT_HINT}', raw)
    name = name.strip()
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return ToolCallError("bad_arguments", '"arguments" is a string that is not a JSON object', raw, name)
    if not isinstance(args, dict):
        return ToolCallError("bad_arguments", f'"arguments" is a JSON {_json_type(args)}, not an object', raw, name)
    if tool_names is not None and name not in tool_names:
        known = ", ".join(sorted(tool_names)) or "none"
        return ToolCallError("unknown_tool", f"unknown tool {name[:64]!r} (available: {known})", raw, name)
    return ToolCall(name, args, raw)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The block the Qwen2.5 template writes for a call (for tests and SFT data)."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{CLOSE}'


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null", dict: "object"}.get(type(value), type(value).__name__)

