"""Which boundaries of a trajectory a batch item asks for: ``after_step`` as a dataset gives it.

A manifest row's ``after_step`` (and ``--after-step`` with ``--trajectories``) may be:

- a number, ``5``: that boundary;
- ``"all"``: every boundary of the trajectory; ``"last"``: its last one;
- a list, ``[1, 3, 5]`` (in a CSV cell, ``"1,3,5"``), or a range, ``"3-7"`` (both ends included), or a mix of
  them, ``"1,4-6"``.

``all`` and ``last`` need the trajectory's number of complete tool batches (pvisor's own count, asked once
per file: :mod:`pvisor_host.preflight.survey`); the others are known without reading the file. A selection
that names a boundary past the trajectory's last one keeps it: pvisor's pre-flight rejects that item with
its own reason, as it does any other.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..errors import UsageError

_RANGE = re.compile(r"^(\d+)\s*-\s*(\d+)$")
#: The most boundaries one selection may name explicitly (a typo such as ``1-1000000`` is refused, not run).
MAX_EXPLICIT = 100_000


class StepSelection(BaseModel):
    """A parsed ``after_step``: explicit boundaries, or ``all`` / ``last`` of the trajectory."""

    model_config = ConfigDict(frozen=True)

    steps: tuple[int, ...] = ()
    """Explicit boundaries, in the order given, without repeats."""
    every: bool = False
    """``all``."""
    last: bool = False
    """``last``."""
    plain: bool = False
    """A single number as such (``5``, not ``"5-5"`` or ``[5]``): the item keeps its id without a suffix."""

    @property
    def needs_count(self) -> bool:
        """Whether the trajectory's boundaries must be counted to expand it."""
        return self.every or self.last

    def expand(self, count: int | None) -> list[int]:
        """The boundaries, given the trajectory's ``count`` of complete batches (None: unknown, because pvisor
        refused the file itself; ``all`` and ``last`` then give boundary 1, so the refusal shows as an item)."""
        if self.every:
            return list(range(1, (count or 1) + 1))
        if self.last:
            return [count or 1]
        return list(self.steps)


def parse_steps(value: Any, *, name: str = "after_step") -> StepSelection:
    """Read an ``after_step`` value (see the module docstring).

    Raises:
        UsageError: one line naming ``name`` and what it accepts.
    """
    if isinstance(value, bool):  # bool is an int to Python, never a boundary
        raise _bad(name, value)
    if isinstance(value, float) and value.is_integer():  # a Parquet column of integers with a null in it
        value = int(value)
    if isinstance(value, int):
        return StepSelection(steps=(_positive(value, name),), plain=True)
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return StepSelection(every=True)
        if text == "last":
            return StepSelection(last=True)
        if text.isdigit():
            return StepSelection(steps=(_positive(int(text), name),), plain=True)
        parts = [part.strip() for part in text.removeprefix("[").removesuffix("]").split(",")]
        return _explicit([_part(part, value, name) for part in parts], name)
    if isinstance(value, list | tuple):
        return _explicit([[_positive(_number(item, value, name), name)] for item in value], name)
    raise _bad(name, value)


def _explicit(groups: list[list[int]], name: str) -> StepSelection:
    steps = list(dict.fromkeys(step for group in groups for step in group))
    if not steps:
        raise UsageError(f"{name}: an empty list names no boundary")
    if len(steps) > MAX_EXPLICIT:
        raise UsageError(f"{name}: {len(steps)} boundaries; at most {MAX_EXPLICIT} (use 'all')")
    return StepSelection(steps=tuple(steps))


def _part(part: str, whole: Any, name: str) -> list[int]:
    if part.isdigit():
        return [_positive(int(part), name)]
    found = _RANGE.match(part)
    if found is None:
        raise _bad(name, whole)
    first, last = int(found.group(1)), int(found.group(2))
    if first > last:
        raise UsageError(f"{name}: range {part!r} runs backwards; write it {last}-{first}")
    if last - first >= MAX_EXPLICIT:
        raise UsageError(f"{name}: range {part!r} names more than {MAX_EXPLICIT} boundaries (use 'all')")
    return list(range(_positive(first, name), last + 1))


def _number(item: Any, whole: Any, name: str) -> int:
    if isinstance(item, int) and not isinstance(item, bool):
        return item
    if isinstance(item, str) and item.strip().isdigit():
        return int(item)
    if isinstance(item, float) and item.is_integer():  # a Parquet column of floats
        return int(item)
    raise _bad(name, whole)


def _positive(step: int, name: str) -> int:
    if step < 1:
        raise UsageError(f"{name}: boundaries count from 1 (got {step})")
    return step


def _bad(name: str, value: Any) -> UsageError:
    return UsageError(
        f"{name}: {value!r} is not a boundary; pass a number, 'all', 'last', a list or a range such as 3-7"
    )
