"""Backends: where sandboxes run, behind one seam (:class:`~pvisor_host.backend.base.Backend`).

* :mod:`.docker` — the local Docker engine (the default), the only package that imports docker;
* :mod:`.cluster` — the Docker hosts of a Ray cluster (the ``ray`` extra), the only one that imports Ray.

:func:`open_backend` is the one way in, for the CLI and the Python API alike: it checks the cluster options
(:func:`check_cluster_options`) before any engine or cluster is asked, and imports a backend's module only
when that backend is opened, so commands that need no engine never load one.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import UsageError
from .base import AnyBackend, Backend, ModelGateway

if TYPE_CHECKING:
    from pathlib import Path

    from ..models.ownership import Ownership

__all__ = [
    "AnyBackend", "Backend", "ModelGateway", "Placement", "check_cluster_options", "check_registry", "open_backend",
]  # fmt: skip

#: Where a cluster's nodes pull images from when ``--registry`` is not given.
REGISTRY_ENV = "PVISOR_HOST_REGISTRY"
_REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(:\d{1,5})?(/[a-z0-9._/-]+)?$")


def check_registry(registry: str, *, flag: str = "--registry") -> str:
    """``HOST[:PORT][/PATH]`` of a registry (no scheme, no tag).

    Raises:
        UsageError: anything else.
    """
    registry = registry.strip().rstrip("/")
    if not _REGISTRY.match(registry):
        raise UsageError(f"{flag} {registry!r} is not HOST[:PORT][/PATH] (e.g. registry.internal:5000)")
    return registry


def check_cluster_options(cluster: str | None, registry: str | None) -> str | None:
    """Check what the host can tell about a cluster request without asking anything: ``cluster`` is
    ``HEAD:PORT``, ``registry`` (default ``$PVISOR_HOST_REGISTRY`` with a cluster) is ``HOST[:PORT][/PATH]``
    and is given only with a cluster. Returns the registry the nodes will pull from (None: none).

    Raises:
        UsageError: one of them is malformed, or a registry is given without a cluster.
    """
    if cluster is None:
        if registry:
            raise UsageError("a registry is where cluster nodes pull images from; it needs a cluster (--cluster)")
        return None
    from .cluster.connect import check_address

    check_address(cluster)
    registry = registry or os.environ.get(REGISTRY_ENV)
    return check_registry(registry) if registry else None


class Placement(BaseModel):
    """Where a batch's sandboxes run and its task images come from: one engine (``docker_host``), or the Docker
    hosts of a Ray cluster; mirrors and rewrites of the task images' names. Checked as far as the host can tell
    when made (:func:`check_cluster_options`, the mirrors' forms), before any engine or cluster is asked."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    docker_host: Annotated[str | None, Field(json_schema_extra={"cli": False})] = None
    """The engine (default ``DOCKER_HOST``, else the local socket); with ``cluster``, the engine that makes the
    images."""
    cluster: Annotated[str | None, Field(json_schema_extra={"metavar": "HEAD:PORT"})] = None
    """Run the items on the Docker hosts of the Ray cluster at HEAD:PORT (needs the ray extra and RAY_AUTH_TOKEN);
    images are built here and shipped to the nodes."""
    registry: Annotated[str | None, Field(json_schema_extra={"metavar": "HOST[:PORT]"})] = None
    """With --cluster: push each image here once and have the nodes pull it by digest (default:
    $PVISOR_HOST_REGISTRY, else ship it through the cluster, docker save then docker load, once per node)."""
    registry_mirror: Annotated[str | None, Field(json_schema_extra={"metavar": "HOST[:PORT]"})] = None
    """Pull Docker Hub's task images through this mirror (a pull-through cache); they keep their names."""
    image_rewrites: Annotated[
        list[str], Field(json_schema_extra={"metavar": "FROM=TO", "flag": "--image-rewrite"})
    ] = []
    """Pull task images named FROM... from TO... instead (image name prefixes, e.g.
    docker.io/swebench/=registry.internal:5000/swebench/); repeatable, the first match wins."""

    @model_validator(mode="after")
    def _checked(self) -> Placement:
        from .docker.image.mirrors import Mirrors

        check_cluster_options(self.cluster, self.registry)
        Mirrors.parse(self.registry_mirror, self.image_rewrites)
        return self

    def open(self, *, pool_size: int = 10, out: Path | None = None, **more: Any) -> AnyBackend:
        """:func:`open_backend` here (close it when done)."""
        return open_backend(
            pool_size=pool_size, docker_host=self.docker_host, cluster=self.cluster, registry=self.registry,
            registry_mirror=self.registry_mirror, image_rewrites=self.image_rewrites, out=out, **more,
        )  # fmt: skip


def open_backend(
    *,
    ownership: Ownership | None = None,
    pool_size: int = 10,
    timeout: float = 120,
    docker_host: str | None = None,
    cluster: str | None = None,
    registry: str | None = None,
    registry_mirror: str | None = None,
    image_rewrites: list[str] | None = None,
    out: Path | None = None,
) -> AnyBackend:
    """The Docker engine at ``docker_host`` (default: ``DOCKER_HOST``, else the default socket), checked with a
    ping; with ``cluster`` (``HEAD:PORT``), the Ray cluster there, this engine making the images.

    ``pool_size`` should cover the threads that use the backend at once; ``timeout`` bounds one engine request.
    ``registry`` (``HOST[:PORT][/PATH]``, default ``$PVISOR_HOST_REGISTRY``) is where a cluster's nodes pull
    images from by digest; without one, images travel through the cluster. ``registry_mirror`` (``HOST[:PORT]``)
    and ``image_rewrites`` (``FROM=TO``) say where task images are really pulled from
    (:mod:`.docker.image.mirrors`).

    Raises:
        UsageError: ``cluster``, ``registry``, ``registry_mirror`` or a rewrite is malformed, or ``registry`` is
            given without ``cluster``.
        PrerequisiteError: no engine answers, the ``ray`` extra is not installed, or the cluster has no node
            with an engine.
    """
    from ..models.ownership import Ownership
    from .docker import DockerBackend
    from .docker.image.mirrors import Mirrors

    registry = check_cluster_options(cluster, registry)  # what the host can tell, before anything is asked
    mirrors = Mirrors.parse(registry_mirror, image_rewrites)
    if cluster is not None:
        from .cluster.connect import require_ray

        require_ray()
    ownership = ownership or Ownership.current(out=str(out) if out is not None else None)
    local = DockerBackend.connect(ownership, pool_size=pool_size, timeout=timeout, docker_host=docker_host)
    local.use_mirrors(mirrors)
    if cluster is None:
        return local
    from .cluster.backend import ClusterBackend

    try:
        return ClusterBackend(cluster, local, registry=registry)
    except BaseException:
        local.close()
        raise
