"""``batch --plan`` output streams: each item is written as it is planned, and ``--json`` stays one array."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
from rich.console import Console

from pvisor_host.cli import render
from pvisor_host.fanout.plan import ItemPlan


def _plans(count: int, written: io.StringIO, seen: list[int]) -> Iterator[ItemPlan]:
    for n in range(count):
        seen.append(len(written.getvalue()))  # how much was written before this item was planned
        yield ItemPlan(id=f"i{n}", line=n + 1, action="run" if n % 3 else "reject", reason=None if n % 3 else "bad")


@pytest.mark.parametrize("count", [0, 1, 5])
def test_json_plan_is_one_array_written_item_by_item(count: int) -> None:
    written = io.StringIO()
    seen: list[int] = []
    render.batch_plan(Console(file=written), _plans(count, written, seen), json_output=True)
    parsed = json.loads(written.getvalue())
    assert [p["id"] for p in parsed] == [f"i{n}" for n in range(count)]
    assert [p["action"] for p in parsed] == ["run" if n % 3 else "reject" for n in range(count)]
    assert all(later > earlier for earlier, later in zip(seen[1:], seen[2:], strict=False))  # never buffered
    assert "\x1b[" not in written.getvalue()  # no highlighting escapes


def test_text_plan_counts_what_it_streamed() -> None:
    written = io.StringIO()
    seen: list[int] = []
    render.batch_plan(Console(file=written, width=120), _plans(7, written, seen), json_output=False)
    assert written.getvalue().splitlines()[-1] == "7 items: 4 to run, 0 to skip, 3 rejected"
    assert seen[1] > 0  # the first item was printed before the second was planned
