"""Keep ``report.html`` attachable: fit the items' details into a byte budget.

What always fits: every item's row (compact: about 70 characters an item, so a 100,000-item dataset's rows are
about 7 MB), and the aggregates. What the budget holds beside them, in this order: item by item, failures
first, then divergences, then the others, the calls that did not reproduce (without diffs); then the diffs,
first the first diff of every item, then the second, and so on (so no item takes it all); then, item by item,
the listing of the calls that were exact.
"""

from __future__ import annotations

import json

from .model import CallView, ItemView

#: The characters of the page's JSON beside its rows (the code and style add about 25 KB): 2,000 items' page is
#: under 2 MB, 100,000 items' under 10 MB.
PAGE_BUDGET = 1_600_000


def fit(items: list[ItemView], fixed: int, base: int, budget: int = PAGE_BUDGET) -> tuple[int, int]:
    """Strip diffs and exact calls from ``items`` (in place) until the page's JSON fits ``budget``; ``fixed``
    is the size of everything else in it, ``base`` the :func:`base_size` of ``items``. Returns (diffs
    dropped, items whose exact calls were dropped)."""
    diffs: list[tuple[int, int, CallView, str]] = []
    exact: list[list[CallView]] = []
    for n, item in enumerate(items):
        rank = 0
        for call in item.calls:
            if call.diff is not None:
                diffs.append((rank, n, call, call.diff))
                call.diff = None
                rank += 1
        exact.append([call for call in item.calls if call.outcome == "exact"])
        item.calls = [call for call in item.calls if call.outcome != "exact"]
    left = budget - fixed - base
    dropped = 0
    for _, _, call, diff in sorted(diffs, key=lambda entry: entry[:2]):
        cost = len(json.dumps(diff)) + len(',"diff":')
        if cost > left:
            dropped += 1
            continue
        call.diff, left = diff, left - cost
    hidden = 0
    for item, calls in zip(items, exact, strict=True):
        if not calls:
            continue
        cost = sum(len(call.model_dump_json(exclude_defaults=True)) + 1 for call in calls)
        if cost > left:
            item.exact_listed, hidden, left = False, hidden + 1, left - len(',"exact_listed":false')
            continue
        item.calls, left = sorted(item.calls + calls, key=lambda call: call.index), left - cost
    return dropped, hidden
