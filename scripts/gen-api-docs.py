#!/usr/bin/env python3
"""Write docs/api.md from the public API's docstrings (``pvisor_host.__all__``): ``--check`` fails when the
committed page differs from what the code says."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path

import pvisor_host

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"

HEAD = """# Python API

Generated from the docstrings by `scripts/gen-api-docs.py`; do not edit by hand (`make docs-api` rewrites it,
and a test fails when it is stale).

{intro}

"""


def doc(obj: object) -> str:
    return textwrap.dedent(inspect.getdoc(obj) or "").strip()


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string right after a field) of ``cls`` and its bases."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in zip(body, body[1:], strict=False):
            is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
                found[node.target.id] = " ".join(str(following.value.value).split())  # type: ignore[attr-defined]
    return found


def type_name(annotation: object) -> str:
    """A field's type as one reads it: ``Annotated`` metadata (validators, constraints) left out."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(arg) for arg in args)}]"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def model(name: str, cls: type) -> list[str]:
    lines = [f"### `{name}`", "", doc(cls), ""]
    fields = getattr(cls, "model_fields", {})
    if fields:
        notes = field_docs(cls)
        lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
        for field, info in fields.items():
            kind = type_name(info.annotation).replace("|", "\\|")
            default = "required" if info.is_required() else f"`{info.get_default(call_default_factory=True)!r}`"
            note = notes.get(field, "").replace("|", "\\|")
            lines.append(f"| `{field}` | `{kind}` | {default} | {note} |")
        lines.append("")
    return lines


def function(name: str, obj: object) -> list[str]:
    signature = str(inspect.signature(obj))  # type: ignore[arg-type]
    lines = [f"### `{name}{signature}`", "", doc(obj), ""]
    if inspect.isclass(obj):
        for member, value in vars(obj).items():
            if member.startswith("_") or not (callable(value) or isinstance(value, property)):
                continue
            target = value.fget if isinstance(value, property) else value
            head = (
                f"`{name}.{member}`" if isinstance(value, property) else f"`{name}.{member}{inspect.signature(target)}`"
            )
            lines += [f"- {head}: {' '.join(doc(target).split())}"]
        lines.append("")
    return lines


def batch_options() -> list[str]:
    """The keyword arguments of ``batch`` and ``abatch``: the fields of the models a batch's options are (the
    ``batch`` command's options are made from the same fields)."""
    from pvisor_host.fanout.options import MODELS

    lines = [
        "`batch(items, out=..., **options)` and `abatch` take these as keywords, the `batch` command as options "
        "(`image_budget` is `--image-budget`); any other keyword is a replay option every item starts from "
        "(`ReplaySpec`'s fields), or the build's (`base`, `ca_bundle`).",
        "",
    ]
    for cls in MODELS:
        lines += model(cls.__name__, cls)
    return lines


def render() -> str:
    parts = [HEAD.format(intro=doc(pvisor_host))]
    sections = {"Functions": [], "Models": [], "Errors": []}  # type: dict[str, list[str]]
    for name in pvisor_host.__all__:
        if name.startswith("__") or name == "PVISOR_VERSION":
            continue
        obj = getattr(pvisor_host, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            sections["Errors"] += [f"### `{name}`", "", doc(obj), ""]
        elif inspect.isclass(obj) and hasattr(obj, "model_fields"):
            sections["Models"] += model(name, obj)
        elif inspect.isclass(obj) and name == "ExitCode":
            codes = ", ".join(f"`{c.name}` = {c.value}" for c in obj)  # type: ignore[attr-defined]
            sections["Errors"] += [f"### `{name}`", "", doc(obj), "", codes, ""]
        else:
            sections["Functions"] += function(name, obj)
    sections["Batch options"] = batch_options()
    for title, lines in sections.items():
        parts.append(f"## {title}\n\n" + "\n".join(lines).strip() + "\n\n")
    return "".join(parts).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{PAGE} is stale: run `make docs-api`\n")
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
