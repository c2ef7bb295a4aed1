"""The config reference, generated from the typed config (:mod:`yatt.config`).

    python -m yatt.config_reference            # (re)write docs/config.md
    python -m yatt.config_reference --check    # exit 1 if docs/config.md is out of date

Every key of a recipe, with its type, default, allowed range and meaning (each field's
``description``), one table per section in the order of :class:`yatt.config.Config`.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel

from yatt.config import Config, tagged_members

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
           (annotated_types.Le, "le", "<="))


def _type(ann) -> str:
    """A recipe writer's name for a field type: ``int``, ``float or null``, ``one of "a", "b"``."""
    if tagged_members(ann):
        return "list of mappings, each by its `type`: " + ", ".join(f'"{t}"' for t in tagged_members(ann))
    if typing.get_origin(ann) is typing.Literal:
        return "one of " + ", ".join(json.dumps(a) for a in typing.get_args(ann))
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type(a) for a in typing.get_args(ann))
    if typing.get_origin(ann) is list:
        return f"list of ({_type(typing.get_args(ann)[0])})"
    if typing.get_origin(ann) is dict or (isinstance(ann, type) and issubclass(ann, BaseModel)):
        return "mapping"
    return getattr(ann, "__name__", str(ann))


def _markdown(rst: str) -> str:
    """A docstring paragraph in Markdown: one line, ``x`` and :role:`x` as `x`."""
    return re.sub(r":\w+:`", "`", " ".join(rst.split()).replace("``", "`"))


def _range(field) -> str:
    return ", ".join(f"{sign} {getattr(m, attr)}" for m in field.metadata for kind, attr, sign in _BOUNDS
                     if isinstance(m, kind))


def _optional_section(ann) -> type[BaseModel] | None:
    """The section of a ``Section | None`` field (off when null, e.g. ``trainer.lora``), else None."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and type(None) in typing.get_args(ann):
            return models[0]
    return None


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, type[BaseModel]]]:
    """(title, key prefix, model) of every section (an optional one too), a list item of each
    ``type`` as its own."""
    out = [(prefix.rstrip(".") or "top level", prefix, model)]
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += _sections(field.annotation, f"{prefix}{name}.")
        elif section := _optional_section(field.annotation):
            out += _sections(section, f"{prefix}{name}.")
        for tag, member in (tagged_members(field.annotation) or {}).items():
            out.append((f"{prefix}{name}[]` of type `{tag}", f"{prefix}{name}[].", member))
    return out


def render() -> str:
    """The Markdown of docs/config.md.

    Raises:
        ValueError: a field has no ``description``.
    """
    lines = ["# Config reference", "",
             "Generated from `yatt/config.py` by `python -m yatt.config_reference`; do not edit by hand.",
             "Set any key in a YAML recipe or on the command line (`trainer.total_steps=5`).", ""]
    for title, prefix, model in _sections(Config):
        lines += [f"## `{title}`", ""]
        if prefix and model.__doc__:
            lines += [_markdown(model.__doc__), ""]
        lines += ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                continue
            if not field.description:
                raise ValueError(f"config key '{prefix}{name}' has no description")
            default = "required" if field.is_required() else \
                f"`{json.dumps(field.get_default(call_default_factory=True))}`"
            lines.append(f"| `{prefix}{name}` | {_type(field.annotation)} | {default} | {_range(field)} | "
                         f"{field.description.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m yatt.config_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python -m yatt.config_reference", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
