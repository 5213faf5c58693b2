"""Which images pvisor-host pulled on a batch's behalf, and for whom (Docker does not keep that).

A pulled image carries no label of ours (its labels are its publisher's), so a batch notes each image it
pulls in a small JSON file in the state directory (``pulled.json``, beside ``last-used.json``), with the
owner of the batch, and forgets it when it removes the image. What a batch could not remove (it was killed)
stays noted: ``gc`` removes the images of owners that are gone, ``images`` lists them and ``images prune``
may remove them. Only images noted here are ever removed as pulled ones.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel

from .usage import locked_state

_FILE = "pulled.json"


class PulledRecord(BaseModel):
    """One image a batch pulled and has not removed yet."""

    id: str
    ref: str
    owner: str
    """``host/pid/start-ticks`` of the batch's controller."""
    session: str
    pulled_at: datetime


def note(image_id: str, ref: str, *, owner: str, session: str) -> None:
    """A batch pulled ``ref`` (the image ``image_id``)."""
    entry = PulledRecord(id=image_id, ref=ref, owner=owner, session=session, pulled_at=datetime.now(UTC))
    with locked_state(_FILE) as data:
        data[image_id] = entry.model_dump(mode="json")


def forget(image_id: str) -> None:
    """The image was removed (or is no longer the batch's to remove)."""
    with locked_state(_FILE) as data:
        data.pop(image_id, None)


def pulled() -> list[PulledRecord]:
    """Every image noted as pulled and not removed, oldest first."""
    with locked_state(_FILE) as data:
        entries = [PulledRecord.model_validate(value) for value in data.values()]
    return sorted(entries, key=lambda entry: entry.pulled_at)
