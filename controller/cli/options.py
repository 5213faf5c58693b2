"""The command-line options that describe a replay, generated from the models that validate them.

Every option of ``replay`` (and the item defaults of ``batch``) is a field of
:class:`~pvisor_host.models.spec.ReplaySpec`, of :class:`~pvisor_host.models.spec.ModelUpstream` (as a flat
``--model-*`` option) or of :class:`~pvisor_host.models.image.BuildOptions`. Its name, type, help and the
default it shows come from the field, so an option is described once, in the model, and the CLI cannot
drift from what the library validates: :func:`model_options` turns fields into typer options, and
:func:`with_options` adds them to a command.

Typer has no way to take options from a model, so this module builds the command's signature itself
(``__signature__`` and ``__annotations__``, which typer reads like any other function's). Defaults stay in
the model: an option not given is ``None`` here and absent from what the command passes on, so the model's
own default applies; the help only shows it.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from ..units import short_duration, short_size

if TYPE_CHECKING:  # the models are imported when a command is built, not when the commands are listed
    from pydantic.fields import FieldInfo

#: Fields a batch item sets for itself (or the batch names for it): not batch-wide defaults.
PER_ITEM = frozenset({"trajectory", "after_step", "out", "run_id", "session_id"})
#: Fields the CLI does not offer as such: ``upstream`` is the flat ``--model-*`` options.
NOT_OPTIONS = frozenset({"upstream"})


@dataclass(frozen=True)
class ModelOption:
    """One option, as a field describes it."""

    name: str
    """The parameter's name, which is also the key the model validates (``model_base_url``, ``memory``)."""
    field: FieldInfo
    flag: str | None = None
    """A single flag instead of typer's ``--x/--no-x`` pair (``--no-workspace``)."""
    grouped: bool = False
    """A field of :class:`ModelUpstream` given as a flat ``--model-*`` option: the spec checks that the ones it
    needs come together, so none is required on its own."""
    show_default: bool | None = None
    """Whether the help shows the field's default (None: as the command says)."""

    @property
    def required(self) -> bool:
        return self.field.is_required() and not self.grouped

    def parameter(self, *, with_default: bool) -> inspect.Parameter:
        """The command parameter, keyword-only. ``with_default``: the field's default, in the CLI's words
        (``4g``, ``2h``), which the model reads back as the same value; else ``None`` when not given (the
        option's ``show_default``, when set, decides instead)."""
        with_default = with_default if self.show_default is None else self.show_default
        kind = _cli_type(self.field)
        flags = [self.flag] if self.flag else []
        option = typer.Option(*flags, help=_help(self.field), metavar=_metavar(self.field))
        if self.required:
            annotation: Any = Annotated[kind, option]
            return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation)
        default = _cli_default(self.field) if with_default else None
        annotation = Annotated[kind | None, option]
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def replay_options(*, batch: bool = False) -> list[ModelOption]:
    """The options of ``replay`` (``batch=False``) or the item defaults of ``batch``, in the models' order:
    the required fields first, the ``--model-*`` options where the spec has ``upstream``, the build options
    last."""
    from ..models.spec import ReplaySpec

    found: list[ModelOption] = []
    for name, field in ReplaySpec.model_fields.items():
        if batch and name in PER_ITEM:
            continue
        if name == "upstream":
            found += list(_upstream_options())
        elif name not in NOT_OPTIONS:
            found.append(ModelOption(name, field, _single_flag(name, field)))
    found += build_options(("base", "ca_bundle"))
    return sorted(found, key=lambda option: not option.required)  # stable: the rest keep the models' order


def batch_options() -> list[ModelOption]:
    """The options of ``batch``: the fields of the models a batch's options are
    (:data:`~pvisor_host.fanout.options.MODELS`, their defaults shown), then the replay options every item starts
    from (:func:`replay_options`, whose defaults are the items')."""
    from ..fanout.options import MODELS

    own = [
        ModelOption(name, field, _flag(field) or _single_flag(name, field), show_default=True)
        for model in MODELS
        for name, field in model.model_fields.items()
        if _offered(field)
    ]
    return own + [replace(option, show_default=False) for option in replay_options(batch=True)]


