"""Image stage: render the sandbox recipe, build it once, verify it, reuse it.

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
from collections.abc import Callable
from functools import cache
from importlib import resources
from pathlib import Path

import docker
from docker.models.images import Image
from pydantic import BaseModel

from ...._log import logger
from ...._version import PVISOR_VERSION
from ....errors import ImageBuildError, UsageError
from ....models.image import BaseImage, BuildOptions, BuiltImage
from ....models.ownership import Ownership
from ....models.profiles import AgentProfile, NpmInstall, PipInstall, UnavailableInstall
from .. import labels as L
from ..engine import ENGINE_ERRORS, describe
from .base import find_image, resolve_base, resolve_base_offline
from .probe import ProbeResult, probe_agent_image, probe_image, version_problem

#: Where the sandbox recipe installs pvisor.
DEFAULT_PVISOR_PATH = "/opt/pvisor/bin/pvisor"
#: Where the sandbox recipe installs the model-gateway relay.
RELAY_PATH = "/usr/local/lib/pvisor-host/relay"
_RECIPE_DIR = "sandbox"
_RECIPE_FILES = ("Dockerfile", "with-ca.sh", "ensure-os.sh", "fetch-npm.py", "install-agent.sh", "relay.c")
_BUILD_TIMEOUT = 3600
#: The agent step of the prepare-only image: pvisor is all ``--prepare-only`` needs.
_NO_AGENT = b"#!/bin/sh\n# pvisor-host: the prepare-only image carries no agent runtime.\nexit 0\n"


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
    """A fully rendered build: context files, build args and labels, and the hash of them all. Without a
    profile, the prepare-only image: pvisor and no agent runtime."""

    profile: AgentProfile | None
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
        pvisor = {L.PVISOR_VERSION: PVISOR_VERSION, L.PVISOR_PATH: DEFAULT_PVISOR_PATH, L.BASE_IMAGE: self.base.ref}
        if self.profile is None:
            return {L.MANAGED: "true", L.ROLE: "prepare-image", **pvisor}
        return {
            L.MANAGED: "true",
            L.ROLE: "sandbox-image",
            L.AGENT: self.profile.agent,
            L.AGENT_VERSION: self.profile.version,
            L.AGENT_ENTRYPOINT: self.profile.entrypoint,
            **pvisor,
        }

    @property
    def tag(self) -> str:
        """``pvisor-host/<agent>:<agent-version>-pvisor<version>-<hash12>``; ``pvisor-host/pvisor:<version>-<hash12>``
        for the prepare-only image (its hash covers its base, so each Debian suite has its own)."""
        if self.profile is None:
            return f"pvisor-host/pvisor:{PVISOR_VERSION}-{self.digest[:12]}"
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


def render(profile: AgentProfile | None, base: BaseImage, ca_bundle: Path | None) -> Recipe:
    """Render the sandbox recipe for ``profile`` on ``base`` (no profile: pvisor alone, for prepare-only)."""
    root = resources.files("pvisor_host.images").joinpath(_RECIPE_DIR)
    files = {name: root.joinpath(name).read_bytes() for name in _RECIPE_FILES}
    files["build-ca.pem"] = _read_ca(ca_bundle) if ca_bundle else b""
    if profile is None:  # the same recipe with an agent step that installs nothing (agent images keep their hash)
        files["install-agent.sh"] = _NO_AGENT
        files["agent-fragment.sh"] = b""
        args = {"BASE_IMAGE": base.id, "PVISOR_VERSION": PVISOR_VERSION, "AGENT_INSTALL": "none",
                "AGENT_PACKAGE": "", "AGENT_VERSION": ""}  # fmt: skip
        return Recipe(profile=None, base=base, files=files, build_args=args)
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


def expected_tag(client: docker.DockerClient, profile: AgentProfile | None, suite: str | None = None) -> str | None:
    """The tag ``build`` would produce for ``profile`` (None: the prepare-only image on ``suite``) right now,
    without building (None: no base yet, or an agent that cannot be installed)."""
    if profile is not None and not profile.installable:
        return None
    base = resolve_base_offline(client, suite=profile.suite if profile is not None else suite or "bookworm")
    return render(profile, base, default_ca_bundle()).tag if base is not None else None


def build_agent_image(
    client: docker.DockerClient, ownership: Ownership, profile: AgentProfile, build: BuildOptions | None = None
) -> BuiltImage:
    """The verified sandbox image for ``profile``, built only when its content-addressed tag is missing.

    Raises:
        UsageError: the agent's pinned runtime cannot be installed (its profile says why).
        ImageBuildError: the build failed, or the built image does not carry the pinned versions.
    """
    build = build or BuildOptions()
    if isinstance(profile.install, UnavailableInstall):
        raise UsageError(f"cannot build {profile.agent} {profile.version}: {profile.install.reason}")
    return _build_verified(
        client, profile, build, profile.suite, lambda image: verify(client, ownership, image.id, profile)
    )


def build_pvisor_image(
    client: docker.DockerClient, ownership: Ownership, suite: str, build: BuildOptions | None = None
) -> BuiltImage:
    """The prepare-only image for a ``suite`` base: pvisor verified, no agent runtime; built only when missing.

    Raises:
        ImageBuildError: the build failed, or the built image does not carry the pinned pvisor.
    """
    build = build or BuildOptions()

    def verify_pvisor(image: Image) -> None:
        found = probe_image(client, ownership, image.id, entrypoint="/nonexistent", command="-", version_args=[])
        if found.pvisor_version != f"pvisor {PVISOR_VERSION}":
            raise ImageBuildError(
                f"the prepare-only image just built has {found.pvisor_version!r}, not pvisor {PVISOR_VERSION}"
            )

    return _build_verified(client, None, build, suite, verify_pvisor)


def _build_verified(
    client: docker.DockerClient,
    profile: AgentProfile | None,
    build: BuildOptions,
    suite: str,
    check: Callable[[Image], object],
) -> BuiltImage:
    """The image of ``profile``'s recipe (None: pvisor alone) on a ``suite`` base: found by its tag, else built,
    then ``check``ed; an image that fails its check is removed again.

    Raises:
        ImageBuildError: the build failed, or ``check`` refused the image.
    """
    started = time.monotonic()
    resolved = resolve_base(client, build.base, force_bootstrap=build.force_bootstrap, suite=suite)
    ca_bundle = build.ca_bundle if build.ca_bundle is not None else default_ca_bundle()
    recipe = render(profile, resolved, ca_bundle)
    existing = find_image(client, recipe.tag)
    if existing is not None:
        return _built(recipe, existing, cached=True, started=started)
    logger.info("building {} (base {}, {})", recipe.tag, resolved.ref, resolved.source)
    image = _docker_build(client, recipe)
    try:
        check(image)
    except ImageBuildError:
        _remove_image(client, recipe.tag)
        raise
    logger.info("built and verified {} in {:.0f}s", recipe.tag, time.monotonic() - started)
    return _built(recipe, image, cached=False, started=started)


def _built(recipe: Recipe, image: Image, *, cached: bool, started: float) -> BuiltImage:
    return BuiltImage(
        tag=recipe.tag,
        id=image.id,
        agent=recipe.profile.agent if recipe.profile is not None else "",
        agent_version=recipe.profile.version if recipe.profile is not None else "",
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
        except ENGINE_ERRORS as exc:
            raise ImageBuildError(f"building {recipe.tag} failed: Docker engine: {describe(exc)}") from exc
    image = find_image(client, recipe.tag)
    if image is None:
        raise ImageBuildError(f"the build of {recipe.tag} finished but the image is missing")
    return image


def verify(client: docker.DockerClient, ownership: Ownership, image: str, profile: AgentProfile) -> ProbeResult:
    """Check inside ``image``, with no network, that pvisor and the agent print the pinned versions."""
    found = probe_agent_image(client, ownership, image, profile)
    problem = version_problem(found, profile)
    if problem is not None:
        raise ImageBuildError(f"the image just built for {profile.agent} {problem}")
    return found


def _remove_image(client: docker.DockerClient, ref: str) -> None:
    try:
        client.images.remove(ref, force=True)
    except ENGINE_ERRORS as exc:
        logger.warning("could not remove the rejected image {}: {}", ref, describe(exc))
