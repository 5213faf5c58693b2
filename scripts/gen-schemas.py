#!/usr/bin/env python3
"""Write the JSON Schemas of the files pvisor-host writes into docs/schemas/, from the pydantic models that
write them, so the reference cannot drift from the code: ``--check`` fails when a committed schema differs."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from pvisor_host.fanout.compare import COMPARE_SCHEMA, Comparison
from pvisor_host.fanout.manifest import manifest_line_model
from pvisor_host.models.batch import SUMMARY_SCHEMA, BatchSummary, ItemResult
from pvisor_host.models.record import ReplayRecord

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "schemas"

#: file name -> (the model that writes or reads it, its schema_version, what it describes, which side)
SCHEMAS: dict[str, tuple[type[BaseModel], str, str, str]] = {
    "record.schema.json": (
        ReplayRecord, "pvisor-host.record/v1", "record.json of every replay and batch item", "serialization"
    ),
    "summary.schema.json": (BatchSummary, SUMMARY_SCHEMA, "summary.json of a batch", "serialization"),
    "results-row.schema.json": (
        ItemResult, "pvisor-host.results-row/v1", "one line of a batch's results.jsonl", "serialization"
    ),
    "compare.schema.json": (
        Comparison, COMPARE_SCHEMA, "compare --json, and compare.json of batch --baseline", "serialization"
    ),
    "manifest-line.schema.json": (
        manifest_line_model(), "pvisor-host.manifest-line/v1", "one line of a batch manifest (JSONL)", "validation"
    ),
}  # fmt: skip


def _field_docs() -> Any:
    """``field_docs`` of scripts/gen-api-docs.py: the attribute docstrings the API reference shows too."""
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen-api-docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.field_docs


def models_under(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The model and every model its fields reach, by class name (the schema's ``$defs`` keys)."""
    found: dict[str, type[BaseModel]] = {}
    pending: list[Any] = [model]
    while pending:
        kind = pending.pop()
        if inspect.isclass(kind) and issubclass(kind, BaseModel):
            if kind.__name__ not in found:
                found[kind.__name__] = kind
                pending += [info.annotation for info in kind.model_fields.values()]
        else:
            pending += typing.get_args(kind)
    return found


def render(model: type[BaseModel], version: str, title: str, mode: str = "serialization") -> str:
    schema = model.model_json_schema(mode=mode)  # type: ignore[arg-type]
    field_docs = _field_docs()
    for name, cls in models_under(model).items():
        target = schema if cls is model else schema.get("$defs", {}).get(name)
        if target is None:
            continue
        target.setdefault("description", inspect.getdoc(cls) or "")
        for field, note in field_docs(cls).items():
            target.get("properties", {}).get(field, {}).setdefault("description", note)
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://pvisor-host.invalid/schemas/{version}",
        **schema,
        "description": f"{title} ({version}). Generated from {model.__name__} by scripts/gen-schemas.py."
        + (" Sizes and durations may be numbers or strings such as 2g or 90m." if mode == "validation" else ""),
    }
    return json.dumps(schema, indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a committed schema is stale")
    args = parser.parse_args()
    stale = []
    for name, (model, version, title, mode) in SCHEMAS.items():
        text = render(model, version, title, mode)
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        sys.stderr.write(f"stale: {', '.join(stale)} in docs/schemas/; run `make docs-api`\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
