"""``replay`` and ``batch``: one trajectory, or a whole dataset, replayed in hardened sandboxes.

Their replay options come from the models (:mod:`..options`): ``replay`` shows each one's default, ``batch``
takes the ones given as every item's defaults, which a manifest line's own fields override.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ...errors import ExitCode, UsageError, exit_code_for_status
from ..options import batch_options, build_fields, replay_options, spec_fields, with_options
from ..shared import console, open_engine, say

if TYPE_CHECKING:
    from ...backend.base import AnyBackend
    from ...fanout.manifest import BatchInput, ManifestCheck
    from ...fanout.options import BatchRequest
    from ...fanout.scheduler import BatchOutcome
    from ...models.replay import PreparedReplay


@with_options(replay_options, first=True)
def replay(
    json_output: Annotated[bool, typer.Option("--json", help="Print record.json on stdout.")] = False,
    **options: Any,
) -> int:
    """Replay a trajectory up to --after-step in a fresh hardened container and collect the result."""
    from ...attempts import run_replay
    from ...models.image import BuildOptions
    from ...models.spec import build_spec
    from ...preflight.checks import check_inputs
    from ...preflight.prepare import prepare
    from .. import render

    spec = build_spec(**spec_fields(options))
    checked = check_inputs(spec)
    with open_engine() as backend:
        prepared = prepare(checked, backend, build=BuildOptions(**build_fields(options)))
        if spec.fork is not None:
            return _forked(prepared, backend, json_output)
        record = run_replay(prepared, backend)
    if json_output:
        typer.echo(record.model_dump_json(indent=2))
    else:
        render.replay_summary(console(), record, prepared.out_dir)
    return exit_code_for_status(record.status)


def _forked(prepared: PreparedReplay, backend: AnyBackend, json_output: bool) -> int:
    """``replay --fork K``: the prefix's record and each fork's; the exit code of the first fork that is not ok (of
    the prefix, for a fork it could not start)."""
    import json

    from ...attempts import run_forked
    from ...models.record import first_not_ok
    from .. import render

    records = run_forked(prepared, backend)
    if json_output:
        typer.echo(json.dumps([r.model_dump(mode="json") for r in records], indent=2))
    else:
        render.fork_summary(console(), records, prepared.out_dir)
    worst = first_not_ok(records, prepared.spec.fork)
    return exit_code_for_status(worst.status if worst is not None else "ok")


@with_options(batch_options)
def batch(
    manifest_file: Annotated[
        Path | None,
        typer.Argument(
            metavar="[MANIFEST]",
            help="JSONL file, one replay per line (fields: replay's options, plus id); same as --manifest.",
            show_default=False,
        ),
    ] = None,
    plan: Annotated[
        bool, typer.Option(help="Check every item on the host and show what would run; start no container.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="With --plan: each item's mounts, limits and command too.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress and no table; only the last line.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print summary.json (or the plan) on stdout.")] = False,
    **options: Any,
) -> int:
    """Replay many trajectories in parallel containers; rerunning the same command resumes.

    The options after --fail-on are defaults for every item; a manifest line's own fields override them.
    """
    import contextlib

    from ...fanout.options import BatchRequest

    if manifest_file is not None and options.get("manifest", manifest_file) != manifest_file:
        raise UsageError(f"two manifests given ({manifest_file} and --manifest {options['manifest']}); pass one")
    request = BatchRequest.from_options({**options, "manifest": options.get("manifest", manifest_file)})
    _check_baseline(request, plan=plan)
    checked = _checked_input(request.input)
    with contextlib.closing(request.open(plan=plan)) as backend:
        if plan:
            return _plan(request, checked, backend, json_output=json_output, verbose=verbose)
        outcome = _run(request, checked, backend, quiet=quiet, json_output=json_output)
    return _verdict(request, checked, outcome, quiet=quiet or json_output)


def _checked_input(source: BatchInput) -> ManifestCheck:
    """The whole input read once: every bad line said, then one line and exit 2 if any (nothing runs)."""
    checked = source.check()
    for problem in checked.problems:
        say(f"pvisor-host: {source.name}:{problem.line}: {problem.message}")
    if checked.problems:
        raise UsageError(f"{len(checked.problems)} of the batch's lines are wrong (listed above); nothing ran")
    checked.refuse_if_none_can_run()
    return checked


def _verdict(request: BatchRequest, checked: ManifestCheck, outcome: BatchOutcome, *, quiet: bool) -> int:
    """The batch's exit code, compared against its baseline first; the last line says why when it failed on the
    infrastructure."""
    from ...fanout.summary import exit_code

    baseline, summary = request.verdict.baseline, outcome.summary
    regressed = 0
    if baseline is not None and not summary.interrupted:
        regressed = _compare_with(baseline.absolute(), request.options.out, quiet=quiet)
    allowed = request.verdict.allowed(checked.items)
    code = exit_code(summary, allowed, fail_on=request.verdict.failing, regressed=regressed)
    if code == ExitCode.INFRASTRUCTURE and summary.stopped is not None:
        say(f"pvisor-host: error: {summary.stopped}")
    elif code == ExitCode.INFRASTRUCTURE:
        first = next(r for r in outcome.results if r.status == "infra_error")
        say(f"pvisor-host: error: every failed item failed on the infrastructure; first {first.id}: {first.message}")
    return code


def _check_baseline(request: BatchRequest, *, plan: bool) -> None:
    from ...fanout.compare import check_run_dir

    baseline = request.verdict.baseline
    if baseline is None:
        return
    if plan:
        raise UsageError("--baseline compares finished runs; it does nothing with --plan")
    if request.input.repeat > 1:
        raise UsageError(
            "--repeat finds the flaky items of one run; it cannot be compared item by item with --baseline",
            hint="run --repeat on its own, and compare a run without it against the baseline",
        )
    if request.input.sliced:
        raise UsageError(
            "--baseline compares whole runs: the items a slice (--limit, --sample, --select) leaves out would read "
            "as gone, regressions of every one that was ok",
            hint="run the whole dataset against the baseline, or compare the slice with an earlier run of the same",
        )
    if baseline.absolute() == request.options.out.absolute():
        raise UsageError(f"--baseline {baseline} is the batch's own --out; pass the earlier batch's directory")
    check_run_dir(baseline.absolute())


def _compare_with(baseline: Path, batch_dir: Path, *, quiet: bool) -> int:
    """``batch --baseline``: compare, write the reports, show them; how many items regressed."""
    from ...fanout.compare import compare_runs, write_reports
    from ...report import write_report
    from .. import render

    comparison = compare_runs(baseline, batch_dir)
    write_reports(comparison, batch_dir)
    write_report(batch_dir, comparison=comparison)  # the page again, with what changed side by side
    regressed = len(comparison.failing)
    if quiet:
        say(
            f"pvisor-host: against {baseline}: {len(comparison.regressions)} regressed, "
            f"{regressed - len(comparison.regressions)} new and failing, {len(comparison.changes)} changed "
            "(compare.json)"
        )
    else:
        render.comparison(console(), comparison)
    return regressed


def _plan(
    request: BatchRequest, checked: ManifestCheck, backend: AnyBackend, *, json_output: bool, verbose: bool
) -> int:
    """``batch --plan``: every item's verdict, and the exit code the run would have for what the host can tell."""
    from ...fanout.plan import ImagesPlanned, PlanTally, plan_batch
    from ...fanout.summary import exit_code
    from ...preflight.hostpvisor import runs
    from ...preflight.survey import checked_files
    from .. import render

    images = ImagesPlanned()
    tally = PlanTally()
    plans = tally.counting(plan_batch(request.input.items(), backend, request.options, images))
    render.batch_plan(console(), plans, json_output=json_output, verbose=verbose, images=images, slice=checked)
    say(f"pvisor-host: pre-flight: {len(checked_files())} trajectory files checked in {runs()} host pvisor runs")
    code = exit_code(tally.summary(), request.verdict.allowed(checked.items), fail_on=request.verdict.failing)
    if code == ExitCode.INFRASTRUCTURE and tally.first_infra is not None:
        say(f"pvisor-host: error: {tally.first_infra.id}: {tally.first_infra.reason}")
    return code


def _run(
    request: BatchRequest, checked: ManifestCheck, backend: AnyBackend, *, quiet: bool, json_output: bool
) -> BatchOutcome:
    from ...fanout.scheduler import run_batch
    from ...report import write_report
    from ...signals import ignore_interrupts
    from .. import render

    options = request.options
    total = checked.items
    with render.BatchProgress(total, quiet=quiet or json_output) as progress:
        outcome = run_batch(
            request.input.items(),
            backend,
            options,
            total=total,
            images=checked.image_specs,
            task_images=checked.image_counts,
            reports=(write_report,),
            progress=progress,
            on_pull=progress.pull,
            memory=request.memory,
        )
    ignore_interrupts()  # the batch has ended and its reports are written: nothing is left to stop
    if json_output:
        typer.echo(outcome.summary.model_dump_json(indent=2))
    else:
        render.batch_summary(console(), outcome.summary, options.out, outcome.results, quiet=quiet)
    if outcome.summary.interrupted:
        say(f"pvisor-host: interrupted; every sandbox was removed. Run the same command to resume ({options.out})")
    return outcome
