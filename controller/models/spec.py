"""What a user asks for: one replay, as a validated model.

:class:`ReplaySpec` takes the options of ``pvisor-host replay`` one to one (field names are the option names
with underscores), so the CLI, a batch manifest line and library callers all validate the same way. The
``--model-*`` options only make sense together: they are grouped into one :class:`ModelUpstream` (all of
the three it needs, or none). Sizes and durations accept the CLI's strings (``4g``, ``90m``) or numbers.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from ..errors import UsageError
from ..units import DURATION_JSON_SCHEMA, SIZE_JSON_SCHEMA, parse_duration, parse_size
from .egress import Egress, EgressLimit
from .gateway import Cassette, DriftAction, Masks, ModelPrice

Mode = Literal["continue", "replay-only", "prepare-only"]
Collect = Literal["full", "changes", "none"]
Network = Literal["none", "bridge"]
ModelNetwork = Literal["unix", "internal", "pass-through"]
"""How a sandbox reaches its model: a mounted unix socket (no network), an internal Docker network, or
straight to the upstream with the real key (``pass-through``)."""

_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"^(root|\d+)(:\d+)?$")
_CAPABILITY = re.compile(r"^(CAP_)?[A-Z_]+$")
_RUNTIME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: The environment variable that makes a runtime (gVisor's ``runsc``, say) the default of every replay.
RUNTIME_ENV = "PVISOR_HOST_RUNTIME"
# Paths a workspace must not cover: the sandbox needs them as the image made them.
_RESERVED_PATHS = ("/", "/bin", "/sbin", "/lib", "/lib64", "/usr", "/etc", "/opt", "/var", "/tmp", "/root", "/home")
_RESERVED_TREES = ("/proc", "/sys", "/dev", "/pvisor-host", "/usr", "/opt/pvisor", "/etc", "/bin", "/sbin", "/lib")


def size_value(value: Any) -> Any:
    """A size field's value: the CLI's strings (``4g``) parsed, numbers as they are."""
    return parse_size(value) if isinstance(value, str) else value


#: The least memory the engine gives a container (Docker refuses less than 6 MiB).
MIN_MEMORY = 6 * 1024**2


def memory_value(value: Any) -> Any:
    """A memory limit: a size, at least :data:`MIN_MEMORY`; a bare small number is most likely meant in GiB, and
    the hint says so."""
    size = size_value(value)
    if isinstance(size, int) and not isinstance(size, bool) and 0 < size < MIN_MEMORY:
        bare = str(value).strip().isdigit()
        raise UsageError(
            f"{str(value).strip()} is {size} bytes, less than the 6 MiB a sandbox needs at least",
            hint=f"sizes take a unit: did you mean {str(value).strip()}g?" if bare else "pass e.g. 512m or 4g",
        )
    return size


def duration_value(value: Any) -> Any:
    """A duration field's value: the CLI's strings (``90m``) parsed, numbers as they are."""
    return parse_duration(value) if isinstance(value, str) else value


#: Bytes: a number, or the CLI's sizes (``4g``, ``512m``) in a manifest or a library call.
Bytes = Annotated[int, BeforeValidator(size_value), Field(gt=0), WithJsonSchema(SIZE_JSON_SCHEMA, mode="validation")]
#: Seconds: a number, or the CLI's durations (``90m``, ``8s``).
Seconds = Annotated[
    float, BeforeValidator(duration_value), Field(gt=0), WithJsonSchema(DURATION_JSON_SCHEMA, mode="validation")
]


def duration_or_zero(value: Any) -> Any:
    """A duration field's value where 0 means none: ``0``, or the CLI's durations."""
    return parse_duration(value, zero=True) if isinstance(value, str) else value


#: Seconds, where 0 means none at all.
SecondsOrNone = Annotated[
    float, BeforeValidator(duration_or_zero), Field(ge=0), WithJsonSchema(DURATION_JSON_SCHEMA, mode="validation")
]

#: The flat ``--model-*`` options (and manifest keys) and the :class:`ModelUpstream` field each one sets.
MODEL_OPTIONS = {
    "model_base_url": "base_url",
    "model": "model",
    "model_api_key_env": "api_key_env",
    "model_network": "network",
    "model_body_limit": "body_limit",
    "model_timeout": "timeout",
    "model_retry_budget": "retry_budget",
    "model_concurrency": "concurrency",
    "model_rpm": "requests_per_minute",
    "model_tpm": "tokens_per_minute",
    "model_price": "price",
    "model_cassette": "cassette",
    "cassette_mask": "cassette_masks",
    "on_drift": "on_drift",
}
_MODEL_REQUIRED = ("model_base_url", "model", "model_api_key_env")
#: Without an upstream (a cassette served back), the model's name is all a continuation needs.
_REPLAYING_REQUIRED: tuple[str, ...] = ("model",)
#: ``--no-model-bodies`` (a manifest's ``no_model_bodies``), which is ``--model-body-limit 0``.
NO_MODEL_BODIES_HELP = "Keep no bodies in model-traffic.jsonl (the same as a body limit of 0)."


class ModelUpstream(BaseModel):
    """The real model a live continuation talks to, and how the sandbox reaches it. The key stays on the host:
    a host-side gateway forwards the sandbox's requests with it (except with ``network="pass-through"``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, defer_build=True)

    base_url: str | None = None
    """The real OpenAI-compatible endpoint, e.g. ``https://api.example.com/v1``; a host-side gateway forwards
    the agent's calls to it (none when a cassette is served back)."""
    model: str
    """Model name given to the agent (as ``MODEL_NAME``)."""
    api_key_env: str | None = None
    """Name of the host variable holding the real key; the key itself is never taken from a flag (none when a
    cassette is served back)."""
    network: ModelNetwork = "unix"
    """How the sandbox reaches the gateway: ``unix`` (no network, a mounted socket), ``internal`` (a Docker
    network of its own) or ``pass-through`` (straight to the upstream, with the real key)."""
    body_limit: Annotated[int, BeforeValidator(size_value), Field(ge=0)] = 64 * 1024
    """Bytes of each request and response body kept in ``model-traffic.jsonl``; 0 keeps none."""
    timeout: Seconds = 300.0
    """How long the gateway waits for the upstream before answering 504."""
    retry_budget: SecondsOrNone = 120.0
    """How long the gateway keeps retrying a model call the upstream refused before its first byte (429, 5xx,
    a refused or reset connection), with backoff and jitter, honouring Retry-After; only what outlasts it
    reaches the agent (0: none). A stream that broke off after its first bytes is never retried."""
    concurrency: int | None = Field(default=None, ge=1)
    """Model calls in flight at once across the whole batch (every node of a cluster); the others wait."""
    requests_per_minute: int | None = Field(default=None, ge=1)
    """Model calls started per minute across the whole batch; the others wait."""
    tokens_per_minute: int | None = Field(default=None, ge=1)
    """Tokens (in and out, as the upstream reports them) per minute across the whole batch; a call waits while
    the last minute's tokens reach it."""
    price: ModelPrice | None = None
    """Prices per million tokens, ``input=3,output=15[,cached=0.3]``: records, summary and report show costs."""
    cassette: Cassette | None = None
    """``record DIR``: keep every item's model exchanges in DIR; ``replay DIR``: serve them back with no upstream
    and no key (drift is reported: see on-drift)."""
    cassette_masks: Masks = ()
    """Regular expressions for what legitimately differs from the recording, masked when a cassette served back
    compares a request with it (besides the default masks: dates and times, kernel and OS versions, temporary
    paths, durations, pids and run ids)."""
    on_drift: DriftAction = "fail"
    """With a cassette served back, a request that differs from the recorded one: ``fail`` answers an error
    (the item fails as model_drift), ``serve`` answers the recorded answer all the same. Both record where."""

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    @model_validator(mode="after")
    def _upstream_or_cassette(self) -> ModelUpstream:
        replaying = self.cassette is not None and self.cassette.replaying
        if not replaying and (self.base_url is None or self.api_key_env is None):
            raise ValueError("a model gateway needs --model-base-url and --model-api-key-env (or a cassette to replay)")
        if not self.gateway and (
            self.cassette or self.concurrency or self.requests_per_minute or self.tokens_per_minute
        ):
            raise ValueError(
                "--model-cassette and the --model-concurrency/rpm/tpm limits work in the gateway: "
                "--model-network pass-through has none"
            )
        return self

    @field_validator("api_key_env")
    @classmethod
    def _key_env(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not _ENV_NAME.match(value):
            # not echoed: a value that is no variable name may well be the key itself
            raise ValueError("not a variable name (pass the name of the variable that holds the key, not the key)")
        return value

    def api_key(self) -> str | None:
        """The real key, from this process's environment (None: a cassette served back needs none)."""
        return os.environ[self.api_key_env] if self.api_key_env is not None else None

    @property
    def gateway(self) -> bool:
        """Whether a host-side gateway stands between the sandbox and the upstream."""
        return self.network != "pass-through"


class ReplaySpec(BaseModel):
    """One replay request. Every field is the ``pvisor-host replay`` option of the same name, but ``upstream``,
    which the ``--model-*`` options (or manifest keys) fill in."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, defer_build=True)

    trajectory: Path
    """The agent's native trajectory on the host (read-only in the sandbox)."""
    agent: str | None = None
    """pvisor agent name; default: detected from the trajectory's format (else, with ``image``, the image's
    ``pvisor-host.agent`` label)."""
    image: str | None = None
    """Sandbox image; without it, the image ``pvisor-host build --agent`` makes (built when missing)."""
    inject: bool = False
    """Run in ``image`` unchanged (a task image without pvisor or the agent): both come from a read-only
    runtime volume built from the verified agent image."""
    after_step: int = Field(ge=1)
    """1-based ordinal of the complete tool batch after which live execution resumes."""
    mode: Mode = "continue"
    """``continue`` (replay, then the live agent), ``replay-only`` or ``prepare-only``."""
    max_steps: int | None = Field(default=None, ge=1)
    """Total action budget including the replayed prefix."""
    boundary_user_prompt: str | None = None
    """One user message appended after the boundary observation before the first live request."""
    disable_thinking: bool = False
    """Force the live continuation's model requests to disable thinking."""
    allow_stale_observations: bool = False
    """Let Claude Code reuse recorded observations it cannot reproduce (the result is marked ``degraded``)."""
    session_id: str | None = None
    """Model-router session key (pvisor's default: the run id)."""
    run_id: str | None = None
    """Run id (``[A-Za-z0-9_-]``); a fresh one is generated when absent."""
    workspace_dir: Path | None = None
    """Host directory copied fresh into the sandbox as the workspace (empty when absent)."""
    workspace_path: str | None = None
    """Absolute workspace path in the sandbox; default: the recording's cwd, else ``/workspace``."""
    image_workspace: bool = False
    """Start from a copy of the image's own directory at the workspace path (a task checkout, say)."""
    no_workspace: bool = False
    """Do not collect the final workspace (the same as ``--collect none``)."""
    collect: Collect | None = None
    """What of the final workspace is collected: ``full`` (every file), ``changes`` (the files added and changed,
    and ``workspace.patch``, which turns the starting workspace into the final one), or ``none``; the record
    lists what was added, changed and removed whatever it is. Default: ``full`` for ``replay``, ``changes`` for a
    batch's items."""
    verify: str | None = None
    """A shell command run in the sandbox after pvisor ends, in the workspace, under the same limits (the task's
    tests, say): its exit code decides ``verification.passed``; a reward it writes to /logs/verifier/reward.txt
    (or reward.json, as Harbor's verifiers do) is recorded, else the reward is 1 or 0."""
    verify_timeout: Seconds = 1800.0
    """How long the verifier may run (on top of ``--timeout``); past it, it is killed and does not pass."""
    out: Path | None = None
    """Run directory on the host; default ``./pvisor-runs/<run-id>``. Must be new or empty."""
    timeout: Seconds = 7200.0
    """Wall-clock limit for the container; past it the container is killed and the status is ``timeout``. The
    sandbox also ends itself 30 s after it, should nobody be there to end it (a controller killed with kill -9)."""
    start_timeout: Seconds = 60.0
    """How long the engine may take to start a sandbox; past it the attempt is an ``infra_error`` naming the runtime
    step that hung (``runc create``, say), retried once in a fresh sandbox."""
    memory: Annotated[
        int, BeforeValidator(memory_value), Field(gt=0), WithJsonSchema(SIZE_JSON_SCHEMA, mode="validation")
    ] = 4 * 1024**3
    """Memory limit (no swap on top); the ``/tmp`` tmpfs counts against it."""
    cpus: float = Field(default=2.0, gt=0)
    """CPU limit (fractions allowed)."""
    pids: int = Field(default=1024, ge=16)
    """Most processes and threads the sandbox may have at once."""
    tmp_size: Bytes = 1024**3
    """Size of the tmpfs mounted at ``/tmp`` (the root filesystem is read-only)."""
    collect_limit: Bytes = 4 * 1024**3
    """Cap on the bytes collected from the sandbox; past it the record says ``truncated``."""
    network: Network = "none"
    """``none`` (no interface but loopback) or ``bridge`` (the engine's default bridge)."""
    egress: Egress | None = None
    """Hosts the replayed tool calls may reach through pvisor-host's egress proxy, the sandbox keeping no network of
    its own: allow:HOST[:PORT] entries (*.NAME for subdomains; ports 80 and 443 without one) and presets (pypi,
    npm, github), comma-separated; none allows nothing. Deny by default; names resolve on the host, and a
    non-public address is refused unless listed itself. Every connection is journaled in the record
    (docs/egress.md)."""
    egress_limit: EgressLimit = EgressLimit()
    """Caps on one sandbox's egress: connections=N (in all), bytes=SIZE (both ways), at_once=N. Past them a
    connection is refused or cut, and the record says which cap."""
    env: list[str] = []
    """Names of host variables passed into the sandbox (values never enter the container config)."""
    user: str | None = None
    """``UID[:GID]`` or ``root``; default: a non-root uid (yours, or 65532 when you are root)."""
    cap_add: list[str] = []
    """Capabilities kept despite ``cap_drop=ALL``."""
    writable_rootfs: bool = False
    """Relax the read-only root filesystem."""
    allow_privilege_escalation: bool = False
    """Relax ``no-new-privileges``."""
    strict: bool = False
    """Run a task image with pvisor-host's own hardened profile (a non-root uid, ``HOME=/tmp``, a read-only root)
    instead of as the image says (its user, ``HOME``, working directory and environment, a writable root thrown
    away with the container); see docs/security.md. The product's own agent images always run strict."""
    runtime: str | None = Field(default_factory=lambda: os.environ.get(RUNTIME_ENV) or None)
    """Container runtime the engine has registered (``runc``; ``runsc`` for gVisor); default:
    ``$PVISOR_HOST_RUNTIME``, else the engine's default runtime."""
    upstream: ModelUpstream | None = None
    """The model a live continuation calls, from ``--model-base-url``, ``--model`` and ``--model-api-key-env``
    (all three, or none) and the other ``--model-*`` options; without it the user brings the endpoint
    (``--network bridge`` and ``--env``)."""
    attempts: int = Field(default=3, ge=1, le=20)
    """Attempts for results pvisor marks retryable (model rate limits, 5xx, connection errors)."""
    retry_backoff: Seconds = 5.0
    """Seconds before the first retry; doubled for each further one."""
    fork: int | None = Field(default=None, ge=2, le=32)
    """Continue K times from one replayed prefix: the prefix's sandbox is checkpointed at the boundary (replayed,
    its context rebuilt, no model call yet) and restored K times, each copy continuing on its own (its own
    output, gateway socket and record). Needs a gVisor runtime that can save the boundary (docs/fork.md)."""
    fork_strict: bool = False
    """With ``--fork``: a fork that cannot be restored fails, instead of running once as a full replay."""

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        if value is not None and not _RUN_ID.match(value):
            raise ValueError("may contain only letters, digits, '-' and '_' (at most 100)")
        return value

    @field_validator("session_id")
    @classmethod
    def _session_id(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c in value for c in "\0\r\n")):
            raise ValueError("must be non-empty and contain no NUL, CR or LF")
        return value

    @field_validator("boundary_user_prompt")
    @classmethod
    def _prompt(cls, value: str | None) -> str | None:
        if value is not None and value and not value.strip():
            raise ValueError("must contain a non-whitespace character")
        return value or None

    @field_validator("env")
    @classmethod
    def _env(cls, names: list[str]) -> list[str]:
        for name in names:
            if "=" in name:
                raise ValueError(
                    f"{name.split('=')[0]}=...: pass only the name; the value is read from your environment"
                )
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not a variable name")
        return list(dict.fromkeys(names))

    @field_validator("user")
    @classmethod
    def _user(cls, value: str | None) -> str | None:
        if value is not None and not _USER.match(value):
            raise ValueError("must be UID, UID:GID or root")
        return value

    @field_validator("cap_add")
    @classmethod
    def _caps(cls, caps: list[str]) -> list[str]:
        for cap in caps:
            if not _CAPABILITY.match(cap):
                raise ValueError(f"{cap!r} is not a capability name")
        return [cap.removeprefix("CAP_") for cap in caps]

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, value: str | None) -> str | None:
        if value is not None and not _RUNTIME.match(value):
            raise ValueError(f"{value!r} is not a runtime name")
        return value

    @field_validator("workspace_path")
    @classmethod
    def _workspace_path(cls, value: str | None) -> str | None:
        return None if value is None else check_workspace_path(value)

    @model_validator(mode="before")
    @classmethod
    def _group_model_options(cls, fields: Any) -> Any:
        """The flat ``--model-*`` options become one :class:`ModelUpstream` (all three it needs, or none)."""
        if not isinstance(fields, dict) or not any(name in fields for name in (*MODEL_OPTIONS, "no_model_bodies")):
            return fields
        if "upstream" in fields:
            raise ValueError("pass either upstream or the --model-* options, not both")
        fields = dict(fields)
        given = {name: fields.pop(name) for name in (*MODEL_OPTIONS, "no_model_bodies") if name in fields}
        present = [name for name in _MODEL_REQUIRED if given.get(name) is not None]
        if not present:
            return fields  # tuning options alone (batch-wide defaults, say) change nothing without a model
        required = _REPLAYING_REQUIRED if _replaying(given.get("model_cassette")) else _MODEL_REQUIRED
        if any(given.get(name) is None for name in required):
            missing = ", ".join(flag_name(name) for name in required if name not in present)
            raise ValueError(
                f"a model gateway needs --model-base-url, --model and --model-api-key-env; missing {missing}"
            )
        upstream = {MODEL_OPTIONS[k]: v for k, v in given.items() if k in MODEL_OPTIONS and v is not None}
        if given.get("no_model_bodies"):
            upstream["body_limit"] = 0
        fields["upstream"] = upstream
        return fields

    @model_validator(mode="after")
    def _image_or_agent(self) -> ReplaySpec:
        if self.inject and not self.image:
            raise ValueError("--inject needs --image (the task image to inject the agent's runtime into)")
        if self.image_workspace and self.workspace_dir is not None:
            raise ValueError("--image-workspace and --workspace-dir both set the starting workspace; pass one")
        if self.no_workspace and self.collect not in (None, "none"):
            raise ValueError(f"--no-workspace and --collect {self.collect} disagree; pass one")
        if self.verify is not None and not self.verify.strip():
            raise ValueError("--verify: an empty command")
        refusal = self.egress.loopback_refusal() if self.egress is not None else None
        if refusal is not None:
            raise ValueError(f"--egress {refusal}")
        if self.egress is not None and self.network != "none":
            raise ValueError(f"--egress with --network {self.network}: the bridge reaches every host; keep "
                             "--network none and list the hosts with --egress")  # fmt: skip
        if self.fork is not None and self.mode != "continue":
            raise ValueError(f"--fork with --mode {self.mode}: forks continue from the boundary; use --mode continue")
        if self.fork is not None and self.continuation is not None and self.continuation.network != "unix":
            raise ValueError(f"--fork with --model-network {self.continuation.network}: each fork reaches the model "
                             "through a socket of its own; keep --model-network unix (the default)")  # fmt: skip
        cassette = self.continuation.cassette if self.continuation is not None else None
        if self.fork is not None and cassette is not None and not cassette.replaying:
            raise ValueError("--fork with --model-cassette record: K forks would record K tapes under one name; "
                             "record with a plain replay, then fork with --model-cassette replay")  # fmt: skip
        if self.fork is not None and self.inject:
            raise ValueError("--fork with --inject: pvisor launches an injected runtime from its manifest, which the "
                             "fork gate cannot stand in front of")  # fmt: skip
        if self.fork_strict and self.fork is None:
            raise ValueError("--fork-strict without --fork")
        if self.egress is not None and self.continuation is not None and self.continuation.network != "unix":
            raise ValueError(f"--egress with --model-network {self.continuation.network}: that puts the sandbox on a "
                             "network of its own; keep --model-network unix (the default) with --egress")  # fmt: skip
        return self

    @property
    def collect_mode(self) -> Collect:
        """What of the workspace is collected: ``--collect``, ``none`` with ``--no-workspace``, else ``full``."""
        if self.no_workspace:
            return "none"
        return self.collect or "full"

    @property
    def continuation(self) -> ModelUpstream | None:
        """The upstream of a live continuation (``--mode continue`` with ``--model-base-url``), else None."""
        return self.upstream if self.mode == "continue" else None


