"""An image as the disk holds it: its layers, each named by its chain id and weighed in bytes.

The engine stores a layer once however many images use it, and it names it by its *chain id*: the digest of
the layer's content (its diff id) chained to every layer below it (``ChainID(n) = sha256(ChainID(n-1) + " " +
DiffID(n))``, as in the OCI image spec). Two images share a layer on disk exactly when they share a chain id,
so the image cache counts distinct chain ids, never whole images: twelve SWE task images on one environment
image hold the environment once.

* An image on the engine: its diff ids are in ``RootFS.Layers``; the bytes of each layer come from the
  engine's history of the image, which gives one entry per build step, newest first, with the layer's size,
  or 0 for a step that made no layer (``ENV``, ``CMD``...). When zero-byte steps outnumber the layers that
  weigh nothing, the steps that only set metadata are taken as the ones without a layer (a zero-byte layer
  misplaced weighs nothing, and the image's total stays exact).
* An image in a registry, not pulled yet: its manifest lists each layer's compressed size and its
  configuration lists the diff ids in the same order, so a pull can be priced per layer before it starts,
  and the layers already on the engine cost nothing.

Written here because no library computes chain ids or reads the engine's history per layer; it is the spec's
one-line rule and a walk over the engine's own answer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel

#: Build steps that set metadata only (the classic builder's ``#(nop)`` and BuildKit's plain instructions).
_METADATA = re.compile(
    r"#\(nop\)|^(ENV|LABEL|CMD|ENTRYPOINT|EXPOSE|USER|WORKDIR|ARG|VOLUME|STOPSIGNAL|HEALTHCHECK|SHELL|ONBUILD|"
    r"MAINTAINER)\b",
    re.IGNORECASE,
)


class Layer(BaseModel):
    """One layer of an image: its chain id and its bytes on disk (estimated until it is there)."""

    chain: str
    size: int
    estimated: bool = False
    pull: int = 0
    """Bytes it is expected to take if it has to be pulled (its compressed size times the unpacking ratio)."""
    foreign: bool = False
    """It was on the engine before the cache pulled the image (another image's, the user's): the cache did not
    bring it, and removing the cache's images would not free it, so it does not count."""


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """The chain id of each layer of an image whose layers have ``diff_ids`` (base first)."""
    chains: list[str] = []
    for diff in diff_ids:
        chains.append(diff if not chains else "sha256:" + hashlib.sha256(f"{chains[-1]} {diff}".encode()).hexdigest())
    return chains


def engine_layers(diff_ids: Sequence[str], history: Iterable[dict[str, Any]]) -> list[Layer]:
    """The layers of an image on the engine: ``diff_ids`` from its inspection (``RootFS.Layers``), weighed
    from ``history`` (the engine's ``/images/{id}/history``, newest first); see the module docstring."""
    steps = [(int(step.get("Size") or 0), str(step.get("CreatedBy") or "")) for step in reversed(list(history))]
    layered = _steps_with_layers(steps, len(diff_ids))
    sizes = [size for (size, _), has in zip(steps, layered, strict=True) if has]
    sizes += [0] * (len(diff_ids) - len(sizes))  # a history shorter than the layers (an imported image)
    return [Layer(chain=chain, size=size) for chain, size in zip(chain_ids(diff_ids), sizes, strict=False)]


def _steps_with_layers(steps: list[tuple[int, str]], layers: int) -> list[bool]:
    """Which build steps made a layer: every step that weighs something, then as many zero-byte steps as
    layers are left, preferring those that do more than set metadata."""
    made = [size > 0 for size, _ in steps]
    empty_layers = layers - sum(made)
    if empty_layers <= 0:
        return made
    zero = [i for i, (size, _) in enumerate(steps) if size == 0]
    chosen = sorted(zero, key=lambda i: (bool(_METADATA.search(steps[i][1].strip())), i))[:empty_layers]
    for i in chosen:
        made[i] = True
    return made


def registry_layers(diff_ids: Sequence[str], compressed: Sequence[int], ratio: float) -> list[Layer]:
    """The layers of an image in its registry, each estimated at its compressed size times ``ratio``."""
    return [
        Layer(chain=chain, size=int(size * ratio), estimated=True, pull=int(size * ratio))
        for chain, size in zip(chain_ids(diff_ids), compressed, strict=False)
    ]


def distinct_bytes(layer_sets: Iterable[Iterable[Layer]]) -> int:
    """Bytes the layers take on disk, each chain id once (a measured size wins over an estimate; a foreign layer
    counts nothing, unless another image of the set brought the same one)."""
    return sum(_by_chain(layer_sets).values())


def _by_chain(layer_sets: Iterable[Iterable[Layer]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    measured: set[str] = set()
    for layers in layer_sets:
        for layer in layers:
            if layer.chain in measured or layer.foreign:
                continue
            if not layer.estimated:
                sizes[layer.chain] = layer.size
                measured.add(layer.chain)
            else:
                sizes[layer.chain] = max(sizes.get(layer.chain, 0), layer.size)
    return sizes
