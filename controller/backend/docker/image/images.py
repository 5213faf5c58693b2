"""The engine's images, as other parts of pvisor-host need them: has, load, save, push, pull by digest, tag,
and list ours. The cluster backend ships images to its nodes through these calls and never holds an engine
client of its own.

References are read with docker-py's own parsers (``parse_repository_tag``, ``split_repo_name``): a
``@sha256:`` digest is not a tag, and ``localhost:5001/task`` is a repository on a registry, not a tag.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import IO, TYPE_CHECKING

from docker.auth import split_repo_name
from docker.errors import ImageNotFound
from docker.utils import parse_repository_tag

from ...._log import logger
from ....errors import InfrastructureError, UsageError
from .. import labels as L
from ..engine import engine_errors, retrying

if TYPE_CHECKING:
    import docker


class Reference:
    """An image reference taken apart: its registry (``None``: Docker Hub), path, and a tag or a digest."""

    def __init__(self, text: str) -> None:
        repository, suffix = parse_repository_tag(text)
        if suffix and suffix.startswith("sha256:") and ":" in repository.rsplit("/", 1)[-1]:
            repository = repository.rsplit(":", 1)[0]  # repo:tag@sha256:...: the digest is what counts
        registry, path = split_repo_name(repository)
        self.text = text
        self.repository: str = repository
        self.registry: str | None = None if registry == "docker.io" else registry
        self.path: str = path
        self.digest: str | None = suffix if suffix and suffix.startswith("sha256:") else None
        self.tag: str | None = suffix if suffix and self.digest is None else None

    @property
    def is_id(self) -> bool:
        """An image id (``sha256:<hex>``), not a name."""
        return self.text.startswith("sha256:") and "/" not in self.text

    def __repr__(self) -> str:
        return f"Reference({self.text!r})"


def repo_digest(reference: str, digests: object) -> str | None:
    """The digest the engine holds ``reference``'s repository by (``repo@sha256:...``, from an image's
    ``RepoDigests``), if any."""
    repository = Reference(reference).repository
    found = [str(d) for d in digests] if isinstance(digests, list) else []
    return next((d for d in found if d.startswith(f"{repository}@")), None)


def push_target(registry: str, ref: str, image_id: str) -> tuple[str, str]:
    """The repository and tag an image known here as ``ref`` is pushed as to ``registry``: its own path under
    the registry (whatever registry it came from), with its tag. An image known by digest has no tag, so it
    goes tagged with its id; one known only by id goes as ``pvisor-host/image``."""
    by_id = image_id.removeprefix("sha256:")[:32]
    parsed = Reference(ref)
    if parsed.is_id:
        return f"{registry}/pvisor-host/image", by_id
    return f"{registry}/{parsed.path}", parsed.tag or by_id


class ImageStore:
    """One engine's images. Every method maps engine errors to one-line :class:`InfrastructureError` s."""

    def __init__(self, client: docker.DockerClient) -> None:
        self._client = client

    def has(self, image_id: str) -> bool:
        """Whether the engine holds the image with this id (a load and a pull by digest keep ids)."""
        with engine_errors(f"look up image {image_id[:19]}"):
            try:
                self._client.images.get(image_id)
            except ImageNotFound:
                return False
        return True

    def ours(self) -> list[str]:
        """The tags of the agent images pvisor-host built that the engine holds, sorted (ours only: the tags a user
        gave them for a registry of theirs are not names we list them by)."""
        with engine_errors("list pvisor-host's images"):
            images = self._client.images.list(filters={"label": L.AGENT})
        return sorted(tag for image in images for tag in image.tags if tag.startswith(L.OUR_TAGS))

    def save(self, image_id: str, *, name: str | None, chunk: int) -> Iterator[bytes]:
        """``docker save`` of the image, in pieces of about ``chunk`` bytes; with ``name`` (one of its tags)
        the archive carries that name, so the engine that loads it knows the image by it."""
        with engine_errors(f"save image {image_id[:19]}"):
            image = self._client.images.get(image_id)
            named = name if name in image.tags else bool(image.tags)
            yield from image.save(chunk_size=chunk, named=named)

    def tags(self, image_id: str) -> list[str]:
        """The tags the image has here."""
        with engine_errors(f"inspect image {image_id[:19]}"):
            return list(self._client.images.get(image_id).tags)

    def load(self, archive: IO[bytes]) -> None:
        """``docker load`` an archive made by :meth:`save`."""
        with engine_errors("load an image"):
            self._client.images.load(archive)

    def pull(self, reference: str) -> None:
        """Pull ``reference`` exactly: by digest (``repo@sha256:...``) or by tag, transient errors retried."""
        parsed = Reference(reference)
        if parsed.digest is None and parsed.tag is None:
            raise UsageError(f"{reference}: pull needs a tag or a digest")

        @retrying(quiet=True)
        def pull() -> None:
            self._client.images.pull(parsed.repository, tag=parsed.digest or parsed.tag)

        with engine_errors(f"pull {reference}"):
            pull()

    def tag(self, image_id: str, reference: str) -> None:
        """Give the image the name ``reference`` (``repo:tag``; a digest is not a name one can give)."""
        parsed = Reference(reference)
        if parsed.tag is None:
            raise UsageError(f"{reference}: an image can be tagged only with repository:tag")
        with engine_errors(f"tag image {image_id[:19]} as {reference}"):
            self._client.images.get(image_id).tag(parsed.repository, parsed.tag)

    def untag(self, reference: str) -> None:
        """Remove the name ``reference``, never the image's layers (``docker rmi --no-prune`` of one tag)."""
        with engine_errors(f"remove the tag {reference}"):
            self._client.images.remove(reference, noprune=True)

    def push(self, image_id: str, repository: str, tag: str) -> str:
        """Push the image as ``repository:tag`` and return the digest reference it has there
        (``repository@sha256:...``). The name is given for the push and removed afterwards.

        Raises:
            InfrastructureError: the push failed, or the registry gave no digest.
        """
        target = f"{repository}:{tag}"
        self.tag(image_id, target)
        try:
            with engine_errors(f"push {target}"):
                errors = [
                    line["error"]
                    for line in self._client.images.push(repository, tag, stream=True, decode=True)
                    if "error" in line
                ]
                if errors:
                    raise InfrastructureError(f"docker push {target} failed: {errors[-1]}")
                digests: Iterable[str] = self._client.images.get(image_id).attrs.get("RepoDigests") or []
        finally:  # the push needed the registry's name on the image; this engine keeps only its own
            try:
                self.untag(target)
            except InfrastructureError as exc:
                logger.warning("{} stays on this engine: {}", target, exc.message)
        pushed = next((str(d) for d in digests if str(d).startswith(f"{repository}@")), None)
        if pushed is None:
            raise InfrastructureError(f"docker push {target} gave no digest")
        return pushed
