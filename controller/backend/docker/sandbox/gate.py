"""``--fork``: the gate at the agent's entrypoint, where a prefix's sandbox waits at the boundary.

pvisor launches the agent CLI once it has replayed the prefix and rebuilt the agent's context, before anything
has asked the model. With ``--fork`` pvisor launches it through the gate instead (``--agent-entrypoint``, a
script in the read-only input directory): pvisor's version probe passes straight through; the launch itself
marks the boundary in the run directory (``fork.reached``) and waits until the input directory holds the
go-ahead (``fork.go``), which only the host can write, then ``exec`` s the real CLI with pvisor's arguments and
environment. The host checkpoints the sandbox at the mark; each copy restored from it gets the go-ahead in its
own input directory (docs/fork.md).
"""

from __future__ import annotations

import shlex

from .stage import FORK_GATE, FORK_GO, FORK_REACHED, INPUT_MOUNT, RUN_MOUNT, Staging, host_says

#: Where the sandbox sees the gate.
GATE_PATH = f"{INPUT_MOUNT}/{FORK_GATE}"
#: Seconds between the gate's looks for the go-ahead.
_LOOK = "0.05"


def gate_script(real_entrypoint: str) -> str:
    """The gate in front of ``real_entrypoint`` (the agent's executable in the sandbox)."""
    real = shlex.quote(real_entrypoint)
    return (
        "#!/bin/sh\n"
        "# pvisor-host's fork gate (docs/fork.md): the agent's launch waits here at the boundary.\n"
        f'case "${{1:-}}" in --version | -v | -V) exec {real} "$@" ;; esac\n'
        f": >{RUN_MOUNT}/{FORK_REACHED}\n"
        f"until [ -e {INPUT_MOUNT}/{FORK_GO} ]; do sleep {_LOOK} 2>/dev/null || sleep 1; done\n"
        f'exec {real} "$@"\n'
    )


def add_gate(staging: Staging, real_entrypoint: str) -> Staging:
    """``staging`` with the gate in its input directory, in front of ``real_entrypoint``."""
    path = staging.input_dir / FORK_GATE
    path.write_text(gate_script(real_entrypoint))
    path.chmod(0o555)
    return staging.model_copy(update={"gate": GATE_PATH})


def reached(staging: Staging) -> bool:
    """Whether the sandbox has reached the gate."""
    return (staging.run_dir / FORK_REACHED).exists()


def release(staging: Staging) -> None:
    """Give a restored copy its go-ahead."""
    host_says(staging, FORK_GO)
