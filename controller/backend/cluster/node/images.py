"""Task images on a node: pulled by digest within the node's disk budget, their runtime made ready once.

A copy whose item runs in a task image (``--inject``) gets the image's digest from the driver and pulls it here
(:func:`prepare_task`), with the single-host pull's retries and credentials, then checks that the engine holds
exactly the id the driver resolved. Several Ray workers of one node may ask for the same image at once: a lock
file per image makes one of them pull and the others find it present; the runtime volume is filled under a lock
of its own.

**The node's budget.** What copies pulled on this node is kept in a small ledger file in the node's scratch
folder (image id → bytes, last use, the batch session it belongs to, and while it is pulled the pulling process as
``pid/start ticks``, so a reservation of a killed copy is dropped). The ledger owns these images, not the Ray
worker that pulled them: the pull's note for ``gc`` is taken back, or a worker's exit would make them garbage.
Before a pull would take the images past the budget (``--image-budget``, else half the engine's free space),
images are removed least recently used first: only ones in the ledger, that no container uses, and either of
this batch with every item ended (the driver says so: :meth:`.ledger.Ledger.image_done`) or left by an earlier
batch and not used by this one (a copy that finds an image present makes it its batch's, and trims what
earlier batches left down to its budget, without waiting). When nothing can go
yet, the pull waits for something to (the copies before it end), up to :data:`WAIT_FOR_ROOM` or until the copy
is stopped, then goes ahead over budget and says so (at once when the image alone is larger than the budget).
The ledger records the peak of the latest batch that used the node (from then on: what earlier batches left
and it removed is not its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...._log import logger
from ....errors import ImageUnavailable, InfrastructureError, Interrupted, PvisorHostError
from ....files.atomic import write_atomic
from ....models.image import PulledImage
from ....models.ownership import process_start_ticks
from ....units import format_size
from ...docker.cleanup.pulled import forget as forget_pull

if TYPE_CHECKING:
    from ....models.replay import PreparedReplay
    from ...docker import DockerBackend

#: How long a pull waits for the node's budget to make room before it goes ahead over budget (seconds).
WAIT_FOR_ROOM = 600.0
#: Bytes an image takes on the engine for each byte its registry lists (its layers, compressed), until pulled.
RATIO = 2.5
LEDGER = "task-images.json"


def prepare_task(
    backend: DockerBackend,
    root: Path,
    prepared: PreparedReplay,
    task: dict[str, Any],
    agent_image_id: str,
    ledger: Any,
    session: str,
    cancel: threading.Event | None = None,
) -> str | None:
    """Make the task image of ``prepared`` present on this node (pulled by ``task["pull"]``, its digest) and
    its injected runtime ready. Returns the image id when this copy pulled it (None: it was here).

    Raises:
        InfrastructureError: the pull failed, or gave another image than the driver resolved.
        ImageUnavailable: the registry says there is no such image, or refuses this node's credentials.
        UsageError: the task image cannot take the runtime.
        Interrupted: ``cancel`` was set while the copy waited for room or pulled.
    """
    image_id = task["id"]
    pulled = None
    with _locked(_image_lock(root, image_id)):
        if backend.images.has(image_id):
            _use(backend, root, image_id, task, ledger, session)
        else:
            _make_room(backend, root, image_id, task, ledger, session, cancel)
            try:
                found = backend.pull_image(task["pull"], cancel=cancel)
                if found.id != image_id:  # left noted for gc under this worker: it is garbage
                    raise InfrastructureError(f"{task['pull']} arrived as {found.id[:19]}, not {image_id[:19]}")
                if found.pulled:  # the node's ledger owns it now, not the Ray worker that pulled it (see above)
                    with contextlib.suppress(OSError):
                        forget_pull(found.id)
            except BaseException as exc:  # a failed, cancelled or wrong pull leaves no reservation
                _forget(root, image_id)
                if isinstance(exc, ImageUnavailable):
                    raise ImageUnavailable(exc.kind, f"{_node()}: {exc.message}", hint=exc.hint) from None
                if isinstance(exc, PvisorHostError) and not isinstance(exc, Interrupted):
                    raise InfrastructureError(f"{_node()}: {exc.message}") from None
                raise
            _pulled(root, image_id, found.size, session)
            pulled = image_id
    with _locked(root / f"runtime-{prepared.image.runtime_volume}.lock"):
        backend.inject_into(prepared, agent_image_id)
    return pulled


def budget_of(backend: DockerBackend, task: dict[str, Any]) -> int | None:
    """The node's budget: the batch's ``--image-budget`` (every node keeps it), else the engine's default."""
    given = task.get("budget")
    return int(given) if given is not None else backend.image_budget()


def status(root: Path) -> dict[str, Any]:
    """What ``cluster status`` shows of this node's task images: the bytes they take now, the peak and the budget."""
    with _locked(root / f"{LEDGER}.lock"):
        state = _read(root)
    taken = sum(entry["size"] for entry in state["images"].values())
    return {"images": len(state["images"]), "bytes": taken, "peak": state["peak"], "budget": state["budget"]}


# -- the budget -------------------------------------------------------------------------------------------------


