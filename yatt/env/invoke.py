"""Running one tool call with a time limit, in a thread or on an event loop; never raises.

A plain tool runs on a daemon thread (one per call): a call past its time limit is left running,
not waited for (Python cannot kill a thread), and the daemon thread does not hold up the exit of
the process. An ``async def`` tool is awaited and cancelled at its time limit (:func:`arun_tool`)
or run by ``asyncio.run`` on such a thread (:func:`run_tool`).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from yatt.env.registry import Tool, ToolError

# ToolOutcome.error kinds
BAD_ARGUMENTS, REFUSED, RAISED, TIMEOUT, MALFORMED = "bad_arguments", "refused", "raised", "timeout", "malformed"


@dataclass(frozen=True)
class ToolOutcome:
    """One call's result: ``name`` (the tool; ``None`` for a malformed block), ``content`` (the text
    for the tool message: the result, or ``"Error: ..."``), ``error`` (``None`` or one of
    ``bad_arguments refused raised timeout malformed``), ``seconds`` (wall time)."""
    name: str | None
    content: str
    error: str | None = None
    seconds: float = 0.0


def run_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float | None) -> ToolOutcome:
    """``tool(**arguments)`` on a daemon thread, waited for at most ``timeout_s`` seconds
    (``None``: no limit; ``tool.timeout_s`` wins when set). Never raises."""
    if (why := tool.check_arguments(arguments)) is not None:
        return ToolOutcome(tool.name, f"Error: {why}", BAD_ARGUMENTS)
    limit, start, box = tool.timeout_s or timeout_s, time.monotonic(), {}
    worker = threading.Thread(target=_into, args=(box, _sync_call(tool), arguments), daemon=True,
                              name=f"yatt-tool-{tool.name}")
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        return _timed_out(tool, limit, start)
    return _outcome(tool, box, start)


async def arun_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float | None) -> ToolOutcome:
    """:func:`run_tool` for an event loop: a plain tool on a daemon thread, awaited; an async one
    awaited directly and cancelled at the limit. Never raises."""
    if (why := tool.check_arguments(arguments)) is not None:
        return ToolOutcome(tool.name, f"Error: {why}", BAD_ARGUMENTS)
    limit, start, box = tool.timeout_s or timeout_s, time.monotonic(), {}
    if inspect.iscoroutinefunction(tool.fn):
        try:
            box["value"] = await asyncio.wait_for(tool.fn(**arguments), limit)
        except asyncio.TimeoutError:
            return _timed_out(tool, limit, start)
        except Exception as e:  # noqa: BLE001 - reported as the tool's result
            box["error"] = e
    else:
        loop, done = asyncio.get_running_loop(), asyncio.Event()

        def finished():  # on the worker thread: wake the loop, unless it has gone
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:
                pass

        worker = threading.Thread(target=_into, args=(box, tool.fn, arguments, finished), daemon=True,
                                  name=f"yatt-tool-{tool.name}")
        worker.start()
        try:
            await asyncio.wait_for(done.wait(), limit)
        except asyncio.TimeoutError:
            return _timed_out(tool, limit, start)
    return _outcome(tool, box, start)


def result_text(value: Any) -> str:
    """A tool's return value as message text: a string as is, anything else as JSON (or ``str``)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _sync_call(tool: Tool) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(tool.fn):
        return lambda **kw: asyncio.run(tool.fn(**kw))
    return tool.fn


def _into(box: dict, fn: Callable[..., Any], arguments: dict[str, Any], then: Callable[[], None] | None = None):
    try:
        box["value"] = fn(**arguments)
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        box["error"] = e
    if then is not None:
        then()


def _timed_out(tool: Tool, limit: float | None, start: float) -> ToolOutcome:
    return ToolOutcome(tool.name, f"Error: tool {tool.name!r} timed out after {limit:g} s", TIMEOUT,
                       time.monotonic() - start)


def _outcome(tool: Tool, box: dict, start: float) -> ToolOutcome:
    seconds = time.monotonic() - start
    if "error" in box:
        e = box["error"]
        if isinstance(e, ToolError):
            return ToolOutcome(tool.name, f"Error: {e}", REFUSED, seconds)
        return ToolOutcome(tool.name, f"Error: {type(e).__name__}: {e}", RAISED, seconds)
    try:
        return ToolOutcome(tool.name, result_text(box.get("value")), None, seconds)
    except Exception as e:  # noqa: BLE001 - a __str__ that raises
        return ToolOutcome(tool.name, f"Error: the result could not be written ({type(e).__name__})", RAISED, seconds)
