"""Batch input: a dataset as it is (a manifest or a glob of trajectories), streamed into validated items.

A row holds the fields of ``pvisor-host replay``'s options (underscored: ``after_step``, ``max_steps``, ...)
plus an optional ``id``; options given on the ``batch`` command line are defaults every row may override. The
rows come from a JSONL, CSV or Parquet manifest (:mod:`.tables`, with ``--map FIELD=COLUMN`` for columns named
otherwise), or from ``--trajectories GLOB``, one row per file. Relative ``trajectory`` and ``workspace_dir``
paths are relative to the manifest's directory.

Each row becomes one item per boundary it asks for (:mod:`.steps`: a number, ``all``, ``last``, a list or a
range). Its ``agent`` may be left out: it is detected from the trajectory file. Its ``image`` and ``id`` may be
templates over its columns and its trajectory's path (:mod:`.templates`, ``--image TEMPLATE``, ``--id
TEMPLATE``). Items are validated one at a time as they are run, so a 100,000-row manifest never sits in
memory as 100,000 specs (only its raw rows do, while the items of one image are brought together).
"""

from __future__ import annotations

import collections
import concurrent.futures as futures
import fnmatch
import functools
import glob
import hashlib
import heapq
import os
import re
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    model_validator,
)

from ..errors import UsageError
from ..models.batch import ROW_COLUMNS, ItemKeys, fork_row_id
from ..models.profiles import get_profile
from ..models.spec import MODEL_OPTIONS, ModelUpstream, ReplaySpec, describe_validation_error
from ..preflight.checks import check_options, detect_agent
from ..preflight.prepare import image_request
from ..preflight.survey import boundaries
from ..preflight.trajectory import check_stat, read_trajectory
from .steps import StepSelection, parse_steps
from .tables import ColumnMap, Row, read_rows, strict_columns, text_cells
from .templates import Template, is_template, parse_template, path_fields

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,119}$")
#: Most ``--repeat`` (a flakiness check wants a few runs, not a load test).
MAX_REPEAT = 100
#: What a batch item collects of its workspace unless it says: the changes (a dataset's checkouts are large).
BATCH_COLLECT = "changes"
#: The dataset's columns a row keeps when ``--keep`` does not say (SWE-bench's and its kind's instance id).
DEFAULT_KEEP = ("instance_id",)
#: Where an expanded row carries what its items' rows keep of it (the trajectory as given, the kept columns).
_GIVEN = "__row__"
#: Replay options a line may not set: the batch names each item's run directory and run ids.
_BATCH_OWNED = {"out": "<batch out>/<id>/", "run_id": "<id>-<random>"}


def manifest_line_model() -> type[BaseModel]:
    """A manifest line as a model (for its JSON Schema; lines are validated as :class:`ReplaySpec`): an
    optional ``id``, every replay option but those the batch owns, with the model upstream as its flat
    ``model_*`` keys, as on the command line."""
    fields: dict[str, Any] = {
        "id": (
            str | None,
            Field(
                default=None,
                pattern=_ID.pattern,
                description="Unique in the batch; names the item's directory (default: from the trajectory's name).",
            ),
        )
    }
    for name, info in ReplaySpec.model_fields.items():
        if name == "after_step":
            fields[name] = (
                int | str | list[int],
                Field(
                    description="The boundaries: a number, 'all', 'last', a list, or a range ('3-7', '1,4-6'); "
                    "one item per boundary (default: the batch's --after-step).",
                    default=None,
                ),
            )
        elif name not in _BATCH_OWNED and name != "upstream":
            fields[name] = (info.annotation, info)
    for flat, field in MODEL_OPTIONS.items():
        info = ModelUpstream.model_fields[field]
        if info.is_required():  # required of an upstream, optional on a line (an item without a model)
            fields[flat] = (str | None, Field(default=None, description=info.description))
        else:
            fields[flat] = (info.annotation, info)
    fields["no_model_bodies"] = (bool, Field(default=False, description="Keep no model request or response bodies."))
    model = create_model("ManifestLine", __config__=ConfigDict(extra="forbid"), **fields)
    model.__doc__ = "One line of a batch manifest (JSONL): one replay."
    return model


