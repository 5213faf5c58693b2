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
import requests
from docker.errors import APIError, NotFound

from .collect import Budget, Entry, extract_tar, tar_stream
from .container import stopped_container
from .engine import engine_failure
from .errors import UsageError


def seed_from_image(client: docker.DockerClient, image: str, path: str, dest: Path, budget: Budget) -> list[Entry]:
    """Copy ``path`` out of ``image`` into the directory ``dest``; return its snapshot.

    Raises:
        UsageError: the image has no such directory, or it does not fit the collect limit.
    """
    with stopped_container(client, image, role="seed") as container:
        try:
            chunks, stat = container.get_archive(path)
        except NotFound:
            raise UsageError(
                f"--image-workspace: the image has nothing at {path}", hint="pass the right --workspace-path"
            ) from None
        except (APIError, requests.exceptions.RequestException) as exc:
            raise engine_failure(f"copy {path} out of the image", exc) from exc
        if not stat.get("mode", 0) & 0x80000000:  # Go's os.ModeDir bit
            raise UsageError(f"--image-workspace: {path} in the image is not a directory")
        report = extract_tar(tar_stream(chunks), dest, budget)
    if report.truncated:
        raise UsageError(f"--image-workspace: {path} in the image is larger than --collect-limit")
    return report.entries
