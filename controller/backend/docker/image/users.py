"""A task image's own user as numbers: what its configuration names, looked up in its ``/etc/passwd``.

A task image runs as the image says (docs/security.md), and its configuration may name its user by name
(``USER app``) or by uid alone. The engine resolves such a name when it starts a container; pvisor-host must
know the numbers before that, to give the staged workspace and run directory to that user. They are read
from the image's own ``/etc/passwd`` (a small file copied out of a created, never-started container), as the
engine's runtime reads them: a name or uid without an entry there is refused by the engine too, and a uid
alone takes its entry's primary group, else group 0.
"""

from __future__ import annotations

import threading

from ....errors import UsageError
from ....models.spec import known_user
from .files import ImageFiles


class ImageUsers:
    """Each task image's user resolved once (thread-safe)."""

    def __init__(self, files: ImageFiles) -> None:
        self._files = files
        self._lock = threading.Lock()
        self._found: dict[tuple[str, str], str] = {}

    def resolve(self, image_id: str, configured: str) -> str:
        """``uid:gid`` of the user ``configured`` in the image's configuration (``""``: root).

        Raises:
            UsageError: the image names a user its ``/etc/passwd`` does not have (the engine would refuse to
                start it too).
        """
        known = known_user(configured)
        if known is not None:
            return known
        user, _, group = configured.partition(":")
        key = (image_id, configured)
        with self._lock:
            if key in self._found:
                return self._found[key]
        resolved = self._look_up(image_id, user, group)
        with self._lock:
            self._found[key] = resolved
        return resolved

    def _look_up(self, image_id: str, user: str, group: str) -> str:
        passwd = self._read(image_id, "/etc/passwd")
        entry = next((fields for fields in _entries(passwd) if user in (fields[0], fields[2])), None)
        if entry is None:
            if not user.isdigit():
                raise UsageError(
                    f"task image {image_id[:19]} runs as user {user!r}, which its /etc/passwd does not have",
                    hint="pass --user UID[:GID], or --strict",
                )
            uid, gid = user, "0"
        else:
            uid, gid = entry[2], entry[3]
        if group:
            gid = group if group.isdigit() else self._group(image_id, group)
        return f"{uid}:{gid}"

    def _group(self, image_id: str, name: str) -> str:
        for fields in _entries(self._read(image_id, "/etc/group")):
            if fields[0] == name:
                return fields[2]
        raise UsageError(f"task image {image_id[:19]} runs with group {name!r}, which its /etc/group does not have")

    def _read(self, image_id: str, path: str) -> str:
        data = self._files.read(image_id, path)
        return data.decode("utf-8", errors="replace") if data is not None else ""


def _entries(text: str) -> list[list[str]]:
    """The colon-separated lines of a passwd or group file that have at least four fields."""
    return [fields for line in text.splitlines() if len(fields := line.split(":")) >= 4]
