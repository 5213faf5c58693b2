"""A batch's results as rows to analyse: read from its directory, written as JSON Lines, CSV or Parquet.

``results.jsonl`` has one :class:`~pvisor_host.models.batch.ItemResult` per item (its JSON Schema is
``docs/schemas/results-row.schema.json``); a batch directory without one (a batch killed before its end) is read
from its records. ``pvisor-host results DIR --format csv|parquet`` and ``pvisor_host.results(DIR)`` read it the
same way. CSV and Parquet are flat: nested fields become dotted columns (``verification.passed``,
``model.input_tokens``, ``timings.run``), so a pandas ``read_csv`` or ``read_parquet`` gives one column each.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

from ..errors import PrerequisiteError, UsageError
from ..models.batch import RESULTS_FILE, ItemResult
from ..models.record import load_record
from .resume import item_result

Format = Literal["jsonl", "csv", "parquet"]


def load_results(out: Path) -> list[ItemResult]:
    """The items of the batch directory ``out``: from its ``results.jsonl`` when the batch wrote one (every
    item), else from its records (the items that got one).

    Raises:
        UsageError: ``out`` is not a batch's directory, or its results file is not one.
    """
    return list(iter_results(out))


def iter_results(out: Path) -> Iterator[ItemResult]:
    """:func:`load_results`, one row at a time: a 100,000-item results file is never all in memory as models
    (the bad input it refuses is refused before the first row)."""
    if not out.is_dir():
        raise UsageError(f"{out} is not a directory; pass a batch's --out directory")
    try:
        handle = (out / RESULTS_FILE).open(encoding="utf-8")
    except FileNotFoundError:
        return _from_records(out)
    except OSError as exc:
        raise UsageError(f"cannot read {out / RESULTS_FILE}: {exc.strerror}") from None
    first = handle.readline()
    try:
        head = [ItemResult.model_validate_json(first)] if first.strip() else []
    except ValueError:
        handle.close()
        raise UsageError(
            f"{out / RESULTS_FILE} is not a batch's results file; rerun the batch into {out} to rewrite it"
        ) from None
    return _from_file(out, handle, head)


def _from_file(out: Path, handle: IO[str], head: list[ItemResult]) -> Iterator[ItemResult]:
    with handle:
        yield from head
        for line in handle:
            if not line.strip():
                continue
            try:
                yield ItemResult.model_validate_json(line)
            except ValueError:
                raise UsageError(
                    f"{out / RESULTS_FILE} is not a batch's results file; rerun the batch into {out} to rewrite it"
                ) from None


def _from_records(out: Path) -> Iterator[ItemResult]:
    results = []
    for path in sorted(out.glob("*/record.json")):
        try:
            record = load_record(path)
        except (OSError, ValueError):
            continue
        item_id, line = (record.batch.item_id, record.batch.line) if record.batch else (path.parent.name, 0)
        row = item_result(record, item_id=item_id, line=line, run_dir=path.parent)
        results.append(row.model_copy(update={"path": path.parent.name}))
    if not results:
        raise UsageError(
            f"{out} holds no batch results (no results.jsonl or */record.json); pass a batch's --out directory"
        )
    return iter(sorted(results, key=lambda r: (r.line, r.id)))


def flat(row: ItemResult) -> dict[str, Any]:
    """A row as one level of columns: nested objects as dotted names, lists as JSON text."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, list):
            out[prefix] = json.dumps(value)
        else:
            out[prefix] = value

    walk("", row.model_dump(mode="json"))
    return out


def write_results(rows: list[ItemResult], form: Format, target: Path | None) -> bytes | None:
    """Write ``rows`` as ``form`` to ``target`` (None: return the bytes, for stdout; Parquet needs a file).

    Raises:
        UsageError: Parquet without a file to write.
        PrerequisiteError: Parquet without pyarrow.
    """
    if form == "jsonl":
        data = b"".join(row.model_dump_json().encode() + b"\n" for row in rows)
    elif form == "csv":
        flats = [flat(row) for row in rows]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=_flat_columns(flats), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(flats)
        data = text.getvalue().encode()
    else:
        if target is None:
            raise UsageError("--format parquet writes a file: pass --output FILE")
        _parquet(rows, target)
        return None
    if target is None:
        return data
    target.write_bytes(data)
    return None


def _flat_columns(rows: list[dict[str, Any]]) -> list[str]:
    order: dict[str, None] = {}
    for row in rows:
        for name in row:
            order.setdefault(name, None)
    return list(order)


def _parquet(rows: list[ItemResult], target: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrerequisiteError("writing Parquet needs pyarrow", hint="pip install 'pvisor-host[parquet]'") from None
    flats = [flat(row) for row in rows]
    names = _flat_columns(flats)
    table = pa.Table.from_pylist([{name: row.get(name) for name in names} for row in flats])
    pq.write_table(table, target)
