"""``pvisor-host cluster status``: the nodes of a cluster, their engines, slots, images and running sandboxes.

It needs no Docker engine on the machine it runs on: every node answers for its own.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel

from ....errors import InfrastructureError
from ..connect import ENGINE_RESOURCE, connect, engine_nodes, pinned_to
from . import tasks as on_node


class NodeStatus(BaseModel):
    """One node, as ``cluster status`` shows it."""

    node: str
    address: str
    alive: bool
    slots: int
    """Replays it may run at once (its ``docker_engine`` resource; 0: no engine, the head say)."""
    engine: str | None = None
    """Its Docker engine's version (none without an engine)."""
    running: int = 0
    """Sandboxes of pvisor-host running there now (any driver's)."""
    images: list[str] = []
    """pvisor-host images its engine holds."""
    task_images: int = 0
    """Task images the batches' copies pulled there that it still holds."""
    task_image_bytes: int = 0
    """The bytes they take."""
    task_image_peak: int = 0
    """The most bytes they took at once."""
    task_image_budget: int | None = None
    """The budget the last batch gave it (None: none yet, or none)."""

    @property
    def free(self) -> int:
        """Slots not taken by a running sandbox of pvisor-host."""
        return max(0, self.slots - self.running) if self.alive else 0


def cluster_status(address: str) -> list[NodeStatus]:
    """Join the cluster at ``address`` as a driver, ask every node, and leave.

    Raises:
        PrerequisiteError: Ray is not installed, or this machine runs no node of a cluster.
        UsageError: a bad address, or no token.
        InfrastructureError: the head or a node does not answer.
    """
    connection = connect(address)
    try:
        return statuses(connection.ray, address)
    finally:
        connection.close()


def statuses(ray: Any, address: str) -> list[NodeStatus]:
    """Every node of the connected cluster, alive ones first, those with the most slots first."""
    ask = ray.remote(num_cpus=0, max_retries=0)(on_node.node_status)
    engines = engine_nodes(ray)
    session = uuid.uuid4().hex[:16]
    refs = [ask.options(scheduling_strategy=pinned_to(n["NodeID"])).remote(session) for n in engines]
    try:
        reports = ray.get(refs, timeout=60)
    except ray.exceptions.GetTimeoutError:
        raise InfrastructureError(f"the nodes of the cluster at {address} did not answer within 60s") from None
    by_id = dict(zip([n["NodeID"] for n in engines], reports, strict=True))
    found = []
    for entry in ray.nodes():
        report = by_id.get(entry["NodeID"], {})
        found.append(
            NodeStatus(
                node=report.get("node") or entry.get("NodeManagerAddress", "?"),
                address=entry.get("NodeManagerAddress", "?"),
                alive=bool(entry.get("Alive")),
                slots=int(entry.get("Resources", {}).get(ENGINE_RESOURCE, 0)),
                engine=report.get("engine"),
                running=int(report.get("running", 0)),
                images=list(report.get("images", [])),
                task_images=int(report.get("task_images", {}).get("images", 0)),
                task_image_bytes=int(report.get("task_images", {}).get("bytes", 0)),
                task_image_peak=int(report.get("task_images", {}).get("peak", 0)),
                task_image_budget=report.get("task_images", {}).get("budget"),
            )
        )
    return sorted(found, key=lambda n: (not n.alive, -n.slots, n.node))
