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

from . import render
from ._version import PVISOR_VERSION, __version__
from .errors import ExitCode, PvisorHostError, exit_code_for_status
from .signals import install_sigterm_as_interrupt

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
def images(ctx: typer.Context, json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> int:
    """List pvisor-host's images and runtime volumes, least recently used first."""
    if ctx.invoked_subcommand is not None:
        return ExitCode.OK
    from .catalog import list_catalog
    from .engine import connect

    entries = list_catalog(connect())
    if json_output:
        typer.echo(json.dumps([e.model_dump(mode="json") for e in entries], indent=2))
    else:
        render.catalog_table(_out, entries)
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


_MODE_HELP = "continue (replay, then the live agent), replay-only or prepare-only."


@app.command()
def replay(
    trajectory: Annotated[Path, typer.Option(help="The agent's native trajectory file.")],
    after_step: Annotated[int, typer.Option(help="Complete tool batch after which live execution resumes (1-based).")],
    agent: Annotated[str | None, typer.Option(help="Agent name; default: the image's label.")] = None,
    image: Annotated[str | None, typer.Option(help="Sandbox image; default: the one `build --agent` makes.")] = None,
    inject: Annotated[
        bool, typer.Option(help="Run in --image unchanged; pvisor and the agent come from a read-only runtime volume.")
    ] = False,
    mode: Annotated[str, typer.Option(help=_MODE_HELP)] = "continue",
    max_steps: Annotated[int | None, typer.Option(help="Total action budget including the prefix.")] = None,
    boundary_user_prompt: Annotated[
        str | None, typer.Option(help="User message appended after the boundary observation.")
    ] = None,
    disable_thinking: Annotated[bool, typer.Option(help="Disable thinking in live model requests.")] = False,
    allow_stale_observations: Annotated[
        bool, typer.Option(help="Let Claude reuse source observations it cannot reproduce (degraded).")
    ] = False,
    session_id: Annotated[str | None, typer.Option(help="Model-router session key.")] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id ([A-Za-z0-9_-]); generated when absent.")] = None,
    workspace_dir: Annotated[Path | None, typer.Option(help="Host directory copied in as the workspace.")] = None,
    workspace_path: Annotated[
        str | None, typer.Option(help="Workspace path in the sandbox (default: the recorded cwd, else /workspace).")
    ] = None,
    image_workspace: Annotated[
        bool, typer.Option(help="Start from a copy of the image's own directory at the workspace path.")
    ] = False,
    no_workspace: Annotated[bool, typer.Option("--no-workspace", help="Do not collect the final workspace.")] = False,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (new or empty); default ./pvisor-runs/<run-id>.")
    ] = None,
    timeout: Annotated[str, typer.Option(help="Wall-clock limit, e.g. 90s, 30m, 2h.")] = "2h",
    memory: Annotated[str, typer.Option(help="Memory limit, e.g. 2g.")] = "4g",
    cpus: Annotated[float, typer.Option(help="CPU limit.")] = 2.0,
    pids: Annotated[int, typer.Option(help="Process limit.")] = 1024,
    tmp_size: Annotated[str, typer.Option(help="Size of the /tmp tmpfs.")] = "1g",
    collect_limit: Annotated[str, typer.Option(help="Most bytes collected from the sandbox.")] = "4g",
    network: Annotated[str, typer.Option(help="none (default) or bridge.")] = "none",
    env: Annotated[list[str] | None, typer.Option(help="Pass this host variable into the sandbox (repeat).")] = None,
    user: Annotated[str | None, typer.Option(help="Sandbox user UID[:GID] or root (default: non-root).")] = None,
    cap_add: Annotated[list[str] | None, typer.Option(help="Keep this capability (repeat).")] = None,
    writable_rootfs: Annotated[bool, typer.Option(help="Do not make the root filesystem read-only.")] = False,
    allow_privilege_escalation: Annotated[bool, typer.Option(help="Do not set no-new-privileges.")] = False,
    model_base_url: Annotated[
        str | None, typer.Option(help="The real OpenAI-compatible endpoint; a host-side gateway forwards to it.")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Model name for the agent (MODEL_NAME).")] = None,
    model_api_key_env: Annotated[
        str | None, typer.Option(help="Name of the host variable holding the real key (never the key itself).")
    ] = None,
    model_network: Annotated[
        str, typer.Option(help="unix (default: no network, a mounted socket), internal, or pass-through.")
    ] = "unix",
    model_body_limit: Annotated[str, typer.Option(help="Bytes of each body kept in model-traffic.jsonl.")] = "64k",
    no_model_bodies: Annotated[bool, typer.Option(help="Keep no bodies in model-traffic.jsonl.")] = False,
    model_timeout: Annotated[str, typer.Option(help="How long the gateway waits for the upstream.")] = "5m",
    attempts: Annotated[int, typer.Option(help="Attempts for failures pvisor marks retryable.")] = 3,
    retry_backoff: Annotated[str, typer.Option(help="Wait before the first retry (doubles each time).")] = "5s",
    base: Annotated[str | None, typer.Option(help="Base image when the agent image must be built.")] = None,
    ca_bundle: Annotated[Path | None, typer.Option(help="CA bundle when the agent image must be built.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print record.json on stdout.")] = False,
) -> int:
    """Replay a trajectory up to --after-step in a fresh hardened container and collect the result."""
    from .attempts import run_replay
    from .engine import connect
    from .preflight import check_inputs, prepare
    from .spec import build_spec

    spec = build_spec(
        trajectory=trajectory,
        agent=agent,
        image=image,
        inject=inject,
        after_step=after_step,
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
        env=env or [],
        user=user,
        cap_add=cap_add or [],
        writable_rootfs=writable_rootfs,
        allow_privilege_escalation=allow_privilege_escalation,
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
    client = connect()
    prepared = prepare(checked, client, base=base, ca_bundle=ca_bundle)
    record = run_replay(prepared, client)
    if json_output:
        typer.echo(record.model_dump_json(indent=2))
    else:
        render.replay_summary(_out, record, prepared.out_dir)
    return exit_code_for_status(record.status)


def _say(line: str) -> None:
    """One unwrapped line on stderr (errors must stay one line whatever the terminal width)."""
    sys.stderr.write(line.replace("\n", " ") + "\n")
    sys.stderr.flush()


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
    sys.exit(code)
