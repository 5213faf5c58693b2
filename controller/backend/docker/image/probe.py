"""Look inside an image: which pvisor and which agent version does it really carry?

Used after every build (an image is only kept when both versions are the pinned ones) and for images
pvisor-host did not build. The probe runs with the sandbox's hardening and no network, in a labelled
container that is removed afterwards.
"""

from __future__ import annotations

import re
import uuid

import docker
from pydantic import BaseModel

from ...._version import PVISOR_VERSION
from ....models.ownership import Ownership
from ....models.profiles import AgentProfile
from ....models.spec import default_user
from .. import labels as L
from ..container import ContainerSpec, logs_text, sandbox_container, start, wait

_PROBE_TIMEOUT = 120.0
# Prints KEY=value lines; the agent's answer is framed because it may span lines.
_SCRIPT = r"""
for p in /opt/pvisor/bin/pvisor "$(command -v pvisor 2>/dev/null)"; do
  if [ -n "$p" ] && [ -x "$p" ]; then
    echo "PVISOR_PATH=$p"
    echo "PVISOR_VERSION=$("$p" --version 2>/dev/null | head -n 1)"
    break
  fi
done
entry="$1"
[ -x "$entry" ] || entry="$(command -v "$2" 2>/dev/null || true)"
if [ -n "$entry" ] && [ -x "$entry" ]; then
  # Like pvisor's own probe: the canonical path (symlinks resolved), stdout or else stderr.
  entry="$(readlink -f "$entry")"
  echo "AGENT_PATH=$entry"
  shift 2
  out="$("$entry" "$@" 2>/tmp/.pvisor-host-probe.err)"; code=$?
  [ -n "$out" ] || out="$(cat /tmp/.pvisor-host-probe.err)"
  echo "AGENT_EXIT=$code"
  printf 'AGENT_OUTPUT<<\n%s\n>>AGENT_OUTPUT\n' "$out"
fi
"""


class ProbeResult(BaseModel):
    """What the probe found in the image."""

    pvisor_path: str | None = None
    pvisor_version: str | None = None
    """``pvisor --version`` output, e.g. ``pvisor 0.3.1``."""
    agent_path: str | None = None
    agent_exit: int | None = None
    agent_output: str | None = None


def parse_probe(text: str) -> ProbeResult:
    """Parse the probe script's output."""
    fields: dict[str, str] = {}
    block = re.search(r"AGENT_OUTPUT<<\n(.*?)\n>>AGENT_OUTPUT", text, re.S)
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in {"PVISOR_PATH", "PVISOR_VERSION", "AGENT_PATH", "AGENT_EXIT"}:
            fields[key] = value.strip()
    return ProbeResult(
        pvisor_path=fields.get("PVISOR_PATH"),
        pvisor_version=fields.get("PVISOR_VERSION") or None,
        agent_path=fields.get("AGENT_PATH"),
        agent_exit=int(fields["AGENT_EXIT"]) if fields.get("AGENT_EXIT", "").isdigit() else None,
        agent_output=block.group(1).strip() if block else None,
    )


def probe_image(
    client: docker.DockerClient,
    ownership: Ownership,
    image: str,
    *,
    entrypoint: str,
    command: str,
    version_args: list[str],
) -> ProbeResult:
    """Run the probe in ``image``: pvisor's version, and ``entrypoint`` (else ``command`` on PATH)."""
    spec = ContainerSpec(
        image=image,
        command=["/bin/sh", "-c", _SCRIPT, "probe", entrypoint, command, *version_args],
        name=f"pvisor-host-probe-{uuid.uuid4().hex[:12]}",
        labels=L.resource_labels(ownership, "probe"),
        user=default_user(),
        environment={"HOME": "/tmp"},
        memory=1024**3,
        cpus=1.0,
        pids=256,
        tmpfs_size=256 * 1024**2,
    )
    with sandbox_container(client, spec) as container:
        start(container)
        wait(container, _PROBE_TIMEOUT)
        return parse_probe(logs_text(container, stdout=True))


def probe_agent_image(
    client: docker.DockerClient, ownership: Ownership, image: str, profile: AgentProfile
) -> ProbeResult:
    """Probe ``image`` for pvisor and ``profile``'s agent (its entrypoint, else its name on PATH)."""
    return probe_image(
        client,
        ownership,
        image,
        entrypoint=profile.entrypoint,
        command=profile.agent,
        version_args=profile.version_probe.args,
    )


def version_problem(found: ProbeResult, profile: AgentProfile) -> str | None:
    """What is wrong with a probed image for ``profile`` (completing "image X ..."), or None."""
    if found.pvisor_path is None:
        return f"has no pvisor; pvisor-host needs pvisor {PVISOR_VERSION} in the image"
    if found.pvisor_version != f"pvisor {PVISOR_VERSION}":
        return f"has {found.pvisor_version!r}; pvisor-host needs pvisor {PVISOR_VERSION} in the image"
    if found.agent_path is None:
        return f"has no {profile.agent} executable at {profile.entrypoint} or on PATH"
    if found.agent_output is None or not profile.version_probe.matches(found.agent_output):
        args = " ".join(profile.version_probe.args)
        return (
            f"has {found.agent_path} {args} printing {found.agent_output!r}; "
            f"{profile.agent} must be exactly {profile.version}"
        )
    return None
