"""``replay`` and ``batch``: one trajectory, or a whole dataset, replayed in hardened sandboxes.

Their replay options come from the models (:mod:`..options`): ``replay`` shows each one's default, ``batch``
takes the ones given as every item's defaults, which a manifest line's own fields override.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ...errors import ExitCode, UsageError, exit_code_for_status
from ..options import build_fields, replay_options, spec_fields, with_options
from ..shared import console, open_engine, say

if TYPE_CHECKING:
    from ...backend.base import AnyBackend
    from ...fanout.manifest import BatchInput, ManifestCheck
    from ...fanout.scheduler import BatchOptions, BatchOutcome
    from ...fanout.summary import FailOn


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
        record = run_replay(prepared, backend)
    if json_output:
        typer.echo(record.model_dump_json(indent=2))
    else:
        render.replay_summary(console(), record, prepared.out_dir)
    return exit_code_for_status(record.status)


@with_options(lambda: replay_options(batch=True), show_defaults=False)
def batch(
    manifest_file: Annotated[
        Path | None,
        typer.Argument(
            metavar="[MANIFEST]",
            help="JSONL file, one replay per line (fields: replay's options, plus id); same as --manifest.",
            show_default=False,
        ),
    ] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            help="The dataset: JSONL, CSV or Parquet, one replay (or one per boundary) per row; fields: replay's "
            "options, plus id."
        ),
    ] = None,
    trajectories: Annotated[
        str | None, typer.Option(help="Glob of trajectory files (one row per file; needs --after-step).")
    ] = None,
    after_step: Annotated[
        str | None,
        typer.Option(help="Boundaries of every row that names none: N, all, last, a list (1,3) or a range (3-7)."),
    ] = None,
    item_id: Annotated[
        str | None,
        typer.Option(
            "--id",
            metavar="TEMPLATE",
            help="Each item's id from its row, e.g. '{parent}-{stem}' (fields: the row's columns, stem, name, "
            "parent); --image takes templates too, e.g. 'reg/{stem|lower}:v1' or the preset @swebench.",
        ),
    ] = None,
    columns: Annotated[
        list[str] | None,
        typer.Option(
            "--map", metavar="FIELD=COLUMN", help="Read a field from a column named otherwise, e.g. id=instance_id."
        ),
    ] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Batch directory; rerunning into it resumes.")] = Path(
        "pvisor-batch"
    ),
    workers: Annotated[
        int | None, typer.Option(min=1, help="Containers at a time (default: from CPUs and memory).")
    ] = None,
    deadline: Annotated[
        str | None, typer.Option(help="Limit for the whole batch, e.g. 6h: nothing starts after it.")
    ] = None,
    rerun_failed: Annotated[bool, typer.Option(help="Also rerun items that finished with a failure.")] = False,
    retry_oom: Annotated[bool, typer.Option(help="Retry attempts killed for memory.")] = False,
    allow_failures: Annotated[str | None, typer.Option(help="Exit 0 with up to N (or P%) items not ok.")] = None,
    plan: Annotated[
        bool, typer.Option(help="Check every item on the host and show what would run; start no container.")
    ] = False,
    baseline: Annotated[
        Path | None,
        typer.Option(
            help="An earlier batch's --out: compare against it at the end (compare.json, compare.xml in --out); "
            "--fail-on is then regressions unless given."
        ),
    ] = None,
    fail_on: Annotated[
        str | None,
        typer.Option(
            metavar="LIST",
            help="What makes the batch exit 1, a comma list of: regressions, an item that regressed against "
            "--baseline (the default with it); failures, more items not ok than --allow-failures; verification, an "
            "item whose verifier did not pass (failures,verification is the default without --baseline); or never. "
            "A batch that did not answer (its deadline, a full disk, the engine) exits 4 or 6 all the same.",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, metavar="N", help="Only the first N items (by line, then boundary).")
    ] = None,
    sample: Annotated[
        int | None,
        typer.Option(min=1, metavar="N", help="Only N items drawn at random (the same N for the same --seed)."),
    ] = None,
    seed: Annotated[int, typer.Option(metavar="S", help="What --sample draws with.")] = 0,
    select: Annotated[
        list[str] | None,
        typer.Option(metavar="PATTERN", help="Only the items whose id matches this shell pattern (repeatable)."),
    ] = None,
    keep: Annotated[
        list[str] | None,
        typer.Option(
            metavar="COLUMN,...",
            help="The dataset's own columns each item's row keeps, to join the results back to it (default: "
            "instance_id, where the dataset has one; --keep '' keeps none).",
        ),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="With --plan: each item's mounts, limits and command too.")
    ] = False,
    cluster: Annotated[
        str | None,
        typer.Option(
            metavar="HEAD:PORT",
            help="Run the items on the Docker hosts of the Ray cluster at HEAD:PORT (needs the ray extra and "
            "RAY_AUTH_TOKEN); images are built here and shipped to the nodes.",
        ),
    ] = None,
    registry: Annotated[
        str | None,
        typer.Option(
            metavar="HOST[:PORT]",
            help="With --cluster: push each image here once and have the nodes pull it by digest (default: "
            "$PVISOR_HOST_REGISTRY, else ship it through the cluster, docker save then docker load, once per node).",
        ),
    ] = None,
    pull_workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="Task images (--image) pulled at once, ahead of their items, while sandboxes run (0: every image "
            "first, before any item; no --image-budget then).",
        ),
    ] = 2,
    image_budget: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Most disk the engine's image cache may take, e.g. 200g: the distinct layers of the task images "
            "pulled for batches, shared by every batch on the engine; images nobody uses are removed first, least "
            "recently used (default: half of the engine storage's free space plus what the cache holds).",
        ),
    ] = None,
    keep_images: Annotated[
        bool, typer.Option(help="Keep the task images the batch pulled when it ends (it removes them by default).")
    ] = False,
    repeat: Annotated[
        int,
        typer.Option(
            metavar="K",
            help="Run every item K times, under ids of their own (<id>.r1 ...): the summary, the report and "
            "compare list the items whose repeats end or change the workspace otherwise (flaky).",
        ),
    ] = 1,
    registry_mirror: Annotated[
        str | None,
        typer.Option(
            metavar="HOST[:PORT]",
            help="Pull Docker Hub's task images through this mirror (a pull-through cache); they keep their names.",
        ),
    ] = None,
    image_rewrite: Annotated[
        list[str] | None,
        typer.Option(
            metavar="FROM=TO",
            help="Pull task images named FROM... from TO... instead (image name prefixes, e.g. "
            "docker.io/swebench/=registry.internal:5000/swebench/); repeatable, the first match wins.",
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress and no table; only the last line.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print summary.json (or the plan) on stdout.")] = False,
    **options: Any,
) -> int:
    """Replay many trajectories in parallel containers; rerunning the same command resumes.

    Options after --json are defaults for every item; a manifest line's own fields override them.
    """
    from ...backend import check_cluster_options
    from ...backend.docker.mirrors import Mirrors
    from ...fanout.manifest import BatchInput
    from ...fanout.scheduler import BatchOptions, default_workers, fit_workers
    from ...fanout.summary import allowed_failures, exit_code
    from ...models.image import BuildOptions
    from ...units import parse_duration, parse_size

    if manifest_file is not None and manifest is not None and manifest_file != manifest:
        raise UsageError(f"two manifests given ({manifest_file} and --manifest {manifest}); pass one")
    allowance = allowed_failures(allow_failures)
    if baseline is not None:
        _check_baseline(baseline, out_dir, plan=plan, repeat=repeat)
    failing = _fail_on(fail_on, baseline)
    check_cluster_options(cluster, registry)
    Mirrors.parse(registry_mirror, image_rewrite)  # what the host can tell, before anything is asked
    source = BatchInput.parse(
        manifest=manifest or manifest_file, trajectories=trajectories, after_step=after_step, id=item_id,
        map=columns or [], defaults=spec_fields(options), repeat=repeat, limit=limit, sample=sample, seed=seed,
        select=select or [], keep=keep,
    )  # fmt: skip
    checked = source.check()
    for problem in checked.problems:
        say(f"pvisor-host: {source.name}:{problem.line}: {problem.message}")
    if checked.problems:
        raise UsageError(f"{len(checked.problems)} of the batch's lines are wrong (listed above); nothing ran")
    checked.refuse_if_none_can_run()
    batch_options = BatchOptions.checked(
        out=out_dir.absolute(),
        workers=workers or default_workers(source.spec_default("memory")),
        deadline=parse_duration(deadline, flag="--deadline") if deadline is not None else None,
        rerun_failed=rerun_failed,
        retry_oom=retry_oom,
        build=BuildOptions(**build_fields(options)),
        pull_workers=pull_workers,
        image_budget=parse_size(image_budget, flag="--image-budget") if image_budget is not None else None,
        keep_images=keep_images,
    )
    with open_engine(
        pool_size=batch_options.workers + 8,
        cluster=None if plan else cluster,
        registry=None if plan else registry,
        registry_mirror=registry_mirror,
        image_rewrites=image_rewrite,
        out=batch_options.out,
    ) as backend:
        if not plan:
            batch_options = fit_workers(batch_options, backend, given=workers is not None)
        if plan:
            return _plan(
                source, checked, backend, batch_options, json_output=json_output, verbose=verbose,
                allowed=allowance(checked.items), fail_on=failing,
            )  # fmt: skip
        outcome = _run(source, checked, backend, batch_options, quiet=quiet, json_output=json_output)
    regressed = 0
    if baseline is not None and not outcome.summary.interrupted:
        regressed = _compare_with(baseline.absolute(), batch_options.out, quiet=quiet or json_output)
    code = exit_code(outcome.summary, allowance(checked.items), fail_on=failing, regressed=regressed)
    if code == ExitCode.INFRASTRUCTURE and outcome.summary.stopped is not None:
        say(f"pvisor-host: error: {outcome.summary.stopped}")
    elif code == ExitCode.INFRASTRUCTURE:
        first = next(r for r in outcome.results if r.status == "infra_error")
        say(f"pvisor-host: error: every failed item failed on the infrastructure; first {first.id}: {first.message}")
    return code


def _fail_on(text: str | None, baseline: Path | None) -> frozenset[FailOn]:
    """``--fail-on``, checked before anything runs."""
    from ...fanout.summary import parse_fail_on

    return parse_fail_on(text, baseline=baseline is not None)


def _check_baseline(baseline: Path, batch_dir: Path, *, plan: bool, repeat: int) -> None:
    from ...fanout.compare import check_run_dir

    if plan:
        raise UsageError("--baseline compares finished runs; it does nothing with --plan")
    if repeat > 1:
        raise UsageError(
            "--repeat finds the flaky items of one run; it cannot be compared item by item with --baseline",
            hint="run --repeat on its own, and compare a run without it against the baseline",
        )
    if baseline.absolute() == batch_dir.absolute():
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
    source: BatchInput,
    checked: ManifestCheck,
    backend: AnyBackend,
    options: BatchOptions,
    *,
    json_output: bool,
    verbose: bool,
    allowed: int,
    fail_on: frozenset[FailOn],
) -> int:
    """``batch --plan``: every item's verdict, and the exit code the run would have for what the host can tell."""
    from ...fanout.plan import ImagesPlanned, PlanTally, plan_batch
    from ...fanout.summary import exit_code
    from ...preflight.hostpvisor import runs
    from ...preflight.survey import checked_files
    from .. import render

    images = ImagesPlanned()
    tally = PlanTally()
    plans = tally.counting(plan_batch(source.items(), backend, options, images))
    render.batch_plan(console(), plans, json_output=json_output, verbose=verbose, images=images, slice=checked)
    say(f"pvisor-host: pre-flight: {len(checked_files())} trajectory files checked in {runs()} host pvisor runs")
    code = exit_code(tally.summary(), allowed, fail_on=fail_on)
    if code == ExitCode.INFRASTRUCTURE and tally.first_infra is not None:
        say(f"pvisor-host: error: {tally.first_infra.id}: {tally.first_infra.reason}")
    return code


def _run(
    source: BatchInput,
    checked: ManifestCheck,
    backend: AnyBackend,
    options: BatchOptions,
    *,
    quiet: bool,
    json_output: bool,
) -> BatchOutcome:
    from ...fanout.scheduler import run_batch
    from ...report import write_report
    from ...signals import ignore_interrupts
    from .. import render

    total = checked.items
    with render.BatchProgress(total, quiet=quiet or json_output) as progress:
        outcome = run_batch(
            source.items(),
            backend,
            options,
            total=total,
            images=checked.image_specs,
            task_images=checked.image_counts,
            reports=(write_report,),
            progress=progress,
            on_pull=progress.pull,
        )
    ignore_interrupts()  # the batch has ended and its reports are written: nothing is left to stop
    if json_output:
        typer.echo(outcome.summary.model_dump_json(indent=2))
    else:
        render.batch_summary(console(), outcome.summary, options.out, outcome.results, quiet=quiet)
    if outcome.summary.interrupted:
        say(f"pvisor-host: interrupted; every sandbox was removed. Run the same command to resume ({options.out})")
    return outcome
