"""How an image reaches the nodes, with no registry assumed and never an implicit pull.

* With a registry (``--registry HOST:PORT`` or ``PVISOR_HOST_REGISTRY``) the driver pushes the image once,
  under its content-hash tag, and every node pulls it **by digest**: exactly the bytes the driver built.
* Without one, the driver's ``docker save`` is put into Ray's object store in chunks, the first time a node
  turns out not to have the image, and each node that lacks it loads it once (``docker load``). A node that
  has the image (the same id) gets nothing.

Either way the node checks the image id it ends up with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..._log import logger
from ..docker.image.images import push_target
from .node.tasks import CHUNK

if TYPE_CHECKING:
    from ..docker.image.images import ImageStore


class Shipper:
    """The images of one batch on their way to the nodes (thread-safe: one push or save per image)."""

    def __init__(self, images: ImageStore, ray: Any, registry: str | None = None) -> None:
        self._images = images
        self._ray = ray
        self.registry = registry
        self._lock = threading.Lock()
        self._pushed: dict[str, str] = {}
        self._chunks: dict[str, list[Any]] = {}

    def manifest(self, image_id: str, ref: str, *, chunks: bool = False) -> dict[str, Any]:
        """What a node gets to make the image ``image_id`` (built here as ``ref``) present: its id and ref, and a
        digest to pull, or (``chunks``, once a node turned out not to have it) the chunks of its ``docker save``."""
        found: dict[str, Any] = {"id": image_id, "ref": ref}
        if self.registry is not None:
            found["pull"] = self._push(image_id, ref)
        elif chunks:
            found["chunks"] = self._save(image_id, ref)
        return found

    def _push(self, image_id: str, ref: str) -> str:
        with self._lock:
            if image_id in self._pushed:
                return self._pushed[image_id]
            assert self.registry is not None
            started = time.monotonic()
            pushed = self._images.push(image_id, *push_target(self.registry, ref, image_id))
            logger.info("pushed {} as {} in {:.1f}s", ref, pushed, time.monotonic() - started)
            self._pushed[image_id] = pushed
            return pushed

    def _save(self, image_id: str, ref: str) -> list[Any]:
        with self._lock:
            if image_id in self._chunks:
                return self._chunks[image_id]
            started = time.monotonic()
            pieces = self._images.save(image_id, name=ref, chunk=CHUNK)  # the node knows it by its tag
            refs = [self._ray.put(chunk) for chunk in rechunk(pieces, CHUNK)]
            logger.info(
                "{} is in the cluster's object store for the nodes that lack it ({} chunks, {:.1f}s)",
                ref,
                len(refs),
                time.monotonic() - started,
            )
            self._chunks[image_id] = refs
            return refs

    def close(self) -> None:
        """Let the object store drop the chunks."""
        with self._lock:
            self._chunks.clear()


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
