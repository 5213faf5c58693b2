"""A registry, asked directly: what an image will cost to pull, and how long a rate-limited registry wants
us to wait.

The engine pulls; it does not say what a pull will cost before it starts, nor pass on a registry's
``Retry-After``. So for ``--plan`` (bytes to pull) and for a 429 (how long to wait) pvisor-host reads the
registry's manifests itself, with the same credentials the docker CLI uses (``~/.docker/config.json`` and its
credential helpers, through docker-py's ``docker.auth``), over ``requests`` (which docker-py already brings).
Registries on a loopback address are spoken to over plain HTTP, as the engine does; all others over HTTPS.
Nothing here ever logs a credential or a token.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from typing import Any

import requests
from docker import auth

from ...._log import logger
from ....units import parse_retry_after
from .images import Reference
from .mirrors import Mirrors

#: The manifest kinds asked for: an image's own, and the multi-platform lists that point at them.
MANIFEST_TYPES = ", ".join((
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
))  # fmt: skip
_INDEXES = ("manifest.list", "image.index")
_HUB = "registry-1.docker.io"
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
TIMEOUT = 20.0


class ManifestInfo:
    """What a registry says of an image: its digest, and its layers with their (compressed) sizes."""

    def __init__(
        self, digest: str | None, layers: list[tuple[str, int]], config: int, config_digest: str | None
    ) -> None:
        self.digest = digest
        self.ordered = layers
        """Each layer's digest and bytes as pulled (compressed), base first (a layer may appear twice)."""
        self.layers = dict(layers)
        """Layer digest → bytes, as pulled (compressed)."""
        self.config = config
        self.config_digest = config_digest
        """The digest of the image's configuration, which is the id the engine gives the image."""

    @property
    def bytes(self) -> int:
        """Everything a pull downloads when no layer is present yet."""
        return sum(self.layers.values()) + self.config

    @property
    def sizes(self) -> list[int]:
        """The compressed bytes of each layer, base first."""
        return [size for _, size in self.ordered]


