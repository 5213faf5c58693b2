"""How an image reaches the nodes, with no registry assumed and never an implicit pull.

* With a registry (``--registry HOST:PORT`` or ``PVISOR_HOST_REGISTRY``) the driver pushes the image once,
  under its content-hash tag, and every node pulls it **by digest**: exactly the bytes the driver built.
* Without one, the driver's ``docker save`` is put into Ray's object store in chunks, the first time a node
  turns out not to have the image, and each node that lacks it loads it once (``docker load``). A node that
  has the image (the same id) gets nothing.

Either way the node checks the image id it ends up with.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .._log import logger
from ..errors import InfrastructureError, UsageError
from .node import CHUNK

if TYPE_CHECKING:
    import docker

    from ..models.image import ImageRef

REGISTRY_ENV = "PVISOR_HOST_REGISTRY"
_REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(:\d{1,5})?(/[a-z0-9._/-]+)?$")


def check_registry(registry: str) -> str:
    """``HOST[:PORT][/PATH]`` of a registry the nodes pull from (no scheme, no tag).

    Raises:
        UsageError: anything else.
    """
    registry = registry.strip().rstrip("/")
    if not _REGISTRY.match(registry):
        raise UsageError(f"--registry {registry!r} is not HOST[:PORT][/PATH] (e.g. registry.internal:5000)")
    return registry


class Shipper:
    """The images of one batch on their way to the nodes (thread-safe: one push or save per image)."""

    def __init__(self, client: docker.DockerClient, ray: Any, registry: str | None = None) -> None:
        self._client = client
        self._ray = ray
        self.registry = registry
        self._lock = threading.Lock()
        self._pushed: dict[str, str] = {}
        self._chunks: dict[str, list[Any]] = {}

    def manifest(self, image: ImageRef, *, chunks: bool = False) -> dict[str, Any]:
        """What a node gets to make ``image`` present: its id and ref, and a digest to pull, or (``chunks``,
        once a node turned out not to have it) the chunks of its ``docker save``."""
        found: dict[str, Any] = {"id": image.id, "ref": image.ref}
        if self.registry is not None:
            found["pull"] = self._push(image)
        elif chunks:
            found["chunks"] = self._save(image)
        return found

    def _push(self, image: ImageRef) -> str:
        with self._lock:
            if image.id in self._pushed:
                return self._pushed[image.id]
            assert self.registry is not None
            repository, tag = _target(self.registry, image)
            started = time.monotonic()
            try:
                self._client.images.get(image.id).tag(repository, tag)
                try:
                    errors = [
                        line["error"]
                        for line in self._client.images.push(repository, tag, stream=True, decode=True)
                        if "error" in line
                    ]
                    if errors:
                        raise InfrastructureError(f"docker push {repository}:{tag} failed: {errors[-1]}")
                    digests = self._client.images.get(image.id).attrs.get("RepoDigests") or []
                finally:  # the push needed the registry's name on the image; this engine keeps only its own
                    self._client.images.remove(f"{repository}:{tag}", noprune=True)
            except InfrastructureError:
                raise
            except Exception as exc:  # noqa: BLE001 - docker's errors, in one line
                raise InfrastructureError(f"docker push {repository}:{tag} failed: {exc}") from None
            pulled = next((str(d) for d in digests if str(d).startswith(f"{repository}@")), None)
            if pulled is None:
                raise InfrastructureError(f"docker push {repository}:{tag} gave no digest")
            logger.info("pushed {} as {} in {:.1f}s", image.ref, pulled, time.monotonic() - started)
            self._pushed[image.id] = pulled
            return pulled

    def _save(self, image: ImageRef) -> list[Any]:
        with self._lock:
            if image.id in self._chunks:
                return self._chunks[image.id]
            started = time.monotonic()
            found = self._client.images.get(image.id)
            named = image.ref if image.ref in found.tags else bool(found.tags)  # the node knows it by its tag
            refs = [self._ray.put(chunk) for chunk in rechunk(found.save(chunk_size=CHUNK, named=named), CHUNK)]
            logger.info(
                "{} is in the cluster's object store for the nodes that lack it ({} chunks, {:.1f}s)",
                image.ref,
                len(refs),
                time.monotonic() - started,
            )
            self._chunks[image.id] = refs
            return refs

    def close(self) -> None:
        """Let the object store drop the chunks."""
        with self._lock:
            self._chunks.clear()


def _target(registry: str, image: ImageRef) -> tuple[str, str]:
    """The repository and tag ``image`` is pushed as: its own reference under the registry (its content-hash
    tag for pvisor-host's images), or its id when it was asked for by id."""
    name, _, tag = image.ref.rpartition(":")
    if not name or "/" in tag or image.ref.startswith("sha256:"):
        return f"{registry}/pvisor-host/image", image.id.removeprefix("sha256:")[:32]
    return f"{registry}/{name}", tag


def rechunk(pieces: Iterable[bytes], size: int) -> Iterator[bytes]:
    """``pieces`` as chunks of ``size`` bytes (the last one shorter): the engine streams an image in pieces of
    a few KiB, and one object per piece would make a 650 MB image twenty thousand objects."""
    buffer = bytearray()
    for piece in pieces:
        buffer += piece
        while len(buffer) >= size:
            yield bytes(buffer[:size])
            del buffer[:size]
    if buffer:
        yield bytes(buffer)