class BatchItem(BaseModel):
    """One replay of a batch."""

    model_config = ConfigDict(frozen=True)

    id: str
    """Unique in the batch; names its run directory ``<batch out>/<id>/``."""
    line: int
    """1-based manifest line (or position in the shorthand's expansion)."""
    spec: ReplaySpec
    repeat_of: str | None = None
    """With ``--repeat K``: the id its K repeats share; its own is ``<that>.r<n>``."""
    trajectory: str | None = None
    """The trajectory as the dataset gave it (None: as the spec has it)."""
    columns: dict[str, str | None] = {}
    """The dataset's own columns its row keeps (``--keep``)."""

    @property
    def keys(self) -> ItemKeys:
        """What its row says of it before anything ran (:class:`~pvisor_host.models.batch.ItemKeys`)."""
        return ItemKeys(
            id=self.id, line=self.line, after_step=self.spec.after_step, repeat_of=self.repeat_of,
            trajectory=self.trajectory if self.trajectory is not None else str(self.spec.trajectory),
            agent=self.spec.agent, image=self.spec.image, columns=self.columns,
        )  # fmt: skip

    @property
    def rows(self) -> list[ItemKeys]:
        """The keys of its rows: its own, or with ``fork: K`` one per fork (``<id>.f<k>``), the prefix being the
        forks' shared start, not a row."""
        keys = self.keys
        if self.spec.fork is None:
            return [keys]
        return [keys.model_copy(update={"id": fork_row_id(self.id, k), "fork_of": self.id, "fork_index": k})
                for k in range(1, self.spec.fork + 1)]  # fmt: skip

    def repeats(self, times: int) -> list[BatchItem]:
        """This item ``times`` times, under ids of their own (itself, once, when ``times`` is 1)."""
        if times == 1:
            return [self]
        return [self.model_copy(update={"id": f"{self.id}.r{n}", "repeat_of": self.id}) for n in range(1, times + 1)]


class ManifestProblem(BaseModel):
    """One bad manifest line."""

    line: int
    message: str


class ManifestCheck(BaseModel):
    """What reading a batch's whole input once found."""

    items: int
    """Rows the batch will have: its items (those of the slice, with their repeats), each fork one of its own."""
    problems: list[ManifestProblem]
    image_specs: list[ReplaySpec]
    """One item's spec per distinct image: what the batch's images are made from."""
    image_counts: dict[str, int] = {}
    """Items per image named with ``image`` (task images, in the order the batch runs them)."""
    refused: dict[str, int] = {}
    """Items each reason of the options' own checks refuses (:func:`~pvisor_host.preflight.checks.check_options`)."""
    total: int = 0
    """Items in the whole input, before a slice (``--limit``, ``--sample``, ``--select``)."""
    slice: str | None = None
    """The slice, in words (``a sample of 12 (seed 0)``), when one was asked for."""

    def refuse_if_none_can_run(self) -> None:
        """One line, exit 2, when one reason of the options refuses every item (a mode with no model, a cassette
        that is not there, an agent that cannot be built here): no item could run.

        Raises:
            UsageError: that reason.
        """
        if len(self.refused) == 1 and sum(self.refused.values()) == self.items:
            raise UsageError(f"every item: {next(iter(self.refused))}")


def default_item_id(spec: ReplaySpec) -> str:
    """``<trajectory stem>-after<N>``, made safe for a directory name."""
    return f"{_safe_stem(spec.trajectory)}-after{spec.after_step}"


def _safe_stem(path: Path | str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).stem).strip("._") or "trajectory"


def _resolve(fields: dict[str, Any], base: Path) -> dict[str, Any]:
    for key in ("trajectory", "workspace_dir"):
        value = fields.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            fields[key] = str(base / value)
    return fields


def _item(number: int, fields: dict[str, Any], defaults: dict[str, Any], seen: dict[str, int]) -> BatchItem:
    fields = dict(fields)
    given = fields.pop(_GIVEN, {})
    raw_id = fields.pop("id", None)
    for name, value in _BATCH_OWNED.items():
        if name in fields:
            raise UsageError(f"{name}: a batch sets it for every item ({value}); drop it from the line")
    merged = {**defaults, **fields}
    try:
        spec = ReplaySpec(**merged)
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc, flags=False)) from None
    if spec.collect is None and not spec.no_workspace:
        spec = spec.model_copy(update={"collect": BATCH_COLLECT})
    _host_checks(spec)
    item_id = str(raw_id) if raw_id is not None else default_item_id(spec)
    if not _ID.match(item_id):
        raise UsageError(f"id {item_id!r} may contain only letters, digits, '.', '-' and '_' (at most 120)")
    if item_id in seen:
        if raw_id is not None:
            raise UsageError(f"id {item_id!r} is already used on line {seen[item_id]}")
        item_id = f"{item_id}-{hashlib.sha256(f'{number}-{spec.after_step}'.encode()).hexdigest()[:6]}"
    seen[item_id] = number
    return BatchItem(
        id=item_id, line=number, spec=spec, trajectory=given.get("trajectory"), columns=given.get("columns", {})
    )


