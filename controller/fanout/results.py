"""A batch's results as rows to analyse: read from its directory, written as JSON Lines, CSV or Parquet.

``results.jsonl`` has one :class:`~pvisor_host.models.batch.ItemResult` per item, every item (its JSON Schema is
``docs/schemas/results-row.schema.json``); a batch directory without one (a batch killed before its end) is read
from its records. ``pvisor-host results DIR... --format csv|parquet`` and ``pvisor_host.results(DIR)`` read it the
same way. A row is flat, and every format has the same columns in the same order, whatever options the batch ran
with (:data:`~pvisor_host.models.batch.ROW_COLUMNS`, then the dataset's kept columns): the tables of any two
batches concatenate. Parquet has one Arrow type per column (nullable integers and booleans, never a float for a
count), and is written a slice of rows at a time, so a 100,000-item batch is never all in memory.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, get_args

from ..errors import PrerequisiteError, UsageError
from ..models.batch import RESULTS_FILE, ROW_COLUMNS, ItemKeys, ItemResult
from ..models.record import load_record

if TYPE_CHECKING:
    import pyarrow as pa

Format = Literal["jsonl", "csv", "parquet"]
#: Rows converted and written at a time (Parquet's row groups).
CHUNK = 10_000


def load_results(*outs: Path) -> list[ItemResult]:
    """The items of the batch directories ``outs`` (see :func:`iter_results`).

    Raises:
        UsageError: a directory is not a batch's, or its results file is not one.
    """
    return list(iter_results(*outs))


def iter_results(*outs: Path, names: Iterable[str] | None = None) -> Iterator[ItemResult]:
    """The rows of each batch directory in turn, each with its ``batch`` (``names``: as given, else the
    directory's name): from its ``results.jsonl`` when the batch wrote one (every item), else from its records
    (the items that got one). One row at a time: a 100,000-item results file is never all in memory as models.
    Every directory is checked before the first row, so bad input is refused before anything is written.

    Raises:
        UsageError: a directory is not a batch's, or its results file is not one.
    """
    labels = list(names) if names is not None else [out.name for out in outs]
    sources = [_rows_of(out) for out in outs]
    for label, rows in zip(labels, sources, strict=True):
        for row in rows:
            row.batch = label
            yield row


def _rows_of(out: Path) -> Iterator[ItemResult]:
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
        raise _not_results(out) from None
    return _from_file(out, handle, head)


def _not_results(out: Path) -> UsageError:
    return UsageError(f"{out / RESULTS_FILE} is not a batch's results file; rerun the batch into {out} to rewrite it")


def _from_file(out: Path, handle: IO[str], head: list[ItemResult]) -> Iterator[ItemResult]:
    with handle:
        yield from head
        for line in handle:
            if not line.strip():
                continue
            try:
                yield ItemResult.model_validate_json(line)
            except ValueError:
                raise _not_results(out) from None


def _from_records(out: Path) -> Iterator[ItemResult]:
    rows = []
    for path in sorted(out.glob("*/record.json")):
        try:
            record = load_record(path)
        except (OSError, ValueError):
            continue
        info = record.batch
        keys = ItemKeys(
            id=info.item_id if info is not None else path.parent.name,
            line=info.line if info is not None else 0,
            after_step=record.inputs.after_step,
            trajectory=record.inputs.trajectory.path,
            agent=record.inputs.agent,
            repeat_of=info.repeat_of if info is not None else None,
        )
        rows.append(ItemResult.from_record(record, keys, path=path.parent.name, run_dir=path.parent))
    if not rows:
        raise UsageError(
            f"{out} holds no batch results (no results.jsonl or */record.json); pass a batch's --out directory"
        )
    return iter(sorted(rows, key=row_order))


def row_order(row: ItemResult) -> tuple[int, int, str]:
    """Rows in manifest order: by line, then boundary (then id: the repeats of one item)."""
    return row.line, row.after_step or 0, row.id


def write_results(
    rows: Iterable[ItemResult], form: Format, target: Path | None, *, kept: list[str] | None = None
) -> bytes | None:
    """Write ``rows`` as ``form`` to ``target`` (None: return the bytes, for stdout; Parquet needs a file);
    ``kept``: the dataset's columns the rows keep (Parquet is written a slice at a time: its columns are known
    first; default: those of the first slice).

    Raises:
        UsageError: Parquet without a file to write.
        PrerequisiteError: Parquet without pyarrow.
    """
    if form == "parquet":
        if target is None:
            raise UsageError("--format parquet writes a file: pass --output FILE")
        _parquet(rows, target, kept)
        return None
    data = _jsonl(rows) if form == "jsonl" else _csv(list(rows))
    if target is None:
        return data
    target.write_bytes(data)
    return None


def columns(rows: Iterable[ItemResult]) -> list[str]:
    """The columns of ``rows``: every row's, in order, then the dataset's kept ones as they first appear."""
    kept: dict[str, None] = {}
    for row in rows:
        kept.update(dict.fromkeys(row.columns))
    return [*ROW_COLUMNS, *kept]


def _jsonl(rows: Iterable[ItemResult]) -> bytes:
    return b"".join(row.model_dump_json().encode() + b"\n" for row in rows)


def _cells(row: ItemResult) -> dict[str, Any]:
    """A row as CSV's cells: lists as JSON text."""
    return {name: json.dumps(value) if isinstance(value, list) else value for name, value in row.model_dump().items()}


def _csv(rows: list[ItemResult]) -> bytes:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns(rows), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(_cells(row) for row in rows)
    return text.getvalue().encode()


def arrow_schema(kept: Iterable[str] = ()) -> pa.Schema:
    """The Parquet (Arrow) type of every column, from the row model's own types: a count is a nullable int64, a
    flag a nullable bool, seconds and rewards float64, text a string, a list of hosts a list of strings; the
    dataset's kept columns are strings."""
    import pyarrow as pa

    def arrow(annotation: Any) -> pa.DataType:
        kinds = [kind for kind in get_args(annotation) if kind is not type(None)] or [annotation]
        kind = kinds[0]
        if kind is bool:
            return pa.bool_()
        if kind is int:
            return pa.int64()
        if kind is float:
            return pa.float64()
        if getattr(kind, "__origin__", None) is list:
            return pa.list_(pa.string())
        return pa.string()  # text, and a Literal's names

    fields = [pa.field(name, arrow(info.annotation)) for name, info in ItemResult.model_fields.items()]
    return pa.schema(fields + [pa.field(name, pa.string()) for name in kept])


def kept_columns(*outs: Path) -> list[str]:
    """The dataset's columns the rows of these batch directories keep (``--keep``), from each one's first row."""
    kept: dict[str, None] = {}
    for out in outs:
        first = next(_rows_of(out), None)
        if first is not None:
            kept.update(dict.fromkeys(first.columns))
    return list(kept)


def _parquet(rows: Iterable[ItemResult], target: Path, kept: list[str] | None) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrerequisiteError("writing Parquet needs pyarrow", hint="pip install 'pvisor-host[parquet]'") from None
    chunks = _chunks(rows)
    first = next(chunks, [])
    schema = arrow_schema(kept if kept is not None else columns(first)[len(ROW_COLUMNS) :])
    with pq.ParquetWriter(target, schema) as writer:
        for chunk in itertools.chain([first], chunks):
            records = [row.model_dump() for row in chunk]
            writer.write_table(pa.Table.from_pylist(records, schema=schema))


def _chunks(rows: Iterable[ItemResult]) -> Iterator[list[ItemResult]]:
    chunk: list[ItemResult] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
