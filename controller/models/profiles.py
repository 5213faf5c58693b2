"""Agent profiles: the declarative ``adapters/<agent>.toml`` files, validated.

A profile says everything pvisor-host needs to know about one agent pvisor replays: the pinned version,
how its runtime is installed into an image, where its entrypoint lives, how to check its version, what
its continuation needs and what its native trajectories look like. Adding an agent means adding a
profile, not editing the controller.
"""

from __future__ import annotations

import json
import re
import tomllib
from functools import cache
from importlib import resources
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import UsageError
from .gateway import Masks

_NAME = r"^[a-z][a-z0-9-]*$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NpmInstall(_Model):
    """The runtime is an npm package installed at the pinned version."""

    kind: Literal["npm"] = "npm"
    package: str
    """npm package name, e.g. ``@anthropic-ai/claude-code``; the version is the profile's ``version``."""
    node: bool = True
    """Whether the image needs node (pinned in ``images/runtimes.toml``) for the install or at run time."""
    prefix: str | None = None
    """``npm --prefix`` for the install; default: the global prefix ``/usr/local``."""
    fragment: str | None = None
    """A script in ``images/sandbox/fragments/`` run after the install (e.g. to lay out a runtime root)."""


class PipInstall(_Model):
    """The runtime is a Python distribution installed into its own virtual environment."""

    kind: Literal["pip"] = "pip"
    package: str
    """PyPI distribution name; the version is the profile's ``version``."""
    venv: str = "/opt/agent"
    """Where the virtual environment is created."""
    fragment: str | None = None
    """A script in ``images/sandbox/fragments/`` run after the install."""


class UnavailableInstall(_Model):
    """The pinned runtime cannot be installed; ``build`` refuses with ``reason``."""

    kind: Literal["unavailable"] = "unavailable"
    reason: str
    """Precisely why the pinned version cannot be had (where it is published, what is missing)."""


Install = Annotated[NpmInstall | PipInstall | UnavailableInstall, Field(discriminator="kind")]


class InjectSpec(_Model):
    """How ``--inject`` carries the agent's runtime into a task image that does not have it.

    The runtime is copied out of the verified agent image into a read-only volume once per
    (agent, version, pvisor version) and mounted at ``/pvisor-host/runtime``; pvisor then runs it
    through a ``sandbox-playback-agent.json`` manifest (``--agent-runtime``).
    """

    paths: dict[str, str]
    """Destination (relative to the runtime root, ``.`` for the root itself) → absolute source path in the
    agent image. Directories are copied recursively; symlinks are followed."""
    entrypoint: str
    """The agent executable, relative to the runtime root."""
    requires: list[str] = []
    """Paths the task image must provide (e.g. ``/bin/bash`` for Claude's Bash tool)."""
    libraries: list[str] = []
    """Shared libraries the task image must provide (e.g. ``libstdc++.so.6`` for node)."""

    @field_validator("entrypoint")
    @classmethod
    def _relative(cls, value: str) -> str:
        if not value or value.startswith("/") or ".." in value.split("/"):
            raise ValueError("inject.entrypoint must be a relative path without '..'")
        return value


class VersionProbe(_Model):
    """How to ask the agent CLI for its version, and what the pinned answer looks like."""

    args: list[str] = ["--version"]
    """Arguments given to the entrypoint."""
    expect: str
    """Regular expression searched in the output (stdout, or stderr when stdout is empty), as pvisor reads it;
    anchor it (``\\A...\\Z``, ``^...$``) to demand an exact answer."""

    def matches(self, output: str) -> bool:
        """True when ``output`` is the pinned version's answer."""
        return re.search(self.expect, output.strip(), re.MULTILINE) is not None


class ContinuationNeeds(_Model):
    """What the live continuation (default mode) needs from its environment."""

    api: Literal["chat-completions", "responses"]
    """Which OpenAI-compatible API the agent's bridge calls upstream."""
    env: list[list[str]] = []
    """Groups of variable names; one name of every group must be set."""
    optional_env: list[str] = []
    """Variables the agent reads when present."""
    gateway_env: dict[str, str] = {
        "OPENAI_BASE_URL": "{base_url}",
        "OPENAI_API_KEY": "{api_key}",
        "MODEL_NAME": "{model}",
    }
    """What the sandbox gets with a model gateway: ``{base_url}`` (the gateway), ``{api_key}`` (the per-run
    token) and ``{model}`` are filled in."""
    volatile: Masks = ()
    """Patterns (regular expressions) of what the agent writes afresh each run into the context it sends (a
    tool output's chunk id, its wall time): masked when a cassette compares a request with its recording."""

    def sandbox_model_env(self, *, base_url: str, api_key: str, model: str) -> dict[str, str]:
        """The variables that point this agent at its model."""
        return {k: v.format(base_url=base_url, api_key=api_key, model=model) for k, v in self.gateway_env.items()}


class TrajectoryFormat(_Model):
    """What the agent's native trajectory looks like, for sniffing and defaults."""

    description: str
    encoding: Literal["jsonl", "json"]
    fingerprint: list[list[str]]
    """Rule sets: the format is recognised when one JSON object satisfies every rule of one set.
    A rule is a dotted key (``payload.cwd``) that must exist, or ``key=value`` that must equal."""
    workspace_hint: list[str] = []
    """Dotted keys holding the working directory the recording ran in (first absolute path wins)."""

    @property
    def fingerprint_key(self) -> str:
        """The fingerprint as a hashable text (a cache key)."""
        return json.dumps(self.fingerprint)

    version_hint: list[str] = []
    """Dotted keys holding the version of the agent that recorded it (first string wins)."""
    config_defaults: str | None = None
    """A JSON file in the agent's image with the agent's own default configurations (mini-swe-agent: its
    ``mini.yaml`` and ``mini_textbased.yaml``): what a saved trajectory's config lacks and pvisor's runner needs
    is filled from it (:func:`pvisor_host.backend.docker.sandbox.native.fill_config`)."""


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
    suite: Literal["bookworm", "trixie"] = "bookworm"
    """Debian release of the default base (an agent may need a newer Python than bookworm's 3.11)."""
    install: Install
    inject: InjectSpec | None = None
    """How ``--inject`` carries the runtime into task images; absent: the agent cannot be injected."""
    inject_unsupported: str | None = None
    """Why the agent cannot be injected (shown when ``inject`` is absent)."""
    fork_unsupported: str | None = None
    """Why ``--fork`` cannot gate the agent's launch (absent: pvisor launches it by its entrypoint alone)."""
    version_probe: VersionProbe
    sandbox_env: dict[str, str] = {}
    """Non-secret variables set in every sandbox of this agent (they show in ``docker inspect``)."""
    replay_only_env: dict[str, str] = {}
    """Non-secret variables set in its ``replay-only`` sandboxes: what its runner needs to start although no
    model is called (mini-swe-agent's refuses to start without a model name)."""
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
    def install_source(self) -> str:
        """Where the pinned runtime comes from, for listings."""
        install = self.install
        if isinstance(install, NpmInstall):
            return f"npm {install.package}@{self.version}"
        if isinstance(install, PipInstall):
            return f"PyPI {install.package}=={self.version}"
        return "unavailable"

    @property
    def inject_refusal(self) -> str | None:
        """Why the agent cannot be injected into a task image, in one line (None: it can)."""
        if self.inject is not None:
            return None
        reason = self.inject_unsupported or "its profile has no [inject] section"
        return f"{self.agent} cannot be injected into a task image: {reason}"

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
