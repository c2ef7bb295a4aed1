"""Environments for tests, loaded by import path (``rollout.env=envs:Name``)."""
from yatt.env import StepResult


class Continue:
    """Never done: after every model turn the user says ``go on (turn k)``, with a per-turn reward
    of 0.1 and a counter, so an episode runs until a limit ends it (``rollout.max_turns``)."""

    def reset(self, row):
        return [{"role": "user", "content": row["question"]}]

    def step(self, messages, response):
        k = sum(m["role"] == "assistant" for m in messages) + 1
        return StepResult([{"role": "user", "content": f"go on (turn {k})"}], reward=0.1, info={"tool_calls_go": 1})
