"""Images at the backend seam: what a replay asks for, how the backend means to get it, and what it got.

The decision is a discriminated union (:data:`ImagePlan`): each kind carries exactly what it needs, and the
agent's profile, resolved once, travels with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .profiles import AgentProfile

#: Where an injected runtime's agent lives inside a sandbox (pvisor's ``--agent-runtime``).
RUNTIME_ROOT = "/pvisor-host/runtime/agent"


class ImageRef(BaseModel):
    """The sandbox image and what it carries."""

    ref: str
    """The reference the image was asked for or built as (a tag)."""
    id: str
    """The engine's image id."""
    agent: str
    agent_version: str
    pvisor_version: str
    agent_entrypoint: str
    """The agent executable inside the sandbox (under the runtime volume for ``inject``)."""
    pvisor_path: str
    verified_by: Literal["labels", "probe", "build", "inject"]
    """How the versions were established: built and probed, the image's labels, a probe, or injected from a
    verified agent image."""
    runtime_volume: str | None = None
    """``--inject``: the read-only runtime volume mounted at /pvisor-host/runtime."""
    agent_image: str | None = None
    """``--inject``: the verified agent image the runtime volume was filled from."""
    digest: str | None = None
    """The registry digest the image came from (``repo@sha256:...``), when it was asked for by a reference the
    engine holds a digest for; None for images built here."""
    user: str | None = None
    """A task image's own user, as its configuration says (``uid:gid`` where the engine could read it from the
    image's ``/etc/passwd``; ``""``: root); None for the product's agent images."""
    env: dict[str, str] = {}
    """The environment the image's configuration sets (``Config.Env``), which every sandbox of it starts with."""

    @property
    def task_image(self) -> bool:
        """A task image (someone else's image: probed, or with the agent injected), not one pvisor-host built."""
        return self.verified_by in ("probe", "inject")

    @property
    def runtime_root(self) -> str | None:
        """pvisor's ``--agent-runtime`` directory when the agent is injected."""
        return RUNTIME_ROOT if self.runtime_volume else None


class BaseImage(BaseModel):
    """The base an agent image builds on."""

    model_config = ConfigDict(frozen=True)

    ref: str
    id: str
    source: Literal["local", "pulled", "bootstrapped", "bootstrapped-earlier"]
    """Found locally, pulled from a registry, bootstrapped now with mmdebstrap, or bootstrapped earlier."""


class BuiltImage(BaseModel):
    """An agent image ready for replays (what ``pvisor-host build`` reports)."""

    tag: str
    id: str
    agent: str
    agent_version: str
    pvisor_version: str
    recipe_hash: str
    """sha256 over the recipe files, build arguments, labels and the base image id."""
    base: BaseImage
    cached: bool
    """True when the tag already existed and nothing was built."""
    seconds: float = 0.0
    size: int = 0
    pushed: str | None = None
    """``build --push``: the digest reference it can be pulled by (``registry/name@sha256:...``)."""


class BuildOptions(BaseModel):
    """How agent images are built when one must be (``--base``, ``--ca-bundle``, ``--bootstrap``)."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    base: str | None = None
    """Base image when an agent image must be built; default ``debian:<suite>-slim``, bootstrapped with
    mmdebstrap when no registry answers."""
    ca_bundle: Path | None = None
    """CA bundle for the build's downloads; default: ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE`` or ``PIP_CERT``."""
    force_bootstrap: bool = False
    """Bootstrap the Debian base with mmdebstrap instead of pulling it."""


class ImageRequest(BaseModel):
    """The image part of a replay request: ``--image``, ``--agent`` (resolved to its profile), ``--inject``."""

    model_config = ConfigDict(frozen=True)

    image: str | None = None
    profile: AgentProfile | None = None
    inject: bool = False
    pvisor_only: bool = False
    """Without ``image``: pvisor is all the sandbox needs (``--mode prepare-only`` starts no agent)."""

    @property
    def key(self) -> tuple[str | None, str | None, bool, bool]:
        """What tells two requests' images apart: requests with one key share one image."""
        agent = self.profile.agent if self.profile is not None else None
        return self.image, agent, self.inject, self.pvisor_only and self.image is None

    @property
    def runtime_image(self) -> ImageRequest | None:
        """The agent's own image, which an injected runtime comes from (None: nothing is injected, or the image's
        label names the agent)."""
        return ImageRequest(profile=self.profile) if self.inject and self.profile is not None else None


class _Plan(BaseModel):
    model_config = ConfigDict(frozen=True)

    profile: AgentProfile
    """The agent the image is for (given with ``--agent``, or named by the image's label)."""


class BuildPlan(_Plan):
    """Use the image ``pvisor-host build`` makes for the agent, building it when it is missing; with
    ``pvisor_only``, the image with pvisor and no agent runtime that ``--mode prepare-only`` needs (any agent's)."""

    action: Literal["build"] = "build"
    pvisor_only: bool = False


