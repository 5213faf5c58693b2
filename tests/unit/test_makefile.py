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


def test_make_test_starts_the_engine_and_leaves_images_to_the_tests_that_need_them():
    commands = dry_run("test")
    assert "scripts/ensure-engine.sh" in commands
    assert "scripts/ensure-chromium.sh" in commands  # the report's browser tests run, never skip, in CI
    assert "pvisor-host build" not in commands  # session fixtures build exactly the images the tests use
    assert "pytest" in commands
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
