"""What a batch is asked to do, described once: the ``batch`` command's options and the Python API's keyword
arguments are these models' fields (each field's docstring is its ``--help``), and the reference docs are
generated from them.

* :class:`~.manifest.BatchInput` (its own module): where the items come from, and which of them;
* :class:`BatchOptions`: how the batch runs (``--out``, ``--workers``, the image cache, ...);
* :class:`~pvisor_host.backend.Placement`: where its sandboxes run and its images come from (a cluster, mirrors);
* :class:`Verdict`: what makes the command exit 1 (the CLI's; a library caller reads the results);
* the replay options (every item's defaults) are :class:`~pvisor_host.models.spec.ReplaySpec`'s, and the build's
  :class:`~pvisor_host.models.image.BuildOptions`'.

:func:`split_options` sorts a flat mapping of options (the CLI's, the API's keywords) into those models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .._log import logger
from ..backend import Placement
from ..backend.base import AnyBackend
from ..errors import PvisorHostError, UsageError
from ..models.image import BuildOptions
from ..models.spec import Bytes, Seconds, describe_validation_error
from ..units import host_slots
from .manifest import BatchInput
from .summary import FailOn, allowed_failures, parse_fail_on


def _metavar(name: str) -> dict[str, Any]:
    return {"metavar": name}


class BatchOptions(BaseModel):
    """How a batch runs."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    out: Path = Path("pvisor-batch")
    """Batch directory; rerunning into it resumes."""
    workers: Annotated[int | None, Field(ge=1)] = None
    """Containers at a time (default: two per CPU, as many as memory holds, less the sandboxes other batches run
    on the engine; a cluster's engine slots)."""
    deadline: Seconds | None = None
    """Limit for the whole batch, e.g. 6h: nothing starts after it, running items are cut at it."""
    rerun_failed: bool = False
    """Also rerun items that finished with a failure (by default only missing, incomplete or changed ones rerun)."""
    retry_oom: bool = False
    """Retry attempts killed for memory (infrastructure errors and retryable results always are)."""
    pull_workers: Annotated[int, Field(ge=0)] = 2
    """Task images (--image) pulled at once, ahead of their items, while sandboxes run (0: every image first,
    before any item; no --image-budget then)."""
    image_budget: Annotated[Bytes | None, Field(json_schema_extra=_metavar("SIZE"))] = None
    """Most disk the engine's image cache may take, e.g. 200g: the distinct layers of the task images pulled for
    batches, shared by every batch on the engine; images nobody uses are removed first, least recently used
    (default: half of the engine storage's free space plus what the cache holds)."""
    keep_images: bool = False
    """Keep the task images the batch pulled when it ends (it removes them by default)."""
    build: BuildOptions = Field(default=BuildOptions(), json_schema_extra={"cli": False})
    """How agent images that must be built are built (the build options, ``--base`` and ``--ca-bundle``)."""

    @field_validator("out")
    @classmethod
    def _absolute(cls, out: Path) -> Path:
        return out.absolute()  # the batch's own labels and locks name it, whatever directory the command ran in

    @model_validator(mode="after")
    def _together(self) -> BatchOptions:
        if self.pull_workers == 0 and self.image_budget is not None:
            raise UsageError(
                "--image-budget cannot apply with --pull-workers 0: every image is pulled first, before any item",
                hint="drop --pull-workers 0 to keep the images within the budget, or drop the budget",
            )
        return self

    def pool_size(self, memory: int) -> int:
        """Engine connections the batch's threads need: one per sandbox at a time, and a few for the rest."""
        return (self.workers or default_workers(memory)) + 8


