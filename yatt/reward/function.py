"""A reward function of the user's own, named by import path (``reward.sources`` type ``function``).

Two forms, each plain or ``async def``:

- per response: ``fn(prompt: str, response: str, row: dict) -> float``;
- batched (``batched: true``): ``fn(prompts: list[str], responses: list[str], rows: list[dict])
  -> list[float]`` (one call per step and rank).

``prompt`` is the row's question (before the chat template), ``row`` every field of the data row
(:class:`~yatt.reward.item.RewardItem`). A call that raises, returns something that is not a
finite number (a batch: not one per response), or takes longer than ``timeout_s`` gives
``error_score`` to the responses it covers, counted as errors (and ``timeouts``); the job goes
on. With ``timeout_s > 0`` a plain function runs on a daemon worker thread (one per call) so that
a call that never returns is left behind, not waited for; code that needs the main thread
(``signal.alarm``) wants ``timeout_s: 0``. Async functions run on an event loop in this thread,
per-response calls concurrently, and are cancelled at their time-out.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable

from yatt.imports import load_callable
from yatt.reward.item import RewardItem, Scored, finite_score

log = logging.getLogger("yatt")


class _TimedOut(Exception):
    pass


def _in_thread(fn: Callable, args: tuple, timeout_s: float):
    """``fn(*args)`` on a daemon thread, waited for at most ``timeout_s`` seconds.

    Raises:
        _TimedOut: the call has not returned in time (it is left running).
        Exception: what the call raised.
    """
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="yatt-reward-fn")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _TimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


class FunctionReward:
    """Scores responses with a user function (see the module docstring).

    Args:
        path: ``'package.module:function'``. batched: the list form. timeout_s: seconds per call
            (0: no limit). error_score: the score of a response the function could not score.
        key: the config key named in errors (``reward.sources[i].path``).
    Raises:
        ValueError: ``path`` cannot be loaded.
    """

    def __init__(self, path: str, batched: bool = False, timeout_s: float = 30.0, error_score: float = 0.0,
                 key: str = "path") -> None:
        self.fn, self.path = load_callable(path, key), path
        self.batched, self.timeout_s, self.error_score = batched, timeout_s, error_score
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self._warned: set[str] = set()

    def score(self, items: list[RewardItem]) -> Scored:
        """One score per item (``error_score`` where the function failed); counters ``timeouts``."""
        if not items:
            return Scored([])
        calls = [tuple(map(list, zip(*((i.prompt, i.response, i.row) for i in items))))] if self.batched else [
            (i.prompt, i.response, i.row) for i in items]
        results = asyncio.run(self._run_async(calls)) if self.is_async else [self._run(c) for c in calls]
        scores, errors, timeouts = [], 0, 0
        for args, result in zip(calls, results):
            width = len(args[0]) if self.batched else 1
            values = self._values(result, width)
            timeouts += isinstance(result, _TimedOut)
            errors += sum(v is None for v in values)
            scores.extend(self.error_score if v is None else v for v in values)
        return Scored(scores, errors, {"timeouts": float(timeouts)})

    def _run(self, args: tuple):
        """The call's result, or the exception it ended with."""
        try:
            return _in_thread(self.fn, args, self.timeout_s) if self.timeout_s > 0 else self.fn(*args)
        except Exception as e:  # noqa: BLE001 - a user function's failure is scored, not raised
            return e

    async def _run_async(self, calls: list[tuple]) -> list:
        async def one(args):
            try:
                return await asyncio.wait_for(self.fn(*args), self.timeout_s or None)
            except asyncio.TimeoutError:
                return _TimedOut()
            except Exception as e:  # noqa: BLE001
                return e
        return await asyncio.gather(*(one(a) for a in calls))

    def _values(self, result, width: int) -> list[float | None]:
        """``width`` scores of one call's result (None: an error), warning once per kind of error."""
        if isinstance(result, Exception):
            what = "timed out" if isinstance(result, _TimedOut) else f"raised {type(result).__name__}: {result}"
            self._warn(what.split(":")[0], what)
            return [None] * width
        if not self.batched:
            value = finite_score(result)
            if value is None:
                self._warn("value", f"returned {result!r}, not a finite number")
            return [value]
        if not isinstance(result, (list, tuple)) or len(result) != width:
            self._warn("length", f"returned {type(result).__name__} for {width} responses, not a list of {width}")
            return [None] * width
        values = [finite_score(v) for v in result]
        if None in values:
            self._warn("value", "returned values that are not finite numbers")
        return values

    def _warn(self, kind: str, what: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("reward function %s %s; scored %s and counted (further ones are counted, not logged)",
                        self.path, what, self.error_score)
