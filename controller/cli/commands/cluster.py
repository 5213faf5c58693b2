"""``node join`` and ``cluster status``: Docker hosts as the nodes of a Ray cluster."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ...errors import ExitCode
from ..shared import SETTINGS, JsonFlag, console

Address = Annotated[str, typer.Option(metavar="HEAD:PORT", help="The Ray head's address (its GCS port).")]

node_app = typer.Typer(help="Make this Docker host a worker node of a Ray cluster.", no_args_is_help=True, **SETTINGS)
cluster_app = typer.Typer(help="Look at a Ray cluster of Docker hosts.", no_args_is_help=True, **SETTINGS)


@node_app.command("join")
def node_join(
    address: Address,
    slots: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Replays this host runs at once (default: one per CPU, no more than its memory holds at 4 GiB each).",
        ),
    ] = None,
) -> int:
    """Check this host's engine, sweep our leftovers, and join the cluster at HEAD:PORT as a worker (blocks).

    The token comes from RAY_AUTH_TOKEN (or the file PVISOR_HOST_CLUSTER_TOKEN_FILE names), never from a flag.
    """
    from ...backend.cluster.node.join import join

    join(address, slots=slots)
    return ExitCode.INFRASTRUCTURE  # join replaces this process with `ray start`; reaching here is a failure


@cluster_app.command("status")
def cluster_status(address: Address, json_output: JsonFlag = False) -> int:
    """The cluster's nodes: alive or not, engine, slots, sandboxes of ours running, images present."""
    from ...backend.cluster.connect import require_ray
    from ...backend.cluster.node.status import cluster_status
    from .. import render

    require_ray()
    nodes = cluster_status(address)
    if json_output:
        typer.echo(json.dumps([{**n.model_dump(), "free": n.free} for n in nodes], indent=2))
    else:
        render.cluster_status(console(), nodes)
    return ExitCode.OK


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")
    app.add_typer(cluster_app, name="cluster")
