"""Image stage: resolve a base, render the sandbox recipe, build it once, verify it, reuse it.

The tag is content-addressed — ``pvisor-host/<agent>:<version>-pvisor<version>-<hash12>`` — the hash
covering every recipe file, every build argument (the CA bundle included) and the base image id. An
image with that tag is therefore exactly what the recipe would build again, and a second ``build``
with nothing changed starts no docker build at all.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import tomllib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import docker
import requests
from docker.errors import APIError, ImageNotFound, NotFound
from docker.models.images import Image
from loguru import logger
from pydantic import BaseModel, ConfigDict
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from . import bootstrap
from . import labels as L
from ._version import PVISOR_VERSION
from .engine import engine_failure
from .errors import ImageBuildError, PrerequisiteError, UsageError
from .probe import ProbeResult, probe_agent_image, version_problem
from .profiles import AgentProfile, NpmInstall, PipInstall, UnavailableInstall

DEFAULT_BASE = "debian:bookworm-slim"
#: Where the sandbox recipe installs pvisor.
DEFAULT_PVISOR_PATH = "/opt/pvisor/bin/pvisor"
#: Where the sandbox recipe installs the model-gateway relay.
RELAY_PATH = "/usr/local/lib/pvisor-host/relay"
_RECIPE_DIR = "sandbox"
_RECIPE_FILES = ("Dockerfile", "with-ca.sh", "ensure-os.sh", "fetch-npm.py", "install-agent.sh", "relay.c")
_BUILD_TIMEOUT = 3600
# Registry errors that mean "cannot reach it" (retried a little, then we bootstrap), not "no such image".
_UNREACHABLE = (
    "no such host",
    "dial tcp",
    "connection refused",
    "i/o timeout",
    "tls handshake timeout",
    "client.timeout",
    "network is unreachable",
    "connection reset",
    "temporary failure",
)


class BaseImage(BaseModel):
    """The base an agent image builds on."""

    model_config = ConfigDict(frozen=True)

    ref: str
    id: str
    source: Literal["local", "pulled", "bootstrapped", "bootstrapped-earlier"]


class BuiltImage(BaseModel):
    """An agent image ready for replays."""

    tag: str
    id: str
    agent: str
    agent_version: str
    pvisor_version: str
    recipe_hash: str
    base: BaseImage
    cached: bool
    """True when the tag already existed and nothing was built."""
    seconds: float = 0.0
    size: int = 0


class _Pin(BaseModel):
    package: str
    version: str
    integrity: str

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}#{self.integrity}"


@cache
def _runtimes() -> dict[str, _Pin]:
    text = resources.files("pvisor_host.images").joinpath("runtimes.toml").read_text(encoding="utf-8")
    return {name: _Pin.model_validate(pin) for name, pin in tomllib.loads(text).items()}


class Recipe(BaseModel):
    """A fully rendered build: context files, build args and labels, and the hash of them all."""

    profile: AgentProfile
    base: BaseImage
    files: dict[str, bytes]
    build_args: dict[str, str]

    @property
    def digest(self) -> str:
        """sha256 over recipe files, build args and the base image id."""
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(f"file {name} {hashlib.sha256(self.files[name]).hexdigest()}\n".encode())
        for key in sorted(self.build_args):
            h.update(f"arg {key}={self.build_args[key]}\n".encode())
        h.update(f"base {self.base.id}\n".encode())
        for key, value in sorted(self._facts.items()):
            h.update(f"label {key}={value}\n".encode())
        return h.hexdigest()

    @property
    def _facts(self) -> dict[str, str]:
        """The labels that describe the image's content (everything but the hash itself)."""
        return {
            L.MANAGED: "true",
            L.ROLE: "sandbox-image",
            L.AGENT: self.profile.agent,
            L.AGENT_VERSION: self.profile.version,
            L.AGENT_ENTRYPOINT: self.profile.entrypoint,
            L.PVISOR_VERSION: PVISOR_VERSION,
            L.PVISOR_PATH: DEFAULT_PVISOR_PATH,
            L.BASE_IMAGE: self.base.ref,
        }

    @property
    def tag(self) -> str:
        """``pvisor-host/<agent>:<agent-version>-pvisor<version>-<hash12>``."""
        return f"pvisor-host/{self.profile.agent}:{self.profile.version}-pvisor{PVISOR_VERSION}-{self.digest[:12]}"

    @property
    def labels(self) -> dict[str, str]:
        """Image labels: what the image carries (verified after the build) and the recipe hash."""
        return {**self._facts, L.RECIPE_HASH: self.digest}


def default_ca_bundle() -> Path | None:
    """The CA bundle named by ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE`` or ``PIP_CERT``, if any."""
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT"):
        value = os.environ.get(name)
        if value and Path(value).is_file():
            return Path(value)
    return None


