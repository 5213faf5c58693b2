"""Batch manifests: one replay per JSONL line, validated up front, read as a stream.

A line holds the fields of ``pvisor-host replay``'s options (underscored: ``after_step``, ``max_steps``,
...) plus an optional ``id``; options given on the ``batch`` command line are defaults every line may
override. Relative ``trajectory`` and ``workspace_dir`` paths are relative to the manifest's directory.
``--trajectories GLOB --after-step N|all`` is the shorthand: one item per trajectory (and per boundary with
``all``). Items are validated one at a time as they are run, so a 100,000-line manifest never sits in memory
as 100,000 specs (only its raw lines do, while the items of one image are brought together).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from ..errors import UsageError
from ..models.profiles import get_profile
from ..models.spec import MODEL_OPTIONS, ModelUpstream, ReplaySpec, describe_validation_error
from ..preflight.hostpvisor import complete_batches
from ..preflight.trajectory import check_stat

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,119}$")
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
        if name not in _BATCH_OWNED and name != "upstream":
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


class ManifestProblem(BaseModel):
    """One bad manifest line."""

    line: int
    message: str


class ManifestCheck(BaseModel):
    """What reading a batch's whole input once found."""

    items: int
    problems: list[ManifestProblem]
    image_specs: list[ReplaySpec]
    """One item's spec per distinct (image, agent, inject): what the batch's images are made from."""
    image_counts: dict[str, int] = {}
    """Items per image named with ``image`` (task images, in the order the batch runs them)."""


