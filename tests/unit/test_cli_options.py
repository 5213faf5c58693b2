"""The CLI is a thin layer over the models: every replay option is a field of the spec (or of the build
options), described there once — name, help, the default it shows — so no flag can be silently dropped on its
way down, and ``batch`` offers the same ones as item defaults."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer.main
from pydantic import TypeAdapter

from pvisor_host.cli.app import app
from pvisor_host.cli.app import command as cli_command
from pvisor_host.models.image import BuildOptions
from pvisor_host.models.spec import MODEL_OPTIONS, ModelUpstream, ReplaySpec

COMMAND = typer.main.get_command(app)
#: Options of ``replay`` that are not about the replay itself but about its output.
REPLAY_OWN = {"json_output"}
#: Options of ``batch`` that are about the batch (or its input), not defaults for its items.
BATCH_OWN = {"manifest_file", "manifest", "trajectories", "after_step", "out", "workers", "deadline",
             "rerun_failed", "retry_oom", "allow_failures", "plan", "baseline", "cluster", "registry", "quiet",
             "json_output", "pull_workers", "image_budget", "keep_images", "id", "map", "registry_mirror",
             "image_rewrites", "fail_on", "repeat", "limit", "sample", "seed", "select", "verbose", "keep"}  # fmt: skip
SPEC_OPTIONS = set(ReplaySpec.model_fields) - {"upstream"} | set(MODEL_OPTIONS) | {"no_model_bodies"}
BUILD_OPTIONS = {"base", "ca_bundle"}
PER_ITEM = {"trajectory", "after_step", "out", "run_id", "session_id"}


def params(command: str) -> dict[str, Any]:
    return {p.name: p for p in cli_command(command).params if p.name != "help"}


def field_of(name: str) -> Any:
    if name in MODEL_OPTIONS:
        return ModelUpstream.model_fields[MODEL_OPTIONS[name]]
    return (ReplaySpec.model_fields | BuildOptions.model_fields).get(name)


def test_every_replay_option_is_a_model_field_and_every_field_an_option():
    assert set(params("replay")) - REPLAY_OWN == SPEC_OPTIONS | BUILD_OPTIONS


def test_batch_offers_every_replay_option_but_those_each_item_sets_itself():
    assert set(params("batch")) - BATCH_OWN == (SPEC_OPTIONS - PER_ITEM) | BUILD_OPTIONS


@pytest.mark.parametrize("name", sorted((SPEC_OPTIONS | BUILD_OPTIONS) - {"no_model_bodies"}))
def test_each_option_says_what_its_field_says(name):
    option = params("replay")[name]
    description = " ".join((field_of(name).description or "").replace("``", "").split())
    assert option.help and option.help == description


SHOWN = ["timeout", "memory", "tmp_size", "collect_limit", "retry_backoff", "cpus", "pids", "mode", "network",
         "attempts", "model_network", "model_body_limit", "model_timeout"]  # fmt: skip


@pytest.mark.parametrize("name", SHOWN)
def test_the_default_replay_shows_is_the_models_own(name):
    shown = params("replay")[name].default
    field = field_of(name)
    assert shown is not None
    kind = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
    assert TypeAdapter(kind).validate_python(shown) == field.default


def test_batch_shows_no_default_of_its_own_for_the_items():
    assert all(params("batch")[name].default in (None, ()) for name in SPEC_OPTIONS - PER_ITEM)


def test_every_option_given_on_the_command_line_reaches_the_spec_by_name(tmp_path, monkeypatch):
    """``replay`` with every option set: the spec it validates holds each value (none dropped, none renamed)."""
    import pvisor_host.preflight.checks as checks

    seen: list[ReplaySpec] = []

    def stop(spec: ReplaySpec, **_: Any) -> None:
        seen.append(spec)
        raise SystemExit(0)

    monkeypatch.setattr(checks, "check_inputs", stop)
    monkeypatch.setenv("PVH_KEY", "k")
    trajectory = tmp_path / "t.jsonl"
    args = [
        "replay", "--trajectory", str(trajectory), "--after-step", "3", "--agent", "claude-code", "--image", "img:1",
        "--inject", "--mode", "replay-only", "--max-steps", "9", "--boundary-user-prompt", "go on",
        "--disable-thinking", "--allow-stale-observations", "--session-id", "s", "--run-id", "r1",
        "--workspace-path", "/work", "--image-workspace", "--no-workspace", "--out", str(tmp_path / "o"),
        "--timeout", "90s", "--start-timeout", "20s", "--memory", "2g", "--cpus", "1.5", "--pids", "300",
        "--tmp-size", "64m",
        "--collect-limit", "1g", "--network", "bridge", "--egress-limit", "connections=7,bytes=1m",
        "--env", "A", "--env", "B", "--user", "1000:1000",
        "--cap-add", "NET_ADMIN", "--writable-rootfs", "--allow-privilege-escalation", "--runtime", "runsc",
        "--model-base-url", "http://127.0.0.1:9/v1", "--model", "m", "--model-api-key-env", "PVH_KEY",
        "--model-network", "internal", "--model-body-limit", "8k", "--model-timeout", "1m", "--attempts", "5",
        "--retry-backoff", "2s", "--base", "debian:bookworm-slim", "--ca-bundle", str(tmp_path / "ca.pem"),
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        COMMAND.main(args, standalone_mode=False)
    [spec] = seen
    assert spec.model_dump(exclude={"upstream"}) == {
        "trajectory": trajectory, "agent": "claude-code", "image": "img:1", "inject": True, "after_step": 3,
        "mode": "replay-only", "max_steps": 9, "boundary_user_prompt": "go on", "disable_thinking": True,
        "allow_stale_observations": True, "session_id": "s", "run_id": "r1", "workspace_dir": None,
        "workspace_path": "/work", "image_workspace": True, "no_workspace": True, "collect": None, "verify": None,
        "verify_timeout": 1800.0, "out": tmp_path / "o",
        "timeout": 90.0, "start_timeout": 20.0, "memory": 2 * 1024**3, "cpus": 1.5, "pids": 300,
        "tmp_size": 64 * 1024**2,
        "collect_limit": 1024**3, "network": "bridge", "egress": None,
        "egress_limit": {"connections": 7, "bytes": 1024**2, "at_once": 64}, "env": ["A", "B"], "user": "1000:1000",
        "cap_add": ["NET_ADMIN"], "writable_rootfs": True, "allow_privilege_escalation": True, "strict": False,
        "runtime": "runsc",
        "attempts": 5, "retry_backoff": 2.0, "fork": None, "fork_strict": False,  # --fork needs continue: test_fork
    }  # fmt: skip
    assert spec.upstream == ModelUpstream(
        base_url="http://127.0.0.1:9/v1", model="m", api_key_env="PVH_KEY", network="internal",
        body_limit=8 * 1024, timeout=60.0,
    )  # fmt: skip


def test_no_model_bodies_is_a_body_limit_of_zero(tmp_path, monkeypatch):
    import pvisor_host.preflight.checks as checks

    seen: list[ReplaySpec] = []
    monkeypatch.setattr(checks, "check_inputs", lambda spec, **_: (seen.append(spec), exit(0)))
    model = ["--model-base-url", "http://127.0.0.1:9/v1", "--model", "m", "--model-api-key-env", "PVH_KEY"]
    with pytest.raises(SystemExit):
        COMMAND.main(["replay", "--trajectory", str(Path("t")), "--after-step", "1", "--agent", "codex", *model,
                      "--no-model-bodies"], standalone_mode=False)  # fmt: skip
    assert seen[0].upstream is not None and seen[0].upstream.body_limit == 0


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [(["--help"], set()), (["--version"], set()),
     # typer reads a command's parameters with pydantic; the global options set up the logger
     (["images", "--help"], {"pydantic", "pydantic_core", "loguru"})],
)  # fmt: skip
def test_help_loads_no_engine_client_no_model_and_no_rich(argv, allowed):
    """Start-up is most of what ``--help`` costs: it must not import what only a command's work needs."""
    import subprocess
    import sys

    probe = ("import sys\nfrom pvisor_host.entry import main\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
             "heavy = ('docker', 'pydantic', 'rich', 'loguru', 'ray', 'pvisor_host.models', 'pvisor_host.backend')\n"
             "print(sorted({m.split('.')[0] if m.split('.')[0] != 'pvisor_host' else m for m in sys.modules\n"
             "              if m.startswith(heavy)}), file=sys.stderr)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
    assert set(json.loads(done.stderr.strip().splitlines()[-1].replace("'", '"'))) == allowed


def _commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every command a user can see (hidden ones are not documented), made as when used (cli/app.py)."""
    found = [(path, command)]
    for name in command.list_commands(None) if hasattr(command, "list_commands") else []:
        sub = command.get_command(None, name)  # the lazy ones (build, replay, batch) too, as --help lists them
        if not sub.hidden:
            found += _commands(sub.resolved() if hasattr(sub, "resolved") else sub, (*path, name))
    return found


def test_every_option_of_every_command_is_in_the_docs():
    """``docs/cli.md`` is the guide and points to the generated ``docs/reference.md`` for every option (its
    currency is ``make docs``'s check): an option that appears in neither fails here."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    pages = (docs / "cli.md").read_text() + (docs / "reference.md").read_text()
    missing = [
        f"{' '.join(path) or 'pvisor-host'} {flag}"
        for path, command in _commands(COMMAND)
        for param in command.params
        if not getattr(param, "hidden", False)
        for flag in param.opts
        if flag.startswith("--") and flag != "--help" and not re.search(rf"`{re.escape(flag)}[`\s=\[]", pages)
    ]
    assert missing == []
    assert {("batch",), ("replay",), ("build",)} <= {path for path, _ in _commands(COMMAND)}  # the walk sees all


def test_the_model_gateway_loads_aiohttp_only_when_it_starts():
    """aiohttp (about 0.1 s to import) is the model gateway's: a replay or batch without one, a cluster node's
    worker running a copy, and a ``pass-through`` model (no gateway) start without it; a gateway loads it. Nor do
    their modules load ``report.html``'s (a batch loads it when it ends)."""
    import subprocess
    import sys

    probe = ("import sys\nimport pvisor_host.cli.main, pvisor_host.cli.commands.run, pvisor_host.fanout.scheduler\n"
             "import pvisor_host.backend.docker, pvisor_host.backend.docker.sandbox.run, pvisor_host.attempts\n"
             "import pvisor_host.preflight.prepare, pvisor_host.preflight.checks, pvisor_host.fanout.plan\n"
             "import pvisor_host.fanout.manifest\n"
             "import pvisor_host.backend.cluster.node.tasks\nfrom pvisor_host.backend.docker.gateway import Gateway\n"
             "from pvisor_host.models.spec import ModelUpstream\nseen = ['aiohttp' in sys.modules]\n"
             "print('pvisor_host.report' in sys.modules)\n"
             "for network in ('pass-through', 'unix'):\n"
             "    up = ModelUpstream(base_url='http://127.0.0.1:9', model='m', api_key_env='K', network=network)\n"
             "    Gateway(up, 'k').start().close()\n"
             "    seen.append('aiohttp' in sys.modules)\n"
             "print(*seen)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "False", "False", "True"], done.stderr
