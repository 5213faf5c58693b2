"""``doctor`` on an engine that has the bookworm base and nothing else (as right after ``make demo`` or a
first build): it reports, it does not crash. The engine is a stand-in that answers only what doctor asks."""

from __future__ import annotations

import json

from pvisor_host.backend.docker.image.base import recipe

from conftest import run_cli
from fakeengine import FakeEngine

BOOKWORM = recipe("bookworm").tag


def answer(method: str, path: str) -> tuple[int, dict[str, object]]:
    if path.endswith("/info"):
        return 200, {"Architecture": "x86_64", "DockerRootDir": "/"}
    if f"/images/{BOOKWORM}/json" in path:
        return 200, {"Id": "sha256:" + "b" * 64, "RepoTags": [BOOKWORM], "Config": {"Labels": {}}}
    return 404, {"message": "No such image"}


def test_doctor_reports_an_agent_whose_base_is_not_there_yet():
    with FakeEngine(answer) as engine:
        result = run_cli("doctor", "--json", env=engine.env)
    assert result.code == 0, result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["base image"]["detail"] == f"{BOOKWORM} (bootstrapped-earlier)"
    assert checks["image openhands"] == {
        "name": "image openhands",
        "status": "warn",
        "detail": "not built yet (its trixie base is not present either)",
        "fix": "pvisor-host build --agent openhands",
        "required": False,
    }
    assert checks["image claude-code"]["status"] == "warn"
    assert checks["image claude-code"]["detail"].endswith(" not built yet")
    assert [c["name"] for c in json.loads(result.stdout)["checks"]][:8] == [
        "engine",
        "pvisor on the host",
        "architecture",
        "disk",
        "runtimes",
        "runtime floor",
        "runtime starts",
        "registry",
    ]
    assert checks["runtime starts"]["detail"].startswith("runc 1.1.5 has been seen to hang in `runc init`")
    assert checks["runtimes"]["detail"].startswith("runc (default)")
    # Debian 12's runc: named, with its CVEs and the remedy.
    assert checks["runtime floor"] == {
        "name": "runtime floor",
        "status": "warn",
        "detail": "runc 1.1.5 is older than the fixes for CVE-2025-31133, CVE-2025-52565 and CVE-2025-52881"
        " (runc 1.2.8 / 1.3.3)",
        "fix": "run root sandboxes under gVisor (--runtime runsc), or upgrade runc to 1.2.8 / 1.3.3 or later",
        "required": False,
    }
