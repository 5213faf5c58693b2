"""One image cache per engine: the task images batches pull, held while they are used, kept within a byte
budget counted in layers, and removed least recently used first.

Every batch on an engine, local or a cluster node's copies, goes through the one :class:`ImageCache` of that
engine, whose state is the engine's :class:`~.ledger.Ledger` file. So two batches on one engine see each
other's images, share one budget, and never remove an image the other uses.

* :meth:`ImageCache.reserve` — an item (or a batch's look-ahead) asks for an image. Present: it is held, and
  nothing is pulled. Not present: its pull is priced from the registry's layers minus the layers the engine
  has (:mod:`.layers`), room is made within the budget, and the pull is noted in the ledger *before* it
  starts (``gc`` then knows it even after a ``kill -9``). The image is held from this moment.
* :meth:`ImageCache.fill` — the pull itself; a failed pull is forgotten, a finished one is weighed layer by
  layer, and the unpacking ratio it showed is learned for the next estimates.
* :meth:`ImageCache.release` — the item's container is gone: the image is no longer held by it.
* :meth:`ImageCache.finish` — a batch ends: what it pulled and nobody holds is removed (or kept for good with
  ``--keep-images``); what another batch holds becomes that batch's to remove.

**Making room.** The budget counts the distinct layers of the cache's images. Before a pull that would go past
it, images are removed least recently used first: only images the cache pulled, that nobody holds, that no
container uses, and that the caller lets go (a cluster node keeps its batch's images until the driver says
their items are done, or until :data:`SPARE_WAIT` after their last use: their later items may be waiting on
another node).
When removing every such image would not make room, nothing is removed and the pull waits for holders to let
go (up to :data:`WAIT_FOR_ROOM`), then goes ahead over the budget and says so; so
does a pull when nothing is held anywhere and nothing can go. An image whose pull alone downloads more than
the budget is refused, in one line.

**Locks.** The ledger's file lock is held only to read and change the ledger: no registry request, no engine
call and no wait ever runs under it. Removals are marked in the ledger first (state ``removing``), made, then
settled; so a concurrent reader never counts, or uses, an image on its way out.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from pydantic import BaseModel

from ....._log import logger
from .....errors import Interrupted, UsageError
from .....models.image import ImageHold, ImageUsage, PulledImage, PullProgress
from .....models.ownership import Ownership
from .....signals import pause
from .....units import format_size
from ..registry import ManifestError
from .layers import Layer, distinct_bytes, registry_layers
from .ledger import Budget, CachedImage, CacheState, Hold, Ledger

#: How long a pull waits for holders to let go before it goes ahead over the budget (seconds).
WAIT_FOR_ROOM = 600.0
#: How long after its last use an image of a pull's own batch that nobody holds, but that the batch has not said
#: it is done with, is spared (seconds); then it may go like any other. On a cluster the items still to run of
#: such an image may be waiting on another node for room its own images take: sparing them for ever would be a
#: wait across nodes.
SPARE_WAIT = 30.0
#: How often a waiting pull looks at the ledger again (seconds).
POLL = 0.5
#: How often a waiting pull checks the ledger against the engine (seconds).
TIDY_EVERY = 5.0
#: Unpacked bytes per downloaded byte assumed before any pull on the engine has shown its own.
RATIO = 3.0


class Priced(BaseModel):
    """What the registry says a pull of an image holds: its id, and its layers in order."""

    id: str | None
    diff_ids: list[str]
    compressed: list[int]
    """Bytes each layer downloads (compressed), in the order of ``diff_ids``."""


class CacheEngine(Protocol):
    """The engine and registry calls the cache makes (the Docker backend's, or a fake in unit tests)."""

    def present(self, ref: str) -> PulledImage | None: ...

    def has(self, image: str) -> bool: ...

    def layers(self, image_id: str) -> list[Layer]: ...

    def chain_sizes(self) -> dict[str, int]: ...

    def price(self, ref: str) -> Priced: ...

    def pull(
        self, ref: str, *, progress: Callable[[PullProgress], None] | None, cancel: threading.Event | None
    ) -> PulledImage: ...

    def remove(self, ref: str, image_id: str) -> bool: ...


class Room(StrEnum):
    """What a look at the ledger for room for a pull came to (:func:`make_room`)."""

    PULL = "pull"
    """The budget has room (or the pull may go over it): the pull is noted, the image held."""
    REMOVE = "remove"
    """Removing these images makes room: they go, then the ledger is looked at again."""
    WAIT = "wait"
    """Holders, pulls or removals under way will let go: look again in a moment."""
    ASK = "ask"
    """Room is short: the caller is to say which of its images are done (only that decides it now)."""


@dataclass(frozen=True)
class Verdict:
    """:func:`make_room`'s decision."""

    room: Room
    victims: list[str] = field(default_factory=list)
    """For :attr:`Room.REMOVE`: the ledger keys of the images to remove."""
    over_budget: bool = False
    """For :attr:`Room.PULL`: the pull goes over the budget."""


@dataclass
class _Reservation:
    """One :meth:`ImageCache.reserve`: what it carries from one look at the ledger to the next."""

    ref: str
    token: str
    deadline: float
    """When it stops waiting for room and pulls over the budget."""
    owned: bool
    evicted: list[str] = field(default_factory=list)
    """What it removed to make room."""
    finished: set[str] | None = None
    """The images of its batch that the batch is done with, when asked (None: not asked since the last look)."""
    quote: Priced | None = None
    """What the registry says its pull holds (None: not asked yet, or it could not say)."""
    quoted: float = -TIDY_EVERY
    tidied: float = -TIDY_EVERY


def _sleep(seconds: float, cancel: threading.Event | None) -> None:
    pause(seconds, cancel, "waiting for room for its image")


class ImageCache:
    """The image cache of one engine (see the module docstring). Thread-safe, and safe across processes."""

    def __init__(
        self,
        engine: CacheEngine,
        ledger: Ledger,
        ownership: Ownership,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float, threading.Event | None], None] = _sleep,
    ) -> None:
        self._engine = engine
        self._ledger = ledger
        self._me = ownership.owner
        self._session = ownership.session
        self._clock = clock
        self._sleep = sleep
        self.budget: int | None = None
        """The budget of the latest hold (what ``cluster status`` shows)."""
        self._said_shared = False
        """Whether the line saying this batch keeps to another's budget was said."""
        self._filling: set[str] = set()
        """The holds whose pull runs now in this process (a hold let go before its pull ran leaves no note)."""
        self._lock = threading.Lock()
        """Guards ``_filling`` and a hold's ``key`` between :meth:`fill` and :meth:`release` (a release reads the
        ledger under it, so that a fill cannot start between its look and its settling; no engine or registry
        call is made under it)."""

    # -- asking for an image ----------------------------------------------------------------------------------

    def reserve(
        self,
        ref: str,
        *,
        budget: int | None,
        cancel: threading.Event | None = None,
        owned: bool = True,
        done: Callable[[], Collection[str]] | None = None,
    ) -> ImageHold:
        """Hold the image ``ref``: present, at once; else with room made for its pull and the pull noted (see
        the module docstring). ``owned``: this process removes what it pulls when its batch ends
        (:meth:`finish`); else the cache keeps it within the budgets. ``done``: the images (ids) of this
        batch's session whose items have all ended; only those of its images may go to make room (default:
        every one nobody holds). It is asked before each look at the ledger, never under its lock.

        Raises:
            UsageError: the pull alone downloads more than ``budget``.
            Interrupted: ``cancel`` was set while it waited.
        """
        wanted = _Reservation(ref=ref, token=uuid.uuid4().hex, deadline=self._clock() + WAIT_FOR_ROOM, owned=owned)
        while True:
            if self._clock() - wanted.tidied >= TIDY_EVERY:
                self.tidy()
                wanted.tidied = self._clock()
            found = self._engine.present(ref)
            if found is not None:
                held = self._hold_present(ref, found, wanted.token)
                if held is not None:
                    try:
                        self._trim(budget)
                    except BaseException:
                        self.release(held)
                        raise
                    return held
            elif not self._pulled_elsewhere(ref):
                if wanted.quote is None and self._clock() - wanted.quoted >= TIDY_EVERY:
                    # the registry is asked once per reserve (again now and then while it cannot say); the
                    # engine's layers at every look
                    wanted.quote, wanted.quoted = self._quote(ref), self._clock()
                outcome = self._make_room(wanted, budget, ask=done is not None and wanted.finished is None)
                if isinstance(outcome, ImageHold):
                    return outcome
                if outcome == Room.ASK and done is not None:
                    wanted.finished = set(done())  # which of its images the batch is done with: needed now, asked now
                    continue
                if outcome == Room.REMOVE:
                    continue  # room was made: reserve it now
            self._sleep(POLL, cancel)
            wanted.finished = None  # the batch may be done with more of its images by now: asked again when needed

    def fill(
        self,
        hold: ImageHold,
        *,
        progress: Callable[[PullProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> PulledImage:
        """Pull the reserved image (nothing, when it was present). A failed pull is forgotten; a pull that is
        larger than the whole budget once unpacked is removed again and refused.

        Raises:
            ImageUnavailable, RegistryError, Interrupted: as :meth:`Backend.pull_image`.
            UsageError: the image alone takes more than the budget.
        """
        if hold.present is not None:
            return hold.present
        with self._lock:
            if hold.key is None:
                raise Interrupted(f"the hold of {hold.ref} was let go before its pull started")
            self._filling.add(hold.token)
        try:
            return self._pull_and_note(hold, progress, cancel)
        except BaseException:
            self._settle_failed_pull(hold)  # whatever failed (the pull, weighing it, the note): nothing stays pulling
            raise
        finally:
            with self._lock:
                self._filling.discard(hold.token)

    def _pull_and_note(
        self, hold: ImageHold, progress: Callable[[PullProgress], None] | None, cancel: threading.Event | None
    ) -> PulledImage:
        """:meth:`fill`'s pull, and the image noted as present, weighed layer by layer."""
        pulled = self._engine.pull(hold.ref, progress=progress, cancel=cancel)
        foreign = {x.chain for x in self._pending_layers(hold) if x.foreign}
        layers = [x.model_copy(update={"foreign": x.chain in foreign}) for x in self._engine.layers(pulled.id)]
        with self._ledger.changing() as state:
            entry = state.images.pop(hold.key or "", None)
            if entry is None:  # gc took our note meanwhile: the image is noted again, as ours
                entry = CachedImage(key=pulled.id, ref=hold.ref, state="present", owner=self._me)
                entry.holds[hold.token] = Hold(process=self._me, session=self._session)
            before = state.used()
            estimated = {layer.chain for layer in entry.layers if layer.estimated}
            grown = sum(layer.size for layer in layers if layer.chain in estimated and not _measured(state, layer))
            if entry.compressed and grown:
                state.learn_ratio(grown / entry.compressed)
            entry.key, entry.state, entry.layers, entry.worker = pulled.id, "present", layers, None
            existing = state.images.get(pulled.id)
            if existing is not None:  # the same image, pulled under another name meanwhile: one entry
                existing.holds.update(entry.holds)
            else:
                state.images[pulled.id] = entry
            added = state.used() - before
            state.note_peak(self._session)
        hold.key = pulled.id
        if pulled.pulled and hold.budget is not None and added > hold.budget:
            self.release(hold)
            self._remove([pulled.id])
            hold.key = None  # let go and removed: nothing left to settle
            raise UsageError(
                f"image {hold.ref} takes {format_size(added)}, more than the whole --image-budget "
                f"{format_size(hold.budget)}",
                hint="raise --image-budget, or run its items on a host with more room",
            )
        return pulled

    def _pending_layers(self, hold: ImageHold) -> list[Layer]:
        """The layers the hold's pull was priced with (which of them were on the engine before)."""
        entry = self._ledger.read().images.get(hold.key or "")
        return list(entry.layers) if entry is not None else []

    def release(self, hold: ImageHold) -> None:
        """The holder is done with the image (its container is gone). A hold let go before its pull ran (its
        item was refused, the batch cancelled) takes its note of the pull with it."""
        with self._lock:
            key = hold.key
            if key is None:
                return
            unpulled = hold.present is None and hold.token not in self._filling and self._pulling(key)
            if unpulled:
                hold.key = None  # a fill from now on refuses it
        if unpulled:
            self._settle_failed_pull(hold.model_copy(update={"key": key}))
            return
        with self._ledger.changing() as state:
            entry = state.images.get(key)
            if entry is not None:
                entry.holds.pop(hold.token, None)
                entry.used = self._clock()

    def share_budget(self, budget: int | None) -> None:
        """This process's batch keeps the cache within ``budget``: noted in the ledger, so that every batch on the
        engine keeps to the smallest of the live batches' budgets at each pull (:meth:`_keep_to`), whichever
        started first."""
        if budget is not None:
            with self._ledger.changing() as state:
                state.budgets[self._session] = Budget(process=self._me, bytes=budget)

    def _keep_to(self, state: CacheState, budget: int | None) -> int | None:
        """The budget to keep to now (``state``'s :meth:`~.ledger.CacheState.shared_budget`), said once in one line
        when it is another batch's."""
        kept = state.shared_budget(budget)
        if kept != budget and not self._said_shared:
            self._said_shared = True
            logger.warning(
                "another batch on this engine keeps the image cache within {}; this one keeps to it too",
                format_size(kept or 0),
            )
        return kept

    def finish(self, *, keep: bool = False) -> list[str]:
        """This process's batch has ended: remove the images it pulled that nobody holds (with ``keep``, give
        them up to the user instead); an image another batch holds becomes that batch's to remove. Returns the
        references removed."""
        with self._ledger.changing() as state:
            state.budgets.pop(self._session, None)
            going = []
            for key, entry in state.images.items():
                if entry.owner != self._me:
                    continue
                if keep:
                    entry.kept, entry.owner = True, None
                elif entry.holds:
                    entry.owner = next(iter(entry.holds.values())).process
                elif entry.state == "present" and entry.worker is None:
                    entry.state, entry.worker = "removing", self._me
                    going.append(key)
        return self._remove(going, marked=True)

    def _pulling(self, key: str) -> bool:
        """Whether the ledger still notes ``key`` as being pulled (its pull has not been weighed yet)."""
        entry = self._ledger.read().images.get(key)
        return entry is not None and entry.state == "pulling"

    # -- what it holds ------------------------------------------------------------------------------------------

    def usage(self) -> ImageUsage:
        """The cache's images, their bytes (each layer once) and the latest batch's peak."""
        state = self._ledger.read()
        counted = [i for i in state.images.values() if i.counts]
        peak = state.peaks.get(state.latest or "", 0)
        return ImageUsage(images=len(counted), bytes=state.on_disk(), peak=peak, budget=state.budget)

    def peak(self, session: str) -> int:
        """The most bytes the cache's layers took while ``session`` used it."""
        return self._ledger.read().peaks.get(session, 0)

    def entries(self) -> list[CachedImage]:
        """Every image in the ledger."""
        return list(self._ledger.read().images.values())

    def forget(self, key: str) -> None:
        """Drop ``key`` from the ledger (``gc`` or ``images prune`` removed it, or it is gone)."""
        with self._ledger.changing() as state:
            state.images.pop(key, None)

    # -- the steps ----------------------------------------------------------------------------------------------

    def _hold_present(self, ref: str, found: PulledImage, token: str) -> ImageHold | None:
        """Hold an image the engine has (None: it is being removed, or its pull is still being noted; ask
        again)."""
        with self._ledger.changing() as state:
            entry = state.images.get(found.id)
            if entry is None and any(
                i.ref == ref and i.state == "pulling" and self._ledger.alive(i.worker) for i in state.images.values()
            ):
                return None  # pulled, not yet weighed: the pull's holder notes it under its id in a moment
            if entry is None or entry.kept:
                return ImageHold(ref=ref, token=token, key=None, present=found)
            if entry.state == "removing":
                return None
            entry.holds[token] = Hold(process=self._me, session=self._session)
            entry.used, entry.session = self._clock(), self._session
        return ImageHold(ref=ref, token=token, key=found.id, present=found)

    def _trim(self, budget: int | None) -> None:
        """A batch that found its image here still keeps to its budget: what earlier batches left, that nobody
        holds, goes (least recently used first) while the cache holds more than ``budget``. No waiting: this
        holder needs no room."""
        if budget is not None:
            with self._ledger.changing() as state:
                budget = self._keep_to(state, budget) or budget
                going: list[str] = []
                for image in sorted(state.images.values(), key=lambda i: i.used):
                    staying = [i.layers for i in state.images.values() if i.counts and i.key not in going]
                    if distinct_bytes(staying) <= budget:
                        break
                    if (image.state == "present" and image.counts and not image.holds and image.worker is None
                            and not image.stuck and image.session != self._session):  # fmt: skip
                        image.state, image.worker = "removing", self._me
                        going.append(image.key)
            self._remove(going, marked=True)
        with self._ledger.changing() as state:
            state.budget = budget
            state.note_peak(self._session)

    def _pulled_elsewhere(self, ref: str) -> bool:
        """Whether another holder pulls ``ref`` now (this one then waits, and finds it present)."""
        state = self._ledger.read()
        return any(
            entry.ref == ref and entry.state == "pulling" and self._ledger.alive(entry.worker)
            for entry in state.images.values()
        )

    def _quote(self, ref: str) -> Priced | None:
        """What the registry says a pull of ``ref`` holds; None when it cannot say (see :meth:`_make_room`)."""
        try:
            return self._engine.price(ref)
        except ManifestError as exc:
            logger.debug("could not price {}: {}", ref, exc)
            return None

    def _price(self, priced: Priced | None) -> tuple[list[Layer] | None, int, set[str]]:
        """The layers the ``priced`` pull brings, each estimated or (already on the engine) measured, the bytes
        it downloads, and the layers on the engine now; None when the registry could not say."""
        if priced is None:
            return None, 0, set()
        state = self._ledger.read()
        ratio = max(state.ratios, default=RATIO)
        layers = registry_layers(priced.diff_ids, priced.compressed, ratio)
        here = self._engine.chain_sizes()
        cached = {x.chain for i in state.images.values() if i.counts for x in i.layers if not x.foreign}
        compressed = sum(size for x, size in zip(layers, priced.compressed, strict=False) if x.chain not in here)
        measured = [
            Layer(chain=x.chain, size=here[x.chain], pull=x.pull, foreign=x.chain not in cached)
            if x.chain in here else x
            for x in layers
        ]  # fmt: skip
        return measured, compressed, set(here)

    def _make_room(self, wanted: _Reservation, budget: int | None, *, ask: bool) -> ImageHold | Room:
        """Note the pull when the budget has room (or must give way): its hold; else remove what may go
        (:attr:`Room.REMOVE`: look again), or say why not (see :class:`Room`). The decision is
        :func:`make_room`'s."""
        ref = wanted.ref
        layers, compressed, here = self._price(wanted.quote)
        if budget is not None and compressed > budget:
            raise UsageError(
                f"image {ref} downloads {format_size(compressed)} (more unpacked), more than the whole "
                f"--image-budget {format_size(budget)}",
                hint="raise --image-budget, or run its items on a host with more room",
            )
        with self._ledger.changing() as state:
            budget = self._keep_to(state, budget)
            if any(i.ref == ref and i.state != "present" for i in state.images.values()):
                return Room.WAIT  # another holder pulls it (or it is on its way out): this one finds it when it is here
            if layers is None:  # unpriced: as large as the largest image here, and pulled while no other is
                if any(i.state == "pulling" for i in state.images.values()):
                    return Room.WAIT
                largest = max((sum(x.size for x in i.layers) for i in state.images.values()), default=0)
                layers = [Layer(chain=f"unpriced:{wanted.token}", size=largest, estimated=True)]
            entry = CachedImage(
                key=f"ref:{ref}:{wanted.token}", ref=ref, state="pulling", layers=layers, compressed=compressed,
                owner=self._me if wanted.owned else None, session=self._session, worker=self._me,
                holds={wanted.token: Hold(process=self._me, session=self._session)}, used=self._clock(),
            )  # fmt: skip
            used = state.used()
            state.images[entry.key] = entry
            added = state.used() - used
            state.budget = budget
            verdict = make_room(
                state, entry, here, budget, wanted.finished, ask=ask, late=self._clock() > wanted.deadline
            )
            if verdict.room == Room.PULL:
                if verdict.over_budget:
                    logger.warning(
                        "{}: over the --image-budget of {} ({} held by images in use); pulling it all the same",
                        ref, format_size(budget or 0), format_size(used),
                    )  # fmt: skip
                return ImageHold(
                    ref=ref, token=wanted.token, key=entry.key, added=added, compressed=compressed, budget=budget,
                    over_budget=verdict.over_budget, evicted=wanted.evicted,
                )  # fmt: skip
            del state.images[entry.key]
            for key in verdict.victims:
                state.images[key].state, state.images[key].worker = "removing", self._me
        if verdict.room == Room.REMOVE:  # what would not go is marked stuck: the next look sees it
            wanted.evicted += self._remove(verdict.victims, marked=True)
        return verdict.room

    def _remove(self, keys: list[str], *, marked: bool = False) -> list[str]:
        """Remove the images ``keys`` (marked ``removing`` by this process first, unless ``marked``; then only
        those nobody holds): outside the lock, then settled in the ledger, whatever happened meanwhile (an
        image not removed stays, marked stuck). Returns the references removed."""
        if not marked:
            with self._ledger.changing() as live:
                mine = []
                for key in keys:
                    entry = live.images.get(key)
                    if entry is not None and entry.state == "present" and not entry.holds and entry.worker is None:
                        entry.state, entry.worker = "removing", self._me
                        mine.append(key)
            keys = mine
        if not keys:
            return []
        state = self._ledger.read()
        outcome: dict[str, tuple[str, bool]] = {}
        try:
            for key in keys:
                entry = state.images.get(key)
                if entry is not None:
                    outcome[key] = (entry.ref, self._engine.remove(entry.ref, key))
        finally:
            with self._ledger.changing() as live:
                for key in keys:
                    entry = live.images.get(key)
                    if entry is None or entry.state != "removing" or entry.worker != self._me:
                        continue
                    ref, gone = outcome.get(key, (entry.ref, False))
                    if gone:
                        del live.images[key]
                        logger.info("removed {} from the image cache (nobody holds it)", ref)
                    else:
                        entry.state, entry.worker, entry.stuck = "present", None, True
        return [ref for ref, gone in outcome.values() if gone]

    def tidy(self) -> None:
        """Set the ledger right where the engine says otherwise: a pull or a removal whose process is gone
        (``kill -9``) becomes the image the engine has, or nothing; an image removed behind the cache's back
        (``docker rmi``, a prune) is forgotten."""
        settled: dict[str, tuple[str, list[Layer]] | None] = {}
        """Ledger key → the image it is (its id and layers), or None: not on the engine."""
        for key, entry in self._ledger.read().images.items():
            if entry.state != "present" and self._ledger.alive(entry.worker):
                continue  # a pull or a removal under way
            if key.startswith("ref:"):
                found = self._engine.present(entry.ref)
                image_id = found.id if found is not None else None
            else:
                image_id = key if self._engine.has(key) else None
            if image_id is None:
                settled[key] = None
            elif entry.state != "present" or image_id != key:
                settled[key] = (image_id, self._engine.layers(image_id))
        if not settled:
            return
        with self._ledger.changing() as state:
            for key, verdict in settled.items():
                now = state.images.get(key)
                if now is None or (now.state != "present" and self._ledger.alive(now.worker)):
                    continue  # changed meanwhile: the next tidy looks again
                del state.images[key]
                if verdict is not None and verdict[0] not in state.images:
                    now.key, now.layers = verdict
                    now.state, now.worker = "present", None
                    state.images[now.key] = now

    def _settle_failed_pull(self, hold: ImageHold) -> None:
        """A pull failed or was interrupted: forget its note, unless the image arrived all the same (then it is
        this process's to remove, as any it pulled)."""
        try:
            arrived = self._engine.present(hold.ref)
        except Exception as exc:  # noqa: BLE001 - the engine that failed the pull may not answer either
            logger.debug("could not tell whether {} arrived: {}", hold.ref, exc)
            arrived = None
        with self._ledger.changing() as state:
            entry = state.images.pop(hold.key or "", None)
            if arrived is not None and entry is not None and arrived.id not in state.images:
                entry.key, entry.state, entry.worker, entry.holds = arrived.id, "present", None, {}
                state.images[arrived.id] = entry
        hold.key = None


def make_room(
    state: CacheState,
    new: CachedImage,
    here: set[str],
    budget: int | None,
    finished: set[str] | None,
    *,
    ask: bool,
    late: bool,
) -> Verdict:
    """Whether the pull ``new`` (noted in ``state`` already) may go now, and if not what would make room: a pure
    function of the ledger's state. ``here``: the layers on the engine; ``finished``: the images its batch is done
    with (see :func:`spared`); ``ask``: the caller can say which those are; ``late``: the wait for room is over.

    Short of room, the batch is asked which of its images are done while one of them is spared; else the images
    that may go are removed, when that is enough; else the pull waits while someone will let go (a holder, a pull
    or removal under way, the batch's items still to run), and goes over the budget once nobody will, or once it
    is late."""
    if budget is None or state.used() <= budget:
        return Verdict(Room.PULL)
    if ask and any(spared(i, new, set()) and not i.holds for i in state.images.values() if i.key != new.key):
        return Verdict(Room.ASK)  # the answer decides something only while one of its images is spared
    chosen = victims(state, new, here, budget, finished)
    if chosen is not None:
        return Verdict(Room.REMOVE, victims=chosen)
    busy = any(
        i.holds or i.state != "present" or (spared(i, new, finished) and i.counts)
        for k, i in state.images.items()
        if k != new.key
    )
    return Verdict(Room.WAIT) if busy and not late else Verdict(Room.PULL, over_budget=True)


def spared(image: CachedImage, new: CachedImage, finished: set[str] | None) -> bool:
    """Whether ``image`` stays for its batch's items still to run, while ``new`` is pulled: it is of ``new``'s
    batch, not among the ``finished`` that batch named (None: it names none, so nothing is spared), and used within
    the last :data:`SPARE_WAIT`."""
    return (
        finished is not None
        and image.session == new.session
        and image.key not in finished
        and new.used - image.used < SPARE_WAIT
    )


def victims(
    state: CacheState, new: CachedImage, here: set[str], budget: int, finished: set[str] | None
) -> list[str] | None:
    """The images to remove so that the cache's layers, the new image's included, fit in ``budget``; None when
    removing every image that may go would not be enough. Least recently used first, but images that share
    layers with the new one last: removing them would remove layers its pull then downloads again (each such
    layer is counted at its pull's estimate once its last holder would go)."""
    others = [i for i in state.images.values() if i.key != new.key and i.counts]
    cached = {x.chain for i in others for x in i.layers}
    foreign = here - cached  # layers on the engine that no image of the cache holds: they stay

    def pulled_again(image: CachedImage) -> int:
        """What the new image would download again if ``image`` alone went."""
        kept = {x.chain for i in others if i.key != image.key for x in i.layers} | foreign
        mine = {x.chain for x in image.layers} - kept
        return sum(x.pull for x in new.layers if x.chain in mine)

    candidates = sorted(
        (
            i for i in others
            if i.state == "present" and not i.holds and not i.stuck and i.worker is None
            and not spared(i, new, finished)
        ),
        key=lambda i: (pulled_again(i), i.used),
    )  # fmt: skip
    chosen: list[str] = []
    for image in candidates:
        if _used_without(others, new, set(chosen), foreign) <= budget:
            break
        chosen.append(image.key)
    return chosen if chosen and _used_without(others, new, set(chosen), foreign) <= budget else None


def _used_without(others: list[CachedImage], new: CachedImage, gone: set[str], foreign: set[str]) -> int:
    """The cache's bytes once the images ``gone`` are removed and ``new`` is pulled: a layer of ``new`` that
    only those images held is pulled again, at its estimate."""
    staying = [i for i in others if i.key not in gone]
    kept = {x.chain for i in staying for x in i.layers} | foreign
    pulled = [x if x.chain in kept or not x.pull else x.model_copy(update={"size": x.pull, "estimated": True})
              for x in new.layers]  # fmt: skip
    return distinct_bytes([*(i.layers for i in staying), pulled])


def _measured(state: CacheState, layer: Layer) -> bool:
    """Whether another image of the cache has ``layer`` measured already (so this pull did not bring it)."""
    return any(x.chain == layer.chain and not x.estimated for i in state.images.values() for x in i.layers)
