"""Labels on everything pvisor-host creates in Docker, built from the :class:`Ownership` the backend is given.

Every container, volume, network and image we create carries ``pvisor-host.*`` labels: ``session`` (one per
controller invocation: cancelling finds its sandboxes by it) and ``owner`` (``host/pid/start-ticks`` of
the creating process: ``gc`` tells a live owner from a dead one by it, even when the pid has been reused), and
``out`` (the batch directory it writes into: a later batch into it removes what a dead one left there).
"""

from __future__ import annotations

from datetime import UTC, datetime

from ..._version import __version__
from ...models.ownership import Ownership

PREFIX = "pvisor-host."
MANAGED = PREFIX + "managed"
RUN = PREFIX + "run"
SESSION = PREFIX + "session"
OWNER = PREFIX + "owner"
STARTED = PREFIX + "started"
VERSION = PREFIX + "version"
ROLE = PREFIX + "role"
OUT = PREFIX + "out"

#: The repositories pvisor-host tags its own images in (``pvisor-host/claude-code:...``, ``pvisor-host/base:...``).
OUR_TAGS = "pvisor-host/"


def our_tags(tags: list[str]) -> list[str]:
    """Of an image's tags, ours first, then the others (a user may tag one of our images for a registry of theirs:
    it is still named by ours wherever we list it)."""
    return sorted(tags, key=lambda tag: not tag.startswith(OUR_TAGS))


# Image labels written at build time (the record of what was verified inside the image).
AGENT = PREFIX + "agent"
AGENT_VERSION = PREFIX + "agent-version"
AGENT_ENTRYPOINT = PREFIX + "agent-entrypoint"
PVISOR_VERSION = PREFIX + "pvisor-version"
PVISOR_PATH = PREFIX + "pvisor-path"
RECIPE_HASH = PREFIX + "recipe-hash"
BASE_IMAGE = PREFIX + "base-image"


def resource_labels(ownership: Ownership, role: str, run_id: str | None = None) -> dict[str, str]:
    """Labels for a container, volume or network created on behalf of ``ownership``."""
    labels = {
        MANAGED: "true",
        ROLE: role,
        SESSION: ownership.session,
        OWNER: ownership.owner,
        STARTED: datetime.now(UTC).isoformat(timespec="seconds"),
        VERSION: __version__,
    }
    if run_id:
        labels[RUN] = run_id
    if ownership.out:
        labels[OUT] = ownership.out
    return labels
