"""Small files read out of an image, once per image: a created, never-started container's archive.

What the host must know of an image's contents before a sandbox starts (a task image's ``/etc/passwd``, an
agent's own default configuration) is read this way: no process runs in the image, and a file that is not
there, or is larger than the cap, reads as None.
"""

from __future__ import annotations

import io
import tarfile
import threading

import docker
from docker.errors import NotFound

from ....models.ownership import Ownership
from ..container import stopped_container
from ..engine import engine_errors

#: The most bytes read of one file (these are configuration files).
MAX_BYTES = 4 * 1024 * 1024


class ImageFiles:
    """Files read out of images, each once per (image, path) (thread-safe)."""

    def __init__(self, client: docker.DockerClient, ownership: Ownership) -> None:
        self._client = client
        self._ownership = ownership
        self._lock = threading.Lock()
        self._read: dict[tuple[str, str], bytes | None] = {}

    def read(self, image_id: str, path: str) -> bytes | None:
        """The bytes of the regular file ``path`` in the image (None: absent, not a file, or too large)."""
        key = (image_id, path)
        with self._lock:
            if key in self._read:
                return self._read[key]
        data = self._copy_out(image_id, path)
        with self._lock:
            self._read[key] = data
        return data

    def _copy_out(self, image_id: str, path: str) -> bytes | None:
        with (
            stopped_container(self._client, self._ownership, image_id, role="peek") as container,
            engine_errors(f"read {path} of image {image_id[:19]}"),
        ):
            try:
                chunks, stat = container.get_archive(path)
            except NotFound:
                return None
            if int(stat.get("size", 0)) > MAX_BYTES:
                return None
            data = b"".join(chunks)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            member = next((m for m in archive.getmembers() if m.isfile()), None)
            handle = archive.extractfile(member) if member is not None else None
            return handle.read() if handle is not None else None