class ManifestError(Exception):
    """The registry could not be asked (unreachable, refused, or an answer that is not a manifest).
    ``status`` is the HTTP status it answered (None: no answer, or one that could not be read);
    ``retry_after`` the seconds it asked to wait, when it did."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        retry_after: float | None = None,
        unreachable: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.answered = status is not None
        self.unreachable = unreachable
        """``does not resolve`` or ``refuses connections``: no answer that waiting would change."""


_UNRESOLVED = ("no such host", "name or service not known", "nodename nor servname", "failed to resolve",
               "no address associated", "name resolution")  # fmt: skip


def unreachable(text: str) -> str | None:
    """Why a registry cannot be reached at all, from an error's text: its name does not resolve, or it refuses
    connections (None: something else, which may pass)."""
    lowered = text.lower()
    if any(marker in lowered for marker in _UNRESOLVED):
        return "does not resolve"
    if "connection refused" in lowered:
        return "refuses connections"
    return None


class Registries:
    """The registries of one backend: their credentials and tokens (thread-safe, one session)."""

    def __init__(self, mirrors: Mirrors | None = None) -> None:
        self.mirrors = mirrors or Mirrors()
        """Where each image is really asked for (``--registry-mirror``, ``--image-rewrite``)."""
        self._session = requests.Session()
        self._session.headers["User-Agent"] = "pvisor-host"
        self._tokens: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._config: Any = None

    def manifest(self, reference: str, *, platform: tuple[str, str] = ("linux", "amd64")) -> ManifestInfo:
        """The manifest of ``reference`` (for a multi-platform image, that of ``platform``).

        Raises:
            ManifestError: the registry cannot be reached, refuses, or has no such image.
        """
        try:
            return self._manifest(reference, platform)
        except ManifestError:
            raise
        except Exception as exc:  # noqa: BLE001 - an answer that is no manifest, a failing credential helper
            raise ManifestError(
                f"{reference}: the registry's answer could not be read ({type(exc).__name__})"
            ) from None

    def _manifest(self, reference: str, platform: tuple[str, str]) -> ManifestInfo:
        ref = Reference(self.mirrors.source(reference))
        answer = self._get(ref, ref.digest or ref.tag or "latest")
        digest = answer.headers.get("Docker-Content-Digest") or ref.digest
        body = answer.json()
        if any(kind in str(body.get("mediaType", "")) for kind in _INDEXES) or "manifests" in body:
            chosen = next(
                (m for m in body.get("manifests", []) if (m.get("platform", {}).get("os"),
                                                          m.get("platform", {}).get("architecture")) == platform),
                None,
            )  # fmt: skip
            if chosen is None:
                raise ManifestError(f"{reference} has no {'/'.join(platform)} image")
            body = self._get(ref, chosen["digest"]).json()
        layers = [(str(layer["digest"]), int(layer.get("size", 0))) for layer in body.get("layers", [])]
        config = body.get("config", {})
        return ManifestInfo(digest, layers, int(config.get("size", 0)), config.get("digest"))

    def config(self, reference: str, manifest: ManifestInfo) -> dict[str, Any]:
        """The image configuration ``manifest`` names (its labels, OS and architecture), read from the registry
        without pulling the image.

        Raises:
            ManifestError: the registry cannot be reached, refuses, or has no such blob.
        """
        if manifest.config_digest is None:
            raise ManifestError(f"{reference}: the registry lists no image configuration")
        try:
            found = self._get(Reference(self.mirrors.source(reference)), manifest.config_digest, kind="blobs").json()
        except ManifestError:
            raise
        except Exception as exc:  # noqa: BLE001 - not JSON, a failing credential helper
            raise ManifestError(
                f"{reference}: the image configuration could not be read ({type(exc).__name__})"
            ) from None
        return found if isinstance(found, dict) else {}

    def retry_after(self, reference: str, *, resolved: bool = False) -> float | None:
        """Seconds the registry asks to wait now (its ``Retry-After`` on a 429), or None when it asks none.
        ``resolved``: ``reference`` is where the image comes from already (the mirrors applied)."""
        ref = Reference(reference if resolved else self.mirrors.source(reference))
        try:
            answer = self._request("HEAD", ref, ref.digest or ref.tag or "latest")
        except ManifestError:
            return None
        if answer.status_code != 429:
            return None
        return parse_retry_after(answer.headers.get("Retry-After"))

    # -- HTTP ---------------------------------------------------------------------------------------------

    def _get(self, ref: Reference, what: str, *, kind: str = "manifests") -> requests.Response:
        answer = self._request("GET", ref, what, kind=kind)
        status = answer.status_code
        if status == 404:
            raise ManifestError(f"{ref.text}: not found in the registry", status=status)
        if status in (401, 403):
            raise ManifestError(f"{ref.text}: the registry refused (HTTP {status}: unauthorized)", status=status)
        if status != 200:
            wait = parse_retry_after(answer.headers.get("Retry-After")) if status == 429 else None
            raise ManifestError(f"{ref.text}: the registry answered HTTP {status}", status=status, retry_after=wait)
        return answer

    def _request(self, method: str, ref: Reference, what: str, *, kind: str = "manifests") -> requests.Response:
        host = ref.registry or _HUB
        url = f"{_scheme(host)}://{host}/v2/{_path(ref)}/{kind}/{what}"
        headers = {"Accept": MANIFEST_TYPES}
        scope = f"repository:{_path(ref)}:pull"
        try:
            token = self._tokens.get((host, scope))
            if token:
                headers["Authorization"] = token
            answer = self._session.request(method, url, headers=headers, timeout=TIMEOUT)
            if answer.status_code == 401 and "WWW-Authenticate" in answer.headers:
                token = self._authorize(host, answer.headers["WWW-Authenticate"], scope)
                if token:
                    headers["Authorization"] = token
                    answer = self._session.request(method, url, headers=headers, timeout=TIMEOUT)
        except requests.RequestException as exc:
            why = unreachable(str(exc))
            what = why or f"cannot be reached ({type(exc).__name__})"
            raise ManifestError(f"{host}: the registry {what}", unreachable=why) from None
        return answer

    def _authorize(self, host: str, challenge: str, scope: str) -> str | None:
        """The ``Authorization`` header a challenge asks for: Basic with the configured credentials, or a
        Bearer token fetched from the realm it names (with those credentials, if any)."""
        credentials = self._credentials(host)
        if challenge.lower().startswith("basic"):
            if credentials is None:
                return None
            request = requests.Request("GET", "http://x", auth=credentials).prepare()
            header = request.headers.get("Authorization")
            return header if isinstance(header, str) else None
        fields = dict(_CHALLENGE.findall(challenge))
        realm = fields.get("realm")
        if realm is None:
            return None
        if credentials is not None and not realm.lower().startswith("https://"):
            logger.warning("{} names a token service over plain HTTP; asking it without the credentials", host)
            credentials = None  # a password never travels in clear text, whatever the registry asks
        params = {"service": fields.get("service", host), "scope": fields.get("scope", scope)}
        answer = self._session.get(realm, params=params, auth=credentials, timeout=TIMEOUT)
        if answer.status_code != 200:
            logger.debug("{}: the token service answered HTTP {}", host, answer.status_code)
            return None
        token = answer.json().get("token") or answer.json().get("access_token")
        header = f"Bearer {token}" if token else None
        if header:
            with self._lock:
                self._tokens[(host, scope)] = header
        return header

    def _credentials(self, host: str) -> tuple[str, str] | None:
        """The username and password the docker CLI would use for ``host`` (none: anonymous)."""
        with self._lock:
            if self._config is None:
                self._config = auth.load_config()
            found = self._config.resolve_authconfig("docker.io" if host == _HUB else host) or {}
        username = found.get("username") or found.get("Username")
        password = found.get("password") or found.get("Password")
        return (username, password) if username and password else None


def _scheme(host: str) -> str:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host
    if name == "localhost":
        return "http"
    try:
        return "http" if ipaddress.ip_address(name.strip("[]")).is_loopback else "https"
    except ValueError:
        return "https"


def _path(ref: Reference) -> str:
    """The repository path as the registry knows it (Docker Hub's single names live under ``library/``)."""
    if ref.registry is None and "/" not in ref.path:
        return f"library/{ref.path}"
    return ref.path
