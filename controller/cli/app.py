"""The ``pvisor-host`` commands: parse → validate into a model → one library call → render → exit code.

Every command is thin: options become pydantic models (a :class:`~pvisor_host.models.spec.ReplaySpec`, say),
the library does the work behind the backend seam, and :mod:`.render` shows the result. Exceptions become
exit codes in one place, :func:`pvisor_host.cli.main.main`. Imports are lazy, so ``--help`` loads no engine
client and no pydantic model it does not show.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from .._version import PVISOR_VERSION, __version__
from ..errors import ExitCode, UsageError, exit_code_for_status
from . import options as opt

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..backend.base import Backend
    from ..fanout.manifest import BatchInput, ManifestCheck
    from ..fanout.plan import ItemPlan
    from ..fanout.scheduler import BatchOptions

app = typer.Typer(
    name="pvisor-host",
    help="Replay recorded AI-agent trajectories with pvisor inside hardened Docker containers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
# Wide enough for tables when stdout is a file or a CI log (rich would otherwise wrap at 80 columns).
_out = Console(width=None if sys.stdout.isatty() else 160)


def say(line: str) -> None:
    """One unwrapped line on stderr (errors must stay one line whatever the terminal width)."""
    try:
        sys.stderr.write(line.replace("\n", " ") + "\n")
        sys.stderr.flush()
    except OSError:
        pass  # stderr is gone (a closed pipe): the exit code still says what happened


@contextlib.contextmanager
def _backend(
    *, pool_size: int = 10, timeout: float = 120, cluster: str | None = None, registry: str | None = None
) -> Iterator[Backend]:
    """The local engine (or, with ``cluster``, the Ray cluster at that address, its nodes pulling images from
    ``registry`` when given) for one command, closed afterwards."""
    from ..backend import open_backend

    backend = open_backend(pool_size=pool_size, timeout=timeout, cluster=cluster, registry=registry)
    try:
        yield backend
    finally:
        backend.close()


def _version(value: bool) -> None:
    if value:
        _out.print(f"pvisor-host {__version__} (pvisor {PVISOR_VERSION})")
        raise typer.Exit


@app.callback()
def _global(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every step.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Log warnings and errors only.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Verbose logs and tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    from . import logs

    logs.configure(verbose=verbose, quiet=quiet, debug=debug)


@app.command()
def build(
    agent: Annotated[str, typer.Option(help="Agent to build the sandbox image for (see `pvisor-host agents`).")],
    base: Annotated[str | None, typer.Option(help="Base image (default debian:bookworm-slim, or a bootstrap).")] = None,
    ca_bundle: Annotated[
        Path | None,
        typer.Option(
            help="CA bundle for the build's downloads (default: SSL_CERT_FILE, REQUESTS_CA_BUNDLE, PIP_CERT)."
        ),
    ] = None,
    bootstrap: Annotated[bool, typer.Option(help="Build the Debian base with mmdebstrap instead of pulling.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the image as JSON.")] = False,
) -> int:
    """Build (or find) the verified sandbox image for an agent: pvisor plus the pinned agent CLI."""
    from ..models.image import BuildOptions, BuildPlan
    from ..models.profiles import get_profile
    from . import render

    plan = BuildPlan(profile=get_profile(agent))
    options = BuildOptions(base=base, ca_bundle=ca_bundle, force_bootstrap=bootstrap)
    with _backend() as backend:
        built = backend.ensure_image(plan, options).built
    assert built is not None  # a build plan always reports the image it built or found
    if json_output:
        typer.echo(built.model_dump_json(indent=2))
    else:
        render.built_image(_out, built)
    return ExitCode.OK


@app.command()
def agents(json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> int:
    """List the agents pvisor replays: pinned versions, install sources, images and continuation needs."""
    from ..errors import PrerequisiteError
    from ..models.housekeeping import AgentStatus
    from ..models.profiles import all_profiles
    from . import render

    try:
        with _backend(timeout=10) as backend:
            statuses = backend.agent_statuses()
        engine = True
    except PrerequisiteError:  # still list the agents; image status is unknown
        statuses = [AgentStatus.of(profile) for profile in all_profiles().values()]
        engine = False
    if json_output:
        typer.echo(json.dumps([s.model_dump() for s in statuses], indent=2))
    else:
        render.agents_table(_out, statuses, engine=engine)
    return ExitCode.OK


images_app = typer.Typer(help="List and prune the images and runtime volumes pvisor-host built.", no_args_is_help=False)
app.add_typer(images_app, name="images")
node_app = typer.Typer(help="Make this Docker host a worker node of a Ray cluster.", no_args_is_help=True)
app.add_typer(node_app, name="node")
cluster_app = typer.Typer(help="Look at a Ray cluster of Docker hosts.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


@images_app.callback(invoke_without_command=True)
def images(
    ctx: typer.Context,
    show_all: Annotated[
        bool, typer.Option("--all", "-a", help="Also list the builder's untagged intermediate layers.")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON (every entry, layers included).")] = False,
) -> int:
    """List pvisor-host's images and runtime volumes, least recently used first."""
    if ctx.invoked_subcommand is not None:
        return ExitCode.OK
    from . import render

    with _backend() as backend:
        entries = backend.catalog()
    if json_output:
        typer.echo(json.dumps([e.model_dump(mode="json") for e in entries], indent=2))
    else:
        render.catalog_table(_out, entries, show_all=show_all)
    return ExitCode.OK


