"""Episodes through a tokenizer's chat template (any object with transformers'
``apply_chat_template``): which tool options a template needs, and the text a turn's observation
adds, for a rollout that appends tokens turn by turn instead of re-rendering the conversation.
"""
from __future__ import annotations

from typing import Any

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE = [{"role": "user", "content": "hi"}]


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes ``tools=`` into the prompt (Qwen2.5's does; SmolLM2-135M-
    Instruct's ignores it, and renders a ``tool`` message as an ``<|im_start|>tool`` turn the model
    never saw)."""
    def render(tools):
        return tokenizer.apply_chat_template(_PROBE, tools=tools, tokenize=False, add_generation_prompt=True)
    return "probe_tool" in render([_PROBE_TOOL]) and render([_PROBE_TOOL]) != render(None)


def tool_options(tokenizer: Any) -> dict[str, str]:
    """:class:`~yatt.env.tools.ToolEnv` options for this template: native tools and the ``tool``
    role where the template renders tools, else tools in the system message and results in user
    turns (which on Qwen2.5 renders alike)."""
    if renders_tools(tokenizer):
        return {"tools_in": "template", "tool_role": "tool"}
    return {"tools_in": "system", "tool_role": "user"}


def observation_text(tokenizer: Any, history: list[dict[str, Any]], response: str,
                     observation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                     generated_stop: str | None = None) -> str:
    """The text the template puts after the model's ``response`` to ``history``: the end of the
    assistant turn, the ``observation`` turns and the next generation prompt. For ChatML
    (Qwen2.5, SmolLM2): ``<|im_end|>\\n<|im_start|>user\\n<tool_response>...<|im_start|>assistant\\n``.

    Args:
        history: the conversation the response answered (rendered with ``add_generation_prompt``).
        tools: the template's ``tools=`` (``env.chat_template_tools``).
        generated_stop: the text of the stop token the model generated (``<|im_end|>``); when the
            text starts with it, it is left out (those tokens are the model's).
    Raises:
        ValueError: the template does not render the longer conversation as an extension of the
            shorter (it rewrites earlier turns), so turns cannot be appended.
    """
    prefix = tokenizer.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True)
    prefix += response
    full = tokenizer.apply_chat_template(history + [{"role": "assistant", "content": response}] + observation,
                                         tools=tools, tokenize=False, add_generation_prompt=True)
    if not full.startswith(prefix):
        raise ValueError("the chat template does not extend the conversation turn by turn (it renders earlier "
                         "turns differently once later ones exist); multi-turn rollouts need one that does")
    text = full[len(prefix):]
    if generated_stop and text.startswith(generated_stop):
        text = text[len(generated_stop):]
    return text
