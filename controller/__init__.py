"""pvisor-host: replay recorded AI-agent trajectories with pvisor inside hardened Docker containers.

The public API (see ``docs/api.md``)::

    import pvisor_host

    record = pvisor_host.replay(trajectory="session.jsonl", after_step=5, agent="claude-code", mode="replay-only")
    for result in pvisor_host.batch(specs, out="replays/", workers=8):
        print(result.id, result.status)

What is public is what ``__all__`` names; it follows semantic versioning from 1.0 (until then a minor
release may change it, and says so). Everything else — the modules under ``pvisor_host.*`` — is internal.
The library never configures logging sinks: it logs through loguru under the ``pvisor_host`` name, which
stays disabled until the CLI (or the embedding application, ``logger.enable("pvisor_host")``) enables it.
Names are imported on first use, so ``import pvisor_host`` stays cheap (nothing heavy: not even loguru, which
comes with the first module that logs).
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._version import PVISOR_VERSION, __version__

if "loguru" in sys.modules:  # an application that uses loguru: our records go off now, before it can turn them on
    from . import _log  # noqa: F401

if TYPE_CHECKING:
    from .api import Batch, abatch, batch, build, fork, gc, inspect, replay, results
    from .errors import (
        ExitCode,
        ImageBuildError,
        InfrastructureError,
        Interrupted,
        PreflightRejected,
        PrerequisiteError,
        PvisorHostError,
        ResultProtocolError,
        UsageError,
    )
    from .models.batch import BatchSummary, ItemResult
    from .models.housekeeping import GcReport
    from .models.image import BuildOptions, ImageRef
    from .models.record import ReplayRecord
    from .models.result import ReplayResult
    from .models.spec import ModelUpstream, ReplaySpec
    from .preflight.inspect import TrajectoryReport

_EXPORTS = {
    "replay": "api",
    "fork": "api",
    "batch": "api",
    "abatch": "api",
    "build": "api",
    "gc": "api",
    "inspect": "api",
    "results": "api",
    "Batch": "api",
    "TrajectoryReport": "preflight.inspect",
    "ReplaySpec": "models.spec",
    "ModelUpstream": "models.spec",
    "ReplayRecord": "models.record",
    "ReplayResult": "models.result",
    "ImageRef": "models.image",
    "BuildOptions": "models.image",
    "GcReport": "models.housekeeping",
    "ItemResult": "models.batch",
    "BatchSummary": "models.batch",
    "ExitCode": "errors",
    "PvisorHostError": "errors",
    "UsageError": "errors",
    "PreflightRejected": "errors",
    "PrerequisiteError": "errors",
    "InfrastructureError": "errors",
    "ImageBuildError": "errors",
    "ResultProtocolError": "errors",
    "Interrupted": "errors",
}

__all__ = [
    "PVISOR_VERSION",
    "__version__",
    # functions
    "replay",
    "fork",
    "batch",
    "abatch",
    "build",
    "gc",
    "inspect",
    "results",
    "Batch",
    # models
    "ReplaySpec",
    "ModelUpstream",
    "ReplayRecord",
    "ReplayResult",
    "ImageRef",
    "BuildOptions",
    "GcReport",
    "ItemResult",
    "BatchSummary",
    "TrajectoryReport",
    # errors and exit codes
    "ExitCode",
    "PvisorHostError",
    "UsageError",
    "PreflightRejected",
    "PrerequisiteError",
    "InfrastructureError",
    "ImageBuildError",
    "ResultProtocolError",
    "Interrupted",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pvisor_host' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