@images_app.command("prune")
def images_prune(
    keep_bytes: Annotated[
        str | None, typer.Option(help="Remove least recently used items until at most SIZE remain.")
    ] = None,
    older_than: Annotated[str | None, typer.Option(help="Remove items not used for DURATION (e.g. 7d, 12h).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Only say what would be removed.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> int:
    """Remove pvisor-host images and runtime volumes (never one in use), least recently used first.

    Without --keep-bytes or --older-than, only build-cache layers are removed.
    """
    from ..models.units import parse_duration, parse_size
    from . import render

    keep = parse_size(keep_bytes, flag="--keep-bytes") if keep_bytes is not None else None
    older = parse_duration(older_than, flag="--older-than") if older_than is not None else None
    with _backend() as backend:
        result = backend.prune(keep_bytes=keep, older_than=older, dry_run=dry_run)
    if json_output:
        typer.echo(result.model_dump_json(indent=2))
    else:
        render.prune_result(_out, result, dry_run=dry_run)
    return ExitCode.OK


@app.command()
def doctor(json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> int:
    """Check this host: engine, architecture, disk, registry, base and agent images, pvisor."""
    from ..backend import open_backend
    from ..preflight.doctor import diagnose
    from . import render

    report = diagnose(lambda: open_backend(timeout=10))
    if json_output:
        typer.echo(json.dumps({"ok": report.ok, **report.model_dump()}, indent=2))
    else:
        render.doctor_report(_out, report)
    return ExitCode.OK if report.ok else ExitCode.PREREQUISITE


@app.command()
def replay(
    trajectory: Annotated[Path, typer.Option(help="The agent's native trajectory file.")],
    after_step: Annotated[int, typer.Option(help="Complete tool batch after which live execution resumes (1-based).")],
    agent: opt.Agent = None,
    image: opt.Image = None,
    inject: opt.Inject = False,
    mode: opt.Mode = "continue",
    max_steps: opt.MaxSteps = None,
    boundary_user_prompt: opt.BoundaryUserPrompt = None,
    disable_thinking: opt.DisableThinking = False,
    allow_stale_observations: opt.AllowStaleObservations = False,
    session_id: Annotated[str | None, typer.Option(help="Model-router session key.")] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id ([A-Za-z0-9_-]); generated when absent.")] = None,
    workspace_dir: opt.WorkspaceDir = None,
    workspace_path: opt.WorkspacePath = None,
    image_workspace: opt.ImageWorkspace = False,
    no_workspace: opt.NoWorkspace = False,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (new or empty); default ./pvisor-runs/<run-id>.")
    ] = None,
    timeout: opt.Timeout = "2h",
    memory: opt.Memory = "4g",
    cpus: opt.Cpus = 2.0,
    pids: opt.Pids = 1024,
    tmp_size: opt.TmpSize = "1g",
    collect_limit: opt.CollectLimit = "4g",
    network: opt.Network = "none",
    env: opt.Env = None,
    user: opt.User = None,
    cap_add: opt.CapAdd = None,
    writable_rootfs: opt.WritableRootfs = False,
    allow_privilege_escalation: opt.AllowPrivilegeEscalation = False,
    runtime: opt.Runtime = None,
    model_base_url: opt.ModelBaseUrl = None,
    model: opt.Model = None,
    model_api_key_env: opt.ModelApiKeyEnv = None,
    model_network: opt.ModelNetwork = "unix",
    model_body_limit: opt.ModelBodyLimit = "64k",
    no_model_bodies: opt.NoModelBodies = False,
    model_timeout: opt.ModelTimeout = "5m",
    attempts: opt.Attempts = 3,
    retry_backoff: opt.RetryBackoff = "5s",
    base: opt.Base = None,
    ca_bundle: opt.CaBundle = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print record.json on stdout.")] = False,
) -> int:
    """Replay a trajectory up to --after-step in a fresh hardened container and collect the result."""
    from ..attempts import run_replay
    from ..models.image import BuildOptions
    from ..models.spec import build_spec
    from ..preflight.checks import check_inputs
    from ..preflight.prepare import prepare
    from . import render

    spec = build_spec(
        trajectory=trajectory,
        after_step=after_step,
        agent=agent,
        image=image,
        inject=inject,
        mode=mode,
        max_steps=max_steps,
        boundary_user_prompt=boundary_user_prompt,
        disable_thinking=disable_thinking,
        allow_stale_observations=allow_stale_observations,
        session_id=session_id,
        run_id=run_id,
        workspace_dir=workspace_dir,
        workspace_path=workspace_path,
        image_workspace=image_workspace,
        no_workspace=no_workspace,
        out=out,
        timeout=timeout,
        memory=memory,
        cpus=cpus,
        pids=pids,
        tmp_size=tmp_size,
        collect_limit=collect_limit,
        network=network,
        env=env,
        user=user,
        cap_add=cap_add,
        writable_rootfs=writable_rootfs,
        allow_privilege_escalation=allow_privilege_escalation,
        runtime=runtime,
        model_base_url=model_base_url,
        model=model,
        model_api_key_env=model_api_key_env,
        model_network=model_network,
        model_body_limit=model_body_limit,
        no_model_bodies=no_model_bodies,
        model_timeout=model_timeout,
        attempts=attempts,
        retry_backoff=retry_backoff,
    )
    checked = check_inputs(spec)
    with _backend() as backend:
        prepared = prepare(checked, backend, build=BuildOptions(base=base, ca_bundle=ca_bundle))
        record = run_replay(prepared, backend)
    if json_output:
        typer.echo(record.model_dump_json(indent=2))
    else:
        render.replay_summary(_out, record, prepared.out_dir)
    return exit_code_for_status(record.status)


@app.command()
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
        Path | None, typer.Option(help="JSONL file, one replay per line (fields: replay's options, plus id).")
    ] = None,
    trajectories: Annotated[
        str | None, typer.Option(help="Glob of trajectory files (shorthand for a manifest; needs --after-step).")
    ] = None,
    after_step: Annotated[
        str | None, typer.Option(help="With --trajectories: a boundary N, or 'all' for every boundary of each.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Batch directory; rerunning into it resumes.")] = Path("pvisor-batch"),
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
            "exit 1 when an item regressed."
        ),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            metavar="HEAD:PORT",
            help="Run the items on the Docker hosts of the Ray cluster at HEAD:PORT (needs pvisor-host[ray] and "
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
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress and no table; only the last line.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print summary.json (or the plan) on stdout.")] = False,
    agent: opt.Agent = None,
    image: opt.Image = None,
    inject: opt.Inject = None,
    mode: opt.Mode = None,
    max_steps: opt.MaxSteps = None,
    boundary_user_prompt: opt.BoundaryUserPrompt = None,
    disable_thinking: opt.DisableThinking = None,
    allow_stale_observations: opt.AllowStaleObservations = None,
    workspace_dir: opt.WorkspaceDir = None,
    workspace_path: opt.WorkspacePath = None,
    image_workspace: opt.ImageWorkspace = None,
    no_workspace: opt.NoWorkspace = None,
    timeout: opt.Timeout = None,
    memory: opt.Memory = None,
    cpus: opt.Cpus = None,
    pids: opt.Pids = None,
    tmp_size: opt.TmpSize = None,
    collect_limit: opt.CollectLimit = None,
    network: opt.Network = None,
    env: opt.Env = None,
    user: opt.User = None,
    cap_add: opt.CapAdd = None,
    writable_rootfs: opt.WritableRootfs = None,
    allow_privilege_escalation: opt.AllowPrivilegeEscalation = None,
    runtime: opt.Runtime = None,
    model_base_url: opt.ModelBaseUrl = None,
    model: opt.Model = None,
    model_api_key_env: opt.ModelApiKeyEnv = None,
    model_network: opt.ModelNetwork = None,
    model_body_limit: opt.ModelBodyLimit = None,
    no_model_bodies: opt.NoModelBodies = None,
    model_timeout: opt.ModelTimeout = None,
    attempts: opt.Attempts = None,
    retry_backoff: opt.RetryBackoff = None,
    base: opt.Base = None,
    ca_bundle: opt.CaBundle = None,
) -> int:
    """Replay many trajectories in parallel containers; rerunning the same command resumes.

    Options after --json are defaults for every item; a manifest line's own fields override them.
    """
    from ..fanout.manifest import BatchInput
    from ..fanout.report import allowed_failures
    from ..fanout.scheduler import BatchOptions, default_workers
    from ..models.image import BuildOptions
    from ..models.units import parse_duration

    if manifest_file is not None and manifest is not None and manifest_file != manifest:
        raise UsageError(f"two manifests given ({manifest_file} and --manifest {manifest}); pass one")
    defaults = _given(
        agent=agent,
        image=image,
        inject=inject,
        mode=mode,
        max_steps=max_steps,
        boundary_user_prompt=boundary_user_prompt,
        disable_thinking=disable_thinking,
        allow_stale_observations=allow_stale_observations,
        workspace_dir=workspace_dir,
        workspace_path=workspace_path,
        image_workspace=image_workspace,
        no_workspace=no_workspace,
        timeout=timeout,
        memory=memory,
        cpus=cpus,
        pids=pids,
        tmp_size=tmp_size,
        collect_limit=collect_limit,
        network=network,
        env=env,
        user=user,
        cap_add=cap_add,
        writable_rootfs=writable_rootfs,
        allow_privilege_escalation=allow_privilege_escalation,
        runtime=runtime,
        model_base_url=model_base_url,
        model=model,
        model_api_key_env=model_api_key_env,
        model_network=model_network,
        model_body_limit=model_body_limit,
        no_model_bodies=no_model_bodies,
        model_timeout=model_timeout,
        attempts=attempts,
        retry_backoff=retry_backoff,
    )
    allowance = allowed_failures(allow_failures)
    if baseline is not None:
        _check_baseline(baseline, out, plan=plan)
    if registry and cluster is None:
        raise UsageError("--registry is where cluster nodes pull images from; it needs --cluster")
    source = BatchInput.parse(
        manifest=manifest or manifest_file, trajectories=trajectories, after_step=after_step, defaults=defaults
    )
    checked = source.check()
    for problem in checked.problems:
        say(f"pvisor-host: {source.name}:{problem.line}: {problem.message}")
    if checked.problems:
        raise UsageError(f"{len(checked.problems)} of the batch's lines are wrong (listed above); nothing ran")
    options = BatchOptions(
        out=out.absolute(),
        workers=workers or default_workers(source.spec_default("memory")),
        deadline=parse_duration(deadline, flag="--deadline") if deadline is not None else None,
        rerun_failed=rerun_failed,
        retry_oom=retry_oom,
        build=BuildOptions(base=base, ca_bundle=ca_bundle),
    )
    with _backend(
        pool_size=options.workers + 8, cluster=None if plan else cluster, registry=None if plan else registry
    ) as backend:
        if cluster is not None and not plan and workers is None:
            options = options.model_copy(update={"workers": getattr(backend, "slots", options.workers)})
        if plan:
            return _plan(source, backend, options, json_output=json_output)
        code = _run(source, checked, backend, options, quiet=quiet, json_output=json_output, allowed=allowance)
    if baseline is not None and code != ExitCode.INTERRUPTED:
        code = _compare_with(baseline.absolute(), options.out, code, quiet=quiet or json_output)
    return code


