"""``--image-workspace``: start from a copy of the image's own directory at the workspace path.

Task images carry the task (a repository at ``/app``, say). The sandbox's root filesystem is read-only,
so the replay cannot work in the image's directory itself; instead it is copied out of a container that
is created but never started, through the same safe extractor as every collection, and each sandbox gets a
fresh copy of that, bound at the same path. The copy's snapshot is the "before" of the workspace changes.

The copy out of the image is made once per image and directory (:class:`Seeds`), beside the run
directories, and kept read-only as the source of every item's fresh workspace: a dataset's items of one
image copy a host directory, never the image again. It goes when its image is removed, and when the
backend closes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import docker
from docker.errors import NotFound

from ....errors import UsageError
from ....files.archive import Budget, extract_tar, tar_stream
from ....files.trees import Entry, copy_tree, remove_if_empty, remove_tree
from ....models.ownership import Ownership
from ..container import stopped_container
from ..engine import engine_errors


def seed_from_image(
    client: docker.DockerClient, ownership: Ownership, image: str, path: str, dest: Path, budget: Budget
) -> list[Entry]:
    """Copy ``path`` out of ``image`` into the directory ``dest``; return its snapshot.

    Raises:
        UsageError: the image has no such directory, or it does not fit the collect limit.
    """
    with (
        stopped_container(client, ownership, image, role="seed") as container,
        engine_errors(f"copy {path} out of the image"),
    ):
        try:
            chunks, stat = container.get_archive(path)
        except NotFound:
            stat = None
        _refuse_unless_directory(path, stat)
        report = extract_tar(tar_stream(chunks), dest, budget)
    if report.truncated:
        raise UsageError(f"--image-workspace: {path} in the image is larger than --collect-limit")
    return report.entries


def check_seed(client: docker.DockerClient, ownership: Ownership, image: str, path: str) -> None:
    """What :func:`seed_from_image` refuses, told without copying anything (``batch --plan``): the path's stat.

    Raises:
        UsageError: the image has no such directory.
    """
    with (
        stopped_container(client, ownership, image, role="seed") as container,
        engine_errors(f"look at {path} in the image"),
    ):
        answer = client.api.head(client.api._url("/containers/{0}/archive", container.id), params={"path": path})
        stat = None
        if answer.status_code != 404:
            client.api._raise_for_status(answer)
            encoded = answer.headers.get("X-Docker-Container-Path-Stat")
            stat = json.loads(base64.b64decode(encoded)) if encoded else {}
    _refuse_unless_directory(path, stat)


def _refuse_unless_directory(path: str, stat: dict[str, Any] | None) -> None:
    """The one judgement of a workspace path in an image: ``stat`` is the engine's (None: nothing there)."""
    if stat is None:
        raise UsageError(f"--image-workspace: the image has nothing at {path}", hint="pass the right --workspace-path")
    if not stat.get("mode", 0) & 0x80000000:  # Go's os.ModeDir bit
        raise UsageError(f"--image-workspace: {path} in the image is not a directory")


#: The folder, beside a run directory, that holds the copies out of images.
SEEDS_NAME = ".pvisor-host-seeds"


class Seeds:
    """Copies out of images, made once per (image, directory, place) and shared by every sandbox that starts
    from them (see the module docstring). Thread-safe: the first sandbox makes a copy, the others wait."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root
        """Where the copies are kept (None: beside each run's directory, the batch's folder)."""
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str, Path], threading.Lock] = {}
        self._made: dict[tuple[str, str, Path], tuple[Path, list[Entry]]] = {}
        self._checked: dict[tuple[str, str], UsageError | None] = {}

    def check(self, client: docker.DockerClient, ownership: Ownership, image_id: str, path: str) -> None:
        """Refuse, as :meth:`fill` would, an image with no directory at ``path`` (asked once per image and path).

        Raises:
            UsageError: see :func:`check_seed`.
        """
        key = (image_id, path)
        with self._lock:
            known = key in self._checked
            refusal = self._checked.get(key)
        if not known:
            try:
                check_seed(client, ownership, image_id, path)
            except UsageError as exc:
                refusal = exc
            with self._lock:
                self._checked[key] = refusal
        if refusal is not None:
            raise refusal

    def fill(
        self,
        client: docker.DockerClient,
        ownership: Ownership,
        image_id: str,
        path: str,
        dest: Path,
        budget: Budget,
        *,
        place: Path,
    ) -> tuple[list[Entry], Path]:
        """Fill the new directory ``dest`` with ``path`` of the image (copied out of it, into ``place``, the
        first time); return the snapshot of what it holds, and the read-only copy it was filled from."""
        key = (image_id, path, place)
        with self._lock:
            lock = self._keys.setdefault(key, threading.Lock())
        with lock:
            if key not in self._made:
                # this process's own (its session's): two replays beside each other never share a copy
                name = f"{ownership.session}-{hashlib.sha256(f'{image_id}:{path}'.encode()).hexdigest()[:16]}"
                source = key[2] / SEEDS_NAME / name
                remove_tree(source)  # what a killed run left
                entries = seed_from_image(client, ownership, image_id, path, source, budget)
                _read_only(source)
                with self._lock:
                    self._made[key] = (source, entries)
            source, _ = self._made[key]
        return copy_tree(source, dest), source

    def drop(self, image_id: str) -> None:
        """Remove the copies out of an image (it is gone)."""
        with self._lock:
            gone = [key for key in self._made if key[0] == image_id]
            for key in gone:
                source, _ = self._made.pop(key)
                remove_tree(source)
                remove_if_empty(source.parent)

    def close(self) -> None:
        """Remove every copy."""
        with self._lock:
            images = {key[0] for key in self._made}
        for image_id in images:
            self.drop(image_id)


def _read_only(root: Path) -> None:
    """Directories r-x, files r--: a source to copy from, not to work in (links are left as they are)."""
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode & 0o555)
        os.chmod(directory, 0o555)
