"""What pvisor-host built in Docker — images and runtime volumes — and pruning it, least recently used first.

Only resources labelled ``pvisor-host.managed=true`` are listed or removed, and the task images a batch
pulled and left (role ``pulled``, in the image cache's ledger: :mod:`.pulled`); never one that a container
(running or stopped) uses, nor one a running batch holds. "Last used" comes from :mod:`.usage`; a resource never used is
judged by its creation time. Sizes are the engine's: an image's size counts the base layers it shares
with others, so freeing one image may free less than its size.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import docker
from docker.errors import APIError, NotFound

from ...._log import logger
from ....models.housekeeping import AgentStatus, CatalogEntry, PruneResult
from ....models.ownership import Ownership
from ....models.profiles import all_profiles
from .. import labels as L
from .. import state as usage
from ..engine import engine_errors, retrying
from ..image.base import find_image
from ..image.recipe import expected_tag
from . import pulled


@engine_errors("list images and volumes")
@retrying()
def _usage(client: docker.DockerClient) -> tuple[dict[str, Any], set[str | None]]:
    df = client.df()
    used_images = {c.attrs.get("ImageID") for c in client.containers.list(all=True, sparse=True)}
    return df, used_images


def list_catalog(client: docker.DockerClient) -> list[CatalogEntry]:
    """Every pvisor-host image and runtime volume, and every task image a batch pulled and left (noted in
    :mod:`.pulled`), least recently used first."""
    df, used_images = _usage(client)
    uses = usage.last_used()
    noted = {entry.id: entry for entry in pulled.pulled(pulled.cache_of(client, Ownership.current()))}
    images = df.get("Images") or []
    entries = [_image_entry(image, uses, used_images) for image in images if _ours(image) and image["Id"] not in noted]
    entries += [_pulled_entry(image, noted[str(image["Id"])], used_images) for image in images
                if str(image["Id"]) in noted]  # fmt: skip
    entries += [_volume_entry(volume, uses) for volume in df.get("Volumes") or [] if _ours(volume)]
    return sorted(entries, key=lambda e: (e.recency, e.name))


def _pulled_entry(image: dict[str, Any], noted: pulled.PulledRecord, used: set[str | None]) -> CatalogEntry:
    image_id = str(image["Id"])
    return CatalogEntry(
        kind="image",
        name=noted.ref,
        id=image_id,
        role="pulled",
        size=int(image.get("Size") or 0),
        created=noted.used_at,
        last_used=noted.used_at,
        in_use=image_id in used or int(image.get("Containers") or 0) > 0,
        pulled_by=noted.holder or noted.owner,
    )


def _ours(resource: dict[str, Any]) -> bool:
    """Made by pvisor-host: our label, and (for a tagged image) one of our tags. An image someone built FROM one
    of ours inherits our labels; its own tags tell it apart, and it is never ours to list or prune."""
    labels = resource.get("Labels") or {}
    if not isinstance(labels, dict) or labels.get(L.MANAGED) != "true":
        return False
    tags = [t for t in (resource.get("RepoTags") or []) if t != "<none>:<none>"]
    return not tags or any(tag.startswith(L.OUR_TAGS) for tag in tags)


def _image_entry(image: dict[str, Any], uses: dict[str, datetime], used: set[str | None]) -> CatalogEntry:
    labels: dict[str, str] = dict(image.get("Labels") or {})
    tags = L.our_tags([t for t in (image.get("RepoTags") or []) if t != "<none>:<none>"])
    image_id = str(image["Id"])
    return CatalogEntry(
        kind="image",
        name=tags[0] if tags else "<none>",
        id=image_id,
        # Untagged images are the builder's leftovers (the relay stage, intermediate steps), whatever role label
        # they inherited from the base they were built on.
        role=labels.get(L.ROLE, "image") if tags else "build-cache",
        agent=labels.get(L.AGENT),
        agent_version=labels.get(L.AGENT_VERSION),
        pvisor_version=labels.get(L.PVISOR_VERSION),
        size=int(image.get("Size") or 0),
        created=datetime.fromtimestamp(int(image.get("Created") or 0), UTC),
        last_used=uses.get(image_id),
        in_use=image_id in used or int(image.get("Containers") or 0) > 0,
    )


def _volume_entry(volume: dict[str, Any], uses: dict[str, datetime]) -> CatalogEntry:
    labels: dict[str, str] = dict(volume.get("Labels") or {})
    data: dict[str, int] = dict(volume.get("UsageData") or {})
    created = str(volume.get("CreatedAt") or "1970-01-01T00:00:00Z")
    return CatalogEntry(
        kind="runtime-volume",
        name=str(volume["Name"]),
        id=str(volume["Name"]),
        role=labels.get(L.ROLE, "volume"),
        agent=labels.get(L.AGENT),
        agent_version=labels.get(L.AGENT_VERSION),
        pvisor_version=labels.get(L.PVISOR_VERSION),
        size=max(int(data.get("Size", 0)), 0),
        created=datetime.fromisoformat(created.replace("Z", "+00:00")),
        last_used=uses.get(str(volume["Name"])),
        in_use=int(data.get("RefCount", 0)) > 0,
    )


def prune(
    client: docker.DockerClient,
    *,
    keep_bytes: int | None = None,
    older_than: float | None = None,
    dry_run: bool = False,
) -> PruneResult:
    """Remove pvisor-host images and runtime volumes, least recently used first.

    With ``older_than`` (seconds), everything not used for that long goes; with ``keep_bytes``, the least
    recently used go until the rest fits; with neither, only build-cache layers no image needs go.
    Nothing in use is ever removed.
    """
    entries = list_catalog(client)
    total = sum(e.size for e in entries)
    cutoff = datetime.now(UTC) - timedelta(seconds=older_than) if older_than is not None else None
    result = PruneResult()
    for entry in entries:  # least recently used first
        selected = (
            (cutoff is not None and entry.recency < cutoff)
            or (keep_bytes is not None and total > keep_bytes)
            or (keep_bytes is None and older_than is None and entry.role == "build-cache")
        )
        if not selected:
            continue
        if entry.in_use:
            result.kept[entry.name] = "in use by a container"
            continue
        if entry.role == "pulled" and entry.pulled_by and Ownership.current().owner_alive(entry.pulled_by):
            result.kept[entry.name] = "a running batch pulled it, or holds it, and may still need it"
            continue
        removed, reason = (True, None) if dry_run else _remove(client, entry)
        if reason:
            result.kept[entry.name] = reason
        if not removed:
            continue
        result.removed.append(entry)
        result.freed += entry.size
        total -= entry.size
    if not dry_run:
        usage.forget(*(e.id for e in result.removed))
        removed_pulls = [entry.id for entry in result.removed if entry.role == "pulled"]
        if removed_pulls:
            cache = pulled.cache_of(client, Ownership.current())
            for image_id in removed_pulls:
                cache.forget(image_id)
    return result


def _remove(client: docker.DockerClient, entry: CatalogEntry) -> tuple[bool, str | None]:
    """(removed, why not): an entry already gone with an image removed before it is neither."""
    with engine_errors(f"remove {entry.kind} {entry.name}"):
        return _try_remove(client, entry)


def _try_remove(client: docker.DockerClient, entry: CatalogEntry) -> tuple[bool, str | None]:
    try:
        if entry.kind == "image" and entry.role == "pulled":  # by the name it was pulled as (it may have others),
            if client.images.get(entry.name).id != entry.id:  # unless that name is another image's by now
                pulled.cache_of(client, Ownership.current()).forget(entry.id)
                return False, "its name is another image's now; forgotten as pulled"
            client.images.remove(entry.name, force=False, noprune=False)
        elif entry.kind == "image":
            client.images.remove(entry.id, force=False, noprune=False)
        else:
            client.volumes.get(entry.name).remove(force=False)
    except NotFound:
        return False, None
    except APIError as exc:
        text = str(exc.explanation or exc)
        logger.debug("not removing {}: {}", entry.name, text)
        if "dependent child images" in text:
            return False, "other images are built on it"
        if "in use" in text or "is using" in text or "being used" in text:
            return False, "in use by a container"
        return False, text.split("\n")[0][:200]
    return True, None


def agent_statuses(client: docker.DockerClient) -> list[AgentStatus]:
    """Every agent profile with the tag ``build`` would give its image now, and whether that image is here."""
    statuses = []
    for profile in all_profiles().values():
        expected = expected_tag(client, profile)
        present = expected is not None and find_image(client, expected) is not None
        statuses.append(AgentStatus.of(profile, expected=expected, present=present))
    return statuses
