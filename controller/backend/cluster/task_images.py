"""Task images on a cluster, the driver's side: resolved against their registry, placed, never pulled here.

A dataset's task images (``--image`` with ``--inject``) are gigabytes each, hundreds of them: the driver does
not pull them and the object store does not carry them. The driver asks the registry for each image's
manifest and configuration once (:meth:`TaskImages.resolve`): the digest every node then pulls, so that
every node runs exactly the same bytes, the image id that digest gives, and the labels and platform the
plan checks. The agent image whose runtime is injected is built (or found) here and reaches the nodes as
any agent image does (:mod:`.ship`); each node fills its own runtime volume from it and pulls the task image
itself (:mod:`.node.images`).

Locality (:class:`Placement`): the items of one task image go to one node, chosen when the image's first item
is submitted among the engine nodes with the fewest items placed on them and not yet ended (within one item),
as the one that has the most of its layers already (images on one environment share a node), and Ray is asked
to run them there (a *soft* node affinity: when that node is gone, Ray runs them elsewhere). So an image is pulled
about once, not once per node, while the images spread over the nodes. This is a preference handed to Ray's
scheduler, not a scheduler of its own: Ray still decides when and, if the node is lost, where. Once a node died
during the batch, :meth:`Placement.spread` also places the copies that have no task image, on the least loaded
node (see :meth:`.backend.ClusterBackend.place`).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ...errors import ImageUnavailable, UsageError
from ...models.image import InjectPlan, PulledImage
from ..docker.image.cache.layers import chain_ids
from ..docker.image.images import Reference
from ..docker.image.inject import inject_spec
from ..docker.image.pull import Puller


class TaskImages:
    """The task images of one cluster batch, as the registry describes them (thread-safe)."""

    def __init__(self, puller: Puller) -> None:
        self._puller = puller
        self._lock = threading.Lock()
        self._found: dict[str, PulledImage] = {}
        self._labels: dict[str, dict[str, str]] = {}
        self._users: dict[str, str] = {}
        self._layers: dict[str, dict[str, int]] = {}

    def resolve(self, ref: str, *, cancel: threading.Event | None = None) -> PulledImage:
        """The image ``ref`` names, found in its registry without pulling it: its digest reference (what nodes
        pull), its id, and the bytes a pull downloads. The registry is asked as a pull would ask it (the same
        retries and patience), so an outage ends as it does on one engine.

        Raises:
            ImageUnavailable: no such image, refused credentials, or an image that is not linux/amd64: its items
                are refused, in one line.
            RegistryError: the registry stayed unreachable or failing (an infrastructure error, as a pull's).
            Interrupted: ``cancel`` was set.
        """
        with self._lock:
            if ref in self._found:
                return self._found[ref]
        registries = self._puller.registries
        manifest = self._puller.ask(ref, lambda: registries.manifest(ref), cancel=cancel)
        config = self._puller.ask(ref, lambda: registries.config(ref, manifest), cancel=cancel)
        platform = (config.get("os", "linux"), config.get("architecture", "amd64"))
        if platform != ("linux", "amd64"):
            raise ImageUnavailable(
                "image_unusable",
                f"task image {ref} is {'/'.join(platform)}; pvisor 0.3.1 ships only linux/amd64 (x86_64) binaries",
            )
        if manifest.digest is None or manifest.config_digest is None:
            raise ImageUnavailable("image_unusable", f"task image {ref}: its registry names no digest to pull it by")
        found = PulledImage(
            ref=ref,
            id=manifest.config_digest,
            digest=f"{Reference(registries.mirrors.source(ref)).repository}@{manifest.digest}",  # what nodes pull
            size=manifest.bytes,
        )
        with self._lock:
            self._found[ref] = found
            self._labels[ref] = dict((config.get("config") or {}).get("Labels") or {})
            self._users[ref] = str((config.get("config") or {}).get("User") or "")
            diff_ids = [str(d) for d in (config.get("rootfs") or {}).get("diff_ids") or []]
            self._layers[ref] = dict(zip(chain_ids(diff_ids), manifest.sizes, strict=False))
        return found

    def layers(self, ref: str) -> dict[str, int]:
        """The layers of the resolved image ``ref``: chain id → bytes it downloads (empty: not resolved)."""
        with self._lock:
            return dict(self._layers.get(ref, {}))

    def plan(self, ref: str, profile: Any) -> InjectPlan:
        """The inject plan of task image ``ref`` for ``profile``'s runtime (see :meth:`resolve`).

        Raises:
            UsageError: the agent cannot be injected.
            ImageUnavailable: see :meth:`resolve`.
        """
        if profile is None:
            raise UsageError("--inject needs both --image (the task image) and --agent (the runtime to inject)")
        inject_spec(profile)
        found = self.resolve(ref)
        return InjectPlan(
            profile=profile, ref=ref, id=found.id, labels=self._labels[ref], digest=found.digest, user=self._users[ref]
        )


class Placement:
    """Which node the items of each task image go to, and after a node died, any other copy (see the module
    docstring; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._node: dict[str, str] = {}
        self._load: Counter[str] = Counter()
        """Copies placed on each node (task images' items, and spread copies) and not yet ended."""
        self._layers: dict[str, dict[str, int]] = {}
        """Node → the layers of the images placed on it (chain id → bytes)."""

    def place(self, image: str, nodes: list[str], layers: dict[str, int] | None = None) -> str | None:
        """The node for one more item of ``image`` among the alive engine ``nodes`` (None: no node). A new image
        goes to the node that has the most of its ``layers`` among the least loaded (within one item of the
        least), so images that share an environment share a node's disk and its pulls."""
        with self._lock:
            node = self._node.get(image)
            if node not in nodes:
                if not nodes:
                    return None
                least = min(self._load[n] for n in nodes)
                near = [n for n in nodes if self._load[n] <= least + 1]
                mine = layers or {}

                def shared(n: str) -> int:
                    there = self._layers.get(n, {})
                    return sum(size for chain, size in mine.items() if chain in there)

                node = min(near, key=lambda n: (-shared(n), self._load[n], n))
                self._node[image] = node
                self._layers.setdefault(node, {}).update(mine)
            self._load[node] += 1
            return node

    def spread(self, nodes: list[str]) -> str | None:
        """The node for one copy that has no task image: the least loaded of the alive engine ``nodes``, ties
        going to the first by name (None: no node). Used only once a node died during the batch (see
        :meth:`.backend.ClusterBackend.place`)."""
        with self._lock:
            if not nodes:
                return None
            node = min(nodes, key=lambda n: (self._load[n], n))
            self._load[node] += 1
            return node

    def ended(self, node: str) -> None:
        """A copy placed on ``node`` ended (wherever Ray ran it in the end)."""
        with self._lock:
            self._load[node] -= 1