def render(profile: AgentProfile, base: BaseImage, ca_bundle: Path | None) -> Recipe:
    """Render the sandbox recipe for ``profile`` on ``base``."""
    root = resources.files("pvisor_host.images").joinpath(_RECIPE_DIR)
    files = {name: root.joinpath(name).read_bytes() for name in _RECIPE_FILES}
    files["build-ca.pem"] = _read_ca(ca_bundle) if ca_bundle else b""
    install = profile.install
    assert not isinstance(install, UnavailableInstall)
    files["agent-fragment.sh"] = root.joinpath("fragments", install.fragment).read_bytes() if install.fragment else b""
    args = {
        "BASE_IMAGE": base.id,
        "PVISOR_VERSION": PVISOR_VERSION,
        "AGENT_VERSION": profile.version,
        "AGENT_INSTALL": install.kind,
        "AGENT_PACKAGE": install.package,
    }
    if isinstance(install, NpmInstall):
        args["AGENT_TARGET"] = install.prefix or ""
        if install.node:
            args |= {"NODE_SPEC": _runtimes()["node"].spec, "NPM_SPEC": _runtimes()["npm"].spec}
    elif isinstance(install, PipInstall):
        args["AGENT_TARGET"] = install.venv
    return Recipe(profile=profile, base=base, files=files, build_args=args)


def _read_ca(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"--ca-bundle {path}: cannot be read ({exc.strerror})") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise UsageError(f"--ca-bundle {path}: is not a PEM certificate bundle")
    return data


def find_image(client: docker.DockerClient, ref: str) -> Image | None:
    """The local image ``ref``, or None."""
    try:
        return client.images.get(ref)
    except (ImageNotFound, NotFound):
        return None
    except APIError as exc:
        if exc.status_code in (400, 404):  # an unparsable reference is simply not here
            return None
        raise engine_failure(f"inspect image {ref}", exc) from exc


def _unreachable(exc: BaseException) -> bool:
    if isinstance(exc, requests.exceptions.ConnectionError):
        return True
    return isinstance(exc, APIError) and any(m in str(exc.explanation or exc).lower() for m in _UNREACHABLE)


@retry(
    retry=retry_if_exception(_unreachable),
    stop=stop_after_attempt(3),
    wait=wait_exponential(multiplier=0.5, max=4),
    reraise=True,
)
def _pull(client: docker.DockerClient, ref: str) -> Image:
    repository, _, tag = ref.rpartition(":") if ":" in ref.split("/")[-1] else (ref, "", "latest")
    return client.images.pull(repository, tag=tag)


def default_base(suite: str = "bookworm") -> str:
    """The registry base for a Debian release: ``debian:<suite>-slim``."""
    return f"debian:{suite}-slim"


def resolve_base(
    client: docker.DockerClient, base: str | None = None, *, force_bootstrap: bool = False, suite: str = "bookworm"
) -> BaseImage:
    """Find the base image: local, else pulled (retried), else — for the default base — bootstrapped.

    Raises:
        UsageError: ``--bootstrap`` with another ``--base``, or a base the registry does not have.
        PrerequisiteError: the registry is unreachable for an explicit ``--base``.
    """
    if force_bootstrap:
        if base not in (None, default_base(suite)):
            raise UsageError("--bootstrap builds the default Debian base; drop --base or --bootstrap")
        return _bootstrapped(client, suite, reuse=True)
    ref = base or default_base(suite)
    offline = resolve_base_offline(client, base, suite)
    if offline is not None:
        return offline
    logger.info("pulling base image {}", ref)
    try:
        pulled = _pull(client, ref)
    except (APIError, requests.exceptions.RequestException) as exc:
        detail = str(getattr(exc, "explanation", None) or exc).split("\n")[0][:200]
        if not _unreachable(exc):
            raise UsageError(f"base image {ref} cannot be pulled: {detail}") from exc
        if base is not None:
            raise PrerequisiteError(
                f"base image {ref} is not present and no registry is reachable ({detail})",
                hint="docker load it, or omit --base to bootstrap a Debian base",
            ) from exc
        logger.info("no registry is reachable ({}); bootstrapping a local Debian base instead", detail)
        return _bootstrapped(client, suite, reuse=False)
    return BaseImage(ref=ref, id=pulled.id, source="pulled")


def resolve_base_offline(
    client: docker.DockerClient, base: str | None = None, suite: str = "bookworm"
) -> BaseImage | None:
    """The base :func:`resolve_base` would pick without pulling or bootstrapping, or None."""
    ref = base or default_base(suite)
    local = find_image(client, ref)
    if local is not None:
        return BaseImage(ref=ref, id=local.id, source="local")
    earlier = bootstrap.find_bootstrapped(client, suite) if base is None else None
    if earlier is not None:
        return BaseImage(ref=bootstrap.recipe(suite).tag, id=earlier.id, source="bootstrapped-earlier")
    return None


