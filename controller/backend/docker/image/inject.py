"""``--inject``: replay inside a task's own image, which has neither pvisor nor the agent.

The runtime comes from a read-only Docker volume mounted at ``/pvisor-host/runtime``::

    pvisor/pvisor, pvisor/pvisor-replay     pvisor's static binaries (root-owned, not group/world writable)
    relay                                   the static model-gateway relay
    agent/sandbox-playback-agent.json       pvisor's runtime manifest (``--agent-runtime``)
    agent/...                               the agent runtime, laid out by the profile's ``[inject]`` paths
    .pvisor-host-runtime.json               written last: what the volume holds (its completion marker)

The volume is filled once per (agent, version, pvisor version, agent image) from the verified agent image
and reused; its name carries a hash of everything that went into it. Task images are checked before any
replay: x86_64 Linux from the image's own metadata, then glibc, required paths and libraries in a probe.
:class:`Injector` remembers, for the backend that owns it, which volumes it found complete and what each
task image's probe found.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading

import docker
from docker.errors import NotFound
from docker.models.images import Image
from pydantic import BaseModel

from ...._log import logger
from ...._version import PVISOR_VERSION
from ....errors import ImageBuildError, InfrastructureError, UsageError
from ....models.ownership import Ownership
from ....models.profiles import AgentProfile, InjectSpec
from ....models.spec import default_user
from .. import labels as L
from ..container import ContainerSpec, VolumeMount, logs_text, sandbox_container, start, stopped_container, wait
from ..engine import engine_errors
from .recipe import DEFAULT_PVISOR_PATH, RELAY_PATH

RUNTIME_MOUNT = "/pvisor-host/runtime"
MARKER = ".pvisor-host-runtime.json"
_POPULATE_TIMEOUT = 600.0
_POPULATE = r"""
set -eu
umask 022
R=/pvisor-host/runtime
mkdir -p "$R/pvisor" "$R/agent"
cp -L "$PVISOR_DIR/pvisor" "$PVISOR_DIR/pvisor-replay" "$R/pvisor/"
cp -L "$RELAY" "$R/relay"
while [ "$#" -gt 1 ]; do
  dest="$R/agent/$1" src="$2"; shift 2
  if [ -d "$src" ]; then mkdir -p "$dest" && cp -RL "$src/." "$dest/"
  else mkdir -p "$(dirname "$dest")" && cp -L "$src" "$dest"; fi
done
printf '%s\n' "$MANIFEST" > "$R/agent/sandbox-playback-agent.json"
chmod -R go-w "$R"
printf '%s\n' "$MARKER_JSON" > "$R/.pvisor-host-runtime.json"
"""
_TASK_PROBE = r"""
for loader in /lib/ld-musl-*.so.1; do [ -e "$loader" ] && echo "MUSL=$loader"; done
[ -e /lib64/ld-linux-x86-64.so.2 ] && echo "GLIBC=1"
for path in "$@"; do
  case "$path" in
    lib:*) name=${path#lib:}
      for dir in /lib /lib64 /usr/lib /usr/lib64 /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu; do
        [ -e "$dir/$name" ] && { echo "HAVE=$path"; break; }
      done ;;
    *) [ -e "$path" ] && echo "HAVE=$path" ;;
  esac
done
"""


class RuntimeVolume(BaseModel):
    """A filled runtime volume and where its parts are inside a sandbox."""

    name: str
    agent: str
    agent_version: str
    pvisor_version: str
    agent_image: str
    """The verified agent image the runtime was copied from."""

    @property
    def pvisor_path(self) -> str:
        return f"{RUNTIME_MOUNT}/pvisor/pvisor"

    @property
    def runtime_root(self) -> str:
        """pvisor's ``--agent-runtime`` directory."""
        return f"{RUNTIME_MOUNT}/agent"


def runtime_volume_name(profile: AgentProfile, spec: InjectSpec, agent_image_id: str) -> str:
    """``pvisor-host-runtime-<agent>-<version>-pvisor<version>-<hash12>`` over everything that fills it."""
    digest = hashlib.sha256(
        json.dumps([agent_image_id, spec.model_dump(), _POPULATE, PVISOR_VERSION], sort_keys=True).encode()
    ).hexdigest()
    return f"pvisor-host-runtime-{profile.agent}-{profile.version}-pvisor{PVISOR_VERSION}-{digest[:12]}"


