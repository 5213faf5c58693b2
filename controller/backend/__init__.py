"""Backends: where sandboxes run, behind one seam (:class:`~pvisor_host.backend.base.Backend`).

Nothing outside this package imports docker; :func:`open_backend` imports a backend's module only when one
is opened, so commands that need no engine never load it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .base import Backend, ModelGateway

if TYPE_CHECKING:
    from ..models.ownership import Ownership

__all__ = ["Backend", "ModelGateway", "open_backend"]


def open_backend(
    *,
    ownership: Ownership | None = None,
    pool_size: int = 10,
    timeout: float = 120,
    docker_host: str | None = None,
    cluster: str | None = None,
    registry: str | None = None,
) -> Backend:
    """The Docker engine at ``docker_host`` (default: ``DOCKER_HOST``, else the default socket), checked with a
    ping; with ``cluster`` (``HEAD:PORT``), the Ray cluster there, this engine making the images.

    ``pool_size`` should cover the threads that use the backend at once; ``timeout`` bounds one engine request.
    ``registry`` (``HOST[:PORT][/PATH]``, default ``$PVISOR_HOST_REGISTRY``) is where a cluster's nodes pull
    images from by digest; without one, images travel through the cluster.

    Raises:
        UsageError: ``cluster`` or ``registry`` is malformed, or ``registry`` is given without ``cluster``.
        PrerequisiteError: no engine answers, the ``ray`` extra is not installed, or the cluster has no node
            with an engine.
    """
    from ..models.ownership import Ownership
    from .docker import DockerBackend

    if cluster is not None:  # what the host can tell, before the engine or the cluster is asked
        from ..cluster.connect import check_address, require_ray
        from ..cluster.ship import REGISTRY_ENV, check_registry

        check_address(cluster)
        registry = registry or os.environ.get(REGISTRY_ENV)
        registry = check_registry(registry) if registry else None
        require_ray()
    elif registry:
        from ..errors import UsageError

        raise UsageError("a registry is where cluster nodes pull images from; it needs a cluster (--cluster)")
    local = DockerBackend.connect(
        ownership or Ownership.current(), pool_size=pool_size, timeout=timeout, docker_host=docker_host
    )
    if cluster is None:
        return local
    from ..cluster.backend import ClusterBackend

    try:
        return ClusterBackend(cluster, local, registry=registry)
    except BaseException:
        local.close()
        raise
