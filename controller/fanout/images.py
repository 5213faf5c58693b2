"""Task images, just in time: the batch's order and look-ahead over the engine's one image cache.

A dataset pairs each trajectory with its own image, often gigabytes, hundreds of them. Pulling them all first
costs the disk of all of them and hours before the first result; pulling and removing per item repeats pulls.
:class:`ImageWindow` does the middle (the manifest already runs the items of one image together):

* it pulls ahead of the items, in their order, on a small pool of its own (``--pull-workers``), while
  sandboxes keep running: once an item asks for an image, the next ``2 × pull workers`` images too (on a
  cluster, where a pull is a registry lookup and the nodes keep their own budgets: as many as it has slots);
  an item that finished in an earlier run asks for nothing, so a rerun pulls nothing for it;
* an item waits only for its own image, and the first result comes after one pull: the first image is pulled
  alone, with the disk and the network to itself, and what each image needs once (its probe, its runtime,
  its workspace copy: ``ready``) is made in the pull's worker, not by the first item that asks;
* the budget (``--image-budget``), its layer accounting and the removals of what nobody holds belong to the
  engine's image cache (:meth:`Backend.reserve_image <pvisor_host.backend.base.Backend.reserve_image>`),
  shared by every batch on the engine: the window asks for each image's room in order, on one thread, and
  holds the image from then until the last of its items has ended;
* when the batch ends the cache removes what the batch pulled and nobody else holds (unless ``--keep-images``),
  and the window reports what it pulled, how many bytes, and the peak the cache's layers took meanwhile.

With ``--pull-workers 0`` every image is pulled first, in order, before any item starts (the naive order, kept
for comparison). A second Ctrl-C while the batch stops abandons the pulls still closing (:meth:`hurry`).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from .._log import logger
from ..backend.base import AnyBackend
from ..errors import InfrastructureError, Interrupted, PvisorHostError
from ..models.batch import ImageStats
from ..models.image import ImageHold, PulledImage, PullProgress

#: Seconds :meth:`ImageWindow.close` waits for the pulls to stop before it leaves them (their notes stay for gc).
CLOSE_PATIENCE = 10.0


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
    hold: ImageHold | None = None
    """The batch's hold on it in the engine's cache, from its reservation until its last item has ended."""
    identity: str | None = None
    """Its id as known before a pull ("" once asked and unknown)."""
    wanted: bool = False
    """An item asked for it (one that finished in an earlier run and need not run again does not)."""

    @property
    def finished(self) -> bool:
        """Every item of it has ended."""
        return self.items_left <= 0 and self.in_use == 0


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
        ready: Callable[[str], object] | None = None,
    ) -> None:
        self._backend = backend
        self._images = {ref: _Image(ref, count) for ref, count in order.items()}
        self._order = list(self._images.values())
        self._workers = workers
        self._ahead = max(2, 2 * workers, open_images or 0)
        """Images open at once: held (pulled or being pulled) whose items have not all ended."""
        self._keep = keep
        self._lookups = open_images is not None
        """The backend's nodes pull (a cluster): a pull here only resolves the image."""
        self._progress = progress
        self._ready = ready
        self._lock = threading.Condition()
        self._cancel = threading.Event()
        self._hurry = threading.Event()
        self._first_ended = False
        """An item has ended (or will not run): from then on, pulls go ahead of the items."""
        self._pool: futures.ThreadPoolExecutor | None = None
        self._pulls: list[futures.Future[None]] = []
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
        if self._workers == 0:  # every image held at once, before any item runs: no budget can apply (none waits)
            for image in self._order:
                if self._reserve(image, budget=None):
                    self._pull(image)
            return
        self._pool = futures.ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="pvisor-host-pull")
        self._coordinator = threading.Thread(target=self._coordinate, name="pvisor-host-pulls", daemon=True)
        self._coordinator.start()

    def want(self, ref: str) -> None:
        """An item will ask for the image soon (its pull may start while the item checks its inputs)."""
        image = self._images[ref]
        with self._lock:
            image.wanted = True
            self._lock.notify_all()

    def acquire(self, ref: str, cancel: threading.Event | None = None) -> PulledImage:
        """Wait until the image is present, and hold it for one item.

        Raises:
            PvisorHostError: its pull failed (the same error for each of its items).
            Interrupted: the batch, or ``cancel``, was stopped meanwhile.
        """
        image = self._images[ref]
        self.want(ref)
        while not image.done.wait(0.2):
            if self._cancel.is_set() or (cancel is not None and cancel.is_set()):
                raise Interrupted("interrupted while its image was being pulled")
        with self._lock:
            # The first item runs alone (see _may_start): the first result does not share the CPUs either.
            while not (self._first_ended or self._lookups) and any(i.in_use for i in self._order):
                if self._cancel.is_set() or (cancel is not None and cancel.is_set()):
                    raise Interrupted("interrupted while the batch's first item ran")
                self._lock.wait(0.2)
            if image.error is not None:
                self._first_ended = True
                image.items_left -= 1
                self._lock.notify_all()
                error = image.error
            else:
                assert image.pulled is not None
                image.in_use += 1
                return image.pulled
        self._let_go_if_finished(image)
        raise error

    def release(self, ref: str) -> None:
        """The item that held the image has ended, its container gone."""
        image = self._images[ref]
        with self._lock:
            self._first_ended = True
            image.in_use -= 1
            image.items_left -= 1
            self._lock.notify_all()
        self._let_go_if_finished(image)

    def skip(self, ref: str) -> None:
        """An item of the image ended without asking for it (finished in an earlier run, refused first)."""
        image = self._images[ref]
        with self._lock:
            self._first_ended = True
            image.items_left -= 1
            self._lock.notify_all()
        self._let_go_if_finished(image)

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

    def hurry(self) -> None:
        """Stop waiting for the pulls that are closing (a second Ctrl-C): :meth:`close` leaves them, and what
        they bring stays noted for ``gc``."""
        self._hurry.set()

    def close(self) -> ImageStats:
        """Stop pulling, let go of every image, and have the cache remove what the batch pulled (unless kept);
        the batch's figures."""
        self._cancel.set()
        with self._lock:
            self._lock.notify_all()
        deadline = time.monotonic() + CLOSE_PATIENCE
        if self._coordinator is not None:
            while self._coordinator.is_alive() and not self._hurry.is_set() and time.monotonic() < deadline:
                self._coordinator.join(0.2)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            while not self._pool_idle() and not self._hurry.is_set() and time.monotonic() < deadline:
                time.sleep(0.1)
        for image in self._order:
            self._let_go(image)
        try:
            self.stats.removed += len(self._backend.finish_images(keep=self._keep))
            usage = self._backend.image_usage()
        except (PvisorHostError, OSError) as exc:
            logger.warning("could not remove the images this batch pulled: {}", exc)
            usage = None
        if usage is not None:
            self.stats.peak = usage.peak
        return self.stats

    # -- the pulls ----------------------------------------------------------------------------------------

    def _coordinate(self) -> None:
        """Reserve and start each image's pull, in order, when the window has room for it. A bug here fails the
        images not yet started (their items say so) rather than leave them waiting forever."""
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
                self._lock.notify_all()

    def _start_in_order(self) -> None:
        assert self._pool is not None
        for image in self._order:
            with self._lock:
                while not self._may_start(image):
                    if self._cancel.is_set():
                        return
                    self._lock.wait(0.5)
                if self._cancel.is_set():
                    return
            if not self._reserve(image):  # room in the cache (this may wait for other items to let go)
                continue
            try:
                if self._cancel.is_set():
                    raise RuntimeError("the window closed while the image was reserved")
                self._pulls.append(self._pool.submit(self._pull, image))
            except RuntimeError:  # closed meanwhile (its pool shut): the hold goes, nothing is pulled
                self._failed(image, Interrupted(f"the batch stopped before {image.ref} was pulled"))
                self._let_go(image)
                return

    def _may_start(self, image: _Image) -> bool:
        """Whether ``image`` may be reserved now (under the lock): items have come near it (an item asked for it,
        or for one of the images just before it), and the window and the pool allow it."""
        if image.finished:
            return True  # every item of it ended first (finished earlier): it will be skipped, not pulled
        position = self._order.index(image)
        if not any(i.wanted for i in self._order[max(0, position - self._ahead + 1) : position + 1]):
            return False  # its items are not near yet (or all of them finished earlier and will not ask)
        open_now = [i for i in self._order if i.started and i.hold is not None and not i.finished and not i.error]
        pulling = [i for i in self._order if i.started and not i.done.is_set()]
        if len(open_now) >= self._ahead or len(pulling) >= self._workers:
            return False
        # The first pull goes alone, and so does the first item once its image is here: the first result comes
        # after one pull and one replay, not after pulls and replays that share the disk and the CPUs with it.
        # (On a cluster a "pull" is a registry lookup and the nodes pull: nothing is shared here to wait for.)
        if any(i.done.is_set() for i in self._order if i.started):
            return self._first_ended or self._lookups
        return not pulling

    def _reserve(self, image: _Image, *, budget: int | None | Literal["batch"] = "batch") -> bool:
        """Hold the image in the engine's cache, room made for it within ``budget`` (the batch's by default);
        False when it needs no pull (all its items ended) or cannot be had (its items get the error)."""
        with self._lock:
            image.started = True
            if image.finished:
                image.done.set()
                self._lock.notify_all()
                return False
        try:
            within = self.stats.budget if budget == "batch" else budget
            hold = self._backend.reserve_image(image.ref, budget=within, cancel=self._cancel)
        except Exception as exc:  # noqa: BLE001 - every failure ends in the image's items, never in a hang
            self._failed(image, exc)
            return False
        with self._lock:
            image.hold = hold
            self.stats.removed += len(hold.evicted)
        return True

    def _pull(self, image: _Image) -> None:
        assert image.hold is not None
        report = self._report(image.ref)
        try:
            pulled = self._backend.fill_image(image.hold, progress=report, cancel=self._cancel)
            if self._ready is not None and not self._cancel.is_set():
                self._ready_quietly(image.ref)
        except Exception as exc:  # noqa: BLE001 - every failure ends in the image's items, never in a hang
            self._failed(image, exc)
            self._let_go(image)
            return
        finally:
            report(None)
        with self._lock:
            image.pulled = pulled
            if pulled.pulled:
                self.stats.pulled += 1
                self.stats.downloaded += pulled.downloaded
                self.stats.pull_seconds += pulled.seconds
            image.done.set()
            self._lock.notify_all()
        self._let_go_if_finished(image)  # every item of it ended while it was pulled (refused, say)

    def _ready_quietly(self, ref: str) -> None:
        """What each image needs once, made in the pull's worker; a failure is the items' to report (they ask
        again, and get the same error)."""
        assert self._ready is not None
        try:
            self._ready(ref)
        except Exception as exc:  # noqa: BLE001 - see above
            logger.debug("{} was pulled, but is not ready: {!r}", ref, exc)

    def _report(self, ref: str) -> Callable[[PullProgress | None], None]:
        """The pull's progress for the batch's own (None: the pull ended, however)."""
        started = time.monotonic()
        last = PullProgress(ref=ref, done=0)

        def report(progress: PullProgress | None) -> None:
            nonlocal last
            if self._progress is None:
                return
            if progress is None:
                last = last.model_copy(update={"finished": True, "seconds": time.monotonic() - started})
            else:
                last = progress
            with contextlib.suppress(Exception):  # a display's failure never fails a pull
                self._progress(last)

        report(PullProgress(ref=ref, done=0))
        return report

    def _failed(self, image: _Image, exc: BaseException) -> None:
        error = exc if isinstance(exc, PvisorHostError) else InfrastructureError(f"pulling {image.ref}: {exc!r}")
        with self._lock:
            image.error = error
            self.stats.failed += 0 if isinstance(error, Interrupted) else 1
            image.done.set()  # under the lock, before the wake-up: the coordinator reads it
            self._lock.notify_all()
        if not isinstance(error, Interrupted):
            logger.warning("{}: {}", image.ref, error.one_line())

    def _let_go_if_finished(self, image: _Image) -> None:
        with self._lock:
            finished = image.finished and image.done.is_set()
        if finished:
            self._let_go(image)

    def _let_go(self, image: _Image) -> None:
        """The batch lets go of the image (its items have all ended, or the batch has): once."""
        with self._lock:
            hold, image.hold = image.hold, None
            self._lock.notify_all()
        if hold is not None:
            try:
                self._backend.release_image(hold)
            except (PvisorHostError, OSError) as exc:
                logger.warning("could not let go of {}: {}", image.ref, exc)

    def _pool_idle(self) -> bool:
        return all(pull.done() for pull in list(self._pulls))
