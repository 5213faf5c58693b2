"""The one exception tree of pvisor-host, and the exit codes it maps to.

Every error the controller raises on purpose derives from :class:`PvisorHostError`, and every leaf
carries the exit code the CLI reports for it. The CLI catches the root once, prints one line and exits
with that code; nothing else in the package decides exit codes.

    PvisorHostError                      (exit 6, infrastructure)
    ├── UsageError(ValueError)           (exit 2) bad flags, bad input, bad trajectory, bad image
    │   ├── PreflightRejected             pvisor's own host-side pre-flight refused the request
    │   └── ImageUnavailable              the registry has no such image, or refuses us
    ├── PrerequisiteError                 (exit 3) engine unreachable, a tool or image missing
    ├── InfrastructureError               (exit 6) engine or build failed in a way no input explains
    │   ├── ImageBuildError
    │   ├── RegistryError                 a registry stayed unreachable or failing past the retries
    │   ├── ResultProtocolError           pvisor printed something that is not a v3 result
    │   ├── EngineUnresponsive            the engine stopped answering (a batch stops starting items)
    │   └── DiskFull                      the filesystem of the run directory is full
    └── Interrupted                       (exit 130) Ctrl-C or SIGTERM, after cleanup

A batch reports an error that refused an item under its ``category`` (by default the exit code's name:
``usage``, ``infrastructure``, ...; ``image_not_found``, ``registry_unauthorized``, ``registry_error`` for
the image errors).

Outcomes of a replay that *ran* (ok, replay_failed, timeout, oom, infra_error) are not exceptions:
they are the ``status`` of a :class:`~pvisor_host.models.record.ReplayRecord`, mapped to exit codes by
:func:`exit_code_for_status`.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of the ``pvisor-host`` CLI (documented in ``docs/exit-codes.md``)."""

    OK = 0
    REPLAY_FAILED = 1
    USAGE = 2
    PREREQUISITE = 3
    TIMEOUT = 4
    OOM = 5
    INFRASTRUCTURE = 6
    INTERRUPTED = 130


class PvisorHostError(Exception):
    """Root of every error pvisor-host raises on purpose."""

    exit_code: ExitCode = ExitCode.INFRASTRUCTURE

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    @property
    def category(self) -> str:
        """The failure category a batch records for an item this error refused."""
        return self.exit_code.name.lower()

    def one_line(self) -> str:
        """The single line shown to users: what is wrong, then how to fix it."""
        text = self.message.strip().replace("\n", " ")
        return f"{text} ({self.hint})" if self.hint else text


class UsageError(PvisorHostError, ValueError):
    """The request itself is wrong: a flag, the trajectory, the image, the output directory."""

    exit_code = ExitCode.USAGE


class PreflightRejected(UsageError):
    """pvisor's host-side ``--prepare-only`` pre-flight rejected the trajectory or the boundary."""

    def __init__(self, category: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(f"pvisor rejected the replay ({category}): {message}", hint=hint)
        self.pvisor_category = category

    @property
    def category(self) -> str:
        """pvisor's own failure category (``trajectory_error``, ``configuration_error``, ...)."""
        return self.pvisor_category


class ImageUnavailable(UsageError):
    """The image cannot be had: the registry has no such image (``image_not_found``), or refuses the credentials
    we have (``registry_unauthorized``)."""

    def __init__(self, kind: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.kind = kind

    @property
    def category(self) -> str:
        return self.kind


class PrerequisiteError(PvisorHostError):
    """Something the host needs is missing: the Docker engine, mmdebstrap, the pvisor binary."""

    exit_code = ExitCode.PREREQUISITE


class InfrastructureError(PvisorHostError):
    """The engine, a build or the sandbox failed in a way the user's input does not explain."""

    exit_code = ExitCode.INFRASTRUCTURE


class ImageBuildError(InfrastructureError):
    """An image build or its post-build verification failed."""


class RegistryError(InfrastructureError):
    """A registry stayed unreachable, rate-limited or failing past the pull's retries."""

    @property
    def category(self) -> str:
        return "registry_error"


class DiskFull(InfrastructureError):
    """A filesystem pvisor-host writes to (the run directory's, the staging's) has no space left."""

    def __init__(self, mount: str, free: int, message: str) -> None:
        super().__init__(message)
        self.mount = mount
        self.free = free


class EngineUnresponsive(InfrastructureError):
    """The engine stopped answering: waiting on it would wait for good (a batch ends with what it has)."""


class ResultProtocolError(InfrastructureError):
    """pvisor's stdout was not a ``sandbox-playback.result/v3`` object this version understands."""


class Interrupted(PvisorHostError):
    """The user pressed Ctrl-C (or the process got SIGTERM); cleanup has already run."""

    exit_code = ExitCode.INTERRUPTED


#: Exit code for each :class:`~pvisor_host.record.ReplayStatus` value.
STATUS_EXIT_CODES: dict[str, ExitCode] = {
    "ok": ExitCode.OK,
    "replay_failed": ExitCode.REPLAY_FAILED,
    "timeout": ExitCode.TIMEOUT,
    "oom": ExitCode.OOM,
    "infra_error": ExitCode.INFRASTRUCTURE,
    "interrupted": ExitCode.INTERRUPTED,
}


def exit_code_for_status(status: str) -> ExitCode:
    """Map a replay record's status to the CLI exit code."""
    return STATUS_EXIT_CODES[status]