def _flag(field: FieldInfo) -> str | None:
    """The option's flag where it is not the field's name (``json_schema_extra={"flag": "--image-rewrite"}``)."""
    extra = field.json_schema_extra
    flag = extra.get("flag") if isinstance(extra, dict) else None
    return flag if isinstance(flag, str) else None


def _offered(field: FieldInfo) -> bool:
    """Whether the CLI offers the field as an option (``json_schema_extra={"cli": False}``: the API's alone)."""
    extra = field.json_schema_extra
    return not isinstance(extra, dict) or extra.get("cli", True) is not False


def build_options(names: Iterable[str], rename: dict[str, str] | None = None) -> list[ModelOption]:
    """Options from :class:`BuildOptions` fields (``rename`` gives a field another option name)."""
    from ..models.image import BuildOptions

    rename = rename or {}
    return [ModelOption(rename.get(name, name), BuildOptions.model_fields[name]) for name in names]


def _upstream_options() -> Iterator[ModelOption]:
    from pydantic.fields import FieldInfo

    from ..models.spec import MODEL_OPTIONS, NO_MODEL_BODIES_HELP, ModelUpstream

    for option, field_name in MODEL_OPTIONS.items():
        yield ModelOption(option, ModelUpstream.model_fields[field_name], grouped=True)
        if option == "model_body_limit":
            no_bodies = FieldInfo(annotation=bool, default=False, description=NO_MODEL_BODIES_HELP)
            yield ModelOption("no_model_bodies", no_bodies, flag="--no-model-bodies")


def _single_flag(name: str, field: FieldInfo) -> str | None:
    """``no_workspace`` is the flag ``--no-workspace`` alone (a ``--no-no-workspace`` would say nothing)."""
    return "--" + name.replace("_", "-") if field.annotation is bool and name.startswith("no_") else None


def with_options(
    options: Callable[[], list[ModelOption]], *, show_defaults: bool = True, first: bool = False
) -> Callable[[Callable[..., Any]], WithOptions]:
    """Add the ``options`` (a function giving them, called when the command is built) to a command, after its own
    parameters (before them with ``first``). The command takes them as ``**options``: only those given on the
    command line, by name (the model's defaults apply to the others). ``show_defaults=False`` leaves the
    defaults out of the help (``batch``: they are the items')."""

    def add(command: Callable[..., Any]) -> WithOptions:
        return WithOptions(command, options, show_defaults=show_defaults, first=first)

    return add


class WithOptions:
    """A command with model options added (see :func:`with_options`). Its signature is made the first time typer
    asks for it, so that listing the commands (``pvisor-host --help``) imports no model."""

    def __init__(
        self,
        command: Callable[..., Any],
        options: Callable[[], list[ModelOption]],
        *,
        show_defaults: bool,
        first: bool,
    ) -> None:
        self._command = command
        self._options = options
        self._show_defaults = show_defaults
        self._first = first
        self._made: inspect.Signature | None = None
        self._own: set[str] = set()
        self.__name__ = command.__name__
        self.__qualname__ = command.__qualname__
        self.__module__ = command.__module__
        self.__doc__ = command.__doc__

    @property
    def __signature__(self) -> inspect.Signature:
        if self._made is None:
            own = inspect.signature(self._command, eval_str=True)
            kept = [  # keyword-only like the added ones, so that any order is a valid signature
                p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                for p in own.parameters.values()
                if p.kind is not inspect.Parameter.VAR_KEYWORD
            ]
            self._own = {p.name for p in kept}
            added = [option.parameter(with_default=self._show_defaults) for option in self._options()]
            clash = self._own & {p.name for p in added}
            if clash:
                raise TypeError(f"{self.__name__}: its own parameters {sorted(clash)} are also model options")
            parameters = [*added, *kept] if self._first else [*kept, *added]
            self._made = own.replace(parameters=parameters)
        return self._made

    @property
    def __annotations__(self) -> dict[str, Any]:  # type: ignore[override]
        signature = self.__signature__
        found = {p.name: p.annotation for p in signature.parameters.values()}
        return found | {"return": signature.return_annotation}

    def __call__(self, **given: Any) -> Any:
        self.__signature__  # noqa: B018 - which parameters are the command's own
        own_values = {name: given.pop(name) for name in self._own if name in given}
        chosen = {name: value for name, value in given.items() if value is not None and value != []}
        return self._command(**own_values, **chosen)


