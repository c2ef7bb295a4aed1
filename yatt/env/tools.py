"""The built-in tool-calling environment (``rollout.env: tools``).

Each turn the response is parsed for ``<tool_call>`` blocks (:mod:`yatt.env.tool_parser`). None:
the response is the final answer and the episode is done (``end_reason: answer``). Otherwise every
block is answered in order, by its tool's result or by an ``Error: ...`` message: a malformed
block, an unknown tool, arguments that do not fit the tool's schema, a tool that raises, refuses
(:class:`~yatt.env.registry.ToolError`) or runs past its time limit. Errors are counted and the
episode goes on. Results longer than ``max_result_chars`` are cut.

Counters in ``StepResult.info`` (per turn; sum them over the episode): ``tool_calls`` and
``tool_errors`` (all blocks), ``tool_calls_<name>``, ``tool_errors_<name>`` and
``tool_timeouts_<name>`` for each registered tool, ``tool_errors_malformed`` (blocks that name no
registered tool: bad JSON, unknown tool, ... and calls past ``max_calls_per_turn``).
"""
from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import Any

from yatt.env.base import END_ANSWER, Environment, StepResult, check_messages
from yatt.env.invoke import MALFORMED, TIMEOUT, ToolOutcome, arun_tool, run_tool
from yatt.env.prompt import DEFAULT_SYSTEM, TOOL_ROLES, tool_result_messages, tools_system_message
from yatt.env.registry import Tool, resolve_tools
from yatt.env.tool_parser import ToolCall, parse_tool_calls

TOOLS_IN = ("system", "template")


class ToolEnv(Environment):
    """Tool calling (see the module docstring). One instance per episode; stateless between turns.

    Args:
        tools: built-in names (``calculator``), import paths ``'package.module:attr'`` or
            :class:`~yatt.env.registry.Tool` objects.
        tools_in: where the tools are advertised. ``system``: in the system message, written as
            Qwen2.5's template writes it (works with any template). ``template``: left to the chat
            template, which gets :attr:`chat_template_tools` as ``tools=`` (needs a template that
            renders tools, e.g. Qwen2.5's; SmolLM2's ignores them).
        tool_role: ``user``: results in one user turn of ``<tool_response>`` blocks (any
            template); ``tool``: one ``tool``-role message each (templates that render that role).
        system_prompt: the system message for rows without one (``None``: none with
            ``tools_in: template``, ``"You are a helpful assistant."`` with ``system``).
        tool_timeout_s: seconds a tool call may take (a tool's own ``timeout_s`` wins).
        max_calls_per_turn: blocks answered per response; the rest get an error.
        max_result_chars: a result longer than this is cut and marked.
    Raises:
        ValueError: an unknown option value or a tool that does not resolve.
    """

    def __init__(self, tools: Sequence[str | Tool] = ("calculator",), tools_in: str = "system",
                 tool_role: str = "user", system_prompt: str | None = None, tool_timeout_s: float = 10.0,
                 max_calls_per_turn: int = 8, max_result_chars: int = 2000):
        if isinstance(tools, str):
            tools = [tools]
        if tools_in not in TOOLS_IN:
            raise ValueError(f"tools_in must be one of {TOOLS_IN}, got {tools_in!r}")
        if tool_role not in TOOL_ROLES:
            raise ValueError(f"tool_role must be one of {TOOL_ROLES}, got {tool_role!r}")
        if not tool_timeout_s > 0 or max_calls_per_turn < 1 or max_result_chars < 16:
            raise ValueError("tool_timeout_s must be > 0, max_calls_per_turn >= 1, max_result_chars >= 16")
        self.tools: dict[str, Tool] = resolve_tools(tools)
        if not self.tools:
            raise ValueError("tools: no tool given")
        self.tools_in, self.tool_role, self.system_prompt = tools_in, tool_role, system_prompt
        self.tool_timeout_s, self.max_calls_per_turn = tool_timeout_s, max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.schemas = [t.schema() for t in self.tools.values()]
        self.chat_template_tools = self.schemas if tools_in == "template" else None

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The row's ``messages`` (copied), or one user turn of its ``question``; a system turn
        added per ``system_prompt``; the tools advertised per ``tools_in``.

        Raises:
            ValueError: the row has neither well-formed ``messages`` nor a string ``question``.
        """
        if row.get("messages") is not None:
            messages = copy.deepcopy(check_messages(row["messages"], "row['messages']"))
        elif isinstance(row.get("question"), str):
            messages = [{"role": "user", "content": row["question"]}]
        else:
            raise ValueError("the row has neither 'messages' nor a string 'question'")
        if self.tools_in == "system":
            return tools_system_message(messages, self.schemas, self.system_prompt or DEFAULT_SYSTEM)
        if self.system_prompt is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, messages: list[dict[str, Any]], response: str) -> StepResult:
        """Run the response's tool calls one after another (see the module docstring)."""
        plan = self._plan(response)
        if plan is None:
            return StepResult([], True, None, {"end_reason": END_ANSWER})
        outcomes = [run_tool(self.tools[i.name], i.arguments, self.tool_timeout_s) if isinstance(i, ToolCall) else i
                    for i in plan]
        return self._result(outcomes)

    async def astep(self, messages: list[dict[str, Any]], response: str) -> StepResult:
        """:meth:`step` with this turn's tool calls run concurrently."""
        plan = self._plan(response)
        if plan is None:
            return StepResult([], True, None, {"end_reason": END_ANSWER})

        async def done(outcome: ToolOutcome) -> ToolOutcome:
            return outcome

        outcomes = await asyncio.gather(*(arun_tool(self.tools[i.name], i.arguments, self.tool_timeout_s)
                                          if isinstance(i, ToolCall) else done(i) for i in plan))
        return self._result(list(outcomes))

    def _plan(self, response: str) -> list[ToolCall | ToolOutcome] | None:
        """The calls to run and the answers already known (malformed blocks), in order; ``None``
        when the response has no tool call."""
        parsed = parse_tool_calls(response, self.tools.keys())
        if not parsed.items:
            return None
        plan: list[ToolCall | ToolOutcome] = []
        for n, item in enumerate(parsed.items):
            if n >= self.max_calls_per_turn:
                plan.append(ToolOutcome(None, f"Error: too many tool calls in one turn (at most "
                                              f"{self.max_calls_per_turn}); this one was not run", MALFORMED))
            elif isinstance(item, ToolCall):
                plan.append(item)
            else:
                plan.append(ToolOutcome(None, f"Error: {item.message}", MALFORMED))
        return plan

    def _result(self, outcomes: list[ToolOutcome]) -> StepResult:
        info: dict[str, Any] = {"tool_calls": float(len(outcomes)), "tool_errors": 0.0}
        for o in outcomes:
            if o.name is not None:
                info[f"tool_calls_{o.name}"] = info.get(f"tool_calls_{o.name}", 0.0) + 1
            if o.error is not None:
                info["tool_errors"] += 1
                key = f"tool_errors_{o.name}" if o.name is not None else "tool_errors_malformed"
                info[key] = info.get(key, 0.0) + 1
            if o.error == TIMEOUT:
                info[f"tool_timeouts_{o.name}"] = info.get(f"tool_timeouts_{o.name}", 0.0) + 1
        results = [(o.name or "invalid", self._cut(o.content)) for o in outcomes]
        return StepResult(tool_result_messages(results, self.tool_role), False, None, info)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_result_chars:
            return text
        return text[:self.max_result_chars - 15] + " ...[truncated]"
