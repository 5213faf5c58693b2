"""The ``pvisor-host`` command line: parse → validate into a model → one library call → render → exit code.

:func:`main` is the console script. It is the one place exceptions become exit codes: a
:class:`~pvisor_host.errors.PvisorHostError` prints one line and exits with its code, Ctrl-C exits 130,
and tracebacks appear only with ``--debug``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from typer.exceptions import TyperException

from . import options as opt
from . import render
from ._version import PVISOR_VERSION, __version__
from .errors import ExitCode, PvisorHostError, UsageError, exit_code_for_status
from .signals import ignore_interrupts, install_sigterm_as_interrupt

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
    from .build import build_agent_image
    from .engine import connect
    from .profiles import get_profile

    profile = get_profile(agent)
    built = build_agent_image(connect(), profile, base=base, ca_bundle=ca_bundle, force_bootstrap=bootstrap)
    if json_output:
        typer.echo(built.model_dump_json(indent=2))
    else:
        render.built_image(_out, built)
    return ExitCode.OK


@app.command()
def agents(json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> int:
    """List the agents pvisor replays: pinned versions, install sources, images and continuation needs."""
    from .catalog import agent_statuses
    from .engine import connect
    from .errors import PrerequisiteError

    try:
        client = connect(timeout=10)
    except PrerequisiteError:
        client = None  # still list the agents; image status is unknown
    statuses = agent_statuses(client)
    if json_output:
        typer.echo(json.dumps([s.model_dump() for s in statuses], indent=2))
        return ExitCode.OK
    rows = []
    for s in statuses:
        if not s.installable:
            image = "unavailable (below)"
        elif client is None:
            image = "unknown (no engine)"
        else:
            image = s.image or "not built"
        needs = s.continuation_api + ": " + ", ".join(group[0] for group in s.continuation_env)
        rows.append(
            {
                "agent": s.agent,
                "version": s.version,
                "install_source": s.install_source,
                "image": image,
                "inject": "yes" if s.injectable else "no",
                "needs": needs,
            }
        )
    notes = [f"{s.agent}: {s.unavailable_reason}" for s in statuses if s.unavailable_reason]
    render.agents_table(_out, rows, notes)
    return ExitCode.OK


images_app = typer.Typer(help="List and prune the images and runtime volumes pvisor-host built.", no_args_is_help=False)
app.add_typer(images_app, name="images")


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
    from .catalog import list_catalog
    from .engine import connect

    entries = list_catalog(connect())
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
    from .catalog import prune
    from .engine import connect
    from .units import parse_duration, parse_size

    result = prune(
        connect(),
        keep_bytes=parse_size(keep_bytes, flag="--keep-bytes") if keep_bytes is not None else None,
        older_than=parse_duration(older_than, flag="--older-than") if older_than is not None else None,
        dry_run=dry_run,
    )
    if json_output:
        typer.echo(result.model_dump_json(indent=2))
    else:
        render.prune_result(_out, result, dry_run=dry_run)
    return ExitCode.OK


@app.command()
def doctor(json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> int:
    """Check this host: engine, architecture, disk, registry, base and agent images, pvisor."""
    from .doctor import diagnose

    report = diagnose()
    if json_output:
        typer.echo(json.dumps({"ok": report.ok, **report.model_dump()}, indent=2))
    else:
        render.doctor_report(_out, report)
    return ExitCode.OK if report.ok else ExitCode.PREREQUISITE


def _spec_fields(values: dict[str, object]) -> dict[str, object]:
    """The replay options among a command's parameters (``locals()``), leaving out the ones not given."""
    from .spec import ReplaySpec

    return {name: value for name, value in values.items() if name in ReplaySpec.model_fields and value is not None}


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
    from .attempts import run_replay
    from .engine import connect
    from .preflight import check_inputs, prepare
    from .spec import build_spec

    spec = build_spec(**_spec_fields(locals()))
    checked = check_inputs(spec)
    client = connect()
    prepared = prepare(checked, client, base=base, ca_bundle=ca_bundle)
    record = run_replay(prepared, client)
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
    from .batch import BatchOptions, default_workers, run_batch
    from .engine import connect
    from .manifest import BatchInput
    from .report import allowed_failures, exit_code
    from .units import parse_duration

    if manifest_file is not None and manifest is not None and manifest_file != manifest:
        raise UsageError(f"two manifests given ({manifest_file} and --manifest {manifest}); pass one")
    manifest = manifest or manifest_file
    defaults = _spec_fields(locals())
    allowance = allowed_failures(allow_failures)
    source = BatchInput.parse(manifest=manifest, trajectories=trajectories, after_step=after_step, defaults=defaults)
    checked = source.check()
    for problem in checked.problems:
        _say(f"pvisor-host: {source.name}:{problem.line}: {problem.message}")
    if checked.problems:
        raise UsageError(f"{len(checked.problems)} of the batch's lines are wrong (listed above); nothing ran")
    total = checked.items
    memory_each = source.spec_default("memory")
    options = BatchOptions(
        out=out.absolute(),
        workers=workers or default_workers(memory_each),
        deadline=parse_duration(deadline, flag="--deadline") if deadline is not None else None,
        rerun_failed=rerun_failed,
        retry_oom=retry_oom,
        base=base,
        ca_bundle=ca_bundle,
    )
    client = connect(pool_size=options.workers + 8)
    if plan:
        from .plan import plan_batch

        plans = list(plan_batch(source.items(), client, options))
        render.batch_plan(_out, plans, json_output=json_output)
        return ExitCode.USAGE if any(p.action == "reject" for p in plans) else ExitCode.OK
    with render.BatchProgress(total, quiet=quiet or json_output) as progress:
        outcome = run_batch(source.items(), client, options, total=total, images=checked.image_specs, progress=progress)
    ignore_interrupts()  # the batch has ended and its reports are written: nothing is left to stop
    if json_output:
        typer.echo(outcome.summary.model_dump_json(indent=2))
    else:
        render.batch_summary(_out, outcome.summary, options.out, quiet=quiet)
    if outcome.summary.interrupted:
        _say(f"pvisor-host: interrupted; every sandbox was removed. Run the same command to resume ({options.out})")
    return exit_code(outcome.summary, allowance(total))


