"""Task images, just in time and within a disk budget: the batch's side of a dataset of images.

A dataset pairs each trajectory with its own image, often gigabytes, hundreds of them. Pulling them all first
costs the disk of all of them and hours before the first result; pulling and removing per item repeats pulls.
:class:`ImageWindow` does the middle (the manifest already runs the items of one image together):

* it pulls ahead of the items, in their order, on a small pool of its own (``--pull-workers``), while
  sandboxes keep running: once an item asks for an image, the next ``2 × pull workers`` images too (on a
  cluster, where a pull is a registry lookup and the nodes keep their own budgets: as many as it has
  slots), and never past the byte budget (an item that finished in an earlier run asks for nothing, so a
  rerun pulls nothing for it);
* an item waits only for its own image: the first result comes after one pull (the first image is pulled
  alone, with the disk and the network to itself);
* before a pull that would go over the budget (``--image-budget``), it removes images this batch pulled
  whose items have all ended, least recently used first; never an image the batch did not pull, one a
  sandbox uses, or one a pending item still needs. An image larger than the whole budget is refused for its
  items, in one line;
* when the batch ends it removes what it pulled (unless asked to keep it), and reports what it pulled, how
  many bytes, and the peak the batch's images took.

Sizes are the engine's own (unpacked) per image, shared layers counted in each image: the accounting errs
on the side of the budget. Before a pull, an image's size is estimated from the registry's manifest
(compressed bytes) times the largest unpacking ratio seen so far in the batch (at first :data:`RATIO`).
With ``--pull-workers 0`` every image is pulled first, in order, before any item starts (the naive order,
kept for comparison).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .._log import logger
from ..backend.base import AnyBackend
from ..errors import InfrastructureError, Interrupted, PvisorHostError, UsageError
from ..models.batch import ImageStats
from ..models.image import PulledImage, PullProgress
from ..units import format_size

#: Unpacked bytes per downloaded byte assumed before the batch has seen a pull of its own.
RATIO = 3.0


@dataclass
class _Image:
    ref: str
    items_left: int
    """Items that will still ask for it."""
    in_use: int = 0
    """Items holding it now."""
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    pulled: PulledImage | None = None
    error: PvisorHostError | None = None
    compressed: int | None = None
    """Bytes a pull downloads, as the registry's manifest lists them (0: present, or unknown; None: not asked)."""
    estimate: int = 0
    """Bytes it is expected to take, until it has been pulled."""
    last_used: float = 0.0
    removed: bool = False
    stuck: bool = False
    """The engine would not remove it (something else uses it): it stays, and counts."""
    unpriced: bool = False
    """Its registry could not say what it weighs."""
    identity: str | None = None
    """Its id as known before a pull ("" once asked and unknown)."""
    wanted: bool = False
    """An item asked for it (one that finished in an earlier run and need not run again does not)."""

    @property
    def ours(self) -> bool:
        """Pulled by this batch (so this batch may remove it)."""
        return self.pulled is not None and self.pulled.pulled and not self.removed

    @property
    def evictable(self) -> bool:
        return self.ours and not self.stuck and self.items_left <= 0 and self.in_use == 0

    @property
    def taking(self) -> int:
        """Bytes it takes (or will, once pulled) on the batch's account."""
        if not self.started or self.removed or self.error is not None:
            return 0
        if self.pulled is None:
            return self.estimate
        return self.pulled.size if self.pulled.pulled else 0