def _check_baseline(baseline: Path, out: Path, *, plan: bool) -> None:
    from ..fanout.compare import check_run_dir

    if plan:
        raise UsageError("--baseline compares finished runs; it does nothing with --plan")
    if baseline.absolute() == out.absolute():
        raise UsageError(f"--baseline {baseline} is the batch's own --out; pass the earlier batch's directory")
    check_run_dir(baseline.absolute())


def _compare_with(baseline: Path, out: Path, code: int, *, quiet: bool) -> int:
    """``batch --baseline``: compare, write the reports, show them; a regression makes an ok batch exit 1."""
    from ..fanout.compare import compare_runs, write_reports
    from . import render

    comparison = compare_runs(baseline, out)
    write_reports(comparison, out)
    regressed = len(comparison.regressions)
    if quiet:
        say(f"pvisor-host: against {baseline}: {regressed} regressed, {len(comparison.changes)} changed (compare.json)")
    else:
        render.comparison(_out, comparison)
    return ExitCode.REPLAY_FAILED if regressed and code == ExitCode.OK else code


def _given(**options: Any) -> dict[str, Any]:
    """The replay options a ``batch`` command line gave (the others are ``None``): every item's defaults."""
    return {name: value for name, value in options.items() if value is not None}


def _plan(source: BatchInput, backend: Backend, options: BatchOptions, *, json_output: bool) -> int:
    from ..fanout.plan import plan_batch
    from . import render

    rejected: dict[int | None, ItemPlan] = {}  # the first refusal of each exit code; nothing else is kept

    def tallied() -> Iterator[ItemPlan]:
        for item in plan_batch(source.items(), backend, options):
            if item.action == "reject":
                rejected.setdefault(item.exit_code, item)
            yield item

    render.batch_plan(_out, tallied(), json_output=json_output)
    first = rejected.get(ExitCode.INFRASTRUCTURE)
    if first is not None:
        say(f"pvisor-host: error: {first.id}: {first.reason}")
        return ExitCode.INFRASTRUCTURE
    return ExitCode.USAGE if rejected else ExitCode.OK


