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
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from functools import cache

import docker
import requests
from docker.errors import APIError, NotFound
from docker.models.images import Image
from loguru import logger
from pydantic import BaseModel

from . import labels as L
from ._version import PVISOR_VERSION
from .build import DEFAULT_PVISOR_PATH, RELAY_PATH
from .container import ContainerSpec, VolumeMount, logs_text, sandbox_container, start, stopped_container, wait
from .engine import engine_failure
from .errors import ImageBuildError, InfrastructureError, UsageError
from .profiles import AgentProfile, InjectSpec
from .spec import default_user

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


def ensure_runtime_volume(client: docker.DockerClient, profile: AgentProfile, agent_image_id: str) -> RuntimeVolume:
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
    expected = json.dumps(_marker(profile, agent_image_id), sort_keys=True)
    if _complete(client, name, agent_image_id, expected):
        return found
    logger.info("filling runtime volume {} from the {} image", name, profile.agent)
    _remove_volume(client, name)
    labels = L.resource_labels("runtime") | {
        L.AGENT: profile.agent,
        L.AGENT_VERSION: profile.version,
        L.PVISOR_VERSION: PVISOR_VERSION,
    }
    labels.pop(L.OWNER)  # a shared cache, not a resource of this process: `gc` leaves it to `images prune`
    try:
        client.volumes.create(name=name, labels=labels)
        _populate(client, profile, spec, agent_image_id, name)
    except BaseException:
        _remove_volume(client, name)
        raise
    _complete.cache_clear()
    return found


def inject_spec(profile: AgentProfile) -> InjectSpec:
    """The profile's ``[inject]`` section, or a :class:`UsageError` saying why the agent cannot be injected."""
    if profile.inject is None:
        reason = profile.inject_unsupported or "its profile has no [inject] section"
        raise UsageError(f"{profile.agent} cannot be injected into a task image: {reason}", hint="drop --inject")
    return profile.inject


def _populate(
    client: docker.DockerClient, profile: AgentProfile, spec: InjectSpec, agent_image_id: str, volume: str
) -> None:
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
        name=f"pvisor-host-populate-{volume[-12:]}-{L.session()[:6]}",
        labels=L.resource_labels("populate"),
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
    with sandbox_container(client, container_spec) as container:
        start(container)
        outcome = wait(container, _POPULATE_TIMEOUT)
        if outcome.exit_code != 0:
            detail = " | ".join(logs_text(container, stdout=False).strip().splitlines()[-3:])
            raise ImageBuildError(f"filling runtime volume {volume} failed (exit {outcome.exit_code}): {detail}")


@cache
def _complete(client: docker.DockerClient, name: str, agent_image_id: str, expected: str) -> bool:
    """Whether volume ``name`` exists and holds the completion marker ``expected`` (written last)."""
    try:
        client.volumes.get(name)
    except NotFound:
        return False
    mount = VolumeMount(volume=name, target=RUNTIME_MOUNT, read_only=True)
    with stopped_container(client, agent_image_id, role="peek", mounts=[mount]) as container:
        try:
            chunks, _ = container.get_archive(f"{RUNTIME_MOUNT}/{MARKER}")
        except NotFound:
            return False
        except (APIError, requests.exceptions.RequestException) as exc:
            raise engine_failure(f"read runtime volume {name}", exc) from exc
        with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as archive:
            member = archive.extractfile(MARKER)
            marker = json.loads(member.read()) if member else {}
    return json.dumps(marker, sort_keys=True) == expected


def _remove_volume(client: docker.DockerClient, name: str) -> None:
    try:
        client.volumes.get(name).remove(force=True)
    except NotFound:
        return
    except APIError as exc:
        raise engine_failure(f"remove runtime volume {name}", exc) from exc


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


def check_task_image(client: docker.DockerClient, image_id: str, ref: str, profile: AgentProfile) -> None:
    """Probe the task image: glibc (not musl), and the paths and libraries the agent's runtime needs.

    Raises:
        UsageError: a musl image, or something the injected runtime needs is missing.
    """
    spec = inject_spec(profile)
    wanted = [*spec.requires, *(f"lib:{name}" for name in spec.libraries)]
    facts = _probe_task(client, image_id, tuple(wanted))
    if "MUSL" in facts:
        raise UsageError(
            f"task image {ref} is musl-based ({facts['MUSL'][0]}); --inject needs a glibc-based image",
            hint="use a Debian/Ubuntu-style task image, or bake the agent into an image of its own",
        )
    if "GLIBC" not in facts:
        raise UsageError(f"task image {ref} has no glibc loader (/lib64/ld-linux-x86-64.so.2); --inject needs glibc")
    missing = [item for item in wanted if item not in facts.get("HAVE", [])]
    if missing:
        names = ", ".join(item.removeprefix("lib:") for item in missing)
        raise UsageError(f"task image {ref} lacks {names}, which the injected {profile.agent} runtime needs")


@cache
def _probe_task(client: docker.DockerClient, image_id: str, wanted: tuple[str, ...]) -> dict[str, list[str]]:
    spec = ContainerSpec(
        image=image_id,
        command=["/bin/sh", "-c", _TASK_PROBE, "probe", *wanted],
        name=f"pvisor-host-taskprobe-{L.session()[:6]}-{image_id[7:19]}",
        labels=L.resource_labels("probe"),
        user=default_user(),
        memory=256 * 1024**2,
        cpus=1.0,
        pids=64,
        tmpfs_size=16 * 1024**2,
    )
    facts: dict[str, list[str]] = {}
    with sandbox_container(client, spec) as container:
        try:
            start(container)
        except InfrastructureError as exc:  # an image without /bin/sh cannot even start the probe
            raise UsageError(f"task image {image_id[:19]} cannot run /bin/sh; pvisor needs a shell in it") from exc
        wait(container, 60.0)
        for line in logs_text(container, stdout=True).splitlines():
            key, sep, value = line.partition("=")
            if sep:
                facts.setdefault(key, []).append(value)
    return facts