class Verdict(BaseModel):
    """What makes ``batch`` exit 1 (a batch that did not answer, its deadline, a full disk, the engine, exits 4 or
    6 whatever these say)."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    allow_failures: str | None = None
    """Exit 0 with up to N (or P%) items not ok."""
    baseline: Path | None = None
    """An earlier batch's --out: compare against it at the end (compare.json, compare.xml in --out); --fail-on is
    then regressions unless given."""
    fail_on: Annotated[str | None, Field(json_schema_extra=_metavar("LIST"))] = None
    """What makes the batch exit 1, a comma list of: regressions, an item that regressed against --baseline (the
    default with it); failures, more items not ok than --allow-failures; verification, an item whose verifier did
    not pass (failures,verification is the default without --baseline); or never. A batch that did not answer
    (its deadline, a full disk, the engine) exits 4 or 6 all the same."""

    @model_validator(mode="after")
    def _parsed(self) -> Verdict:
        allowed_failures(self.allow_failures)
        parse_fail_on(self.fail_on, baseline=self.baseline is not None)
        return self

    def allowed(self, total: int) -> int:
        """How many items of ``total`` may be not ok."""
        return allowed_failures(self.allow_failures)(total)

    @property
    def failing(self) -> frozenset[FailOn]:
        """What makes the batch exit 1."""
        return parse_fail_on(self.fail_on, baseline=self.baseline is not None)


#: The models a batch's options are fields of, in the order they are checked (and listed in ``--help``).
MODELS: tuple[type[BaseModel], ...] = (BatchInput, BatchOptions, Placement, Verdict)


@dataclass(frozen=True)
class BatchRequest:
    """Everything a batch is asked, each part checked by its model (see the module docstring)."""

    input: BatchInput
    options: BatchOptions
    placement: Placement
    verdict: Verdict

    @classmethod
    def from_options(cls, given: Mapping[str, Any], **input_fields: Any) -> BatchRequest:
        """Sort ``given`` (the command's options, the API's keywords; those not given absent) into the models:
        a field of one of :data:`MODELS` is that model's, one of :class:`BuildOptions` the build's, and every
        other one a replay option every item starts from (:class:`~pvisor_host.models.spec.ReplaySpec` checks
        them), over the input's ``defaults`` when given. ``input_fields`` go to the input as they are (the API's
        ``entries`` and ``defaults``).

        Raises:
            UsageError: the first option that is wrong, in one line naming its flag.
        """
        owners: tuple[type[BaseModel], ...] = (*MODELS, BuildOptions)
        parts: dict[type[BaseModel], dict[str, Any]] = {model: {} for model in owners}
        defaults: dict[str, Any] = dict(input_fields.pop("defaults", None) or {})
        for name, value in given.items():
            owner = next((model for model in parts if name in model.model_fields), None)
            (parts[owner] if owner is not None else defaults)[name] = value
        verdict = checked_model(Verdict, parts[Verdict])
        placement = checked_model(Placement, parts[Placement])
        batch_input = BatchInput.parse(**parts[BatchInput], **input_fields, defaults=defaults)
        build = parts[BatchOptions].pop("build", None) or checked_model(BuildOptions, parts[BuildOptions])
        options = checked_model(BatchOptions, {**parts[BatchOptions], "build": build})
        return cls(input=batch_input, options=options, placement=placement, verdict=verdict)

    @property
    def memory(self) -> int:
        """The memory every item gets unless its row says otherwise (what the default workers are sized by)."""
        return int(self.input.spec_default("memory"))

    def open(self, *, plan: bool = False) -> AnyBackend:
        """The backend the batch runs on (close it when done); for ``plan``, the local engine only."""
        where = self.placement.model_copy(update={"cluster": None, "registry": None}) if plan else self.placement
        return where.open(pool_size=self.options.pool_size(self.memory), out=self.options.out)


def checked_model(model: type[Any], fields: Mapping[str, Any]) -> Any:
    """``model`` validated from ``fields``, a problem raised as :class:`UsageError` in one line naming the flag."""
    try:
        return model(**fields)
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc)) from None


def default_workers(memory: int) -> int:
    """Sandboxes at a time: two per CPU, as many as the host's memory holds at ``memory`` each, at most 32."""
    return host_slots(2, memory, most=32)


def fit_workers(options: BatchOptions, backend: AnyBackend, memory: int) -> BatchOptions:
    """The sandboxes a batch runs at a time, decided here for the CLI and the library alike: ``--workers`` when
    given; otherwise a cluster's engine slots, or on one engine :func:`default_workers` at ``memory`` each less
    the sandboxes other batches run there now, said in one line (a second batch beside a first fits in what the
    host has left)."""
    if options.workers is not None:
        return options
    capacity = backend.capacity()
    if capacity is not None:
        return options.model_copy(update={"workers": capacity})
    alone = default_workers(memory)
    try:
        running = backend.running_sandboxes()
    except PvisorHostError as exc:  # the batch's own engine calls will say what is wrong; this one only sizes it
        logger.debug("could not count the engine's running sandboxes: {}", exc)
        running = 0
    if not running:
        return options.model_copy(update={"workers": alone})
    workers = max(1, alone - running)
    logger.warning(
        "{} sandboxes of another batch run on this engine: this one runs at most {} at a time (--workers sets it)",
        running,
        workers,
    )
    return options.model_copy(update={"workers": workers})