def _run(
    source: BatchInput,
    checked: ManifestCheck,
    backend: Backend,
    options: BatchOptions,
    *,
    quiet: bool,
    json_output: bool,
    allowed: Callable[[int], int],
) -> int:
    from ..fanout.report import exit_code
    from ..fanout.scheduler import run_batch
    from ..signals import ignore_interrupts
    from . import render

    total = checked.items
    with render.BatchProgress(total, quiet=quiet or json_output) as progress:
        outcome = run_batch(
            source.items(), backend, options, total=total, images=checked.image_specs, progress=progress
        )
    ignore_interrupts()  # the batch has ended and its reports are written: nothing is left to stop
    if json_output:
        typer.echo(outcome.summary.model_dump_json(indent=2))
    else:
        render.batch_summary(_out, outcome.summary, options.out, quiet=quiet)
    if outcome.summary.interrupted:
        say(f"pvisor-host: interrupted; every sandbox was removed. Run the same command to resume ({options.out})")
    code = exit_code(outcome.summary, allowed(total))
    if outcome.summary.stopped is not None and code == ExitCode.INFRASTRUCTURE:
        say(f"pvisor-host: error: {outcome.summary.stopped}")
    elif code == ExitCode.INFRASTRUCTURE:
        first = next(r for r in outcome.results if r.status == "infra_error")
        say(f"pvisor-host: error: every failed item failed on the infrastructure; first {first.id}: {first.message}")
    return code