def _host_checks(spec: ReplaySpec) -> None:
    """What a line can be refused for without reading its trajectory: a file that cannot be one, an unknown
    agent, a workspace directory that is not there."""
    check_stat(spec.trajectory)
    if spec.agent is not None:
        get_profile(spec.agent)
    if spec.workspace_dir is not None and not spec.workspace_dir.is_dir():
        raise UsageError(f"workspace_dir {spec.workspace_dir} is not a directory")


#: A numbered manifest entry: one item's fields, or what is wrong with its row.
Entry = tuple[int, dict[str, Any] | str]
#: Replay options that are per item, never batch-wide defaults (``after_step`` is a default for rows without one).
_PER_ITEM = {"trajectory", "out", "run_id", "session_id"}
#: Fields a row may set: ``id``, the replay options a batch leaves to its items, the flat ``--model-*`` options.
ROW_FIELDS = frozenset(
    {"id", "no_model_bodies", *MODEL_OPTIONS, *(name for name in ReplaySpec.model_fields if name != "upstream")}
)
#: The row fields that are lists (a table's cell holds them comma-separated).
_LIST_FIELDS = {name for name, info in ReplaySpec.model_fields.items() if typing.get_origin(info.annotation) is list}


class Rows:
    """Rows into items' fields: ``--map``, relative paths, the agent detected, templates rendered, boundaries
    expanded (see the module docstring). One per batch input; what it learns of a trajectory file (its agent,
    its boundaries) it learns once."""

    def __init__(
        self,
        *,
        defaults: dict[str, Any],
        base: Path,
        strict: bool,
        id_template: Template | None = None,
        columns: ColumnMap | None = None,
        tables: bool = False,
        keep: list[str] | None = None,
    ) -> None:
        self.base = base
        self.keep = keep
        """The dataset's columns each row's items keep (None: ``instance_id`` where the dataset has one)."""
        self.strict = strict
        self.tables = tables
        self.columns = columns or ColumnMap()
        self.id_template = id_template
        default_image = defaults.get("image")
        self.image_template = parse_template(default_image, flag="--image") if is_template(default_image) else None
        self.default_steps = (
            parse_steps(defaults["after_step"], name="--after-step") if "after_step" in defaults else None
        )
        self.item_defaults = {
            k: v for k, v in defaults.items() if k != "after_step" and not (k == "image" and self.image_template)
        }
        used = self.columns.columns | (id_template.fields if id_template else set())
        used |= set(keep if keep is not None else DEFAULT_KEEP)
        self.template_columns = used | (self.image_template.fields if self.image_template else set())

    def expand(self, number: int, row: dict[str, Any]) -> Iterator[Entry]:
        """The items of one row (or one problem, naming what is wrong with it)."""
        try:
            yield from self._expand(number, row)
        except UsageError as exc:
            yield number, exc.one_line()
        except OSError as exc:  # the trajectory went while it was read
            yield number, f"cannot read {exc.filename or 'the trajectory'}: {exc.strerror}"

    def _expanded(self, number: int, row: dict[str, Any]) -> list[Entry]:
        return list(self.expand(number, row))

    def expand_all(self, rows: Iterable[Row]) -> Iterator[Entry]:
        """The items of every row, in order; rows are expanded a few at a time on a small pool, since counting
        a trajectory's boundaries runs the host's pvisor (once per file: :mod:`..preflight.survey`)."""
        pool = futures.ThreadPoolExecutor(max_workers=_EXPANDERS, thread_name_prefix="pvh-rows")
        pending: collections.deque[futures.Future[list[Entry]]] = collections.deque()
        try:
            for number, row in rows:
                if isinstance(row, str):
                    pending.append(_done([(number, row)]))
                else:
                    pending.append(pool.submit(self._expanded, number, row))
                while len(pending) > _WINDOW or (pending and pending[0].done()):
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:  # Ctrl-C, an error, or a reader that stopped early: what is queued is not run
            for future in pending:
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def _expand(self, number: int, row: dict[str, Any]) -> Iterator[Entry]:
        kept = self._kept(row)
        given = row.get(self.columns.fields.get("trajectory", "trajectory"))
        row = self.columns.apply(dict(row))
        if self.tables:
            row = text_cells(row, _LIST_FIELDS)
        row = _resolve(row, self.base)
        fields = {k: v for k, v in row.items() if k in ROW_FIELDS}
        extra = [k for k in row if k not in ROW_FIELDS and k not in self.template_columns]
        image_template = self._image_template(fields)
        if image_template is not None:
            extra = [k for k in extra if k not in image_template.fields]
        if self.strict and extra:
            raise UsageError(f"{extra[0]}: is not a known option")
        trajectory = fields.get("trajectory")
        if not isinstance(trajectory, str | Path) or not str(trajectory):
            raise UsageError("trajectory: is required")
        check_stat(Path(trajectory))
        if "after_step" in fields:
            steps = parse_steps(fields.pop("after_step"))
        elif self.default_steps is not None:
            steps = self.default_steps
        else:
            raise UsageError("after_step: is required")
        agent = fields.get("agent", self.item_defaults.get("agent"))
        image = fields.get("image", self.item_defaults.get("image") or self.image_template)
        inject = _flag(fields.get("inject", self.item_defaults.get("inject")))
        if agent is None:  # an image's label may name it, unless the agent is to be injected into the image
            agent = self._detect(Path(trajectory), needed=image is None or inject)
            if agent is not None:
                fields["agent"] = agent
        values = {**{k: v for k, v in row.items() if isinstance(v, str | int | float)}, **path_fields(trajectory)}
        explicit_id = fields.pop("id", None)
        values["id"] = explicit_id if explicit_id is not None else Path(trajectory).stem
        if explicit_id is None and self.id_template is not None:
            explicit_id = self.id_template.render(values)
        if image_template is not None:
            fields["image"] = image_template.render(values)
        fields[_GIVEN] = {"trajectory": str(given) if given is not None else None, "columns": kept}
        for step in self._steps(steps, agent, Path(trajectory)):
            item = {**fields, "after_step": step}
            if explicit_id is not None:
                item["id"] = explicit_id if steps.plain else f"{explicit_id}-after{step}"
            yield number, item

    def _kept(self, row: dict[str, Any]) -> dict[str, str | None]:
        """The dataset's own columns the row's items keep (``--keep``; by default ``instance_id``), as text."""
        names = self.keep if self.keep is not None else [name for name in DEFAULT_KEEP if name in row]
        return {name: None if row.get(name) is None else str(row[name]) for name in names}

    def _image_template(self, fields: dict[str, Any]) -> Template | None:
        """The row's own image template, else the default's (None: the image is a name as it is)."""
        image = fields.get("image")
        if image is None:
            return self.image_template
        return parse_template(image, flag="image") if is_template(image) else None

    def _steps(self, steps: StepSelection, agent: str | None, trajectory: Path) -> list[int]:
        if not steps.needs_count:
            return steps.expand(None)
        if agent is None:
            raise UsageError(
                f"after_step {'all' if steps.every else 'last'}: the agent of {trajectory} is needed to count its "
                "boundaries",
                hint="pass agent",
            )
        return steps.expand(boundaries(agent, read_trajectory(trajectory)))

    def _detect(self, trajectory: Path, *, needed: bool) -> str | None:
        """The agent that recorded ``trajectory``; None when it cannot be told and the image's label may say."""
        try:
            return detect_agent(read_trajectory(trajectory))
        except UsageError:
            if needed:
                raise
            return None


