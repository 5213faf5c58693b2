"""The README's two commands do what they say, and no more (``make -n`` prints what a target would run)."""

from __future__ import annotations

import re
import subprocess

from conftest import ROOT


def dry_run(*targets: str) -> str:
    done = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout


def test_make_demo_builds_only_the_image_it_replays():
    commands = dry_run("demo")
    assert re.findall(r"pvisor-host build --agent (\S+)", commands) == ["claude-code"]
    assert re.findall(r"pvisor-host replay --agent (\S+)", commands) == ["claude-code"]
    assert "scripts/ensure-engine.sh" in commands


def test_make_test_starts_the_engine_and_builds_the_first_images_beside_the_unit_tier():
    commands = dry_run("test")
    assert "scripts/ensure-engine.sh" in commands
    assert "scripts/ensure-chromium.sh" in commands  # the report's browser tests run, never skip, in CI
    # The images every engine test needs build in the background, are waited for before the engine tier, and an
    # interrupt reaches them (a background job ignores SIGINT); the others are the session fixtures' to build.
    trap = commands.index("trap 'stop; exit 130' INT")
    build = commands.index("do setsid .venv/bin/pvisor-host build --agent $agent & pid=$!")
    lint = commands.index("scripts/lint.sh && scripts/ensure-chromium.sh")
    unit, engine = commands.index("pytest -m 'not docker and not faults'"), commands.index("built=0; wait $images")
    assert trap < build < lint < unit < engine < commands.rindex("pytest -m 'docker and not faults'")
    assert "trap 'kill -TERM $pid 2>/dev/null; wait $pid; exit 143' TERM" in commands  # the build's cleanup waited for
    assert "kill -TERM $images 2>/dev/null; wait $images" in commands
    # both tiers, which together select what a plain `pytest` does (addopts: not faults): none dropped
    assert "-m 'not docker and not faults'" in commands and "-m 'docker and not faults'" in commands


def test_make_images_builds_the_agents_asked_for():
    assert "for agent in claude-code codex;" in dry_run("images")
    assert "for agent in pi-agent;" in dry_run("images", "AGENTS=pi-agent")


def test_the_wheel_lists_every_package_of_the_source():
    """``pyproject.toml`` names the packages one by one (the source is ``controller/``, not ``pvisor_host/``):
    a package left out installs from a clone (editable) and is missing from the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        "pvisor_host" + "".join(f".{part}" for part in init.parent.relative_to(ROOT / "controller").parts)
        for init in (ROOT / "controller").rglob("__init__.py")
    }
    assert found - listed == set()
