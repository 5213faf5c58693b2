"""``pvisor-host node join``: make this Docker host a worker of a cluster.

It checks the engine the way ``doctor`` does, sweeps what earlier runs of ours left in it (and the run
directories of copies no driver fetched), and becomes ``ray start --block`` joined to the head, advertising
``docker_engine: SLOTS`` (how many replays it may run at once). The cluster token comes from the
environment (see :mod:`.connect`) and is handed to Ray the same way; it is never on a command line, so
``ps`` does not show it either.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ...._log import logger
from ....errors import PrerequisiteError
from ....models.spec import ReplaySpec
from ....units import host_slots
from ..connect import ENGINE_RESOURCE, auth_environment, check_address, require_ray
from .tasks import scratch_root

#: The machine checks a node must pass (``doctor``'s image and registry checks do not apply: images arrive
#: from the driver).
NODE_CHECKS = ("engine", "architecture", "disk")


def join_command(address: str, slots: int, *, ray_binary: str) -> list[str]:
    """The ``ray start`` a node becomes (no secret in it)."""
    return [
        ray_binary,
        "start",
        "--address",
        check_address(address),
        "--resources",
        json.dumps({ENGINE_RESOURCE: slots}),
        "--num-cpus",
        str(slots),
        "--block",
        "--disable-usage-stats",
        # Ray's log monitor streams workers' output to drivers; ours asks for none (``log_to_driver=False``),
        # and the monitor's scans of the log folder cost a node about 6 ms of CPU a second, idle or not.
        "--include-log-monitor",
        "false",
    ]


def default_slots() -> int:
    """Replays at once on this host: one per CPU, no more than its memory holds at a sandbox's default memory
    limit each."""
    return host_slots(1, ReplaySpec.model_fields["memory"].default)


def join(address: str, *, slots: int | None = None) -> None:
    """Check, sweep, then replace this process with ``ray start --block`` (returns only on failure).

    Raises:
        PrerequisiteError: Ray is missing, or the engine fails a check.
        UsageError: a bad address, or no token.
    """
    require_ray()
    environment = {**os.environ, **auth_environment()}
    slots = slots or default_slots()
    command = join_command(address, slots, ray_binary=_ray_binary())
    from ... import open_backend

    backend = open_backend()
    try:
        for check in backend.diagnose():
            if check.name in NODE_CHECKS and check.status == "fail" and check.required:
                raise PrerequisiteError(f"{check.name}: {check.detail}", hint=check.fix)
        report = backend.sweep()
        shutil.rmtree(scratch_root(), ignore_errors=True)  # run directories no driver fetched
        logger.info("swept {} leftovers of earlier runs", len(report.orphans))
    finally:
        backend.close()
    logger.info("joining {} with {} slots", address, slots)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, environment)


def _ray_binary() -> str:
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.is_file() else shutil.which("ray")
    if found is None:
        raise PrerequisiteError("Ray's `ray` command is not installed", hint="pip install 'pvisor-host[ray]'")
    return found