# -- what a field says about its option -------------------------------------------------------------------------

_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]+\.)?([^`]+)`")


def _help(field: FieldInfo) -> str:
    """The field's docstring as one line of plain text (no reST markup)."""
    text = _ROLE.sub(r"\1", field.description or "")
    return " ".join(text.replace("``", "").split())


def _unit(field: FieldInfo) -> Literal["size", "duration"] | None:
    from pydantic import BeforeValidator

    from ..models.spec import duration_or_zero, duration_value, memory_value, size_value

    inner = [arg.__metadata__ for arg in typing.get_args(field.annotation) if hasattr(arg, "__metadata__")]
    for meta in [*field.metadata, *(m for metadata in inner for m in metadata)]:  # an optional size's, too
        if isinstance(meta, BeforeValidator):
            if meta.func in (size_value, memory_value):
                return "size"
            if meta.func in (duration_value, duration_or_zero):
                return "duration"
    return None


def _cli_type(field: FieldInfo) -> Any:
    """What the option takes on the command line: sizes and durations as the CLI's strings (``4g``, ``2h``),
    choices as strings (the model names them when one is wrong), everything else as the field's own type."""
    if _unit(field) is not None:
        return str
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    if typing.get_origin(annotation) is Literal:
        return str
    if typing.get_origin(annotation) in (list, tuple):  # repeatable (a frozen model keeps a tuple)
        return list[str]
    if annotation in (str, int, float, bool, Path):
        return annotation
    pair = getattr(annotation, "cli_pair", None)  # a model given as two values (--model-cassette MODE DIR)
    if pair is not None:
        return pair
    if isinstance(annotation, type) and hasattr(annotation, "model_validate"):
        return str  # a model that reads its own compact form (--model-price input=3,output=15)
    raise TypeError(f"no command-line type for a field of type {annotation!r}")


def _metavar(field: FieldInfo) -> str | None:
    """What the help shows for the option's value: the field's own (``json_schema_extra={"metavar": "N"}``), that of
    a model given as two values (``MODE DIR``); typer's own else."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("metavar"), str):
        return str(extra["metavar"])
    annotation = next((a for a in typing.get_args(field.annotation) if a is not type(None)), field.annotation)
    return getattr(annotation, "cli_metavar", None)


def _cli_default(field: FieldInfo) -> str | int | float | None:
    """The field's default as the command line would give it (None: the model decides, when the command runs:
    a default computed then, or one not worth showing, such as off, none or empty)."""
    if field.is_required() or field.default_factory is not None:
        return None
    default = field.get_default()
    if default is None or isinstance(default, bool) or default in ([], ()):
        return None
    unit = _unit(field)
    if unit == "size":
        return short_size(int(default))
    if unit == "duration":
        return short_duration(float(default))
    return default if isinstance(default, int | float | str) else str(default)


def spec_fields(options: dict[str, Any]) -> dict[str, Any]:
    """The part of a command's model options that :class:`ReplaySpec` validates (not the build options)."""
    from ..models.image import BuildOptions

    return {name: value for name, value in options.items() if name not in BuildOptions.model_fields}


def build_fields(options: dict[str, Any], rename: dict[str, str] | None = None) -> dict[str, Any]:
    """The part of a command's model options that :class:`BuildOptions` validates, by field name."""
    from ..models.image import BuildOptions

    back = {option: field for field, option in (rename or {}).items()}
    fields = {back.get(name, name): value for name, value in options.items()}
    return {name: value for name, value in fields.items() if name in BuildOptions.model_fields}
