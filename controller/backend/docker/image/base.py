"""The base an agent image builds on: found locally, pulled, or bootstrapped without any registry.

When no registry can be reached (as on machines whose only way out is a package mirror), pvisor-host builds
its own Debian base from Debian's packages, ``mmdebstrap`` piped into the engine's image import, following
``images/base/bootstrap.toml``. The tag carries a hash of that recipe, so a changed recipe makes a new base
and an unchanged one is reused. Image references are parsed by docker-py (a digest, ``name@sha256:...``,
included); a pull is retried while the registry is unreachable, then the default base is bootstrapped.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import time
import tomllib
from functools import cache
from importlib import resources

import docker
from docker.errors import APIError, ImageNotFound, NotFound
from docker.models.images import Image
from pydantic import BaseModel, ConfigDict

from ...._log import logger
from ....errors import ImageBuildError, PrerequisiteError, UsageError
from ....models.image import BaseImage
from ..engine import ENGINE_ERRORS, describe, engine_errors, is_transient, retrying

BASE_REPOSITORY = "pvisor-host/base"


class BootstrapRecipe(BaseModel):
    """The mmdebstrap invocation that makes the base (``images/base/bootstrap.toml``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    suite: str
    variant: str
    packages: list[str]
    dpkg_options: list[str] = []
    changes: list[str] = []
    """Dockerfile instructions applied by the import (``ENV``, ``CMD``, ``LABEL``)."""

    def digest(self) -> str:
        """Content hash of the recipe."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()

    @property
    def tag(self) -> str:
        """``pvisor-host/base:<suite>-<hash12>``."""
        return f"{BASE_REPOSITORY}:{self.suite}-{self.digest()[:12]}"

    def command(self, mmdebstrap: str) -> list[str]:
        """The mmdebstrap command line writing the root filesystem as a tar to stdout."""
        return [
            mmdebstrap,
            "--quiet",
            f"--variant={self.variant}",
            f"--include={','.join(self.packages)}",
            *(f"--dpkgopt={option}" for option in self.dpkg_options),
            self.suite,
            "-",
        ]


@cache
def recipe(suite: str = "bookworm") -> BootstrapRecipe:
    """The shipped bootstrap recipe, for Debian ``suite`` (the recipe's packages exist in each release)."""
    text = resources.files("pvisor_host.images").joinpath("base/bootstrap.toml").read_text(encoding="utf-8")
    return BootstrapRecipe.model_validate(tomllib.loads(text) | {"suite": suite})


def find_image(client: docker.DockerClient, ref: str) -> Image | None:
    """The local image ``ref``, or None."""
    with engine_errors(f"inspect image {ref}"):
        try:
            return client.images.get(ref)
        except (ImageNotFound, NotFound):
            return None
        except APIError as exc:
            if exc.status_code in (400, 404):  # an unparsable reference is simply not here
                return None
            raise


def find_bootstrapped(client: docker.DockerClient, suite: str = "bookworm") -> Image | None:
    """The base a previous bootstrap made with the current recipe, if any."""
    return find_image(client, recipe(suite).tag)


def bootstrap(client: docker.DockerClient, suite: str = "bookworm") -> Image:
    """Build the base with mmdebstrap and import it into the engine (about 20–40 s).

    Raises:
        PrerequisiteError: mmdebstrap is not installed.
        ImageBuildError: mmdebstrap or the import failed.
    """
    tool = shutil.which("mmdebstrap")
    if tool is None:
        raise PrerequisiteError(
            "no registry is reachable and mmdebstrap is not installed to build a base image locally",
            hint="apt-get install mmdebstrap, or load a base with docker load and pass --base",
        )
    plan = recipe(suite)
    repository, tag = plan.tag.split(":")
    logger.info("bootstrapping base image {} with mmdebstrap ({})", plan.tag, plan.suite)
    started = time.monotonic()
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(plan.command(tool), stdout=subprocess.PIPE, stderr=errors)
        assert process.stdout is not None
        try:
            with engine_errors(f"import the bootstrapped base {plan.tag}"):
                client.api.import_image_from_stream(
                    process.stdout, repository=repository, tag=tag, changes=plan.changes
                )
        except BaseException:
            process.kill()
            process.wait()
            raise
        finally:
            process.stdout.close()
        code = process.wait()
        errors.seek(0)
        detail = errors.read().decode(errors="replace").strip().splitlines()[-5:]
    if code != 0:
        _forget(client, plan.tag)
        raise ImageBuildError(f"mmdebstrap exited {code} building the base: {' | '.join(detail)}")
    image = find_image(client, plan.tag)
    if image is None:
        raise ImageBuildError(f"the import of the bootstrapped base {plan.tag} finished but the image is missing")
    logger.info("bootstrapped {} in {:.0f}s", plan.tag, time.monotonic() - started)
    return image


def _forget(client: docker.DockerClient, tag: str) -> None:
    try:
        client.images.remove(tag, force=True)
    except ENGINE_ERRORS as exc:
        logger.warning("could not remove the half-made base {}: {}", tag, describe(exc))


@retrying(quiet=True)
def pull(client: docker.DockerClient, ref: str) -> Image:
    """Pull ``ref`` (``name``, ``name:tag`` or ``name@sha256:<digest>``, parsed by docker-py; no tag means
    ``latest``), retried while the registry cannot be reached."""
    return client.images.pull(ref)


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
        pulled = pull(client, ref)
    except ENGINE_ERRORS as exc:
        detail = describe(exc)[:200]
        if not is_transient(exc):
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
    earlier = find_bootstrapped(client, suite) if base is None else None
    if earlier is not None:
        return BaseImage(ref=recipe(suite).tag, id=earlier.id, source="bootstrapped-earlier")
    return None


def _bootstrapped(client: docker.DockerClient, suite: str, *, reuse: bool) -> BaseImage:
    existing = find_bootstrapped(client, suite) if reuse else None
    if existing is not None:
        return BaseImage(ref=recipe(suite).tag, id=existing.id, source="bootstrapped-earlier")
    image = bootstrap(client, suite)
    return BaseImage(ref=recipe(suite).tag, id=image.id, source="bootstrapped")