def _marker(profile: AgentProfile, agent_image_id: str) -> dict[str, str]:
    return {
        "agent": profile.agent,
        "agent_version": profile.version,
        "pvisor_version": PVISOR_VERSION,
        "agent_image": agent_image_id,
    }


def inject_spec(profile: AgentProfile) -> InjectSpec:
    """The profile's ``[inject]`` section, or a :class:`UsageError` saying why the agent cannot be injected."""
    refusal = profile.inject_refusal
    if refusal is not None or profile.inject is None:
        raise UsageError(refusal or "", hint="drop --inject")
    return profile.inject


# -- task images ---------------------------------------------------------------------------------------------


def check_task_image_metadata(image: Image, ref: str) -> None:
    """Refuse a task image that is not linux/amd64, from its metadata alone (no container)."""
    os_name = image.attrs.get("Os", "linux")
    arch = image.attrs.get("Architecture", "amd64")
    if (os_name, arch) != ("linux", "amd64"):
        raise UsageError(
            f"task image {ref} is {os_name}/{arch}; pvisor 0.3.1 ships only linux/amd64 (x86_64) binaries",
            hint="use an x86_64 Linux task image",
        )


class Injector:
    """Runtime volumes and task-image checks for one backend (its client and ownership), with what it found
    remembered: a volume found complete, a task image's probe."""

    def __init__(self, client: docker.DockerClient, ownership: Ownership) -> None:
        self._client = client
        self._ownership = ownership
        self._lock = threading.Lock()
        self._complete: set[str] = set()
        self._task_facts: dict[tuple[str, tuple[str, ...]], dict[str, list[str]]] = {}

    def ensure_runtime_volume(self, profile: AgentProfile, agent_image_id: str) -> RuntimeVolume:
        """The runtime volume for ``profile``, filled from ``agent_image_id`` unless a complete one exists.

        Raises:
            UsageError: the agent has no ``[inject]`` profile.
            ImageBuildError: filling the volume failed (the volume is removed again).
        """
        spec = inject_spec(profile)
        name = runtime_volume_name(profile, spec, agent_image_id)
        found = RuntimeVolume(
            name=name,
            agent=profile.agent,
            agent_version=profile.version,
            pvisor_version=PVISOR_VERSION,
            agent_image=agent_image_id,
        )
        with self._lock:
            if name in self._complete or self._is_complete(name, agent_image_id, _marker(profile, agent_image_id)):
                self._complete.add(name)
                return found
            logger.info("filling runtime volume {} from the {} image", name, profile.agent)
            self._remove_volume(name)
            labels = L.resource_labels(self._ownership, "runtime") | {
                L.AGENT: profile.agent,
                L.AGENT_VERSION: profile.version,
                L.PVISOR_VERSION: PVISOR_VERSION,
            }
            labels.pop(L.OWNER)  # a shared cache, not a resource of this process: `gc` leaves it to `images prune`
            try:
                with engine_errors(f"create runtime volume {name}"):
                    self._client.volumes.create(name=name, labels=labels)
                self._populate(profile, spec, agent_image_id, name)
            except BaseException:
                self._remove_volume(name)
                raise
            self._complete.add(name)
        return found

    def _populate(self, profile: AgentProfile, spec: InjectSpec, agent_image_id: str, volume: str) -> None:
        manifest = {
            "schema_version": "sandbox-playback.agent-runtime/v1",
            "agent": profile.agent,
            "version": profile.version,
            "entrypoint": spec.entrypoint,
        }
        pairs = [item for dest, src in spec.paths.items() for item in (dest, src)]
        container_spec = ContainerSpec(
            image=agent_image_id,
            command=["/bin/sh", "-c", _POPULATE, "populate", *pairs],
            name=f"pvisor-host-populate-{volume[-12:]}-{self._ownership.session[:6]}",
            labels=L.resource_labels(self._ownership, "populate"),
            user="0:0",  # the volume starts root-owned; the files must be root's for pvisor's trust check
            environment={
                "PVISOR_DIR": DEFAULT_PVISOR_PATH.rsplit("/", 1)[0],
                "RELAY": RELAY_PATH,
                "MANIFEST": json.dumps(manifest),
                "MARKER_JSON": json.dumps(_marker(profile, agent_image_id)),
            },
            mounts=[VolumeMount(volume=volume, target=RUNTIME_MOUNT, read_only=False)],
            memory=1024**3,
            cpus=1.0,
            pids=128,
        )
        with sandbox_container(self._client, container_spec) as container:
            start(container)
            outcome = wait(container, _POPULATE_TIMEOUT)
            if outcome.exit_code != 0:
                detail = " | ".join(logs_text(container, stdout=False).strip().splitlines()[-3:])
                raise ImageBuildError(f"filling runtime volume {volume} failed (exit {outcome.exit_code}): {detail}")

    def _is_complete(self, name: str, agent_image_id: str, expected: dict[str, str]) -> bool:
        """Whether volume ``name`` exists and holds the completion marker ``expected`` (written last)."""
        with engine_errors(f"read runtime volume {name}"):
            try:
                self._client.volumes.get(name)
            except NotFound:
                return False
            mount = VolumeMount(volume=name, target=RUNTIME_MOUNT, read_only=True)
            with stopped_container(
                self._client, self._ownership, agent_image_id, role="peek", mounts=[mount]
            ) as container:
                try:
                    chunks, _ = container.get_archive(f"{RUNTIME_MOUNT}/{MARKER}")
                except NotFound:
                    return False
                with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as archive:
                    member = archive.extractfile(MARKER)
                    marker = json.loads(member.read()) if member else {}
        return bool(marker == expected)

    def _remove_volume(self, name: str) -> None:
        with engine_errors(f"remove runtime volume {name}"):
            try:
                self._client.volumes.get(name).remove(force=True)
            except NotFound:
                return

    def check_task_image(self, image_id: str, ref: str, profile: AgentProfile) -> None:
        """Probe the task image: glibc (not musl), and the paths and libraries the agent's runtime needs.

        Raises:
            UsageError: a musl image, or something the injected runtime needs is missing.
        """
        spec = inject_spec(profile)
        wanted = [*spec.requires, *(f"lib:{name}" for name in spec.libraries)]
        facts = self._probe_task(image_id, tuple(wanted))
        if "MUSL" in facts:
            raise UsageError(
                f"task image {ref} is musl-based ({facts['MUSL'][0]}); --inject needs a glibc-based image",
                hint="use a Debian/Ubuntu-style task image, or bake the agent into an image of its own",
            )
        if "GLIBC" not in facts:
            raise UsageError(
                f"task image {ref} has no glibc loader (/lib64/ld-linux-x86-64.so.2); --inject needs glibc"
            )
        missing = [item for item in wanted if item not in facts.get("HAVE", [])]
        if missing:
            names = ", ".join(item.removeprefix("lib:") for item in missing)
            raise UsageError(f"task image {ref} lacks {names}, which the injected {profile.agent} runtime needs")

    def _probe_task(self, image_id: str, wanted: tuple[str, ...]) -> dict[str, list[str]]:
        key = (image_id, wanted)
        with self._lock:
            if key in self._task_facts:
                return self._task_facts[key]
        spec = ContainerSpec(
            image=image_id,
            command=["/bin/sh", "-c", _TASK_PROBE, "probe", *wanted],
            name=f"pvisor-host-taskprobe-{self._ownership.session[:6]}-{image_id[7:19]}",
            labels=L.resource_labels(self._ownership, "probe"),
            user=default_user(),
            memory=256 * 1024**2,
            cpus=1.0,
            pids=64,
            tmpfs_size=16 * 1024**2,
        )
        facts: dict[str, list[str]] = {}
        with sandbox_container(self._client, spec) as container:
            try:
                start(container)
            except InfrastructureError as exc:  # an image without /bin/sh cannot even start the probe
                raise UsageError(f"task image {image_id[:19]} cannot run /bin/sh; pvisor needs a shell in it") from exc
            wait(container, 60.0)
            for line in logs_text(container, stdout=True).splitlines():
                key_, sep, value = line.partition("=")
                if sep:
                    facts.setdefault(key_, []).append(value)
        with self._lock:
            self._task_facts[key] = facts
        return facts
