"""Agent profiles: the declarative ``adapters/<agent>.toml`` files, validated.

A profile says everything pvisor-host needs to know about one agent pvisor replays: the pinned version,
how its runtime is installed into an image, where its entrypoint lives, how to check its version, what
its continuation needs and what its native trajectories look like. Adding an agent means adding a
profile, not editing the controller.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from importlib import resources
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import UsageError

_NAME = r"^[a-z][a-z0-9-]*$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NpmInstall(_Model):
    """The runtime is an npm package installed globally at the pinned version."""

    kind: Literal["npm"] = "npm"
    package: str
    """npm package name, e.g. ``@anthropic-ai/claude-code``; the version is the profile's ``version``."""
    node: bool = True
    """Whether the image needs node (pinned in ``images/runtimes.toml``) for the install or at run time."""


class PipInstall(_Model):
    """The runtime is a Python distribution installed into its own virtual environment."""

    kind: Literal["pip"] = "pip"
    package: str
    """PyPI distribution name; the version is the profile's ``version``."""


class UnavailableInstall(_Model):
    """The pinned runtime cannot be installed; ``build`` refuses with ``reason``."""

    kind: Literal["unavailable"] = "unavailable"
    reason: str
    """One sentence saying why the pinned version cannot be had."""


Install = Annotated[NpmInstall | PipInstall | UnavailableInstall, Field(discriminator="kind")]


class VersionProbe(_Model):
    """How to ask the agent CLI for its version, and what the pinned answer looks like."""

    args: list[str] = ["--version"]
    """Arguments given to the entrypoint."""
    expect: str
    """Regular expression the stripped output must match in full."""

    def matches(self, output: str) -> bool:
        """True when ``output`` is the pinned version's answer."""
        return re.fullmatch(self.expect, output.strip()) is not None


class ContinuationNeeds(_Model):
    """What the live continuation (default mode) needs from its environment."""

    api: Literal["chat-completions", "responses"]
    """Which OpenAI-compatible API the agent's bridge calls upstream."""
    env: list[list[str]] = []
    """Groups of variable names; one name of every group must be set."""
    optional_env: list[str] = []
    """Variables the agent reads when present."""


class TrajectoryFormat(_Model):
    """What the agent's native trajectory looks like, for sniffing and defaults."""

    description: str
    encoding: Literal["jsonl", "json"]
    fingerprint: list[list[str]]
    """Rule sets: the format is recognised when one JSON object satisfies every rule of one set.
    A rule is a dotted key (``payload.cwd``) that must exist, or ``key=value`` that must equal."""
    workspace_hint: list[str] = []
    """Dotted keys holding the working directory the recording ran in (first absolute path wins)."""


class NativeArtifacts(_Model):
    """pvisor's file names (under its output dir) for the agent's native trajectories."""

    prepared: str
    reconstructed: str
    continued: str


class AgentProfile(_Model):
    """One agent pvisor 0.3.1 replays, pinned to an exact runtime version."""

    agent: Annotated[str, Field(pattern=_NAME)]
    """pvisor's ``--agent`` name."""
    display_name: str
    version: str
    """The exact CLI/runtime version pvisor's profile requires."""
    pvisor_profile: str
    """pvisor's own profile id, e.g. ``claude-code/2.1.220/native-resume-v1``."""
    entrypoint: str
    """Absolute path of the agent executable inside images built by pvisor-host."""
    install: Install
    version_probe: VersionProbe
    continuation: ContinuationNeeds
    trajectory: TrajectoryFormat
    artifacts: NativeArtifacts

    @field_validator("entrypoint")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("entrypoint must be an absolute path")
        return value

    @property
    def installable(self) -> bool:
        """False when the pinned runtime cannot be installed here."""
        return not isinstance(self.install, UnavailableInstall)


def _load(name: str, text: str) -> AgentProfile:
    try:
        profile = AgentProfile.model_validate(tomllib.loads(text))
    except (tomllib.TOMLDecodeError, ValidationError) as exc:
        raise UsageError(f"agent profile {name} is invalid: {exc}") from exc
    if f"{profile.agent}.toml" != name:
        raise UsageError(f"agent profile {name} declares agent {profile.agent!r}; the file must be named after it")
    return profile


@cache
def all_profiles() -> dict[str, AgentProfile]:
    """Every profile shipped in the ``adapters`` package, by agent name."""
    root = resources.files("pvisor_host.adapters")
    profiles = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            profile = _load(entry.name, entry.read_text(encoding="utf-8"))
            profiles[profile.agent] = profile
    return profiles


def get_profile(agent: str) -> AgentProfile:
    """The profile for ``agent``, or a :class:`UsageError` naming the known agents."""
    profiles = all_profiles()
    try:
        return profiles[agent]
    except KeyError:
        known = ", ".join(sorted(profiles))
        raise UsageError(f"unknown agent {agent!r}", hint=f"known agents: {known}") from None
