"""Tool-use transcripts of a reasoning-gym task, for a supervised cold start before RL with tools.

A policy that never writes a tool call cannot learn from RL to use the tool: RL only reweighs
what the policy samples. SmolLM2-135M-Instruct wrote no ``<tool_call>`` in 32 samples of 3-digit
arithmetic with the calculator advertised, also with a one-shot example (2026-12-06). A few SFT
steps on transcripts of the format its episodes will use make tool calls likely enough to learn
from. Each transcript is what :class:`~yatt.env.tools.ToolEnv` makes of the row, so SFT and RL
see the same text::

    system (the tools advertised) / user: question / assistant: <tool_call>{calculator}</tool_call>
    / user: <tool_response>result</tool_response> / assistant: <answer>answer</answer>

Write them as a chat-format jsonl (``data.messages_key``) for ``stage: sft``::

    python -m yatt.env.transcripts --out data/tool_sft.jsonl --size 400 \\
        --task-config '{"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3}'
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from yatt.env.tool_parser import format_tool_call
from yatt.env.tools import ToolEnv


def transcript(row: dict[str, Any], env: ToolEnv) -> dict[str, Any]:
    """The chat row of one reasoning-gym ``row`` (``question``, ``answer`` and
    ``metadata.expression``): the calculator called on the expression, then the answer in
    ``<answer>`` tags.

    Raises:
        KeyError: the row has no ``metadata.expression``.
        ValueError: the calculator cannot evaluate it (its error would be the tool's result).
    """
    expression = row["metadata"]["expression"]
    messages = env.reset(row)
    call = format_tool_call("calculator", {"expression": expression})
    result = env.step(messages, call)
    if result.done or result.info.get("tool_errors"):
        raise ValueError(f"the calculator did not evaluate {expression!r}: {result.observation}")
    return {"messages": [*messages, {"role": "assistant", "content": call}, *result.observation,
                         {"role": "assistant", "content": f"<answer>{row['answer']}</answer>"}],
            "answer": row["answer"]}


def transcripts(task: str, size: int, seed: int, task_config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """:func:`transcript` of each of ``size`` rows of the reasoning-gym ``task`` (seeded)."""
    import reasoning_gym as rg

    env = ToolEnv()
    for row in rg.create_dataset(task, size=size, seed=seed, **task_config):
        yield transcript(row, env)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m yatt.env.transcripts", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="jsonl file to write")
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--task-config", default="{}", help="the task's keyword arguments, as JSON")
    ap.add_argument("--size", type=int, default=400)
    ap.add_argument("--seed", type=int, default=7, help="keep it apart from the RL data's seed")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = list(transcripts(args.task, args.size, args.seed, json.loads(args.task_config)))
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} transcripts to {out}")


if __name__ == "__main__":
    main()