def default_item_id(spec: ReplaySpec) -> str:
    """``<trajectory stem>-after<N>``, made safe for a directory name."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.trajectory.stem).strip("._") or "trajectory"
    return f"{stem}-after{spec.after_step}"


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open("r", encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if text.strip() and not text.lstrip().startswith("#"):
                yield number, text


def _resolve(fields: dict[str, Any], base: Path) -> dict[str, Any]:
    for key in ("trajectory", "workspace_dir"):
        value = fields.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            fields[key] = str(base / value)
    return fields


def _item(number: int, fields: dict[str, Any], defaults: dict[str, Any], seen: dict[str, int]) -> BatchItem:
    raw_id = fields.pop("id", None)
    for name, value in _BATCH_OWNED.items():
        if name in fields:
            raise UsageError(f"{name}: a batch sets it for every item ({value}); drop it from the line")
    merged = {**defaults, **fields}
    try:
        spec = ReplaySpec(**merged)
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc, flags=False)) from None
    _host_checks(spec)
    item_id = str(raw_id) if raw_id is not None else default_item_id(spec)
    if not _ID.match(item_id):
        raise UsageError(f"id {item_id!r} may contain only letters, digits, '.', '-' and '_' (at most 120)")
    if item_id in seen:
        if raw_id is not None:
            raise UsageError(f"id {item_id!r} is already used on line {seen[item_id]}")
        item_id = f"{item_id}-{hashlib.sha256(str(number).encode()).hexdigest()[:6]}"
    seen[item_id] = number
    return BatchItem(id=item_id, line=number, spec=spec)


def _host_checks(spec: ReplaySpec) -> None:
    """What a line can be refused for without reading its trajectory: a file that cannot be one, an unknown
    agent, a workspace directory that is not there."""
    check_stat(spec.trajectory)
    if spec.agent is not None:
        get_profile(spec.agent)
    if spec.workspace_dir is not None and not spec.workspace_dir.is_dir():
        raise UsageError(f"workspace_dir {spec.workspace_dir} is not a directory")


def batch_items(
    entries: Iterable[ReplaySpec | Mapping[str, Any]], defaults: Mapping[str, Any] | None = None
) -> list[BatchItem]:
    """Items from specs, or from mappings of manifest-line fields (``id`` included), each validated as a
    manifest line is, over ``defaults``. Relative paths are relative to the working directory.

    Raises:
        UsageError: the first bad entry, by its position (and how many more there are); or no entries.
    """
    seen: dict[str, int] = {}
    items: list[BatchItem] = []
    problems: list[str] = []
    for number, entry in enumerate(entries, start=1):
        fields = entry.model_dump(exclude_unset=True) if isinstance(entry, ReplaySpec) else dict(entry)
        try:
            items.append(_item(number, fields, dict(defaults or {}), seen))
        except UsageError as exc:
            problems.append(f"item {number}: {exc.one_line()}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageError(problems[0] + more)
    if not items:
        raise UsageError("the batch holds no items")
    return items


def by_image(items: list[BatchItem]) -> tuple[list[BatchItem], dict[str, int]]:
    """The items with those of one ``image`` together (as :meth:`BatchInput.items` runs them), and how many
    items each image has, in that order."""
    first: dict[object, int] = {}
    for position, item in enumerate(items):
        first.setdefault(item.spec.image or ("item", position), position)
    order = sorted(range(len(items)), key=lambda n: first[items[n].spec.image or ("item", n)])
    counts: dict[str, int] = {}
    for n in order:
        image = items[n].spec.image
        if image is not None:
            counts[image] = counts.get(image, 0) + 1
    return [items[n] for n in order], counts


def image_specs(items: Iterable[BatchItem]) -> list[ReplaySpec]:
    """One item's spec per distinct (image, agent, inject): what a batch's images are made from."""
    distinct: dict[tuple[str | None, str | None, bool], ReplaySpec] = {}
    for item in items:
        distinct.setdefault((item.spec.image, item.spec.agent, item.spec.inject), item.spec)
    return list(distinct.values())


#: A numbered manifest entry: its fields, or what is wrong with the line.
Entry = tuple[int, dict[str, Any] | str]
#: Replay options that are per item, never batch-wide defaults.
_PER_ITEM = {"trajectory", "after_step", "out", "run_id"}


class BatchInput(BaseModel):
    """Where a batch's items come from: a manifest, or the ``--trajectories`` shorthand; plus the defaults."""

    manifest: Path | None = None
    trajectories: str | None = None
    after_step: str | None = None
    """The shorthand's boundary: a number, or ``all``."""
    defaults: dict[str, Any] = {}
    """Replay options given on the command line; every item starts from them."""

    @model_validator(mode="after")
    def _one_source(self) -> BatchInput:
        if (self.manifest is None) == (self.trajectories is None):
            raise UsageError("pass a manifest (MANIFEST or --manifest FILE) or --trajectories GLOB (one of them)")
        if self.trajectories is not None and self.after_step is None:
            raise UsageError("--trajectories needs --after-step N (or --after-step all)")
        if self.manifest is not None and self.after_step is not None:
            raise UsageError("--after-step goes with --trajectories; a manifest gives after_step per line")
        if self.after_step not in (None, "all"):
            _step(self.after_step)
        self.defaults = {k: v for k, v in self.defaults.items() if k not in _PER_ITEM}
        _check_defaults(self.defaults)
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
        """How problems name the source (``FILE:LINE``, or ``--trajectories:N`` for the shorthand's N-th item)."""
        return str(self.manifest) if self.manifest is not None else "--trajectories"

    def spec_default(self, field: str) -> Any:
        """The value every item gets for ``field`` unless its line says otherwise."""
        return getattr(_probe_spec({field: self.defaults[field]} if field in self.defaults else {}), field)

    def check(self) -> ManifestCheck:
        """Read every entry once: how many items there are, every bad line with its number, and one item per
        distinct image (so a batch can make its images ready before the first sandbox)."""
        problems: list[ManifestProblem] = []
        seen: dict[str, int] = {}
        images: dict[tuple[str | None, str | None, bool], ReplaySpec] = {}
        counts: dict[str, int] = {}
        count = 0
        for number, entry in self._entries():
            if isinstance(entry, str):
                problems.append(ManifestProblem(line=number, message=entry))
                continue
            try:
                spec = _item(number, entry, self.defaults, seen).spec
            except UsageError as exc:
                problems.append(ManifestProblem(line=number, message=exc.one_line()))
                continue
            count += 1
            images.setdefault((spec.image, spec.agent, spec.inject), spec)
            if spec.image is not None:
                counts[spec.image] = counts.get(spec.image, 0) + 1
        if count == 0 and not problems:
            raise UsageError(f"{self.name} holds no items")
        return ManifestCheck(items=count, problems=problems, image_specs=list(images.values()), image_counts=counts)

    def items(self) -> Iterator[BatchItem]:
        """The items, one at a time (after :meth:`check` found no problem), those of one image together.

        Items that name the same ``image`` run one after another, images in the order they first appear, so
        a task image is pulled once and can go once its items are done (``ids`` and lines stay the items'
        own: results and reports are keyed and sorted by them). Only the entries' raw fields are held while
        they are grouped, never every item's validated spec."""
        seen: dict[str, int] = {}
        for number, entry in _grouped(self._entries(), self.defaults.get("image")):
            if isinstance(entry, str):
                raise UsageError(f"{self.name}:{number}: {entry}")
            yield _item(number, entry, self.defaults, seen)

    def _entries(self) -> Iterator[Entry]:
        if self.manifest is not None:
            return _manifest_entries(self.manifest)
        assert self.trajectories is not None
        assert self.after_step is not None
        return _glob_entries(self.trajectories, self.after_step, self.defaults.get("agent"))


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
        try:
            _probe_spec({name: value})
        except ValidationError as exc:
            if any(error["loc"][:1] == (name,) for error in exc.errors()):
                raise UsageError(describe_validation_error(exc)) from None


