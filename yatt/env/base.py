"""The environment protocol: what a multi-turn episode talks to (``rollout.env``).

One environment **instance per episode**, made by the factory :func:`load_env` returns; it keeps
that episode's state on itself, so a rollout can hold many episodes and advance them in lock-step
(one batched engine call per turn, then :func:`yatt.env.batch.step_all` on every active episode)
without episodes sharing mutable state::

    make_env = load_env("package.module:Class", **kwargs)   # once per rank
    env = make_env()                                        # once per episode
    messages = env.reset(row)                               # the prompt's chat messages
    # the engine writes `response` (the assistant turn's text) for the chat `messages`
    result = env.step(messages, response)                   # StepResult
    messages += [{"role": "assistant", "content": response}] + result.observation

``step`` gets the conversation *before* the assistant turn and must not change it; the rollout
appends the assistant turn and ``observation``. A step that is not ``done`` must return at least
one observation message. ``async def astep`` is optional (the default calls ``step``); the batch
helpers use it so that slow environments (tools on a network) wait concurrently.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

BUILTIN_ENVS = {"tools": "yatt.env.tools:ToolEnv"}
KEY = "rollout.env"
# StepResult.info["end_reason"] values the environments here set; the rollout adds its own
# (e.g. max_turns, token_budget, context_length, truncated).
END_ANSWER, END_ENV_ERROR = "answer", "env_error"


@dataclass
class StepResult:
    """What one turn of an episode gave.

    Args:
        observation: chat messages (``{"role": str, "content": str, ...}``) to append after the
            model's assistant turn (e.g. tool results); empty when ``done``.
        done: the episode is over (the response was the final answer, or it failed).
        reward: an optional per-turn reward (``None``: none; the episode's reward is scored on the
            final answer as usual).
        info: numeric counters of this turn (summed over an episode by
            :func:`yatt.env.batch.sum_counts`), ``end_reason`` (str) when ``done``, ``error``
            (str) when the environment failed.
    """
    observation: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base class of environments (subclassing is optional: any class with ``reset`` and ``step``
    is accepted). See the module docstring for the contract."""

    #: The tool schemas to pass to the chat template (``apply_chat_template(..., tools=...)``) when
    #: rendering this episode, or ``None``.
    chat_template_tools: list[dict[str, Any]] | None = None

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The episode's initial chat messages.

        Args:
            row: the data row (``question``, ``answer``, ``metadata``, ``messages`` where the row
                has them, and the file's other fields).
        Raises:
            Exception: anything; the rollout ends the episode with ``error_score``.
        """
        raise NotImplementedError

    def step(self, messages: list[dict[str, Any]], response: str) -> StepResult:
        """One turn: the model wrote ``response`` after the conversation ``messages``.

        Raises:
            Exception: anything; the rollout ends the episode with ``error_score``.
        """
        raise NotImplementedError

    async def astep(self, messages: list[dict[str, Any]], response: str) -> StepResult:
        """:meth:`step` for an event loop; override to wait on I/O without blocking other episodes."""
        return self.step(messages, response)


@dataclass(frozen=True)
class EnvFactory:
    """Makes one environment per episode: ``factory()``. ``path`` as configured, ``target`` the
    class (or function) it names, ``kwargs`` its keyword arguments."""
    path: str
    target: Callable[..., Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self) -> Environment:
        return self.target(**self.kwargs)


def load_env(path: str, /, **kwargs: Any) -> EnvFactory:
    """The factory of the environment class at ``'package.module:Class'`` (or a built-in name of
    :data:`BUILTIN_ENVS`, ``tools``), checked by making one instance with ``kwargs``.

    Raises:
        ValueError: ``path`` is not of that form, does not import, names something that is not a
            class or function, the instance cannot be made with ``kwargs``, or it has no ``reset``
            or ``step`` method; the message starts with ``rollout.env``.
    """
    if not isinstance(path, str):
        raise ValueError(f"{KEY}: expected 'package.module:Class', got {type(path).__name__} {path!r}")
    full = BUILTIN_ENVS.get(path, path)
    module, sep, name = full.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{KEY}: {path!r} is not 'package.module:Class' nor a built-in environment "
                         f"({', '.join(BUILTIN_ENVS)})")
    try:
        target = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{KEY}: cannot load {path!r} ({type(e).__name__}: {e})") from None
    if not callable(target):
        raise ValueError(f"{KEY}: {path!r} is a {type(target).__name__}, not a class")
    factory = EnvFactory(path, target, dict(kwargs))
    try:
        env = factory()
    except Exception as e:  # noqa: BLE001 - a bad kwarg, or the class's own check
        raise ValueError(f"{KEY}: {path!r} cannot be made with {dict(kwargs)!r} ({type(e).__name__}: {e})") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"{KEY}: {path!r} makes a {type(env).__name__}, which has no {' or '.join(missing)} method")
    return factory


def check_messages(messages: Any, what: str) -> list[dict[str, Any]]:
    """``messages`` if it is a list of chat messages (dicts with string ``role`` and ``content``).

    Raises:
        ValueError: it is not; the message starts with ``what``.
    """
    if not isinstance(messages, list):
        raise ValueError(f"{what}: expected a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{what}[{i}]: expected {{'role': str, 'content': str}}, got {m!r:.80}")
    return messages


def check_result(result: Any, what: str) -> StepResult:
    """``result`` if it is a well-formed :class:`StepResult` (see its fields).

    Raises:
        ValueError: it is not, or it is not done and has no observation; starts with ``what``.
    """
    if not isinstance(result, StepResult):
        raise ValueError(f"{what}: step returned {type(result).__name__}, not a StepResult")
    check_messages(result.observation, f"{what}: observation")
    if not isinstance(result.done, bool):
        raise ValueError(f"{what}: done is {type(result.done).__name__}, not bool")
    if not result.done and not result.observation:
        raise ValueError(f"{what}: not done, but no observation to show the model")
    if result.reward is not None and (isinstance(result.reward, bool) or not isinstance(result.reward, (int, float))
                                      or not math.isfinite(result.reward)):
        raise ValueError(f"{what}: reward {result.reward!r} is not a finite number or None")
    if not isinstance(result.info, dict):
        raise ValueError(f"{what}: info is {type(result.info).__name__}, not dict")
    return result
