"""The image cache's ledger: one small JSON file per engine, in the state directory, read and changed under a
file lock held for the read-modify-write only.

It lives beside ``last-used.json`` (``$PVISOR_HOST_STATE_DIR``, else ``~/.local/state/pvisor-host``), named
after the engine's id, so every process using that engine (local batches, a node's Ray workers) shares it, and
it survives ``node join`` (which empties a node's scratch folder) and a reboot. Nothing in it is a secret.

Processes are named ``host/pid/start-ticks`` (:class:`~pvisor_host.models.ownership.Ownership`): a hold or a
pull of a process that is gone (``kill -9``) is dropped when the ledger is next read, so nothing stays
protected, or reserved, by the dead.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, field_validator

from .....files.atomic import write_atomic
from .....models.ownership import Ownership
from .layers import Layer, distinct_bytes

#: The latest pulls' unpacking ratios kept (the estimate takes the largest of them).
RATIOS_KEPT = 16
#: The batch sessions whose peaks are kept.
PEAKS_KEPT = 16


class Hold(BaseModel):
    """One holder of an image: an item (or a batch's look-ahead) that will use it, until its container is gone."""

    process: str
    session: str | None = None


class Budget(BaseModel):
    """The image budget a running batch keeps the cache within (keyed by its session in the ledger)."""

    process: str
    bytes: int


class CachedImage(BaseModel):
    """One image the cache pulled (or is pulling, or removing)."""

    key: str
    """The image id; ``ref:<reference>`` until a pull whose id the registry could not tell has finished."""
    ref: str
    """The reference it was pulled by (the one it is removed by)."""
    state: Literal["pulling", "present", "removing"]
    layers: list[Layer] = []
    """Its layers, base first (estimated from the registry while it is pulled)."""
    compressed: int = 0
    """Bytes its pull downloads (the layers it did not find), as the registry lists them."""
    owner: str | None = None
    """The process that removes it when its batch ends; None: the cache keeps it within the budgets."""
    kept: bool = False
    """Given up to the user (``--keep-images``): it stays, and counts no more."""
    session: str | None = None
    """The latest batch session that asked for it."""
    worker: str | None = None
    """The process pulling or removing it now."""
    holds: dict[str, Hold] = {}
    """Token → holder."""
    used: float = 0.0
    """When it was last asked for or let go (seconds since the epoch)."""
    stuck: bool = False
    """The engine would not remove it (a container of someone else's uses it)."""

    @property
    def counts(self) -> bool:
        """Whether its layers count against the budget."""
        return not self.kept


class CacheState(BaseModel):
    """The whole ledger."""

    images: dict[str, CachedImage] = {}
    ratios: list[float] = []
    """Unpacked bytes per downloaded byte of the latest pulls."""
    peaks: dict[str, int] = {}
    """Session → the most bytes the cache's layers took while that session used it."""
    latest: str | None = None
    """The session that used the cache last."""
    budget: int | None = None
    """The budget the latest pull kept to."""
    budgets: dict[str, Budget] = {}
    """A running batch's session → the image budget it keeps to: every batch on the engine keeps to the smallest, so
    the cache stays within one budget however many batches share it."""

    @field_validator("budgets", mode="before")
    @classmethod
    def _budgets(cls, value: Any) -> Any:  # an older ledger's (process → bytes) counts for nothing
        return {k: v for k, v in value.items() if isinstance(v, dict)} if isinstance(value, dict) else value

    def shared_budget(self, budget: int | None) -> int | None:
        """The budget a batch keeping to ``budget`` keeps to: the smallest of it and the live batches' (one cache,
        within one budget, whichever batch started first)."""
        return min((b for b in (budget, *(b.bytes for b in self.budgets.values())) if b is not None), default=None)

    def used(self) -> int:
        """Bytes the cache's images take (or will, once their pulls end), each layer once."""
        return distinct_bytes(i.layers for i in self.images.values() if i.counts)

    def on_disk(self) -> int:
        """Bytes the cache's pulled images take now, each layer once (no estimate)."""
        return distinct_bytes(i.layers for i in self.images.values() if i.counts and i.state != "pulling")

    def staying(self) -> int:
        """Bytes the cache's pulled images take once the removals under way end (a removal the engine refuses
        leaves its image present: counted from then on)."""
        return distinct_bytes(i.layers for i in self.images.values() if i.counts and i.state == "present")

    def note_peak(self, session: str | None) -> None:
        """The cache's bytes on disk now, but for images on their way out, count toward the peak of ``session``
        and of every session holding an image. An image being removed is not counted: its removal was decided
        before this moment (a batch trimming what earlier batches left does not peak at what it trims)."""
        used = self.staying()
        sessions = {h.session for i in self.images.values() for h in i.holds.values()} | {session}
        for name in sorted(n for n in sessions if n is not None):
            self.peaks[name] = max(self.peaks.pop(name, 0), used)  # re-inserted: the latest stay
        if session is not None:
            self.latest = session
        while len(self.peaks) > PEAKS_KEPT:
            self.peaks.pop(next(iter(self.peaks)))

    def learn_ratio(self, ratio: float) -> None:
        self.ratios = [*self.ratios, ratio][-RATIOS_KEPT:]


class Ledger:
    """The ledger file of one engine (see the module docstring)."""

    def __init__(self, path: Path, ownership: Ownership) -> None:
        self.path = path
        self._ownership = ownership

    @contextlib.contextmanager
    def changing(self) -> Iterator[CacheState]:
        """The state under the lock, written back (atomically) when the block ends without an exception."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.with_name(f".{self.path.name}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self._read()
            before = state.model_dump_json()
            yield state
            after = state.model_dump_json()
            if after != before:
                write_atomic(self.path, after.encode())

    def read(self) -> CacheState:
        """The state now (under the lock for the read only)."""
        with self.changing() as state:
            return state.model_copy(deep=True)

    def alive(self, process: str | None) -> bool:
        """Whether ``process`` runs (one on another host is taken to)."""
        return process is not None and self._ownership.owner_alive(process) is not False

    def _read(self) -> CacheState:
        try:
            state = CacheState.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return CacheState()
        except (OSError, ValueError, ValidationError):
            # An unreadable ledger loses what it knew, not the batch: `gc` judges by the engine's own lists.
            return CacheState()
        for image in state.images.values():  # the dead hold nothing
            image.holds = {token: hold for token, hold in image.holds.items() if self.alive(hold.process)}
        state.budgets = {session: b for session, b in state.budgets.items() if self.alive(b.process)}
        return state
