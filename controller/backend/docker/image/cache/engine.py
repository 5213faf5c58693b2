"""The Docker engine and its registries as the image cache asks them (:class:`~.cache.CacheEngine`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from docker.errors import APIError, ImageNotFound

from ....._log import logger
from .....errors import PvisorHostError
from .....models.image import PulledImage, PullProgress
from ...engine import describe, engine_errors
from ..images import ImageStore
from ..registry import ManifestError
from .cache import ImageCache, Priced
from .layers import Layer, engine_layers
from .ledger import Ledger

if TYPE_CHECKING:
    import docker

    from .....models.ownership import Ownership
    from ..pull import Puller


class DockerCacheEngine:
    """One engine's images and the registries they come from. An image's layers are read once per process
    (an image id names the same layers for ever)."""

    def __init__(
        self, client: docker.DockerClient, puller: Puller, *, on_removed: Callable[[str], None] | None = None
    ) -> None:
        self._client = client
        self._images = ImageStore(client)
        self._puller = puller
        self._on_removed = on_removed
        self._layers: dict[str, list[Layer]] = {}
        self._lock = threading.Lock()

    def present(self, ref: str) -> PulledImage | None:
        return self._puller.present(ref)

    def has(self, image: str) -> bool:
        return self._images.has(image)

    def layers(self, image_id: str) -> list[Layer]:
        """The image's layers, measured (empty when the engine has no such image)."""
        with self._lock:
            if image_id in self._layers:
                return self._layers[image_id]
        with engine_errors(f"inspect image {image_id[:19]}"):
            try:
                attrs = self._client.api.inspect_image(image_id)
                history = self._client.api.history(image_id)
            except ImageNotFound:
                return []
        layers = engine_layers(list((attrs.get("RootFS") or {}).get("Layers") or []), history)
        with self._lock:
            self._layers[image_id] = layers
        return layers

    def chain_sizes(self) -> dict[str, int]:
        """Every layer the engine holds now: chain id → bytes."""
        with engine_errors("list the engine's images"):
            ids = [str(image["Id"]) for image in self._client.api.images(all=False)]
        sizes: dict[str, int] = {}
        for image_id in ids:
            try:
                for layer in self.layers(image_id):
                    sizes[layer.chain] = layer.size
            except PvisorHostError as exc:  # removed meanwhile: its layers are not here to count
                logger.debug("could not read the layers of {}: {}", image_id[:19], exc.message)
        return sizes

    def price(self, ref: str) -> Priced:
        """The image's id and layers as its registry lists them.

        Raises:
            ManifestError: the registry cannot say.
        """
        registries = self._puller.registries
        manifest = registries.manifest(ref)
        config: dict[str, Any] = registries.config(ref, manifest)
        diff_ids = [str(d) for d in (config.get("rootfs") or {}).get("diff_ids") or []]
        if len(diff_ids) != len(manifest.ordered):
            raise ManifestError(f"{ref}: its configuration and its manifest list different layers")
        return Priced(id=manifest.config_digest, diff_ids=diff_ids, compressed=manifest.sizes)

    def pull(
        self, ref: str, *, progress: Callable[[PullProgress], None] | None, cancel: threading.Event | None
    ) -> PulledImage:
        return self._puller.pull(ref, progress=progress, cancel=cancel)

    def remove(self, ref: str, image_id: str) -> bool:
        """Remove the image ``image_id``: by ``ref`` while that name is still its own, then by id (never forced:
        a container that uses it keeps it). True when it is gone."""
        try:
            with engine_errors(f"remove image {ref}"):
                current = self._puller.present(ref)
                try:
                    if current is not None and current.id == image_id:
                        self._client.images.remove(ref)
                    if self.has(image_id):
                        self._client.images.remove(image_id)
                except ImageNotFound:
                    pass
                except APIError as exc:
                    if exc.status_code == 409:  # a container uses it, or another name holds it
                        logger.info("{} stays: {}", ref, describe(exc))
                        return False
                    raise
                gone = not self.has(image_id)
        except PvisorHostError as exc:
            logger.warning("could not remove {}: {}", ref, exc.message)
            return False
        if gone:
            with self._lock:
                self._layers.pop(image_id, None)
            if self._on_removed is not None:
                try:
                    self._on_removed(image_id)
                except OSError as exc:  # what was kept beside the image (its workspace seed) stays for gc
                    logger.warning("removed {}, but not what was kept beside it: {}", ref, exc)
        return gone


def open_cache(
    client: docker.DockerClient,
    ownership: Ownership,
    *,
    puller: Puller | None = None,
    on_removed: Callable[[str], None] | None = None,
) -> ImageCache:
    """The image cache of the engine ``client`` speaks to (its ledger named after the engine's id)."""
    from ...state import engine_state
    from ..pull import Puller

    ledger = Ledger(engine_state(client, "image-cache").with_suffix(".json"), ownership)
    engine = DockerCacheEngine(client, puller or Puller(client), on_removed=on_removed)
    return ImageCache(engine, ledger, ownership)
