"""A dataset file as rows of columns: JSONL, CSV or Parquet, streamed, with ``--map`` applied.

The format comes from the suffix: ``.jsonl`` / ``.ndjson`` / ``.json`` (one JSON object per line, ``#``
comments and blank lines skipped), ``.csv`` / ``.tsv`` (a header row; empty cells are absent), ``.parquet`` /
``.pq`` (read in record batches through pyarrow, the ``parquet`` extra). A row is numbered as a user finds
it: a JSONL or CSV file's line, a Parquet table's 1-based row.

CSV cells are text: numbers and booleans are read by the models that validate them, and a list option
(``env``, ``cap_add``) is a comma-separated cell or a JSON list. JSONL rows are hand-written manifests, so a
key that is neither an option nor used by a template or ``--map`` is an error there (``strict_columns``);
tables exported from a dataset carry columns of their own (a problem statement, a patch), which are left
alone.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..errors import PrerequisiteError, UsageError

#: A numbered row: its columns, or what is wrong with it.
Row = tuple[int, dict[str, Any] | str]
_JSONL = {".jsonl", ".ndjson", ".json"}
_CSV = {".csv": ",", ".tsv": "\t"}
_PARQUET = {".parquet", ".pq"}
_PARQUET_BATCH = 4096
#: The largest CSV cell read (csv's own limit is 128 KiB).
_CELL_LIMIT = 256 * 1024 * 1024


class ColumnMap(BaseModel):
    """``--map FIELD=COLUMN``: a dataset whose columns are named otherwise (``id=instance_id``)."""

    model_config = ConfigDict(frozen=True)

    fields: dict[str, str] = {}
    """Field → the column it is read from."""

    @classmethod
    def parse(cls, pairs: list[str] | Mapping[str, str] | None, known: set[str]) -> ColumnMap:
        """From ``FIELD=COLUMN`` strings (or a mapping); ``known`` are the fields a row may set.

        Raises:
            UsageError: a pair that is not ``FIELD=COLUMN``, or a field that is not an option.
        """
        if pairs is None:
            return cls()
        items = list(pairs.items()) if isinstance(pairs, Mapping) else [_pair(text) for text in pairs]
        fields: dict[str, str] = {}
        for field, column in items:
            if field not in known:
                raise UsageError(f"--map {field}={column}: {field} is not a field a row sets (id, trajectory, ...)")
            if field in fields and fields[field] != column:
                raise UsageError(f"--map {field}: mapped twice ({fields[field]} and {column})")
            fields[field] = column
        return cls(fields=fields)

    @property
    def columns(self) -> set[str]:
        return set(self.fields.values())

    def apply(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row with each mapped field read from its column (the column stays, for templates)."""
        for field, column in self.fields.items():
            if column in row:
                row[field] = row[column]
        return row


def _pair(text: str) -> tuple[str, str]:
    field, sep, column = text.partition("=")
    if not sep or not field.strip() or not column.strip():
        raise UsageError(f"--map {text!r}: pass FIELD=COLUMN, e.g. --map id=instance_id")
    return field.strip(), column.strip()


def table_kind(path: Path) -> str:
    """``jsonl``, ``csv`` or ``parquet``, from the file's suffix."""
    suffix = path.suffix.lower()
    if suffix in _JSONL:
        return "jsonl"
    if suffix in _CSV:
        return "csv"
    if suffix in _PARQUET:
        return "parquet"
    raise UsageError(
        f"manifest {path}: {suffix or 'no suffix'} is not a manifest format",
        hint="name it .jsonl, .csv, .tsv or .parquet",
    )


def strict_columns(path: Path) -> bool:
    """Whether a column that is no option is an error (JSONL) or left alone (tables)."""
    return table_kind(path) == "jsonl"


def read_rows(path: Path) -> Iterator[Row]:
    """The rows of a manifest file, one at a time (see the module docstring).

    Raises:
        UsageError: the file is missing, not text, or not of a known format.
        PrerequisiteError: a Parquet file without pyarrow installed.
    """
    kind = table_kind(path)
    if not path.is_file():
        raise UsageError(f"--manifest {path} does not exist or is not a file")
    try:
        if kind == "jsonl":
            yield from _jsonl(path)
        elif kind == "csv":
            yield from _csv(path, _CSV[path.suffix.lower()])
        else:
            yield from _parquet(path)
    except UnicodeDecodeError as exc:
        raise UsageError(f"--manifest {path} is not UTF-8 text ({exc.reason})") from None


def _jsonl(path: Path) -> Iterator[Row]:
    with path.open("r", encoding="utf-8") as handle:
        if handle.read(1) == "[":
            raise UsageError(
                f"--manifest {path} is one JSON array; write JSON Lines, an object per line "
                "(pandas: to_json(orient='records', lines=True))"
            )
        handle.seek(0)
        for number, text in enumerate(handle, start=1):
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            try:
                fields = json.loads(text)
            except ValueError as exc:
                yield number, f"not JSON: {exc}"
                continue
            yield (number, fields) if isinstance(fields, dict) else (number, "not a JSON object")


def _csv(path: Path, delimiter: str) -> Iterator[Row]:
    csv.field_size_limit(_CELL_LIMIT)  # a dataset's cells (a patch, a problem statement) outgrow csv's 128 KiB
    with path.open("r", encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter=delimiter)
        try:
            if not reader.fieldnames:
                return
            yield from _csv_rows(reader)
        except csv.Error as exc:
            raise UsageError(f"--manifest {path}:{reader.line_num}: not CSV ({exc})") from None


def _csv_rows(reader: csv.DictReader[str]) -> Iterator[Row]:
    columns = len(reader.fieldnames or [])
    for row in reader:
        number = reader.line_num
        if None in row:  # DictReader's key for cells past the header's columns
            yield number, f"more cells than the header's {columns} columns"
            continue
        cells = {k.strip(): v for k, v in row.items() if k and v is not None and v.strip() != ""}
        if cells:
            yield number, cells


def _parquet(path: Path) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrerequisiteError(
            f"--manifest {path}: reading Parquet needs pyarrow", hint="pip install 'pvisor-host[parquet]'"
        ) from None
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid, OSError, ... for a file that is not Parquet
        raise UsageError(f"--manifest {path} is not a Parquet file ({exc})") from None
    number = 0
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH):
        for row in batch.to_pylist():
            number += 1
            cells = {str(k): v for k, v in row.items() if not _missing(v)}
            if cells:
                yield number, cells


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def text_cells(fields: dict[str, Any], lists: set[str]) -> dict[str, Any]:
    """A table row's text cells as values: the list options split (``A,B`` or a JSON list)."""
    for name in lists & fields.keys():
        value = fields[name]
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    fields[name] = json.loads(text)
                    continue
                except ValueError:
                    pass
            fields[name] = [part.strip() for part in text.split(",") if part.strip()]
    return fields
