"""``--image-workspace``: start from a copy of the image's own directory at the workspace path.

Task images carry the task (a repository at ``/app``, say). The sandbox's root filesystem is read-only,
so the replay cannot work in the image's directory itself; instead it is copied out of a container that
is created but never started, through the same safe extractor as every collection, into the staged
workspace, and that copy is bound at the same path. The copy's snapshot is the "before" of the
workspace changes.
"""

from __future__ import annotations

from pathlib import Path

import docker
from docker.errors import NotFound

from ....errors import UsageError
from ....files.archive import Budget, extract_tar, tar_stream
from ....files.trees import Entry
from ....models.ownership import Ownership
from ..engine import engine_errors
from .container import stopped_container


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
            raise UsageError(
                f"--image-workspace: the image has nothing at {path}", hint="pass the right --workspace-path"
            ) from None
        if not stat.get("mode", 0) & 0x80000000:  # Go's os.ModeDir bit
            raise UsageError(f"--image-workspace: {path} in the image is not a directory")
        report = extract_tar(tar_stream(chunks), dest, budget)
    if report.truncated:
        raise UsageError(f"--image-workspace: {path} in the image is larger than --collect-limit")
    return report.entries
