"""Templates that name each item's image and id from its row: ``--image TEMPLATE`` and ``--id TEMPLATE``.

A template is text with fields in braces, each optionally passed through filters::

    registry.example/tasks/{instance_id|lower}:v1
    swebench/sweb.eval.x86_64.{id|swebench}:latest

The fields are the row's columns (a manifest's keys, a CSV's or Parquet's columns, after ``--map``), the
trajectory's ``{stem}``, ``{name}`` and ``{parent}`` (its file name without and with the suffix, and its
directory's name), and ``{id}``, the item's id before any ``-after<N>`` suffix. ``{{`` and ``}}`` are
literal braces.

Filters: ``lower``, ``upper``, ``slug`` (anything but letters, digits, ``.``, ``_`` and ``-`` becomes ``_``),
and ``swebench``, SWE-bench's image name for an instance id (lowercased, ``__`` replaced by ``_1776_``:
``django__django-11099`` → ``django_1776_django-11099``).

A template may also be a named preset, ``@swebench``, which is
``swebench/sweb.eval.x86_64.{id|swebench}:latest`` (``@`` starts no image reference, so a preset is never
mistaken for one).

Written here rather than with :class:`string.Formatter` alone: its format specs and conversions (``{x!r}``,
``{x:>10}``) are not filters, and attribute or index look-ups (``{x.y}``, ``{x[0]}``) have no place in an
image name. The parsing is still the standard library's (``string.Formatter().parse``).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeGuard

from pydantic import BaseModel, ConfigDict

from ..errors import UsageError


def swebench_id(value: str) -> str:
    """SWE-bench's form of an instance id in image names: ``__`` → ``_1776_``, lowercased."""
    return value.replace("__", "_1776_").lower()


FILTERS: dict[str, Callable[[str], str]] = {
    "lower": str.lower,
    "upper": str.upper,
    "slug": lambda value: re.sub(r"[^A-Za-z0-9_.-]+", "_", value),
    "swebench": swebench_id,
}
PRESETS = {"swebench": "swebench/sweb.eval.x86_64.{id|swebench}:latest"}
"""Named templates (``--image @swebench``)."""
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class Template(BaseModel):
    """A parsed template (see the module docstring)."""

    model_config = ConfigDict(frozen=True)

    text: str
    """As given (a preset by its ``@name``)."""
    parts: tuple[tuple[str, str | None, tuple[str, ...]], ...]
    """(literal text, field or None, filters) in order."""

    @property
    def fields(self) -> set[str]:
        """The fields it reads."""
        return {field for _, field, _ in self.parts if field is not None}

    def render(self, values: Mapping[str, object]) -> str:
        """The text with every field filled in from ``values``.

        Raises:
            UsageError: a field that ``values`` lacks (naming the ones it has), or one that is empty.
        """
        out: list[str] = []
        for literal, field, filters in self.parts:
            out.append(literal)
            if field is None:
                continue
            value = values.get(field)
            if value is None or value == "":
                have = ", ".join(sorted(k for k, v in values.items() if v not in (None, "")))
                raise UsageError(f"{self.text}: no value for {{{field}}} (this item has {have})")
            text = str(value)
            for name in filters:
                text = FILTERS[name](text)
            out.append(text)
        return "".join(out)


def is_template(value: object) -> TypeGuard[str]:
    """Whether a value is a template (or a preset) rather than a name as it is."""
    return isinstance(value, str) and ("{" in value or value.startswith("@"))


def parse_template(text: str, *, flag: str) -> Template:
    """Parse ``text`` (a preset by its ``@name``).

    Raises:
        UsageError: one line naming ``flag``: unknown preset or filter, unbalanced braces, a bad field.
    """
    source = text
    if text.startswith("@"):
        if text[1:] not in PRESETS:
            raise UsageError(f"{flag} {text}: no preset {text[1:]!r}; presets: {', '.join('@' + p for p in PRESETS)}")
        source = PRESETS[text[1:]]
    try:
        parsed = list(string.Formatter().parse(source))
    except ValueError as exc:
        raise UsageError(f"{flag} {text!r}: {exc}") from None
    parts: list[tuple[str, str | None, tuple[str, ...]]] = []
    for literal, field, spec, conversion in parsed:
        if field is None:
            parts.append((literal, None, ()))
            continue
        # "{a|lower}" reaches us as the field "a|lower"; a ":" or "!" belongs to str.format, not to us.
        if spec or conversion:
            raise UsageError(f"{flag} {text!r}: {{{field}}}: use filters ({{x|lower}}), not format specs")
        name, *filters = [piece.strip() for piece in field.split("|")]
        if not _FIELD.match(name):
            raise UsageError(f"{flag} {text!r}: {{{field}}} names no field")
        unknown = [f for f in filters if f not in FILTERS]
        if unknown:
            raise UsageError(f"{flag} {text!r}: no filter {unknown[0]!r}; filters: {', '.join(FILTERS)}")
        parts.append((literal, name, tuple(filters)))
    return Template(text=text, parts=tuple(parts))


def path_fields(trajectory: str | Path) -> dict[str, str]:
    """``stem``, ``name`` and ``parent`` of a trajectory path."""
    path = Path(trajectory)
    return {"stem": path.stem, "name": path.name, "parent": path.parent.name}
