"""Many episodes in lock-step: reset all, then each turn step every active episode at once.

An environment that raises (or returns something malformed) ends *its* episode: the result is
``done`` with ``info["end_reason"] == "env_error"``, ``info["env_errors"] == 1`` and
``info["error"]`` the message; the other episodes go on. The rollout gives that episode
``error_score``.
"""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from yatt.env.base import END_ENV_ERROR, StepResult, check_messages, check_result


def env_error(exc: BaseException) -> StepResult:
    """The result standing for an environment that failed with ``exc``."""
    return StepResult([], True, None, {"end_reason": END_ENV_ERROR, "env_errors": 1.0,
                                       "error": f"{type(exc).__name__}: {exc}"[:500]})


def reset_all(envs: Sequence[Any], rows: Sequence[dict[str, Any]]) -> list[StepResult]:
    """``env.reset(row)`` of each pair, as results: ``observation`` the initial messages
    (not ``done``), or an :func:`env_error` result (also for an empty or malformed message list)."""
    if len(envs) != len(rows):
        raise ValueError(f"reset_all: {len(envs)} environments, {len(rows)} rows")
    out = []
    for env, row in zip(envs, rows):
        try:
            messages = check_messages(env.reset(row), f"{type(env).__name__}.reset")
            if not messages:
                raise ValueError(f"{type(env).__name__}.reset returned no messages")
            out.append(StepResult(messages, False))
        except Exception as e:  # noqa: BLE001 - ends this episode only
            out.append(env_error(e))
    return out


def step_all(envs: Sequence[Any], histories: Sequence[list[dict[str, Any]]], responses: Sequence[str],
             max_concurrency: int = 64) -> list[StepResult]:
    """One turn of every episode given: ``env.astep`` (or ``env.step``) of each, concurrently on an
    event loop of its own, at most ``max_concurrency`` at a time. Results in the order given.

    Raises:
        ValueError: the three sequences differ in length.
        RuntimeError: called from a running event loop (await :func:`astep_all` there).
    """
    return asyncio.run(astep_all(envs, histories, responses, max_concurrency))


async def astep_all(envs: Sequence[Any], histories: Sequence[list[dict[str, Any]]], responses: Sequence[str],
                    max_concurrency: int = 64) -> list[StepResult]:
    """:func:`step_all` on the running event loop."""
    if not len(envs) == len(histories) == len(responses):
        raise ValueError(f"step_all: {len(envs)} environments, {len(histories)} histories, "
                         f"{len(responses)} responses")
    gate = asyncio.Semaphore(max(1, max_concurrency))

    async def one(env, history, response) -> StepResult:
        async with gate:
            try:
                astep = getattr(env, "astep", None)
                if inspect.iscoroutinefunction(astep):
                    result = await astep(history, response)
                else:
                    result = env.step(history, response)
                return check_result(result, f"{type(env).__name__}.step")
            except Exception as e:  # noqa: BLE001 - ends this episode only
                return env_error(e)

    return list(await asyncio.gather(*(one(*args) for args in zip(envs, histories, responses))))


def sum_counts(infos: Iterable[dict[str, Any]]) -> dict[str, float]:
    """The numeric entries of ``infos`` summed by key (an episode's turns, or a rank's episodes);
    strings such as ``end_reason`` are left out."""
    total: dict[str, float] = {}
    for info in infos:
        for key, value in info.items():
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0.0) + float(value)
    return total