class _Existing(_Plan):
    ref: str
    """The image as the user named it."""
    id: str
    labels: dict[str, str] = {}
    digest: str | None = None
    """The registry digest the engine holds it by for that name (``repo@sha256:...``), when it has one."""
    user: str = ""
    """The user its configuration runs as (``Config.User``: a name, ``uid[:gid]``, or ``""`` for root)."""
    env: dict[str, str] = {}
    """The environment its configuration sets (``Config.Env``)."""


class LabelledPlan(_Existing):
    """An image pvisor-host built: its labels vouch for the pinned versions (no container needed)."""

    action: Literal["labels"] = "labels"


class ProbePlan(_Existing):
    """An image pvisor-host did not build: a probe container must confirm the versions first."""

    action: Literal["probe"] = "probe"


class InjectPlan(_Existing):
    """A task image used unchanged: pvisor and the agent come from a runtime volume filled from the agent image."""

    action: Literal["inject"] = "inject"


ImagePlan = Annotated[BuildPlan | LabelledPlan | ProbePlan | InjectPlan, Field(discriminator="action")]
"""The image decision, made before anything runs."""


class ResolvedImage(BaseModel):
    """An image ready to run replays in."""

    profile: AgentProfile
    """The agent it runs (its profile, resolved once with the plan)."""
    image: ImageRef
    built: BuiltImage | None = None
    """The agent image built or found on the way: the image itself for ``--agent`` alone, the runtime's source
    for ``--inject``; None for an image the user named."""


class PullProgress(BaseModel):
    """How far one pull has come (the engine reports its layers as they download)."""

    ref: str
    done: int
    """Bytes downloaded so far (layers already present count as nothing)."""
    total: int | None = None
    """Bytes to download, once the engine knows every layer's size."""
    seconds: float = 0.0
    """Since the pull started."""
    finished: bool = False
    """The pull has ended (done, failed or stopped)."""

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.done / self.seconds if self.seconds > 0 else 0.0


class PulledImage(BaseModel):
    """An image present on the engine because a batch asked for it by reference."""

    ref: str
    id: str
    digest: str | None = None
    """The registry digest it came from (``repo@sha256:...``), when the engine knows one."""
    size: int = 0
    """Bytes on the engine (unpacked)."""
    pulled: bool = False
    """Pulled now; False: it was already there (then nobody may remove it on the batch's behalf)."""
    downloaded: int = 0
    seconds: float = 0.0


class ImageHold(BaseModel):
    """One item's (or a batch's look-ahead's) hold on a task image, from the moment it asks for it until its
    container is gone: an image held is never removed to make room."""

    ref: str
    token: str
    key: str | None = None
    """The image as the engine's cache knows it (None: nothing the cache keeps: an image it did not pull, or
    an image a cluster's nodes pull)."""
    present: PulledImage | None = None
    """Set when the image was there already: nothing to pull."""
    added: int = 0
    """Bytes its pull is expected to add to the cache's layers."""
    compressed: int = 0
    """Bytes its pull is expected to download."""
    budget: int | None = None
    evicted: list[str] = []
    """The images removed to make its room."""
    over_budget: bool = False
    """It went ahead over the budget (nothing more could go)."""


class ImageUsage(BaseModel):
    """What an engine's image cache holds: what ``cluster status`` and a batch's summary show."""

    images: int
    bytes: int
    """Bytes its images' layers take on disk, each layer once."""
    peak: int
    """The most bytes they took while the batch (for ``cluster status``: the latest batch) used the cache."""
    budget: int | None


class ImageCost(BaseModel):
    """What an image named by reference will cost a batch, found without pulling it."""

    ref: str
    present: bool
    id: str | None = None
    size: int | None = None
    """Bytes on the engine, when present."""
    digest: str | None = None
    """The registry's digest for the reference (or the one the engine holds it by)."""
    layers: dict[str, int] = {}
    """When absent: its layers (digest → compressed bytes), as the registry lists them."""
    error: str | None = None
    """When absent and the registry could not say: why."""
    unavailable: bool = False
    """That ``error`` is final and the input's: no such image, credentials refused, a registry that does not
    resolve or refuses connections (otherwise the registry's trouble, which may pass)."""

    @property
    def pull_bytes(self) -> int:
        """Bytes a pull downloads (0 when present)."""
        return 0 if self.present else sum(self.layers.values())


class ImagePreview(BaseModel):
    """What :class:`ResolvedImage` a plan would give, found without building, probing or filling anything."""

    image: ImageRef
    """The image; while it is still to be built, a stand-in with the tag and versions it will have."""
    exists: bool
    """False while the image is still to be built (its id, and so content keys, are not known yet)."""
    note: str | None = None
    """What the first run does first (a build, a probe)."""
