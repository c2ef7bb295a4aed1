"""The environment protocol (yatt/env/base.py, batch.py): load_env by import path (and bad paths),
many episodes in lock-step, and an environment that raises or breaks the contract ending only its
own episode (no model)."""
import asyncio

import pytest

from yatt.env import END_ENV_ERROR, Environment, StepResult, ToolEnv, load_env, reset_all, step_all, sum_counts
from yatt.env.base import EnvFactory


class CountDown(Environment):
    """Done after `turns` steps (from the row); a reward of 1 per turn that says "yes"."""

    def __init__(self, greeting: str = "Hi"):
        self.greeting, self.left = greeting, None

    def reset(self, row):
        self.left = row["turns"]
        return [{"role": "user", "content": f"{self.greeting}: {row['question']}"}]

    def step(self, messages, response):
        self.left -= 1
        reward = 1.0 if "yes" in response else 0.0
        if self.left == 0:
            return StepResult([], True, reward, {"end_reason": "answer", "says": 1})
        return StepResult([{"role": "user", "content": f"{self.left} left"}], False, reward, {"says": 1})


class AsyncEcho(Environment):
    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, messages, response):
        raise AssertionError("the batch helpers use astep")

    async def astep(self, messages, response):
        await asyncio.sleep(0)
        return StepResult([], True, None, {"end_reason": "answer"})


class Duck:  # no base class: reset and step are enough
    def reset(self, row):
        return [{"role": "user", "content": "quack"}]

    def step(self, messages, response):
        return StepResult([], True)


class Broken(Environment):
    def __init__(self, mode: str = "raise"):
        self.mode = mode

    def reset(self, row):
        if self.mode == "reset":
            raise KeyError("question")
        if self.mode == "reset_empty":
            return []
        if self.mode == "reset_bad":
            return [{"role": "user", "content": 3}]
        return [{"role": "user", "content": "q"}]

    def step(self, messages, response):
        return {
            "raise": lambda: 1 / 0,
            "not_a_result": lambda: ([], True),
            "no_observation": lambda: StepResult([], False),
            "bad_observation": lambda: StepResult([{"role": "tool"}], False),
            "bad_reward": lambda: StepResult([], True, float("nan")),
            "bool_done": lambda: StepResult([], 1),
        }[self.mode]()


class NoStep:
    def reset(self, row):
        return []


def needs_a_value(value):
    return CountDown()


def here(name: str) -> str:
    return f"{__name__}:{name}"


def test_load_env_gives_a_factory_of_fresh_instances():
    factory = load_env(here("CountDown"), greeting="Hello")
    assert isinstance(factory, EnvFactory) and factory.kwargs == {"greeting": "Hello"}
    a, b = factory(), factory()
    assert a is not b and a.greeting == "Hello"
    assert isinstance(load_env("tools")(), ToolEnv)
    assert isinstance(load_env("yatt.env.tools:ToolEnv")(), ToolEnv)
    assert isinstance(load_env(here("Duck"))(), Duck)
    assert isinstance(load_env(here("needs_a_value"), value=1)(), CountDown)  # a factory function is fine


@pytest.mark.parametrize("path, kwargs, says", [
    ("CountDown", {}, "is not 'package.module:Class' nor a built-in environment (tools)"),
    (":CountDown", {}, "is not 'package.module:Class'"),
    ("tests.x:", {}, "is not 'package.module:Class'"),
    ("no_such_pkg_xyz.envs:Env", {}, "cannot load 'no_such_pkg_xyz.envs:Env' (ModuleNotFoundError"),
    (f"{__name__}:Missing", {}, "cannot load"),
    ("yatt.env.base:KEY", {}, "is a str, not a class"),
    (f"{__name__}:CountDown", {"colour": "red"}, "cannot be made with {'colour': 'red'} (TypeError"),
    (f"{__name__}:needs_a_value", {}, "cannot be made with {} (TypeError"),
    (f"{__name__}:NoStep", {}, "makes a NoStep, which has no step method"),
    (3, {}, "expected 'package.module:Class', got int"),
])
def test_load_env_bad_paths_name_the_config_key(path, kwargs, says):
    with pytest.raises(ValueError) as e:
        load_env(path, **kwargs)
    assert str(e.value).startswith("rollout.env: ") and says in str(e.value), str(e.value)


