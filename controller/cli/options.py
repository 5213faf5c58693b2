"""The replay options, declared once for ``replay`` and ``batch``.

``replay`` gives them its defaults; ``batch`` defaults every one to ``None`` ("not given"), so that only
the options a user passes become the batch-wide defaults each manifest line may override. Help texts,
types and flag names therefore cannot drift between the two commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Agent = Annotated[str | None, typer.Option(help="Agent name; default: the image's label.")]
Image = Annotated[str | None, typer.Option(help="Sandbox image; default: the one `build --agent` makes.")]
Inject = Annotated[
    bool | None,
    typer.Option(help="Run in --image unchanged; pvisor and the agent come from a read-only runtime volume."),
]
Mode = Annotated[str | None, typer.Option(help="continue (replay, then the live agent), replay-only or prepare-only.")]
MaxSteps = Annotated[int | None, typer.Option(help="Total action budget including the prefix.")]
BoundaryUserPrompt = Annotated[str | None, typer.Option(help="User message appended after the boundary observation.")]
DisableThinking = Annotated[bool | None, typer.Option(help="Disable thinking in live model requests.")]
AllowStaleObservations = Annotated[
    bool | None, typer.Option(help="Let Claude reuse source observations it cannot reproduce (degraded).")
]
WorkspaceDir = Annotated[Path | None, typer.Option(help="Host directory copied in as the workspace.")]
WorkspacePath = Annotated[
    str | None, typer.Option(help="Workspace path in the sandbox (default: the recorded cwd, else /workspace).")
]
ImageWorkspace = Annotated[
    bool | None, typer.Option(help="Start from a copy of the image's own directory at the workspace path.")
]
NoWorkspace = Annotated[bool | None, typer.Option("--no-workspace", help="Do not collect the final workspace.")]
Timeout = Annotated[str | None, typer.Option(help="Wall-clock limit per replay, e.g. 90s, 30m, 2h.")]
Memory = Annotated[str | None, typer.Option(help="Memory limit, e.g. 2g.")]
Cpus = Annotated[float | None, typer.Option(help="CPU limit.")]
Pids = Annotated[int | None, typer.Option(help="Process limit.")]
TmpSize = Annotated[str | None, typer.Option(help="Size of the /tmp tmpfs.")]
CollectLimit = Annotated[str | None, typer.Option(help="Most bytes collected from the sandbox.")]
Network = Annotated[str | None, typer.Option(help="none (default) or bridge.")]
Env = Annotated[list[str] | None, typer.Option(help="Pass this host variable into the sandbox (repeat).")]
User = Annotated[str | None, typer.Option(help="Sandbox user UID[:GID] or root (default: non-root).")]
CapAdd = Annotated[list[str] | None, typer.Option(help="Keep this capability (repeat).")]
WritableRootfs = Annotated[bool | None, typer.Option(help="Do not make the root filesystem read-only.")]
AllowPrivilegeEscalation = Annotated[bool | None, typer.Option(help="Do not set no-new-privileges.")]
Runtime = Annotated[
    str | None,
    typer.Option(
        help="Container runtime the engine has registered, e.g. runsc (gVisor); default $PVISOR_HOST_RUNTIME."
    ),
]
ModelBaseUrl = Annotated[
    str | None, typer.Option(help="The real OpenAI-compatible endpoint; a host-side gateway forwards to it.")
]
Model = Annotated[str | None, typer.Option(help="Model name for the agent (MODEL_NAME).")]
ModelApiKeyEnv = Annotated[
    str | None, typer.Option(help="Name of the host variable holding the real key (never the key itself).")
]
ModelNetwork = Annotated[
    str | None, typer.Option(help="unix (default: no network, a mounted socket), internal, or pass-through.")
]
ModelBodyLimit = Annotated[str | None, typer.Option(help="Bytes of each body kept in model-traffic.jsonl.")]
NoModelBodies = Annotated[bool | None, typer.Option(help="Keep no bodies in model-traffic.jsonl.")]
ModelTimeout = Annotated[str | None, typer.Option(help="How long the gateway waits for the upstream.")]
Attempts = Annotated[int | None, typer.Option(help="Attempts for failures worth retrying (see docs/batch.md).")]
RetryBackoff = Annotated[str | None, typer.Option(help="Wait before the first retry (doubles each time).")]
Base = Annotated[str | None, typer.Option(help="Base image when the agent image must be built.")]
CaBundle = Annotated[Path | None, typer.Option(help="CA bundle when the agent image must be built.")]