@app.command()
def compare(
    old: Annotated[Path, typer.Argument(help="The earlier batch's --out directory.", show_default=False)],
    new: Annotated[Path, typer.Argument(help="The later batch's --out directory.", show_default=False)],
    junit: Annotated[
        Path | None, typer.Option(help="Also write a JUnit file in which only the regressions fail.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
) -> int:
    """What changed between two batch runs: regressions first, then other status changes, moved divergences,
    items gone and new.

    Items are matched by id and boundary (after_step). Exit 1 when an item that was ok is not any more.
    """
    from ..fanout.compare import compare_runs, write_junit
    from . import render

    comparison = compare_runs(old.absolute(), new.absolute())
    if junit is not None:
        write_junit(comparison, junit.absolute())
    if json_output:
        typer.echo(comparison.model_dump_json(indent=2))
    else:
        render.comparison(_out, comparison)
    return ExitCode.REPLAY_FAILED if comparison.regressions else ExitCode.OK


@node_app.command("join")
def node_join(
    address: Annotated[str, typer.Option(metavar="HEAD:PORT", help="The Ray head's address (its GCS port).")],
    slots: Annotated[
        int | None, typer.Option(min=1, help="Replays this host runs at once (default: one per CPU).")
    ] = None,
) -> int:
    """Check this host's engine, sweep our leftovers, and join the cluster at HEAD:PORT as a worker (blocks).

    The token comes from RAY_AUTH_TOKEN (or the file PVISOR_HOST_CLUSTER_TOKEN_FILE names), never from a flag.
    """
    from ..cluster.join import join

    join(address, slots=slots)
    return ExitCode.INFRASTRUCTURE  # join replaces this process with `ray start`; reaching here is a failure


@cluster_app.command("status")
def cluster_status(
    address: Annotated[str, typer.Option(metavar="HEAD:PORT", help="The Ray head's address (its GCS port).")],
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> int:
    """The cluster's nodes: alive or not, engine, slots, sandboxes of ours running, images present."""
    from ..cluster.connect import require_ray
    from ..cluster.status import cluster_status
    from . import render

    require_ray()
    nodes = cluster_status(address)
    if json_output:
        typer.echo(json.dumps([{**n.model_dump(), "free": n.free} for n in nodes], indent=2))
    else:
        render.cluster_status(_out, nodes)
    return ExitCode.OK


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A batch's --out directory.", show_default=False)],
) -> int:
    """Write DIR/report.html: one self-contained page with the batch's totals, phase times, a filterable item
    table, each item's observation diffs and the tool calls that diverge most often.

    batch writes it at the end too; run this after copying a batch directory, or to rewrite it.
    """
    from ..report import write_report

    path = write_report(run_dir.absolute())
    typer.echo(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return ExitCode.OK


@app.command()
def gc(
    dry_run: Annotated[bool, typer.Option(help="Only list what would be removed.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> int:
    """Remove containers, volumes and networks whose pvisor-host process is gone (after a kill -9, say).

    Resources of a live pvisor-host, of another host, and anything without pvisor-host labels are never touched.
    """
    from . import render

    with _backend() as backend:
        report = backend.sweep(dry_run=dry_run)
    if json_output:
        typer.echo(report.model_dump_json(indent=2))
    else:
        render.gc_report(_out, report, dry_run=dry_run)
    return ExitCode.OK if not report.failed else ExitCode.INFRASTRUCTURE
