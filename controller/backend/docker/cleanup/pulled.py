"""The task images the engine's image cache pulled, as ``gc``, ``images`` and ``images prune`` see them.

A pulled image carries no label of ours (its labels are its publisher's), so the image cache's ledger
(:mod:`..cache.ledger`, one per engine in the state directory) is what says which images pvisor-host pulled,
for whom, and who holds them now. A batch's pull is noted there before it starts; what a batch could not
remove (it was killed) stays noted with its owner: ``gc`` removes the images of owners that are gone, ``images``
lists them and ``images prune`` may remove them. Images a cluster node's copies pulled belong to the cache
itself (no owner): they stay within the budgets for the next batch, and ``images prune`` may remove them when
nobody holds them. Only images noted here are ever removed as pulled ones.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pydantic import BaseModel

from ..image.cache.engine import open_cache

if TYPE_CHECKING:
    import docker

    from ....models.ownership import Ownership
    from ..image.cache import ImageCache


class PulledRecord(BaseModel):
    """One image the cache pulled and has not removed."""

    id: str
    ref: str
    owner: str | None
    """``host/pid/start-ticks`` of the batch that removes it when it ends (None: the cache keeps it)."""
    holder: str | None
    """A process that holds it now (None: nobody)."""
    used_at: datetime


def cache_of(client: docker.DockerClient, ownership: Ownership) -> ImageCache:
    """The engine's image cache, set right against the engine first (pulls and removals of dead processes)."""
    cache = open_cache(client, ownership)
    cache.tidy()
    return cache


def pulled(cache: ImageCache) -> list[PulledRecord]:
    """Every image the cache pulled, holds, and has not given up (``--keep-images``), least recently used first."""
    records = [
        PulledRecord(
            id=entry.key,
            ref=entry.ref,
            owner=entry.owner,
            holder=next((hold.process for hold in entry.holds.values()), None),
            used_at=datetime.fromtimestamp(entry.used, UTC),
        )  # fmt: skip
        for entry in cache.entries()
        if entry.state == "present" and entry.counts
    ]
    return sorted(records, key=lambda record: record.used_at)
