"""Where task images are really pulled from: a registry mirror and image-prefix rewrites.

Datasets name their images as their authors pulled them, often under ``docker.io`` (SWE-bench, OpenHands), or
under a registry the hosts cannot reach. ``--registry-mirror HOST`` pulls every Docker Hub image through
``HOST`` (a pull-through cache: ``python:3.11`` comes from ``HOST/library/python:3.11``), and ``--image-rewrite
FROM=TO`` replaces the prefix ``FROM`` of any image's full name (``registry/path``) with ``TO``. The first rule
that matches wins; rewrites come before the mirror. An image keeps the name the dataset gave it: it is pulled
from its source, then named as the dataset named it, so records, reports and reruns see the dataset's names.

References are read with docker-py's own parser (as :class:`.images.Reference` does, with
``parse_repository_tag`` and ``split_repo_name``); nothing here asks a registry.
"""

from __future__ import annotations

import re

from docker.auth import split_repo_name
from docker.utils import parse_repository_tag
from pydantic import BaseModel, ConfigDict

from ....errors import UsageError

_HOST = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$")
_PREFIX = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[a-z0-9._/-]*)?$")
_HUB = "docker.io/"


class Mirrors(BaseModel):
    """The rules, in order: (prefix of a full name, what replaces it)."""

    model_config = ConfigDict(frozen=True)

    rules: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, mirror: str | None = None, rewrites: list[str] | None = None) -> Mirrors:
        """``--registry-mirror`` and each ``--image-rewrite``.

        Raises:
            UsageError: a mirror that is not ``HOST[:PORT]``, a rewrite that is not ``FROM=TO`` with two image
                name prefixes.
        """
        rules: list[tuple[str, str]] = []
        for rewrite in rewrites or []:
            source, equals, target = rewrite.partition("=")
            source, target = source.strip(), target.strip()
            if not equals or not source or not target or "://" in rewrite:
                raise UsageError(
                    f"--image-rewrite {rewrite!r} is not FROM=TO (two image name prefixes, e.g. "
                    "docker.io/swebench/=registry.internal:5000/swebench/)"
                )
            for prefix in (source, target):
                if not _PREFIX.match(prefix):
                    raise UsageError(f"--image-rewrite {rewrite!r}: {prefix!r} is not an image name prefix")
            rules.append((source, target))
        if mirror is not None:
            host = mirror.strip().rstrip("/")
            if not _HOST.match(host) or host.startswith(("-", ".")):
                raise UsageError(f"--registry-mirror {mirror!r} is not HOST[:PORT] (e.g. mirror.internal:5000)")
            rules.append((_HUB, f"{host}/"))
        return cls(rules=tuple(rules))

    def source(self, ref: str) -> str:
        """Where ``ref`` is pulled from (``ref`` itself when no rule matches, or it is an image id)."""
        if not self.rules or ref.startswith("sha256:"):
            return ref
        full, suffix = _full_name(ref)
        for prefix, target in self.rules:
            if full.startswith(prefix):
                return f"{target}{full[len(prefix) :]}{suffix}"
        return ref

    def __bool__(self) -> bool:
        return bool(self.rules)


def _full_name(ref: str) -> tuple[str, str]:
    """``registry/path`` of ``ref`` (Docker Hub's as ``docker.io/library/x``), and its ``:tag`` or ``@digest``."""
    repository, suffix = parse_repository_tag(ref)
    registry, path = split_repo_name(repository)
    if registry == "docker.io" and "/" not in path:
        path = f"library/{path}"
    mark = "@" if suffix and suffix.startswith("sha256:") else ":"
    return f"{registry}/{path}", f"{mark}{suffix}" if suffix else ""
