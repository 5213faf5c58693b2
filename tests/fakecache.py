"""A fake engine and registry for the image cache (:mod:`pvisor_host.backend.docker.image.cache`), and a clock whose
time passes only when the cache waits: the cache's own logic tested without an engine and without sleeps. A
test aid for our own logic only."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pvisor_host.backend.docker.image.cache import Priced
from pvisor_host.backend.docker.image.cache.layers import Layer, chain_ids
from pvisor_host.backend.docker.image.registry import ManifestError
from pvisor_host.errors import Interrupted
from pvisor_host.models.image import PulledImage

MB = 1_000_000


@dataclass
class Image:
    id: str
    diff_ids: list[str]
    sizes: list[int]
    """Unpacked bytes per layer."""
    compressed: list[int]


@dataclass
class FakeEngine:
    """Images in a registry, and those present on the engine; pulls and removals as the engine makes them."""

    registry: dict[str, Image] = field(default_factory=dict)
    present_refs: dict[str, str] = field(default_factory=dict)
    """Reference → image id, for images on the engine."""
    in_use: set[str] = field(default_factory=set)
    unpriced: set[str] = field(default_factory=set)
    pulls: list[str] = field(default_factory=list)
    removals: list[str] = field(default_factory=list)
    fail_pull: dict[str, BaseException] = field(default_factory=dict)
    arrive_anyway: set[str] = field(default_factory=set)
    on_price: Callable[[], None] | None = None
    """Runs as the cache prices a pull (another process doing something meanwhile)."""
    prices: list[str] = field(default_factory=list)
    """The references priced (asked of the registry), in order."""
    fail_remove: BaseException | None = None
    """Raised by the next removal (the engine went away)."""

    def add(self, ref: str, base: list[tuple[str, int]], own: list[tuple[str, int]]) -> Image:
        layers = base + own
        image = Image(
            id=f"sha256:{ref}", diff_ids=[f"sha256:{name}" for name, _ in layers], sizes=[s for _, s in layers],
            compressed=[s // 2 for _, s in layers],
        )  # fmt: skip
        self.registry[ref] = image
        return image

    def _by_id(self, image_id: str) -> Image | None:
        return next((i for i in self.registry.values() if i.id == image_id), None)

    def present(self, ref: str) -> PulledImage | None:
        image_id = self.present_refs.get(ref)
        return None if image_id is None else PulledImage(ref=ref, id=image_id, size=self.size(image_id))

    def size(self, image_id: str) -> int:
        image = self._by_id(image_id)
        return sum(image.sizes) if image else 0

    def has(self, image: str) -> bool:
        return image in self.present_refs.values() or image in self.present_refs

    def layers(self, image_id: str) -> list[Layer]:
        image = self._by_id(image_id)
        if image is None or not self.has(image_id):
            return []
        return [Layer(chain=c, size=s) for c, s in zip(chain_ids(image.diff_ids), image.sizes, strict=True)]

    def chain_sizes(self) -> dict[str, int]:
        return {x.chain: x.size for image_id in set(self.present_refs.values()) for x in self.layers(image_id)}

    def price(self, ref: str) -> Priced:
        self.prices.append(ref)
        if self.on_price is not None:
            self.on_price()
        if ref in self.unpriced:
            raise ManifestError(f"{ref}: the registry answered HTTP 500")
        image = self.registry[ref]
        return Priced(id=image.id, diff_ids=image.diff_ids, compressed=image.compressed)

    def pull(self, ref: str, *, progress: object = None, cancel: threading.Event | None = None) -> PulledImage:
        self.pulls.append(ref)
        if ref in self.arrive_anyway:
            self.present_refs[ref] = self.registry[ref].id
        if ref in self.fail_pull:
            raise self.fail_pull[ref]
        image = self.registry[ref]
        self.present_refs[ref] = image.id
        return PulledImage(ref=ref, id=image.id, size=sum(image.sizes), pulled=True)

    def remove(self, ref: str, image_id: str) -> bool:
        if self.fail_remove is not None:
            failure, self.fail_remove = self.fail_remove, None
            raise failure
        if image_id in self.in_use:
            return False
        self.removals.append(ref)
        self.present_refs = {r: i for r, i in self.present_refs.items() if i != image_id}
        return True


class Clock:
    """Time that passes only when the cache waits; ``on_wait`` runs at each wait (another holder's doing)."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self.waits = 0
        self.on_wait: Callable[[], None] | None = None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float, cancel: threading.Event | None) -> None:
        if cancel is not None and cancel.is_set():
            raise Interrupted("interrupted while waiting for room for its image")
        self.waits += 1
        self.now += seconds
        if self.on_wait is not None:
            self.on_wait()


def swe(engine: FakeEngine, tasks: int, *, env: int = 250 * MB, own: int = 20 * MB, envs: int = 1) -> list[str]:
    """``envs`` environment images' layers under ``tasks`` task images of ``own`` bytes each."""
    refs = []
    for n in range(tasks):
        base = [("os", 50 * MB), (f"env{n % envs}", env)]
        refs.append(f"task{n}")
        engine.add(f"task{n}", base, [(f"own{n}", own)])
    return refs
