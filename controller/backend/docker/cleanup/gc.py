"""``pvisor-host gc``: remove what a controller that died without cleaning up (``kill -9``) left in Docker.

Every container, network and per-run volume pvisor-host creates carries ``pvisor-host.owner`` =
``<host>/<pid>/<start ticks>`` of the controller process. A resource is an orphan when that process is
gone (the pid no longer runs, or runs a different process since the start time differs). Resources of a
live controller, of a controller on another host (sharing the engine) and anything without the label —
including the shared runtime volumes and images, which ``images prune`` manages — are never touched. Task
images a dead batch pulled and could not remove (in the image cache's ledger, :mod:`.pulled`) are removed
too, unless a container uses them; the images the cache keeps for the next batch (a node's) are not orphans.
"""

from __future__ import annotations

import docker
from docker.errors import APIError, NotFound

from ...._log import logger
from ....models.housekeeping import GcReport, Resource, ResourceKind
from ....models.ownership import Ownership
from .. import labels as L
from ..container import LEFTOVER_TIMEOUT, remove_container
from ..engine import ENGINE_ERRORS, describe, engine_errors, retrying
from . import pulled


@engine_errors("list pvisor-host's containers, networks and volumes")
@retrying()
def labelled_resources(client: docker.DockerClient) -> list[Resource]:
    """Every container (running or not), network and volume carrying a ``pvisor-host.owner`` label."""
    filters = {"label": L.OWNER}
    found: list[Resource] = []
    # sparse: the list's own fields, no inspect of each (the engine makes an inspect wait on a container whose
    # start hangs in the runtime, and the listing with it)
    for container in client.containers.list(all=True, filters=filters, sparse=True):
        name = (container.attrs.get("Names") or [container.id])[0].lstrip("/")
        found.append(_resource("container", container.id, name, container.attrs.get("Labels") or {}))
    for network in client.networks.list(filters=filters):
        found.append(_resource("network", network.id, network.name, network.attrs.get("Labels") or {}))
    for volume in client.volumes.list(filters=filters):
        found.append(_resource("volume", volume.id, volume.name, volume.attrs.get("Labels") or {}))
    return found


def _resource(kind: ResourceKind, resource_id: str, name: str, labels: dict[str, str]) -> Resource:
    return Resource(
        kind=kind, id=resource_id, name=name, owner=labels[L.OWNER], role=labels.get(L.ROLE), run=labels.get(L.RUN),
        out=labels.get(L.OUT),
    )  # fmt: skip


def collect_garbage(
    client: docker.DockerClient, ownership: Ownership, *, dry_run: bool = False, out: str | None = None
) -> GcReport:
    """Find the orphans (see the module docstring) and remove them: containers first, then networks and volumes.
    With ``out``, only those of runs into that directory (the task images the cache noted are left to ``gc``).

    Owners are judged on ``ownership.host``, this host: another host's resources are counted, never removed.
    """
    orphans: list[Resource] = []
    live = other_hosts = 0
    for resource in labelled_resources(client):
        if out is not None and resource.out != out:
            continue
        alive = ownership.owner_alive(resource.owner)
        if alive is None:
            other_hosts += 1
        elif alive:
            live += 1
        else:
            orphans.append(resource)
    cache = pulled.cache_of(client, ownership)
    for noted in pulled.pulled(cache) if out is None else []:  # task images a batch pulled and could not remove itself
        if noted.owner is None or noted.holder is not None:
            continue  # the cache keeps it (within the budgets), or a live process holds it
        alive = ownership.owner_alive(noted.owner)
        if alive is None:
            other_hosts += 1
        elif alive:
            live += 1
        else:
            orphans.append(Resource(kind="image", id=noted.id, name=noted.ref, owner=noted.owner, role="pulled"))
    report = GcReport(orphans=orphans, live=live, other_hosts=other_hosts)
    if dry_run:
        return report
    for resource in list(orphans):  # already in order: containers, networks, volumes, images
        try:
            _remove(client, resource)
            if resource.kind == "image":
                cache.forget(resource.id)
        except APIError as exc:
            if resource.kind == "image" and exc.status_code == 409:  # something else uses it now: not ours to take
                logger.info("leaving {}: {}", resource.name, describe(exc))
                cache.forget(resource.id)
                report.orphans.remove(resource)
                report.live += 1
                continue
            report.failed[resource.name] = describe(exc)
            logger.warning("could not remove {} {}: {}", resource.kind, resource.name, describe(exc))
        except ENGINE_ERRORS as exc:
            report.failed[resource.name] = describe(exc)
            logger.warning("could not remove {} {}: {}", resource.kind, resource.name, describe(exc))
    return report


@retrying()
def _remove(client: docker.DockerClient, resource: Resource) -> None:
    try:
        if resource.kind == "container":  # by id, not inspected first: the engine makes an inspect wait on a
            # container whose start hangs in its runtime, as long as the removal would
            remove_container(client.containers.prepare_model({"Id": resource.id}), LEFTOVER_TIMEOUT)
        elif resource.kind == "network":
            client.networks.get(resource.id).remove()
        elif resource.kind == "image":  # by the name it was pulled as; never forced (a container may use it)
            if client.images.get(resource.name).id == resource.id:  # unless the name is another image's by now
                client.images.remove(resource.name)
        else:
            client.volumes.get(resource.id).remove(force=True)
    except NotFound:
        pass  # gone meanwhile (its owner's own cleanup, or the engine's auto-removal)
