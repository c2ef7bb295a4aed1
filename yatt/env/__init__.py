"""Environments and tools for multi-turn rollouts (``rollout.env``): the protocol
(:mod:`~yatt.env.base`), lock-step batch helpers (:mod:`~yatt.env.batch`), the tool-calling
environment (:mod:`~yatt.env.tools`), the Hermes/Qwen tool-call parser
(:mod:`~yatt.env.tool_parser`), the tool registry (:mod:`~yatt.env.registry`), the calculator
(:mod:`~yatt.env.calculator`) and chat-template helpers (:mod:`~yatt.env.template`).
"""
from yatt.env.base import BUILTIN_ENVS, END_ANSWER, END_ENV_ERROR, EnvFactory, Environment, StepResult, load_env
from yatt.env.batch import astep_all, reset_all, step_all, sum_counts
from yatt.env.registry import BUILTIN_TOOLS, Tool, ToolError, resolve_tool, resolve_tools, tool
from yatt.env.tool_parser import ParsedResponse, ToolCall, ToolCallError, parse_tool_calls
from yatt.env.tools import ToolEnv

__all__ = ["BUILTIN_ENVS", "BUILTIN_TOOLS", "END_ANSWER", "END_ENV_ERROR", "EnvFactory", "Environment",
           "ParsedResponse", "StepResult", "Tool", "ToolCall", "ToolCallError", "ToolEnv", "ToolError",
           "astep_all", "load_env", "parse_tool_calls", "reset_all", "resolve_tool", "resolve_tools",
           "step_all", "sum_counts", "tool"]