class ImageWindow:
    """The task images of one batch (see the module docstring). ``order`` is every image with its number of
    items, in the order the batch runs them."""

    def __init__(
        self,
        backend: AnyBackend,
        order: dict[str, int],
        *,
        budget: int | None,
        workers: int = 2,
        keep: bool = False,
        progress: Callable[[PullProgress], None] | None = None,
        open_images: int | None = None,
    ) -> None:
        self._backend = backend
        self._images = {ref: _Image(ref, count) for ref, count in order.items()}
        self._order = list(self._images.values())
        self._workers = workers
        self._ahead = max(2, 2 * workers, open_images or 0)
        """Images open at once: pulled (or being pulled) whose items have not all ended."""
        self._keep = keep
        self._progress = progress
        self._lock = threading.Condition()
        self._cancel = threading.Event()
        self._ratio = RATIO
        self._pool: futures.ThreadPoolExecutor | None = None
        self._coordinator: threading.Thread | None = None
        self.stats = ImageStats(budget=budget)

    # -- the batch's side ---------------------------------------------------------------------------------

    def __contains__(self, ref: object) -> bool:
        return ref in self._images

    @contextlib.contextmanager
    def holding(self, ref: str, cancel: threading.Event | None = None) -> Iterator[PulledImage]:
        """The image, held for one item while the block runs (see :meth:`acquire`)."""
        image = self.acquire(ref, cancel)
        try:
            yield image
        finally:
            self.release(ref)

    def start(self) -> None:
        """Start pulling ahead (with no pull workers: pull every image now, in order)."""
        if not self._order:
            return
        if self._workers == 0:
            for image in self._order:
                image.started = True
                self._pull(image)
            return
        self._pool = futures.ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="pvisor-host-pull")
        self._coordinator = threading.Thread(target=self._coordinate, name="pvisor-host-pulls", daemon=True)
        self._coordinator.start()

    def acquire(self, ref: str, cancel: threading.Event | None = None) -> PulledImage:
        """Wait until the image is present, and hold it for one item.

        Raises:
            PvisorHostError: its pull failed (the same error for each of its items).
            Interrupted: the batch, or ``cancel``, was stopped meanwhile.
        """
        image = self._images[ref]
        with self._lock:
            image.wanted = True
            self._lock.notify_all()
        while not image.done.wait(0.2):
            if self._cancel.is_set() or (cancel is not None and cancel.is_set()):
                raise Interrupted("interrupted while its image was being pulled")
        with self._lock:
            if image.error is not None:
                image.items_left -= 1
                self._lock.notify_all()
                raise image.error
            assert image.pulled is not None
            image.in_use += 1
            image.last_used = time.monotonic()
            return image.pulled

    def release(self, ref: str) -> None:
        """The item that held the image has ended (the last one to: the backend hears the image is done)."""
        with self._lock:
            image = self._images[ref]
            image.in_use -= 1
            image.items_left -= 1
            image.last_used = time.monotonic()
            done = image.items_left <= 0 and image.in_use == 0 and image.pulled is not None
            self._lock.notify_all()
        if done:
            assert image.pulled is not None
            self._backend.image_done(image.pulled)

    def identity(self, ref: str) -> str | None:
        """The image's id without pulling it: the engine's, or its registry's (its configuration's digest);
        None when neither can say."""
        image = self._images[ref]
        if image.pulled is not None:
            return image.pulled.id
        if image.identity is None:  # asked once (two items asking at once may both ask: no harm)
            try:
                image.identity = self._backend.image_cost(ref).id or ""
            except Exception:  # noqa: BLE001 - unknown: the item asks for the image, as any other
                image.identity = ""
        return image.identity or None

    def skip(self, ref: str) -> None:
        """An item of the image ended without asking for it (finished in an earlier run, refused first)."""
        with self._lock:
            image = self._images[ref]
            image.items_left -= 1
            done = image.items_left <= 0 and image.in_use == 0 and image.pulled is not None
            self._lock.notify_all()
        if done:  # its last item to end did not run: the backend hears it is done all the same
            assert image.pulled is not None
            self._backend.image_done(image.pulled)

    def close(self) -> ImageStats:
        """Stop pulling, and remove what the batch pulled (unless kept); the batch's figures."""
        self._cancel.set()
        with self._lock:
            self._lock.notify_all()
        if self._coordinator is not None:
            self._coordinator.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for image in self._order:
            if image.ours and image.pulled is not None and self._keep:
                self._backend.keep_image(image.pulled)
            elif image.ours and image.in_use == 0:
                self._remove(image)
        return self.stats

    # -- the pulls ----------------------------------------------------------------------------------------

    def _coordinate(self) -> None:
        """Start each image's pull, in order, when the window and the budget have room for it. A bug here
        fails the images not yet started (their items say so) rather than leave them waiting forever."""
        try:
            self._start_in_order()
        except Exception as exc:  # noqa: BLE001 - reported through every image still waiting
            logger.opt(exception=exc).error("the image pulls stopped: {!r}", exc)
            failure = InfrastructureError(f"the batch's image pulls stopped: {exc!r}")
            with self._lock:
                for image in self._order:
                    if not image.done.is_set() and not image.started:
                        image.error = failure
                        image.done.set()

    def _start_in_order(self) -> None:
        assert self._pool is not None
        for image in self._order:
            with self._lock:
                while not self._room_for(image):
                    if self._cancel.is_set():
                        return
                    self._lock.wait(0.5)
                if self._cancel.is_set():
                    return
                image.started = True
            self._pool.submit(self._pull, image)

    def _room_for(self, image: _Image) -> bool:
        """Whether ``image`` may start now (under the lock): items have come near it (an item asked for it, or
        for one of the images just before it), and the window, the pool and the budget allow it; images the
        batch is done with are removed to make the budget's room."""
        if image.items_left <= 0 and image.in_use == 0:
            return True  # every item of it ended first (finished earlier): it will be skipped, not pulled
        position = self._order.index(image)
        if not any(i.wanted for i in self._order[max(0, position - self._ahead + 1) : position + 1]):
            return False  # its items are not near yet (or all of them finished earlier and will not ask)
        ahead = [i for i in self._order if i.started and not i.removed and i.error is None and i.items_left > 0]
        pulling = [i for i in self._order if i.started and not i.done.is_set()]
        if len(ahead) >= self._ahead or len(pulling) >= self._workers:
            return False
        if pulling and not any(i.done.is_set() for i in self._order if i.started):
            return False  # the first pull goes alone: the first result comes after one pull, not after a shared one
        budget = self.stats.budget
        if budget is None:
            return True
        image.estimate = self._estimate(image)
        if (image.compressed or 0) > budget:
            return True  # refused in its own pull, in one line
        retried = False
        while self._used() + image.estimate > budget:
            victim = min((i for i in self._order if i.evictable), key=lambda i: i.last_used, default=None)
            if victim is not None:
                self._remove(victim)
                continue
            if pulling or any(i.in_use or (i.ours and i.items_left > 0) for i in self._order):
                return False  # wait until an image's items end
            if not retried:  # nothing of ours holds anything: try again what would not go before
                retried = True
                for stuck in (i for i in self._order if i.stuck):
                    stuck.stuck = False
                continue
            logger.warning(
                "the --image-budget is taken by images the engine will not remove (something else uses them); "
                "pulling {} over it", image.ref,
            )  # fmt: skip
            return True
        return True

    def _estimate(self, image: _Image) -> int:
        """Unpacked bytes the image will take: the manifest's compressed bytes times the largest unpacking
        ratio seen in this batch (0 when it is present already); when the registry cannot say, the largest
        image the batch pulled so far (the budget errs on its own side)."""
        if image.compressed is None:
            try:
                cost = self._backend.image_cost(image.ref)
                image.compressed = cost.pull_bytes
                image.unpriced = not cost.present and not cost.layers
            except Exception as exc:  # noqa: BLE001 - a registry's odd answer: the pull will say what is wrong
                logger.debug("could not price {}: {!r}", image.ref, exc)
                image.compressed, image.unpriced = 0, True
        if image.unpriced:
            return max((i.pulled.size for i in self._order if i.pulled is not None and i.pulled.pulled), default=0)
        return int(image.compressed * self._ratio)

    def _used(self) -> int:
        """Bytes the batch's own images take now, or will once their pulls finish."""
        return sum(image.taking for image in self._order)

    def _pull(self, image: _Image) -> None:
        with self._lock:
            skip = image.items_left <= 0 and image.in_use == 0
            if skip:
                image.done.set()
                self._lock.notify_all()
                return
        budget = self.stats.budget
        try:
            if budget is not None and (image.compressed or 0) > budget:
                raise UsageError(
                    f"image {image.ref} downloads {format_size(image.compressed or 0)} (more unpacked), more than "
                    f"the whole --image-budget {format_size(budget)}",
                    hint="raise --image-budget, or run its items on a host with more room",
                )
            pulled = self._backend.pull_image(image.ref, progress=self._progress, cancel=self._cancel)
            if pulled.pulled and budget is not None and pulled.size > budget:
                self._backend.remove_image(pulled)
                raise UsageError(
                    f"image {image.ref} takes {format_size(pulled.size)}, more than the whole --image-budget "
                    f"{format_size(budget)}",
                    hint="raise --image-budget, or run its items on a host with more room",
                )
        except Exception as exc:  # noqa: BLE001 - every failure ends in the image's items, never in a hang
            error = exc if isinstance(exc, PvisorHostError) else InfrastructureError(f"pulling {image.ref}: {exc!r}")
            with self._lock:
                image.error = error
                self.stats.failed += 0 if isinstance(error, Interrupted) else 1
                image.done.set()  # under the lock, before the wake-up: the coordinator reads it
                self._lock.notify_all()
            if not isinstance(error, Interrupted):
                logger.warning("{}: {}", image.ref, error.one_line())
            return
        with self._lock:
            image.pulled = pulled
            image.last_used = time.monotonic()
            if pulled.pulled:
                self.stats.pulled += 1
                self.stats.downloaded += pulled.downloaded
                self.stats.pull_seconds += pulled.seconds
                if image.compressed:  # learn how much an image grows when unpacked
                    seen = pulled.size / image.compressed
                    self._ratio = seen if self.stats.pulled == 1 else max(self._ratio, seen)
            self.stats.peak = max(self.stats.peak, self._present())
            image.done.set()
            self._lock.notify_all()

    def _present(self) -> int:
        """Bytes the images this batch pulled take on the engine now."""
        return sum(i.pulled.size for i in self._order if i.ours and i.pulled is not None)

    def _remove(self, image: _Image) -> None:
        """Remove an image the batch pulled and is done with (under the lock, or after the pulls stopped)."""
        assert image.pulled is not None
        try:
            removed = self._backend.remove_image(image.pulled)
        except PvisorHostError as exc:
            logger.warning("could not remove {}: {}", image.ref, exc.message)
            removed = False
        if removed:
            image.removed = True
            self.stats.removed += 1
            logger.info("removed {} ({}): its items are done", image.ref, format_size(image.pulled.size))
        else:
            image.stuck = True