def _replaying(cassette: Any) -> bool:
    """Whether a ``--model-cassette`` value (``[MODE, DIR]``, a mapping or a :class:`Cassette`) serves back."""
    if isinstance(cassette, Cassette):
        return cassette.replaying
    if isinstance(cassette, list | tuple) and cassette:
        return bool(cassette[0] == "replay")
    return isinstance(cassette, dict) and bool(cassette.get("mode") == "replay")


def check_workspace_path(value: str) -> str:
    """Validate an in-sandbox workspace path: absolute, normalised, not covering system directories."""
    if not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path")
    normal = posixpath.normpath(value)
    if normal != value.rstrip("/") and normal != value:
        raise ValueError(f"{value!r} must be a normalised path (try {normal!r})")
    if normal in _RESERVED_PATHS or any(normal == t or normal.startswith(t + "/") for t in _RESERVED_TREES):
        raise ValueError(f"{normal!r} would cover a system directory of the sandbox; choose e.g. /workspace")
    return normal


_FLAG_NAMES = {"no_workspace": "--no-workspace"}
_GROUPED = {f"upstream.{field}": option for option, field in MODEL_OPTIONS.items()}


def flag_name(field: str) -> str:
    """The CLI flag for a spec field (``after_step`` → ``--after-step``, ``upstream.base_url`` →
    ``--model-base-url``)."""
    field = _GROUPED.get(field, field)
    return _FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def describe_validation_error(exc: ValidationError, *, flags: bool = True) -> str:
    """One line for the first problem of a pydantic error, naming the flag (or manifest field) at fault."""
    first = exc.errors()[0]
    location = ".".join(str(part) for part in first["loc"] if not isinstance(part, int))
    message = str(first["msg"]).removeprefix("Value error, ")
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, UsageError):
        message = cause.one_line()
    elif first["type"] == "missing":
        message = "is required"
    elif first["type"] == "extra_forbidden":
        message = "is not a known option"
    where = (flag_name(location) if flags else _GROUPED.get(location, location)) if location else ""
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where}: {message}{more}" if where else message + more


def build_spec(**fields: Any) -> ReplaySpec:
    """Validate ``fields`` into a :class:`ReplaySpec`, raising :class:`UsageError` with one clear line."""
    try:
        return ReplaySpec(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise UsageError(describe_validation_error(exc)) from None


def parse_user(user: str) -> tuple[int, int]:
    """``UID[:GID]`` or ``root`` → (uid, gid)."""
    if user == "root":
        return 0, 0
    uid_text, _, gid_text = user.partition(":")
    return int(uid_text), int(gid_text or uid_text)


def known_user(configured: str) -> str | None:
    """``uid:gid`` of an image's configured user (``USER``) when its text alone says it (``""`` and ``root`` are
    root); None when only the image's ``/etc/passwd`` can (a name, or a uid alone, whose group is its entry's)."""
    user, _, group = configured.partition(":")
    if user in ("", "root", "0") and group in ("", "root", "0"):
        return "0:0"
    if user.isdigit() and group.isdigit():
        return f"{user}:{group}"
    return None


def default_user() -> str:
    """The sandbox's default uid:gid: the caller's own when not root, else 65532 (a conventional nonroot)."""
    uid = os.getuid()
    return "65532:65532" if uid == 0 else f"{uid}:{os.getgid()}"