#: Rows expanded at once, and rows read ahead of the one being yielded.
_EXPANDERS = max(2, min(8, os.cpu_count() or 1))
_WINDOW = 256


def _flag(value: Any) -> bool:
    """A boolean field as a row gives it: ``true``, or a table's ``"true"``, ``"1"``, ``"yes"``."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _done(value: list[Entry]) -> futures.Future[list[Entry]]:
    done: futures.Future[list[Entry]] = futures.Future()
    done.set_result(value)
    return done


def _step_text(value: Any) -> Any:
    """A boundary given as a number (the API's ``after_step=3``), as the command line gives it."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class BatchInput(BaseModel):
    """Where a batch's items come from, and which of them: a manifest, the ``--trajectories`` shorthand, or (the
    Python API) the items themselves; plus every item's defaults. The CLI's and the API's one way in: both read,
    check and run the items through it (:meth:`check`, :meth:`items`)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    manifest: Path | None = None
    """The dataset: JSONL, CSV or Parquet, one replay (or one per boundary) per row; fields: replay's options, plus
    id."""
    trajectories: str | None = None
    """Glob of trajectory files (one row per file; needs --after-step)."""
    entries: Annotated[list[dict[str, Any]] | None, Field(json_schema_extra={"cli": False})] = None
    """The items themselves (the Python API's): one mapping of a manifest row's fields each."""
    after_step: Annotated[str | None, BeforeValidator(_step_text)] = None
    """Boundaries of every row that names none: N, all, last, a list (1,3) or a range (3-7)."""
    id: Annotated[str | None, Field(json_schema_extra={"metavar": "TEMPLATE"})] = None
    """Each item's id from its row, e.g. '{parent}-{stem}' (fields: the row's columns, stem, name, parent);
    --image takes templates too, e.g. 'reg/{stem|lower}:v1' or the preset @swebench."""
    map: Annotated[list[str], Field(json_schema_extra={"metavar": "FIELD=COLUMN"})] = []
    """Read a field from a column named otherwise, e.g. id=instance_id."""
    defaults: Annotated[dict[str, Any], Field(json_schema_extra={"cli": False})] = {}
    """Replay options every item starts from (the command's own replay options)."""
    repeat: Annotated[int, Field(ge=1, le=MAX_REPEAT, json_schema_extra={"metavar": "K"})] = 1
    """Run every item K times, under ids of their own (<id>.r1 ...): the summary, the report and compare list the
    items whose repeats end or change the workspace otherwise (flaky)."""
    limit: Annotated[int | None, Field(ge=1, json_schema_extra={"metavar": "N"})] = None
    """Only the first N items (by line, then boundary)."""
    sample: Annotated[int | None, Field(ge=1, json_schema_extra={"metavar": "N"})] = None
    """Only N items drawn at random (the same N for the same --seed)."""
    seed: Annotated[int, Field(json_schema_extra={"metavar": "S"})] = 0
    """What --sample draws with."""
    select: Annotated[list[str], Field(json_schema_extra={"metavar": "PATTERN"})] = []
    """Only the items whose id matches this shell pattern (repeatable)."""
    keep: Annotated[list[str] | None, Field(json_schema_extra={"metavar": "COLUMN,..."})] = None
    """The dataset's own columns each item's row keeps, to join the results back to it (default: instance_id,
    where the dataset has one; --keep '' keeps none)."""
    _chosen: set[tuple[int, int]] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_source(self) -> BatchInput:
        sources = [self.manifest, self.trajectories, self.entries]
        if sum(source is not None for source in sources) != 1:
            raise UsageError("pass a manifest (MANIFEST or --manifest FILE) or --trajectories GLOB (one of them)")
        if self.trajectories is not None and self.after_step is None:
            raise UsageError("--trajectories needs --after-step (a number, all, last, a list or a range)")
        if self.map and self.manifest is None:
            raise UsageError(f"--map reads a manifest's columns; {self.name} has none")
        if self.limit is not None and self.sample is not None:
            raise UsageError("--limit takes the first items and --sample draws some at random; pass one")
        if self.keep is not None:
            self.keep = [name.strip() for column in self.keep for name in column.split(",") if name.strip()]
            clash = [name for name in self.keep if name in ROW_COLUMNS]
            if clash:
                raise UsageError(f"--keep {clash[0]}: every row has a column of that name; keep another")
            if self.keep and self.manifest is None:
                raise UsageError(f"--keep keeps a manifest's columns; {self.name} has none")
        if self.after_step is not None:
            parse_steps(self.after_step, name="--after-step")
            self.defaults = {**self.defaults, "after_step": self.after_step}
        own = sorted(set(self.defaults) & _PER_ITEM)
        if own:
            raise UsageError(f"{own[0]} is each item's own: give it in the items, not as every item's default")
        _check_defaults(self.defaults)
        self._rows()  # the templates and the map, checked now
        return self

    @classmethod
    def parse(cls, **fields: Any) -> BatchInput:
        """Validate the batch's input options, raising :class:`UsageError` with one clear line."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise UsageError(describe_validation_error(exc)) from None

    @property
    def name(self) -> str:
        """How problems name the source (``FILE:LINE``, ``--trajectories:N`` for the shorthand's N-th file, ``item
        N`` for the API's N-th)."""
        if self.manifest is not None:
            return str(self.manifest)
        return "--trajectories" if self.trajectories is not None else "the items"

    def spec_default(self, field: str) -> Any:
        """The value every item gets for ``field`` unless its line says otherwise."""
        return getattr(_probe_spec({field: self.defaults[field]} if field in self.defaults else {}), field)

    @functools.cached_property
    def _rows_cached(self) -> Rows:
        return self._rows()

    def _rows(self) -> Rows:
        base = self.manifest.parent.absolute() if self.manifest is not None else Path.cwd()
        tables = self.manifest is not None and not strict_columns(self.manifest)
        return Rows(
            defaults=self.defaults,
            base=base,
            strict=(self.manifest is not None and not tables) or self.entries is not None,
            id_template=parse_template(self.id, flag="--id") if self.id is not None else None,
            columns=ColumnMap.parse(self.map, set(ROW_FIELDS)),
            tables=tables,
            keep=self.keep,
        )

    def check(self) -> ManifestCheck:
        """Read every entry once (twice with a slice: which items it keeps, then theirs): how many items there are,
        every bad line with its number, what the options alone refuse, and one item per distinct image (so a batch
        can make its images ready before the first sandbox). No item's spec is kept but one per image."""
        problems: list[ManifestProblem] = []
        kept: list[tuple[int, int, str]] = []
        tally = _Tally(self.repeat)
        total = 0
        for item in self._checked_items(problems):
            total += 1
            if self.select and not any(fnmatch.fnmatchcase(item.id, pattern) for pattern in self.select):
                continue
            if self.sliced:
                kept.append((item.line, item.spec.after_step, item.id))
            else:
                tally.add(item.spec)
        if total == 0 and not problems:
            raise UsageError(f"{self.name} holds no items")
        if self.sliced:
            self._chosen = self._slice(kept)
            for item in self._checked_items([]):
                if (item.line, item.spec.after_step) in self._chosen:
                    tally.add(item.spec)
            if tally.items == 0 and not problems:
                raise UsageError(f"--select {','.join(self.select)} matches none of the {total} items")
        return ManifestCheck(
            items=tally.items, problems=problems, image_specs=list(tally.images.values()), image_counts=tally.counts,
            refused=tally.refused, total=total * self.repeat, slice=self._slice_words(),
        )  # fmt: skip

    def _checked_items(self, problems: list[ManifestProblem]) -> Iterator[BatchItem]:
        """Every item of the input in line order, a bad line noted in ``problems`` instead."""
        seen: dict[str, int] = {}
        defaults = self._rows_cached.item_defaults
        for number, entry in self._entries():
            if isinstance(entry, str):
                problems.append(ManifestProblem(line=number, message=entry))
                continue
            try:
                yield _item(number, entry, defaults, seen)
            except UsageError as exc:
                problems.append(ManifestProblem(line=number, message=exc.one_line()))

    def _slice(self, kept: list[tuple[int, int, str]]) -> set[tuple[int, int]]:
        """The items of the slice, by (line, boundary): the first ``--limit``, or a ``--sample`` (each item's place
        in it drawn from a hash of the seed and its id, so the same seed keeps the same items); else those
        ``--select`` matched."""
        if self.limit is not None:
            return {(line, step) for line, step, _ in sorted(kept)[: self.limit]}
        if self.sample is not None:
            drawn = heapq.nsmallest(
                self.sample, kept, key=lambda k: hashlib.sha256(f"{self.seed}:{k[2]}".encode()).digest()
            )
            return {(line, step) for line, step, _ in drawn}
        return {(line, step) for line, step, _ in kept}

    def _slice_words(self) -> str | None:
        words = []
        if self.select:
            words.append(f"the items matching {', '.join(self.select)}")
        if self.limit is not None:
            words.append(f"the first {self.limit}")
        if self.sample is not None:
            words.append(f"a sample of {self.sample} (seed {self.seed})")
        return "; ".join(words) or None

    def items(self) -> Iterator[BatchItem]:
        """The items, one at a time (after :meth:`check` found no problem), those of one image together.

        Items that name the same ``image`` run one after another, images in the order they first appear, so
        a task image is pulled once and can go once its items are done (``ids`` and lines stay the items'
        own: results and reports are keyed and sorted by them). Only the entries' raw fields are held while
        they are grouped, never every item's validated spec."""
        seen: dict[str, int] = {}
        defaults = self._rows_cached.item_defaults
        chosen = self._chosen
        if self.sliced and chosen is None:
            self.check()
            chosen = self._chosen
        for number, entry in _grouped(self._entries(), defaults.get("image")):
            if isinstance(entry, str):
                raise UsageError(f"{self.name}:{number}: {entry}")
            item = _item(number, entry, defaults, seen)
            if chosen is None or (item.line, item.spec.after_step) in chosen:
                yield from item.repeats(self.repeat)

    @property
    def sliced(self) -> bool:
        """Whether a slice keeps some of the items only."""
        return bool(self.select) or self.limit is not None or self.sample is not None

    def _entries(self) -> Iterator[Entry]:
        rows = self._rows_cached
        if self.entries is not None:
            source: Iterable[Row] = enumerate((dict(entry) for entry in self.entries), start=1)
        elif self.manifest is not None:
            source = _manifest_rows(self.manifest)
        else:
            source = _glob_rows(self.trajectories or "")
        return rows.expand_all(source)


class _Tally:
    """What :meth:`BatchInput.check` counts of the items it keeps."""

    def __init__(self, repeat: int) -> None:
        self.repeat = repeat
        self.items = 0
        self.images: dict[object, ReplaySpec] = {}
        self.counts: dict[str, int] = {}
        self.refused: dict[str, int] = {}

    def add(self, spec: ReplaySpec) -> None:
        self.items += self.repeat * (spec.fork or 1)  # a row per fork
        self.images.setdefault(image_request(spec).key, spec)
        if spec.image is not None:
            self.counts[spec.image] = self.counts.get(spec.image, 0) + self.repeat
        refusal = option_refusal(spec)
        if refusal is not None:
            self.refused[refusal] = self.refused.get(refusal, 0) + self.repeat * (spec.fork or 1)


def option_refusal(spec: ReplaySpec) -> str | None:
    """What the options alone refuse ``spec`` for (:func:`~pvisor_host.preflight.checks.check_options`), in one
    line; None: nothing."""
    try:
        check_options(spec, get_profile(spec.agent) if spec.agent is not None else None)
    except UsageError as exc:
        return exc.one_line()
    return None


def _grouped(entries: Iterable[Entry], default_image: str | None) -> Iterator[Entry]:
    """``entries`` with those of one image together, images in order of first appearance (a line that
    names no image, or is wrong, stays a group of its own where it stands)."""
    groups: dict[object, list[Entry]] = {}
    for number, entry in entries:
        image = entry.get("image", default_image) if isinstance(entry, dict) else None
        groups.setdefault(image if isinstance(image, str) else ("line", number), []).append((number, entry))
    for group in groups.values():
        yield from group


def _check_defaults(defaults: dict[str, Any]) -> None:
    """Each command-line default on its own, so a bad one is reported once, naming its flag."""
    for name, value in defaults.items():
        if name == "after_step" or (name == "image" and is_template(value)):
            continue  # a selection and a template: checked as such
        try:
            _probe_spec({name: value})
        except ValidationError as exc:
            if any(error["loc"][:1] == (name,) for error in exc.errors()):
                raise UsageError(describe_validation_error(exc)) from None


def _probe_spec(fields: dict[str, Any]) -> ReplaySpec:
    """A spec of ``fields`` completed with stand-ins for what only an item gives."""
    fields = {k: v for k, v in fields.items() if k != "after_step"}
    return ReplaySpec(**{"trajectory": Path("-"), "after_step": 1, "agent": "-", **fields})


def _manifest_rows(path: Path) -> Iterator[Row]:
    return read_rows(path)


def _glob_rows(pattern: str) -> Iterator[Row]:
    """The shorthand: one row per file matching ``pattern``, numbered in path order."""
    paths = sorted(Path(p).absolute() for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise UsageError(f"--trajectories {pattern!r} matches no file")
    for number, path in enumerate(paths, start=1):
        yield number, {"trajectory": str(path)}