def test_lock_step_episodes_of_different_lengths():
    """The rollout's loop: one batched 'engine call' per turn over the active episodes only."""
    factory = load_env(here("CountDown"))
    rows = [{"question": f"q{i}", "turns": t} for i, t in enumerate([1, 3, 2])]
    envs = [factory() for _ in rows]
    starts = reset_all(envs, rows)
    assert [s.observation for s in starts] == [[{"role": "user", "content": f"Hi: q{i}"}] for i in range(3)]
    conversations = [s.observation for s in starts]
    active, infos, rewards, turns = [0, 1, 2], [[] for _ in rows], [[] for _ in rows], 0
    while active:
        turns += 1
        responses = [f"yes {i}" if i != 1 else "no" for i in active]  # the engine's batched call
        results = step_all([envs[i] for i in active], [conversations[i] for i in active], responses)
        for i, response, result in zip(active, responses, results):
            conversations[i] = conversations[i] + [{"role": "assistant", "content": response}] + result.observation
            infos[i].append(result.info)
            rewards[i].append(result.reward)
        active = [i for i, r in zip(active, results) if not r.done]
    assert turns == 3 and [len(r) for r in rewards] == [1, 3, 2]
    assert rewards == [[1.0], [0.0, 0.0, 0.0], [1.0, 1.0]]
    assert conversations[1][-2:] == [{"role": "user", "content": "1 left"}, {"role": "assistant", "content": "no"}]
    assert [sum_counts(i) for i in infos] == [{"says": 1}, {"says": 3}, {"says": 2}]
    assert [i[-1]["end_reason"] for i in infos] == ["answer"] * 3


def test_step_all_uses_astep_and_accepts_duck_typed_environments():
    results = step_all([AsyncEcho(), Duck()], [[], []], ["a", "b"])
    assert [r.done for r in results] == [True, True]


def test_the_default_astep_calls_step():
    env = CountDown()
    env.reset({"question": "q", "turns": 2})
    assert asyncio.run(env.astep([], "yes")).reward == 1.0 and env.left == 1


@pytest.mark.parametrize("mode, says", [
    ("raise", "ZeroDivisionError: division by zero"),
    ("not_a_result", "step returned tuple, not a StepResult"),
    ("no_observation", "not done, but no observation"),
    ("bad_observation", "observation[0]: expected {'role': str, 'content': str}"),
    ("bad_reward", "reward nan is not a finite number"),
    ("bool_done", "done is int, not bool"),
])
def test_a_failing_environment_ends_only_its_episode(mode, says):
    good = load_env(here("CountDown"))()
    good.reset({"question": "q", "turns": 2})
    results = step_all([good, Broken(mode)], [[], []], ["yes", "x"])
    assert not results[0].done and results[0].reward == 1.0
    bad = results[1]
    assert bad.done and bad.observation == [] and bad.reward is None
    assert bad.info["end_reason"] == END_ENV_ERROR and bad.info["env_errors"] == 1 and says in bad.info["error"]


@pytest.mark.parametrize("mode, says", [("reset", "KeyError: 'question'"), ("reset_empty", "returned no messages"),
                                        ("reset_bad", "reset[0]: expected")])
def test_a_failing_reset_ends_only_its_episode(mode, says):
    results = reset_all([Broken(mode), Duck()], [{}, {}])
    assert results[0].done and results[0].info["end_reason"] == END_ENV_ERROR and says in results[0].info["error"]
    assert not results[1].done and results[1].observation == [{"role": "user", "content": "quack"}]


def test_lengths_must_match():
    with pytest.raises(ValueError, match="2 environments, 1 histories"):
        step_all([Duck(), Duck()], [[]], ["a", "b"])
    with pytest.raises(ValueError, match="1 environments, 2 rows"):
        reset_all([Duck()], [{}, {}])


def test_sum_counts_skips_strings():
    assert sum_counts([{"a": 1, "end_reason": "answer"}, {"a": 2.5, "b": True}]) == {"a": 3.5, "b": 1.0}
