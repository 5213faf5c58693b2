"""What the housekeeping commands report: leftovers (``gc``), images (``images``), agents and host health."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel

from .profiles import AgentProfile, UnavailableInstall

ResourceKind = Literal["container", "network", "volume", "image"]
"""What ``gc`` removes; an ``image`` is a task image a batch pulled and could not remove itself."""


class Resource(BaseModel):
    """One labelled resource a controller created."""

    kind: ResourceKind
    id: str
    name: str
    owner: str
    role: str | None = None
    run: str | None = None
    out: str | None = None
    """The batch directory its creator wrote into, when it had one."""


class GcReport(BaseModel):
    """What ``gc`` found and did."""

    orphans: list[Resource]
    """Resources whose owner is gone: removed (or, with ``--dry-run``, to be removed)."""
    live: int
    """Resources left alone because their owner still runs."""
    other_hosts: int
    """Resources left alone because their owner runs on another host."""
    failed: dict[str, str] = {}
    """Orphans that could not be removed: name → the engine's error."""


class CatalogEntry(BaseModel):
    """One image or runtime volume pvisor-host made."""

    kind: Literal["image", "runtime-volume"]
    name: str
    """Tag (``<none>`` for build-cache layers) or volume name."""
    id: str
    role: str
    agent: str | None = None
    agent_version: str | None = None
    pvisor_version: str | None = None
    size: int
    created: datetime
    last_used: datetime | None = None
    in_use: bool = False
    pulled_by: str | None = None
    """For an image a batch pulled (role ``pulled``): the owner of that batch (``host/pid/start-ticks``)."""

    @property
    def recency(self) -> datetime:
        """What pruning orders by: the last use, else the creation."""
        return self.last_used or self.created


class PruneResult(BaseModel):
    """What ``images prune`` removed and what it kept back, and why."""

    removed: list[CatalogEntry] = []
    kept: dict[str, str] = {}
    """Name → why it was not removed although selected (in use, has dependent images, engine refusal)."""
    freed: int = 0


class AgentStatus(BaseModel):
    """One agent pvisor replays, and whether this host has its image."""

    agent: str
    version: str
    install_source: str
    installable: bool
    unavailable_reason: str | None = None
    image: str | None = None
    """The tag ``build`` makes for it now, when that image is present."""
    expected_image: str | None = None
    injectable: bool
    continuation_api: str
    continuation_env: list[list[str]]

    @classmethod
    def of(cls, profile: AgentProfile, *, expected: str | None = None, present: bool = False) -> AgentStatus:
        """The status of ``profile``, whose image would be tagged ``expected`` (present or not)."""
        install = profile.install
        return cls(
            agent=profile.agent,
            version=profile.version,
            install_source=profile.install_source,
            installable=profile.installable,
            unavailable_reason=install.reason if isinstance(install, UnavailableInstall) else None,
            image=expected if present else None,
            expected_image=expected,
            injectable=profile.inject is not None,
            continuation_api=profile.continuation.api,
            continuation_env=profile.continuation.env,
        )


class Check(BaseModel):
    """One line of ``doctor``'s report."""

    name: str
    status: Literal["ok", "warn", "fail"]
    detail: str
    fix: str | None = None
    required: bool = True
    """A failing required check makes ``doctor`` exit 3; the others only inform."""


class HealthReport(BaseModel):
    """All of ``doctor``'s checks; ``ok`` when no required check failed."""

    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" and c.required for c in self.checks)
