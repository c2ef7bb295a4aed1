"""Tools: a callable with a name, a description and a JSON schema of its parameters.

A tool is named in a recipe by a built-in name (:data:`BUILTIN_TOOLS`: ``calculator``) or an
import path ``'package.module:attr'`` whose attribute is a :class:`Tool` (e.g. made with the
:func:`tool` decorator) or a plain function (its schema read from its signature and docstring)::

    @tool(description="Look a word up.", timeout_s=5.0)
    def lookup(word: str) -> str:
        ...

A tool is called with the call's ``arguments`` as keyword arguments; it may be ``async def``.
Its return value becomes the tool message: a string as is, anything else as JSON. It signals a
refusal by raising :class:`ToolError` (its message goes back to the model); any other exception is
reported as ``<Type>: <message>``. Either way the environment counts an error and goes on.
"""
from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from yatt.imports import load_callable

BUILTIN_TOOLS = {"calculator": "yatt.env.calculator:CALCULATOR"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_CHECK = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
          "object": (dict,), "null": (type(None),)}


class ToolError(Exception):
    """A tool's refusal of a call: the message is returned to the model as the tool result."""


@dataclass(frozen=True)
class Tool:
    """A tool (see the module docstring).

    Args:
        name: ``[A-Za-z_][A-Za-z0-9_.-]*``, at most 64 characters; the name calls use.
        description: what it does, for the model.
        parameters: JSON schema of the arguments, ``{"type": "object", "properties": {...},
            "required": [...]}``.
        fn: called with the arguments as keyword arguments; plain or ``async def``.
        timeout_s: seconds a call may take; ``None``: the environment's ``tool_timeout_s``.
    Raises:
        ValueError: a bad name, a schema that is not an object schema, or ``fn`` not callable.
    """
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] = field(repr=False)
    timeout_s: float | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r}: must match {_NAME.pattern}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema with type 'object'")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn is not callable")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates take in ``tools=[...]``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """Why ``arguments`` do not fit :attr:`parameters` (required, unknown and top-level JSON
        types only), or ``None`` when they do."""
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"missing argument(s) {', '.join(map(repr, missing))} for tool {self.name!r}"
        if self.parameters.get("additionalProperties", False) is False:
            extra = [k for k in arguments if k not in props]
            if extra:
                return f"unknown argument(s) {', '.join(map(repr, extra))} for tool {self.name!r}"
        for key, value in arguments.items():
            want = props.get(key, {}).get("type")
            kinds = [want] if isinstance(want, str) else list(want or [])
            ok = [t for t in kinds if t in _CHECK]
            if ok and not any(isinstance(value, _CHECK[t]) and not (isinstance(value, bool) and t != "boolean")
                              for t in ok):
                return f"argument {key!r} of tool {self.name!r} must be of type {' or '.join(ok)}"
        return None


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         parameters: dict | None = None, timeout_s: float | None = None):
    """Make a :class:`Tool` of a function: ``@tool`` or ``@tool(name=..., timeout_s=...)``.

    Defaults: ``name`` the function's name, ``description`` its docstring's first paragraph,
    ``parameters`` from its signature (annotations ``str int float bool list dict``; a parameter
    without a default is required; descriptions from a Google-style ``Args:`` section).

    Raises:
        ValueError: the signature has ``*args`` / ``**kwargs`` (and no ``parameters`` was given),
            or :class:`Tool` refuses the result.
    """
    def make(f: Callable) -> Tool:
        doc = inspect.getdoc(f) or ""
        return Tool(name or f.__name__, description if description is not None else doc.split("\n\n")[0].strip(),
                    parameters if parameters is not None else schema_from_signature(f), f, timeout_s)
    return make(fn) if fn is not None else make


def schema_from_signature(fn: Callable) -> dict[str, Any]:
    """The JSON object schema of ``fn``'s keyword parameters (see :func:`tool`).

    Raises:
        ValueError: ``fn`` takes ``*args`` or ``**kwargs``.
    """
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: no types
        hints = {}
    docs = _arg_docs(inspect.getdoc(fn) or "")
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: *args/**kwargs need an explicit parameters schema")
        prop: dict[str, Any] = {}
        if (t := _JSON_TYPES.get(typing.get_origin(hints.get(p.name)) or hints.get(p.name))) is not None:
            prop["type"] = t
        if p.name in docs:
            prop["description"] = docs[p.name]
        props[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "object", "properties": props, "required": required}


def _arg_docs(doc: str) -> dict[str, str]:
    """``name: text`` lines of a docstring's ``Args:`` section."""
    out, inside = {}, False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            inside = True
        elif inside and line and not line.startswith(" "):
            break
        elif inside and (m := re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", line)):
            out[m.group(1)] = m.group(2).strip()
    return out


def resolve_tool(spec: str | Tool | Callable, key: str = "tools") -> Tool:
    """The :class:`Tool` a recipe names.

    Args:
        spec: a built-in name, ``'package.module:attr'`` (a Tool or a function), a Tool or a function.
        key: the config key, for messages.
    Raises:
        ValueError: an unknown name, an import path that does not load, or an attribute that is
            not a tool; the message starts with ``key``.
    """
    if isinstance(spec, str):
        path = BUILTIN_TOOLS.get(spec, spec)
        if ":" not in path:
            raise ValueError(f"{key}: {spec!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) "
                             "nor an import path 'package.module:function'")
        spec = load_callable(path, key)
    if isinstance(spec, Tool):
        return spec
    if callable(spec):
        try:
            return tool(spec)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    raise ValueError(f"{key}: {spec!r} is not a tool")


def resolve_tools(specs: Iterable[str | Tool | Callable], key: str = "tools") -> dict[str, Tool]:
    """:func:`resolve_tool` of each spec (``key[i]`` in messages), by name.

    Raises:
        ValueError: as :func:`resolve_tool`, or two tools with one name.
    """
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        t = resolve_tool(spec, f"{key}[{i}]")
        if t.name in tools:
            raise ValueError(f"{key}[{i}]: a second tool named {t.name!r}")
        tools[t.name] = t
    return tools
