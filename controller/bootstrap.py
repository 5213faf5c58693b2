"""A Debian base image without any registry: ``mmdebstrap`` piped into the engine's image import.

When no registry can be reached (as on machines whose only way out is a package mirror), pvisor-host
builds its own bookworm base from Debian's packages, following ``images/base/bootstrap.toml``. The tag
carries a hash of that recipe, so a changed recipe makes a new base and an unchanged one is reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import tempfile
import time
import tomllib
from functools import cache
from importlib import resources

import docker
import requests
from docker.errors import APIError, ImageNotFound
from docker.models.images import Image
from loguru import logger
from pydantic import BaseModel, ConfigDict

from .engine import engine_failure
from .errors import ImageBuildError, PrerequisiteError

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


def find_bootstrapped(client: docker.DockerClient, suite: str = "bookworm") -> Image | None:
    """The base a previous bootstrap made with the current recipe, if any."""
    try:
        return client.images.get(recipe(suite).tag)
    except ImageNotFound:
        return None


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
            client.api.import_image_from_stream(process.stdout, repository=repository, tag=tag, changes=plan.changes)
        except (APIError, requests.exceptions.RequestException) as exc:
            process.kill()
            process.wait()
            raise engine_failure(f"import the bootstrapped base {plan.tag}", exc) from exc
        finally:
            process.stdout.close()
        code = process.wait()
        errors.seek(0)
        detail = errors.read().decode(errors="replace").strip().splitlines()[-5:]
    if code != 0:
        _forget(client, plan.tag)
        raise ImageBuildError(f"mmdebstrap exited {code} building the base: {' | '.join(detail)}")
    image = client.images.get(plan.tag)
    logger.info("bootstrapped {} in {:.0f}s", plan.tag, time.monotonic() - started)
    return image


def _forget(client: docker.DockerClient, tag: str) -> None:
    with contextlib.suppress(ImageNotFound, APIError):
        client.images.remove(tag, force=True)