def _make_room(
    backend: DockerBackend,
    root: Path,
    image_id: str,
    task: dict[str, Any],
    ledger: Any,
    session: str,
    cancel: threading.Event | None,
) -> None:
    """Reserve the image's bytes in the node's ledger, removing what the budget needs first (see the module
    docstring): images of this batch whose items are done, or that an earlier batch pulled, that no container
    uses, least recently used first."""
    budget = budget_of(backend, task)
    estimate = int((task.get("size") or 0) * RATIO)
    deadline = time.monotonic() + WAIT_FOR_ROOM
    while True:
        with _locked(root / f"{LEDGER}.lock"):
            state = _read(root)
            state["budget"] = budget
            images: dict[str, Any] = state["images"]
            _drop_gone(backend, images)
            taken = sum(entry["size"] for entry in images.values())
            late = time.monotonic() > deadline
            if budget is None or taken + estimate <= budget or not images or estimate > budget or late:
                if budget is not None and taken + estimate > budget and images:
                    logger.warning("{}: over the image budget of {} to run its items", _node(), format_size(budget))
                _this_batch(state, session)
                images[image_id] = {"size": estimate, "used": time.time(), "pulling": _me(), "session": session}
                _write(root, state)
                return
            taken = _evict(backend, root, images, budget - estimate, set(_done(ledger)), session)
            _write(root, state)
            if taken + estimate <= budget:
                continue  # room now: reserve it on the next turn
        # Nothing can go yet: the copies before this one end, or the driver says an image is done.
        if cancel is not None and cancel.wait(1.0):
            raise Interrupted("stopped while waiting for room for its task image")
        if cancel is None:
            time.sleep(1.0)


def _use(backend: DockerBackend, root: Path, image_id: str, task: dict[str, Any], ledger: Any, session: str) -> None:
    """An item of ``session`` uses an image that is here: the image is this batch's now (the budget does not
    take it before the batch's driver says its items are done), and what earlier batches left goes while the
    node holds more than this batch's budget (no waiting and no question to the driver: this copy needs no
    room, so only earlier batches' images go)."""
    budget = budget_of(backend, task)
    with _locked(root / f"{LEDGER}.lock"):
        state = _read(root)
        state["budget"] = budget
        _this_batch(state, session)
        images: dict[str, Any] = state["images"]
        _drop_gone(backend, images)
        if image_id in images:
            images[image_id].update(used=time.time(), session=session)
        taken = sum(entry["size"] for entry in images.values())
        if budget is not None and taken > budget:
            taken = _evict(backend, root, images, budget, set(), session)
        state["peak"] = max(state["peak"], taken)
        _write(root, state)


def _evict(backend: DockerBackend, root: Path, images: dict[str, Any], room: int, done: set[str], session: str) -> int:
    """Remove images until they take at most ``room`` bytes, least recently used first: only those no container
    uses, no copy is pulling or about to use (its image lock is held), of this batch with every item ended
    (``done``) or of an earlier batch. Returns the bytes the images take then."""
    taken: int = sum(entry["size"] for entry in images.values())
    for victim in sorted(images, key=lambda key: images[key]["used"]):
        if taken <= room:
            break
        entry = images[victim]
        finished = victim in done or entry.get("session") != session
        if not finished or entry.get("pulling") or _busy(root, victim) or backend.image_in_use(victim):
            continue
        if backend.remove_image(PulledImage(ref=victim, id=victim, size=entry["size"], pulled=True)):
            logger.info("{}: removed task image {} (its items are done)", _node(), victim[:19])
            taken -= entry["size"]
            del images[victim]
    return taken


def _drop_gone(backend: DockerBackend, images: dict[str, Any]) -> None:
    """Forget the images removed meanwhile (gc, prune, by hand): they take no room."""
    for gone in [k for k, e in images.items() if not e.get("pulling") and not backend.images.has(k)]:
        del images[gone]


def _image_lock(root: Path, image_id: str) -> Path:
    return root / f"task-{image_id.removeprefix('sha256:')[:32]}.lock"


def _busy(root: Path, image_id: str) -> bool:
    """Whether a copy holds the image's lock now (it is pulling it, or found it and is about to use it)."""
    path = _image_lock(root, image_id)
    if not path.exists():
        return False
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def _this_batch(state: dict[str, Any], session: str) -> None:
    """The peak is the latest batch's to use the node, from when it first did."""
    if state["session"] != session:
        state["session"], state["peak"] = session, 0


def _done(ledger: Any) -> list[str]:
    import ray

    try:
        return list(ray.get(ledger.done_images.remote(), timeout=30))
    except Exception:  # noqa: BLE001 - the driver is gone or slow: nothing is known to be done
        return []


def _pulled(root: Path, image_id: str, size: int, session: str) -> None:
    with _locked(root / f"{LEDGER}.lock"):
        state = _read(root)
        state["images"][image_id] = {"size": size, "used": time.time(), "pulling": None, "session": session}
        taken = sum(entry["size"] for entry in state["images"].values())
        state["peak"] = max(state["peak"], taken)
        _write(root, state)


def _forget(root: Path, image_id: str) -> None:
    with _locked(root / f"{LEDGER}.lock"):
        state = _read(root)
        state["images"].pop(image_id, None)
        _write(root, state)


def _read(root: Path) -> dict[str, Any]:
    """The ledger; a reservation whose process is gone (a copy killed mid-pull) is dropped."""
    try:
        state = json.loads((root / LEDGER).read_text())
    except (OSError, ValueError):
        state = {}
    images = {
        key: entry
        for key, entry in (state.get("images") or {}).items()
        if not entry.get("pulling") or _alive(str(entry["pulling"]))
    }
    return {
        "images": images,
        "peak": int(state.get("peak") or 0),
        "budget": state.get("budget"),
        "session": state.get("session"),
    }


def _write(root: Path, state: dict[str, Any]) -> None:
    write_atomic(root / LEDGER, json.dumps(state).encode())


def _me() -> str:
    """This process as ``pid/start ticks``: a reservation outlives no process, not even one whose pid is reused."""
    return f"{os.getpid()}/{process_start_ticks(os.getpid())}"


def _alive(process: str) -> bool:
    pid, _, ticks = process.partition("/")
    return pid.isdigit() and process_start_ticks(int(pid)) == ticks


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _node() -> str:
    import socket

    return socket.gethostname()
