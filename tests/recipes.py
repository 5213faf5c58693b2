"""The CI recipes of ``docs/ci/`` as the tests read them: each shell step, in order, as a CI would run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CI = Path(__file__).resolve().parents[1] / "docs" / "ci"
GITHUB = CI / "github-replay.yml"
GITLAB = CI / "gitlab-ci.yml"


def github_steps() -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The workflow's ``env`` and its one job's steps."""
    workflow = yaml.safe_load(GITHUB.read_text())
    (job,) = workflow["jobs"].values()
    return workflow.get("env", {}), job["steps"]


def gitlab_job() -> dict[str, Any]:
    """The ``replay`` job."""
    return yaml.safe_load(GITLAB.read_text())["replay"]


def github_defaults() -> dict[str, Any]:
    """The workflow's ``defaults``."""
    return dict(yaml.safe_load(GITHUB.read_text()).get("defaults", {}))
