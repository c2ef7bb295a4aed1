"""Tools and tool results as chat messages, written as the Qwen2.5 chat template writes them.

Qwen2.5's template advertises tools in the system turn and wraps each tool result in
``<tool_response>`` tags inside a ``user`` turn (consecutive results share one turn). Templates
without tool support (SmolLM2-135M-Instruct's renders every role as ``<|im_start|>{role}`` and
ignores ``tools=``) get the same text through plain messages: :func:`tools_system_message` and
:func:`tool_result_messages` with ``role="user"``. On Qwen2.5 that plain form renders byte for byte
like the native one (``tests/test_env_template.py``).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

DEFAULT_SYSTEM = "You are a helpful assistant."
TOOL_ROLES = ("tool", "user")


def tools_prompt(schemas: Sequence[dict[str, Any]]) -> str:
    """The text Qwen2.5's template appends to the system prompt for ``tools=schemas``."""
    listed = "".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_system_message(messages: list[dict[str, Any]], schemas: Sequence[dict[str, Any]],
                         default_system: str = DEFAULT_SYSTEM) -> list[dict[str, Any]]:
    """``messages`` with the tools advertised in the system turn: :func:`tools_prompt` appended to
    the first message's content when it is a system message, else a system message
    ``default_system + tools_prompt`` put first. Returns a new list; the input is not changed."""
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = messages[0]["content"] + tools_prompt(schemas)
        return messages
    return [{"role": "system", "content": default_system + tools_prompt(schemas)}] + messages


def tool_result_messages(results: Sequence[tuple[str, str]], role: str = "user") -> list[dict[str, Any]]:
    """Tool results ``(name, content)`` as the messages that follow the assistant turn.

    ``role="tool"``: one ``{"role": "tool", "name", "content"}`` message each (for templates that
    render the tool role, like Qwen2.5's). ``role="user"``: one user message holding every result
    as ``<tool_response>\\n{content}\\n</tool_response>``, joined by newlines (any template).

    Raises:
        ValueError: ``role`` is not ``tool`` or ``user``.
    """
    if role == "tool":
        return [{"role": "tool", "name": name, "content": content} for name, content in results]
    if role == "user":
        if not results:
            return []
        return [{"role": "user",
                 "content": "\n".join(f"<tool_response>\n{content}\n</tool_response>" for _, content in results)}]
    raise ValueError(f"tool_role must be one of {TOOL_ROLES}, got {role!r}")