@app.command()
def gc(
    dry_run: Annotated[bool, typer.Option(help="Only list what would be removed.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> int:
    """Remove containers, volumes and networks whose pvisor-host process is gone (after a kill -9, say).

    Resources of a live pvisor-host, of another host, and anything without pvisor-host labels are never touched.
    """
    from .engine import connect
    from .gc import collect_garbage

    report = collect_garbage(connect(), dry_run=dry_run)
    if json_output:
        typer.echo(report.model_dump_json(indent=2))
    else:
        render.gc_report(_out, report, dry_run=dry_run)
    return ExitCode.OK if not report.failed else ExitCode.INFRASTRUCTURE


def _say(line: str) -> None:
    """One unwrapped line on stderr (errors must stay one line whatever the terminal width)."""
    try:
        sys.stderr.write(line.replace("\n", " ") + "\n")
        sys.stderr.flush()
    except OSError:
        pass  # stderr is gone (a closed pipe): the exit code still says what happened


def _debugging(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("PVISOR_HOST_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI and exit with a documented code."""
    args = sys.argv[1:] if argv is None else argv
    debug = _debugging(args)
    install_sigterm_as_interrupt()
    code: int
    try:
        result = app(args=args, prog_name="pvisor-host", standalone_mode=False)
        code = int(result) if isinstance(result, int) else ExitCode.OK
    except PvisorHostError as exc:
        if debug:
            traceback.print_exc()
        interrupted = exc.exit_code == ExitCode.INTERRUPTED
        _say(f"pvisor-host: {exc.one_line()}" if interrupted else f"pvisor-host: error: {exc.one_line()}")
        code = exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        _say("pvisor-host: interrupted")
        code = ExitCode.INTERRUPTED
    except TyperException as exc:  # usage errors from option parsing
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        else:
            _say(f"pvisor-host: error: {exc.format_message()}")
        code = exc.exit_code
    except Exception as exc:  # a bug: say so in one line, keep the traceback for --debug
        if debug:
            traceback.print_exc()
        _say(f"pvisor-host: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)")
        code = ExitCode.INFRASTRUCTURE
    ignore_interrupts()  # the outcome is decided and everything cleaned up: a late Ctrl-C must not change the code
    sys.exit(code)