def expected_tag(client: docker.DockerClient, profile: AgentProfile) -> str | None:
    """The tag ``build`` would produce for ``profile`` right now, without building (None: no base yet)."""
    base = resolve_base_offline(client, suite=profile.suite)
    return render(profile, base, default_ca_bundle()).tag if base is not None and profile.installable else None


def _bootstrapped(client: docker.DockerClient, suite: str, *, reuse: bool) -> BaseImage:
    existing = bootstrap.find_bootstrapped(client, suite) if reuse else None
    if existing is not None:
        return BaseImage(ref=bootstrap.recipe(suite).tag, id=existing.id, source="bootstrapped-earlier")
    image = bootstrap.bootstrap(client, suite)
    return BaseImage(ref=bootstrap.recipe(suite).tag, id=image.id, source="bootstrapped")


def build_agent_image(
    client: docker.DockerClient,
    profile: AgentProfile,
    *,
    base: str | None = None,
    ca_bundle: Path | None = None,
    force_bootstrap: bool = False,
) -> BuiltImage:
    """The verified sandbox image for ``profile``, built only when its content-addressed tag is missing.

    Raises:
        UsageError: the agent's pinned runtime cannot be installed (its profile says why).
        ImageBuildError: the build failed, or the built image does not carry the pinned versions.
    """
    if isinstance(profile.install, UnavailableInstall):
        raise UsageError(f"cannot build {profile.agent} {profile.version}: {profile.install.reason}")
    started = time.monotonic()
    resolved = resolve_base(client, base, force_bootstrap=force_bootstrap, suite=profile.suite)
    recipe = render(profile, resolved, ca_bundle if ca_bundle is not None else default_ca_bundle())
    existing = find_image(client, recipe.tag)
    if existing is not None:
        return _built(recipe, existing, cached=True, started=started)
    logger.info("building {} (base {}, {})", recipe.tag, resolved.ref, resolved.source)
    image = _docker_build(client, recipe)
    try:
        verify(client, image.id, profile)
    except ImageBuildError:
        _remove_image(client, recipe.tag)
        raise
    logger.info("built and verified {} in {:.0f}s", recipe.tag, time.monotonic() - started)
    return _built(recipe, image, cached=False, started=started)


def _built(recipe: Recipe, image: Image, *, cached: bool, started: float) -> BuiltImage:
    return BuiltImage(
        tag=recipe.tag,
        id=image.id,
        agent=recipe.profile.agent,
        agent_version=recipe.profile.version,
        pvisor_version=PVISOR_VERSION,
        recipe_hash=recipe.digest,
        base=recipe.base,
        cached=cached,
        seconds=time.monotonic() - started,
        size=int(image.attrs.get("Size", 0)),
    )


def _docker_build(client: docker.DockerClient, recipe: Recipe) -> Image:
    tail: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pvisor-host-build-") as context:
        for name, data in recipe.files.items():
            path = Path(context, name)
            path.write_bytes(data)
            path.chmod(0o755 if name.endswith(".sh") else 0o644)
        try:
            stream = client.api.build(
                path=context,
                tag=recipe.tag,
                buildargs=recipe.build_args,
                labels=recipe.labels,
                rm=True,
                forcerm=True,
                pull=False,
                decode=True,
                timeout=_BUILD_TIMEOUT,
            )
            for event in stream:
                if "error" in event:
                    raise ImageBuildError(
                        f"building {recipe.tag} failed: {event['error'].strip()} | {' | '.join(tail)}"
                    )
                line = str(event.get("stream", "")).rstrip()
                if line:
                    logger.debug("build: {}", line)
                    tail = (tail + [line])[-5:]
        except (APIError, requests.exceptions.RequestException) as exc:
            raise ImageBuildError(f"building {recipe.tag} failed: {exc}") from exc
    image = find_image(client, recipe.tag)
    if image is None:
        raise ImageBuildError(f"the build of {recipe.tag} finished but the image is missing")
    return image


def verify(client: docker.DockerClient, image: str, profile: AgentProfile) -> ProbeResult:
    """Check inside ``image``, with no network, that pvisor and the agent print the pinned versions."""
    found = probe_agent_image(client, image, profile)
    problem = version_problem(found, profile)
    if problem is not None:
        raise ImageBuildError(f"the image just built for {profile.agent} {problem}")
    return found


def _remove_image(client: docker.DockerClient, ref: str) -> None:
    try:
        client.images.remove(ref, force=True)
    except (ImageNotFound, APIError) as exc:
        logger.warning("could not remove the rejected image {}: {}", ref, exc)
