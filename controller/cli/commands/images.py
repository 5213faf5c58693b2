"""``build``, ``images`` and ``images prune``: the sandbox images pvisor-host makes and keeps."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from ...errors import ExitCode
from ..options import build_fields, build_options, with_options
from ..shared import SETTINGS, JsonFlag, console, open_engine

#: ``build --bootstrap`` is the field ``BuildOptions.force_bootstrap``.
_BUILD_RENAMED = {"force_bootstrap": "bootstrap"}


@with_options(lambda: build_options(("base", "ca_bundle", "force_bootstrap"), rename=_BUILD_RENAMED))
def build(
    agent: Annotated[str, typer.Option(help="Agent to build the sandbox image for (see `pvisor-host agents`).")],
    push: Annotated[
        str | None,
        typer.Option(
            metavar="REGISTRY",
            help="Then push it to REGISTRY (HOST[:PORT][/PATH]) under its content-hash tag and print the digest "
            "reference to pass as --image (the same verified bytes on every machine).",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the image as JSON.")] = False,
    **options: Any,
) -> int:
    """Build (or find) the verified sandbox image for an agent: pvisor plus the pinned agent CLI."""
    from ...backend import check_registry
    from ...models.image import BuildOptions, BuildPlan
    from ...models.profiles import get_profile
    from .. import render

    registry = check_registry(push, flag="--push") if push is not None else None
    plan = BuildPlan(profile=get_profile(agent))
    with open_engine() as backend:
        built = backend.ensure_image(plan, BuildOptions(**build_fields(options, _BUILD_RENAMED))).built
        assert built is not None  # a build plan always reports the image it built or found
        if registry is not None:
            built = built.model_copy(update={"pushed": backend.push_image(built.tag, registry)})
    if json_output:
        typer.echo(built.model_dump_json(indent=2))
    else:
        render.built_image(console(), built)
    return ExitCode.OK


images_app = typer.Typer(
    help="List and prune the images and runtime volumes pvisor-host built.", no_args_is_help=False, **SETTINGS
)


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
    from .. import render

    with open_engine() as backend:
        entries = backend.catalog()
    if json_output:
        typer.echo(json.dumps([e.model_dump(mode="json") for e in entries], indent=2))
    else:
        render.catalog_table(console(), entries, show_all=show_all)
    return ExitCode.OK


@images_app.command("prune")
def images_prune(
    keep_bytes: Annotated[
        str | None, typer.Option(help="Remove least recently used items until at most SIZE remain.")
    ] = None,
    older_than: Annotated[str | None, typer.Option(help="Remove items not used for DURATION (e.g. 7d, 12h).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Only say what would be removed.")] = False,
    json_output: JsonFlag = False,
) -> int:
    """Remove pvisor-host images and runtime volumes (never one in use), least recently used first.

    Without --keep-bytes or --older-than, only build-cache layers are removed.
    """
    from ...units import parse_duration, parse_size
    from .. import render

    keep = parse_size(keep_bytes, flag="--keep-bytes") if keep_bytes is not None else None
    older = parse_duration(older_than, flag="--older-than") if older_than is not None else None
    with open_engine() as backend:
        result = backend.prune(keep_bytes=keep, older_than=older, dry_run=dry_run)
    if json_output:
        typer.echo(result.model_dump_json(indent=2))
    else:
        render.prune_result(console(), result, dry_run=dry_run)
    return ExitCode.OK


def register(app: typer.Typer) -> None:
    """``images`` (``build`` is made when used: :mod:`pvisor_host.cli.app`)."""
    app.add_typer(images_app, name="images")
