"""What the model gateway is asked to do beyond forwarding: prices to turn tokens into money, and a cassette
to record a batch's model exchanges or serve them back. Both read the CLI's compact forms
(``input=3,output=15``; ``record DIR``) as well as their JSON ones (a manifest, a library call)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ..units import key_values

CassetteMode = Literal["record", "replay"]
DriftAction = Literal["fail", "serve"]
"""What the gateway does when a request differs from the one the cassette holds: answer with an error (the
agent stops, the item fails as ``model_drift``) or serve the recorded answer all the same."""


def _regexes(value: tuple[str, ...]) -> tuple[str, ...]:
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a regular expression ({exc})") from None
    return value


#: Regular expressions of what a cassette masks before it compares a request with its recording: an agent
#: profile's ``volatile`` and a user's ``--cassette-mask``, both checked here (one line for a bad one).
Masks = Annotated[tuple[str, ...], AfterValidator(_regexes)]

#: A run's tape, recorded into its run directory; the batch then keeps it in the cassette's directory.
MODEL_CASSETTE = "model-cassette.jsonl"

_PRICE_KEYS = {"input": "input", "output": "output", "cached": "cached", "cached_input": "cached"}


class ModelPrice(BaseModel):
    """Prices per million tokens, in the currency of the user's choosing (the figures carry no unit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cached: float | None = Field(default=None, ge=0)
    """Cached input tokens (None: priced as input)."""

    @model_validator(mode="before")
    @classmethod
    def _compact(cls, value: Any) -> Any:
        """``input=3,output=15[,cached=0.3]``, as the CLI takes it."""
        if not isinstance(value, str):
            return value
        return key_values(value, _PRICE_KEYS, "input=PRICE,output=PRICE[,cached=PRICE] per million tokens")

    def cost(self, *, input_tokens: int, output_tokens: int, cached_tokens: int) -> float:
        """What these tokens cost (``input_tokens`` includes the cached ones, as the APIs count them)."""
        cached = self.input if self.cached is None else self.cached
        fresh = max(0, input_tokens - cached_tokens)
        return (fresh * self.input + cached_tokens * cached + output_tokens * self.output) / 1e6


class Cassette(BaseModel):
    """``record``: keep each item's model exchanges in ``dir`` (one file per item, calls in order);
    ``replay``: serve them back from there, with no upstream and no key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: CassetteMode
    dir: Path

    #: On the command line: two values, the mode and the directory.
    cli_pair: ClassVar[Any] = tuple[str, Path]
    cli_metavar: ClassVar[str] = "MODE DIR"

    @model_validator(mode="before")
    @classmethod
    def _pair(cls, value: Any) -> Any:
        """``[MODE, DIR]``, as the CLI's two values (or a manifest's list) give it."""
        if isinstance(value, list | tuple):
            if len(value) != 2:
                raise ValueError("expected MODE DIR (record or replay, then a directory)")
            return {"mode": value[0], "dir": value[1]}
        return value

    @field_validator("dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    @property
    def replaying(self) -> bool:
        return self.mode == "replay"

    def tape(self, name: str) -> Path:
        """Where the tape of the run named ``name`` (a batch item's id) lives."""
        return self.dir / f"{name}.jsonl"
