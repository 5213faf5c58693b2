"""Task images on a node: held in the node engine's one image cache, pulled by digest within its budget, their
runtime made ready once.

A copy whose item runs in a task image (``--inject``) gets the image's digest from the driver and holds it in
the node's image cache (:mod:`pvisor_host.backend.docker.image.cache`), the same cache a local batch uses, with the
same budget arithmetic (distinct layers), the same pulls (retries, credentials) and the same ledger in the
engine's state directory: so it survives ``node join`` (which empties the scratch folder) and a reboot, and
two batches on one node share one budget. The copy holds the image from before its pull until its sandbox is
gone; several copies asking at once make one pull, the others wait and find it present. Then the engine must
hold exactly the id the driver resolved. The runtime volume is filled under a lock of its own.

What the node's copies pull is the cache's, not a batch's: it stays for the next batch within the budget
(``--image-budget``, else half of what the engine's disk has free plus what the cache holds). Room is made
least recently used first, sparing an image this batch's driver has not said it is done with
(:meth:`.ledger.Ledger.image_done`) until :data:`~pvisor_host.backend.docker.image.cache.cache.SPARE_WAIT` after its
last use (its items still to run may be waiting on another node); the driver is asked outside any lock, and
only while its answer could spare an image.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...._log import logger
from ....errors import ImageUnavailable, InfrastructureError, Interrupted, PvisorHostError, RegistryError

if TYPE_CHECKING:
    import threading

    from ....models.image import ImageHold
    from ....models.replay import PreparedReplay
    from ...docker import DockerBackend


def prepare_task(
    backend: DockerBackend,
    root: Path,
    prepared: PreparedReplay,
    task: dict[str, Any],
    agent_image_id: str,
    ledger: Any,
    cancel: threading.Event | None = None,
) -> tuple[ImageHold, str | None]:
    """Hold the task image of ``prepared`` on this node (pulled by ``task["pull"]``, its digest, when it is not
    here) and make its injected runtime ready. Returns the hold (the copy releases it once its sandbox is
    gone) and the image id when this copy pulled it (None: it was here).

    Raises:
        InfrastructureError: the pull failed, or gave another image than the driver resolved.
        RegistryError: the registry stayed unreachable or failing (as on one engine).
        ImageUnavailable: the registry says there is no such image, or refuses this node's credentials.
        UsageError: the task image cannot take the runtime.
        Interrupted: ``cancel`` was set while the copy waited for room or pulled.
    """
    hold = backend.reserve_image(
        task["pull"], budget=budget_of(backend, task), cancel=cancel, owned=False, done=lambda: _done(ledger)
    )
    try:
        found = backend.fill_image(hold, cancel=cancel)
        if found.id != task["id"]:
            raise InfrastructureError(f"{task['pull']} arrived as {found.id[:19]}, not {task['id'][:19]}")
        with _locked(root / f"runtime-{prepared.image.runtime_volume}.lock"):
            backend.inject_into(prepared, agent_image_id)
    except PvisorHostError as exc:
        backend.release_image(hold)
        raise _on_this_node(exc) from None
    except BaseException:
        backend.release_image(hold)
        raise
    return hold, (found.id if found.pulled else None)


def budget_of(backend: DockerBackend, task: dict[str, Any]) -> int | None:
    """The node's budget: the batch's ``--image-budget`` (every node keeps it), else the engine's default."""
    given = task.get("budget")
    return int(given) if given is not None else backend.image_budget()


def status(backend: DockerBackend) -> dict[str, Any]:
    """What ``cluster status`` shows of this node's task images: the bytes they take now, the latest batch's
    peak and its budget."""
    return backend.image_cache.usage().model_dump()


def _on_this_node(exc: PvisorHostError) -> PvisorHostError:
    """``exc`` naming this node, in the same class (so the same category and exit code as on one engine)."""
    if isinstance(exc, Interrupted):
        return exc
    if isinstance(exc, ImageUnavailable):
        return ImageUnavailable(exc.kind, f"{_node()}: {exc.message}", hint=exc.hint)
    if isinstance(exc, RegistryError):
        return RegistryError(f"{_node()}: {exc.message}", hint=exc.hint)
    if isinstance(exc, InfrastructureError):
        return InfrastructureError(f"{_node()}: {exc.message}", hint=exc.hint)
    return exc


def _done(ledger: Any) -> list[str]:
    """The task images the batch's driver is done with (asked outside any lock)."""
    import ray

    try:
        return list(ray.get(ledger.done_images.remote(), timeout=30))
    except Exception:  # noqa: BLE001 - the driver is gone or slow: nothing is known to be done
        logger.debug("the batch's ledger did not say which task images are done")
        return []


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _node() -> str:
    import socket

    return socket.gethostname()