def _probe_spec(fields: dict[str, Any]) -> ReplaySpec:
    """A spec of ``fields`` completed with stand-ins for what only an item gives."""
    return ReplaySpec(**{"trajectory": Path("-"), "after_step": 1, "agent": "-", **fields})


def _manifest_entries(path: Path) -> Iterator[Entry]:
    if not path.is_file():
        raise UsageError(f"--manifest {path} does not exist or is not a file")
    base = path.parent.absolute()
    try:
        for number, text in _lines(path):
            try:
                fields = json.loads(text)
            except ValueError as exc:
                yield number, f"not JSON: {exc}"
                continue
            if not isinstance(fields, dict):
                yield number, "not a JSON object"
                continue
            yield number, _resolve(fields, base)
    except UnicodeDecodeError as exc:
        raise UsageError(f"--manifest {path} is not UTF-8 text ({exc.reason})") from None


def _glob_entries(pattern: str, after_step: str, agent: str | None) -> Iterator[Entry]:
    """The shorthand: every file matching ``pattern``, at ``after_step`` or (``all``) every boundary."""
    paths = sorted(Path(p).absolute() for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise UsageError(f"--trajectories {pattern!r} matches no file")
    if after_step == "all" and not agent:
        raise UsageError("--after-step all needs --agent (to count each trajectory's boundaries)")
    position = 0
    for path in paths:
        if after_step == "all":
            assert agent is not None
            # A trajectory pvisor rejects outright still gets one item, so its failure shows in the results.
            steps = list(range(1, (_boundaries(agent, path) or 1) + 1))
        else:
            steps = [_step(after_step)]
        for step in steps:
            position += 1
            yield position, {"trajectory": str(path), "after_step": step}


@functools.lru_cache(maxsize=4096)
def _count(agent: str, path: Path, size: int, mtime_ns: int) -> int | None:
    return complete_batches(agent, path)


def _boundaries(agent: str, path: Path) -> int | None:
    """pvisor's count of complete batches, asked once per file version (the check and the run share it)."""
    try:
        info = path.stat()
    except OSError:
        return None
    return _count(agent, path, info.st_size, info.st_mtime_ns)


def _step(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--after-step {text!r}: pass a positive number or 'all'")
    return int(text)
