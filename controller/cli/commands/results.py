"""``results``, ``compare`` and ``report``: what finished batches say, as rows, side by side, or on one page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ...errors import ExitCode
from ..shared import console


def compare(
    old: Annotated[Path, typer.Argument(help="The earlier batch's (or replay's) --out directory.", show_default=False)],
    new: Annotated[Path, typer.Argument(help="The later batch's (or replay's) --out directory.", show_default=False)],
    junit: Annotated[
        Path | None, typer.Option(help="Also write a JUnit file in which only the regressions fail.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
) -> int:
    """What changed between two batch runs (or two replays): regressions first, then other status changes,
    other diverged calls, other workspace effects (the files), other images, items gone and new.

    Items are matched by id and boundary (after_step); a replay's one item by its trajectory's file name. Every
    item counts, a rejected one too. Exit 1 when an item that was ok is not any more (or is gone), or a new item is
    not ok.
    """
    from ...fanout.compare import compare_runs, write_junit
    from ...files.atomic import check_target
    from .. import render

    junit = check_target(junit, "--junit") if junit is not None else None
    comparison = compare_runs(old.absolute(), new.absolute())
    if junit is not None:
        write_junit(comparison, junit)
    if json_output:
        typer.echo(comparison.model_dump_json(indent=2))
    else:
        render.comparison(console(), comparison)
    return ExitCode.REPLAY_FAILED if comparison.failing else ExitCode.OK


def report(
    run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A batch's --out directory.", show_default=False)],
    baseline: Annotated[
        Path | None,
        typer.Option(help="An earlier batch's --out: the page shows what changed against it, regressions first."),
    ] = None,
) -> int:
    """Write DIR/report.html: one self-contained page with the batch's totals, phase times, a filterable item
    table, each item's observation diffs and the tool calls that diverge most often; with --baseline, what
    changed against an earlier batch, side by side.

    batch writes it at the end too; run this after copying a batch directory, or to rewrite it.
    """
    from ...fanout.compare import compare_runs
    from ...report import write_report

    comparison = compare_runs(baseline.absolute(), run_dir.absolute()) if baseline is not None else None
    path = write_report(run_dir.absolute(), comparison=comparison)
    typer.echo(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return ExitCode.OK


def results(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(metavar="DIR...", help="Batch --out directories (several: one table).", show_default=False),
    ],
    form: Annotated[
        str, typer.Option("--format", metavar="jsonl|csv|parquet", help="Rows as JSON Lines, CSV or Parquet.")
    ] = "jsonl",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to this file (Parquet needs one); default: stdout.")
    ] = None,
    not_ok: Annotated[
        bool, typer.Option("--not-ok", help="Only the items that did not end ok, or whose verifier did not pass.")
    ] = False,
) -> int:
    """One row per item of a batch, whatever happened to it, to analyse (pandas, a spreadsheet, CI): the same
    columns in the same order for every batch (docs/batch.md#from-a-dataset-to-results), so several batches read
    as one table, with a batch column saying whose row it is.
    """
    from ...errors import UsageError
    from ...fanout.results import iter_results, kept_columns, write_results
    from ...files.atomic import check_target

    if form not in ("jsonl", "csv", "parquet"):
        raise UsageError(f"--format {form!r}: pass jsonl, csv or parquet")
    output = check_target(output, "--output") if output is not None else None
    outs = [path.absolute() for path in run_dirs]
    rows = iter_results(*outs, names=[str(path) for path in run_dirs])
    kept = kept_columns(*outs)
    data = write_results((row for row in rows if row.not_ok or not not_ok), form, output, kept=kept)  # type: ignore[arg-type]
    if data is not None:
        typer.echo(data.decode(), nl=False)
    return ExitCode.OK


def register(app: typer.Typer) -> None:
    app.command()(results)
    app.command()(compare)
    app.command()(report)
