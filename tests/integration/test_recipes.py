"""The CI recipes of ``docs/ci/``, run step by step as written: the real wheel of this repository installed from
an HTTP server, ``docker login`` to a real registry holding the pushed sandbox image, the baseline fetched
through each CI's API (a loopback server that checks the token, as GitHub's and GitLab's do), and the batch
continuing against a recorded cassette with no key and no network; then the same again against that baseline.

What a recipe ``uses:`` (checkout, setup-python, the artifact actions, the JUnit report) is done here the way
the action does it; every ``run:`` step and every line of the GitLab script is run by bash, unchanged."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from recipes import github_defaults, github_steps, gitlab_job

from cluster import Registry
from conftest import run_cli
from modelserver import StubServer
from trajgen import Call, Turn, claude_session, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
TOKEN, JOB_TOKEN = "ghs_test_token_1c9d", "glcbt-test-4a7e"
MODEL = ["--mode", "continue", "--max-steps", "8", "--model", "my-model"]


class CiServer:
    """What the recipes download from: the release's wheel, GitHub's runs and GitLab's job artifacts."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self.github_runs: list[int] = []  # successful runs of the workflow on main, newest first
        self.gitlab_artifacts: bytes | None = None  # the replay job's artifacts on the default branch
        self.asked: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                server.asked.append(self.path)
                status, body = server.answer(self.path, self.headers)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, path: str, headers: Any) -> tuple[int, bytes]:
        if path.endswith(f"/{self.wheel.name}"):
            return 200, self.wheel.read_bytes()
        if path == "/repos/o/r/actions/workflows/replay.yml/runs?branch=main&event=push&status=success&per_page=1":
            if headers.get("Authorization") != f"Bearer {TOKEN}":
                return 401, b'{"message": "Bad credentials"}'
            runs = [{"id": n} for n in self.github_runs[:1]]
            return 200, json.dumps({"total_count": len(runs), "workflow_runs": runs}).encode()
        if path == "/api/v4/projects/7/jobs/artifacts/main/download?job=replay":
            if headers.get("JOB-TOKEN") != JOB_TOKEN:
                return 401, b'{"message": "401 Unauthorized"}'
            return (200, self.gitlab_artifacts) if self.gitlab_artifacts else (404, b'{"message": "404 Not found"}')
        return 404, b"not here"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """This repository's wheel, built from a copy of its tree (as a release job builds it)."""
    tree = tmp_path_factory.mktemp("tree") / "pvisor-host"

    def ignored(directory: str, names: list[str]) -> list[str]:  # the checkout's own files, not what runs left
        top = Path(directory) == ROOT
        return [n for n in names if (top and (n.startswith(".") or n in ("build", "site", "pvisor-runs")))
                or n == "__pycache__" or n.endswith(".egg-info")]  # fmt: skip

    shutil.copytree(ROOT, tree, ignore=ignored)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, tree],
                   check=True, timeout=300)  # fmt: skip
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def project(tmp_path_factory, docker_client, claude_image, node_image) -> Iterator[dict[str, Any]]:
    """A repository as the recipes expect it (trajectories/, cassettes/ recorded against a stub model), and the
    registry holding the pushed sandbox image."""
    repo = tmp_path_factory.mktemp("repo")
    trajectory = claude_session(  # one boundary: each run is one continuation
        "Create f.txt containing hi.",
        [Turn([Call("Bash", {"command": "echo hi > f.txt", "description": "create f.txt"})], "Creating it."),
         Turn(text="Done.")],
    )  # fmt: skip
    (repo / "trajectories").mkdir()
    write_jsonl(repo / "trajectories" / "files.jsonl", trajectory)
    with Registry(docker_client) as registry:
        built = run_cli("build", "--agent", "claude-code", "--push", registry.name, "--json")
        assert built.code == 0, built.stderr
        image = json.loads(built.stdout)["pushed"]
        with StubServer() as stub:
            recorded = run_cli(
                "batch", "--trajectories", repo / "trajectories" / "*.jsonl", "--after-step", "all", "--image", image,
                *MODEL, "--model-base-url", stub.base_url, "--model-api-key-env", "PVH_RECIPE_KEY",
                "--model-cassette", "record", repo / "cassettes", "--out", repo.parent / "recorded", "--quiet",
                env={"PVH_RECIPE_KEY": "sk-recipe-key"},
            )  # fmt: skip
        assert recorded.code == 0, recorded.stderr
        assert len(list((repo / "cassettes").iterdir())) == 1  # one per item
        yield {"repo": repo, "registry": registry.name, "image": image, "recorded": repo.parent / "recorded"}


def job_dir(project: dict[str, Any], root: Path) -> Path:
    """A fresh checkout of the repository."""
    shutil.copytree(project["repo"], root)
    return root


def base_env(root: Path) -> dict[str, str]:
    """A runner's environment: no model key, a Docker config of its own (pip's cache is the machine's, as a
    runner's cache action would keep it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PVH_", "GITHUB_", "CI_"))}
    env.pop("PYTHONPATH", None)  # a runner's Python finds only what the recipe installs
    env["DOCKER_CONFIG"] = str(root / "docker-config")
    return env


def run_github(workflow_env: dict[str, str], steps: list[dict], root: Path, env: dict[str, str], artifacts: dict,
               run_id: int) -> list[str]:  # fmt: skip
    """The job's steps in order (``shell: bash`` is ``bash --noprofile --norc -eo pipefail``); the steps it ran,
    by name."""
    job = {**env, **workflow_env}
    files = {name: root.parent / f"{root.name}-{name}" for name in ("output", "env", "summary")}
    for path in files.values():
        path.write_text("")
    job |= {"GITHUB_OUTPUT": str(files["output"]), "GITHUB_ENV": str(files["env"]),
            "GITHUB_STEP_SUMMARY": str(files["summary"])}  # fmt: skip
    outputs: dict[str, dict[str, str]] = {}
    ran = []

    def expression(text: str) -> str:
        def value(match: re.Match[str]) -> str:
            name = match.group(1).strip()
            if name == "github.token":
                return TOKEN
            if name.startswith("secrets."):
                return {"secrets.REGISTRY_USER": "ci", "secrets.REGISTRY_PASSWORD": "registry-pass"}[name]
            step, _, output = name.removeprefix("steps.").partition(".outputs.")
            return outputs.get(step, {}).get(output, "")

        return re.sub(r"\$\{\{(.*?)\}\}", value, str(text))

    for step in steps:
        condition = step.get("if", "success()")
        if condition not in ("always()", "success()"):
            assert re.fullmatch(r"steps\.\w+\.outputs\.[\w-]+ != ''", condition), condition
            if expression("${{ " + condition.split(" != ")[0] + " }}") == "":
                continue
        ran.append(step.get("name", step.get("uses", "")))
        with_ = {k: expression(v) for k, v in step.get("with", {}).items()}
        if "run" in step:
            files["output"].write_text("")
            done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=root,
                                  env={**job, **{k: expression(v) for k, v in step.get("env", {}).items()}},
                                  capture_output=True, text=True, timeout=900)  # fmt: skip
            assert done.returncode == 0, f"{ran[-1]}: exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
            if "id" in step:
                lines = files["output"].read_text().splitlines()
                outputs[step["id"]] = dict(line.split("=", 1) for line in lines if "=" in line)
        elif step["uses"] == "actions/setup-python@v5":  # a Python of that version first on PATH
            venv = root.parent / "setup-python"
            if not venv.exists():
                subprocess.run([sys.executable, "-m", "venv", venv], check=True)
            job["PATH"] = f"{venv / 'bin'}:{job['PATH']}"
        elif step["uses"] == "actions/download-artifact@v4":
            assert (with_["run-id"], with_["github-token"]) == (str(artifacts["latest"]), TOKEN)
            stored = artifacts.get(int(with_["run-id"]), {}).get(with_["name"])
            if stored is None:  # expired
                assert step.get("continue-on-error") is True, "a missing baseline would fail the job"
                continue
            shutil.copytree(stored, root / with_["path"])
        elif step["uses"] == "actions/upload-artifact@v4":
            path = root / with_["path"]
            assert path.exists(), f"{ran[-1]}: {path} is missing"
            artifacts.setdefault(run_id, {})[with_["name"]] = path
        elif step["uses"] == "mikepenz/action-junit-report@v4":
            assert (root / with_["report_paths"]).is_file()
        else:
            assert step["uses"] == "actions/checkout@v4", step  # the job directory is the checkout
    return ran


def test_the_github_recipe_as_written_then_again_against_its_baseline(project, wheel, tmp_path):
    server = CiServer(wheel)
    try:
        workflow_env, steps = github_steps()
        assert github_defaults() == {"run": {"shell": "bash"}}  # what run_github runs the steps with
        release = workflow_env["PVISOR_HOST_WHEEL"]
        assert release.endswith(f"/{wheel.name}")  # the recipe names this version's wheel
        workflow_env |= {
            "PVISOR_HOST_WHEEL": release.replace("https://github.com", server.url),
            "REGISTRY": project["registry"],
            "IMAGE": project["image"],
        }
        artifacts: dict[Any, Any] = {}
        env = base_env(tmp_path) | {"GITHUB_API_URL": server.url, "GITHUB_REPOSITORY": "o/r",
                                     "GITHUB_SERVER_URL": "https://github.com", "GITHUB_RUN_ID": "101"}  # fmt: skip
        first = run_github(workflow_env, steps, job_dir(project, tmp_path / "run1"), env, artifacts, 101)
        assert "Download the baseline" not in first  # no successful run on main yet
        summary = json.loads((tmp_path / "run1" / "replays" / "summary.json").read_text())
        assert summary["counts"] == {"ok": 1}
        for record in (tmp_path / "run1" / "replays").glob("*/record.json"):
            model = json.loads(record.read_text())["model"]
            assert (model["cassette"], model["upstream"], model["totals"]["drift"]) == ("replay", None, None)
        docker_config = json.loads((tmp_path / "docker-config" / "config.json").read_text())
        assert project["registry"] in docker_config["auths"]  # logged in as the recipe says

        server.github_runs, artifacts["latest"] = [101], 101
        second = run_github(workflow_env, steps, job_dir(project, tmp_path / "run2"), env, artifacts, 102)
        assert "Download the baseline" in second
        compared = json.loads((tmp_path / "run2" / "replays" / "compare.json").read_text())
        assert (compared["matched"], compared["changes"]) == (1, [])
        assert "### pvisor-host batch" in (tmp_path / "run2-summary").read_text()
        published = (tmp_path / "run2" / "junit.xml").read_bytes()  # against the baseline: only regressions fail
        assert published == (tmp_path / "run2" / "replays" / "compare.xml").read_bytes()
        assert (tmp_path / "run1" / "junit.xml").read_bytes() == (
            tmp_path / "run1" / "replays" / "junit.xml"
        ).read_bytes()

        # The baseline run's artifacts expired: a warning, and the batch runs without a baseline.
        server.github_runs, artifacts["latest"] = [99], 99
        third = run_github(workflow_env, steps, job_dir(project, tmp_path / "run3"), env, artifacts, 103)
        assert "Download the baseline" in third and not (tmp_path / "run3" / "replays" / "compare.json").exists()
        assert any("actions/workflows/replay.yml/runs" in path for path in server.asked)
    finally:
        server.close()


def test_the_gitlab_recipe_as_written_against_its_baseline(project, wheel, tmp_path):
    server = CiServer(wheel)
    try:
        job = gitlab_job()
        variables = dict(job["variables"])
        variables |= {
            "PVISOR_HOST_WHEEL": variables["PVISOR_HOST_WHEEL"].replace("https://github.com", server.url),
            "REGISTRY": project["registry"],
            "IMAGE": project["image"],
        }
        env = base_env(tmp_path) | variables | {
            "CI_JOB_TOKEN": JOB_TOKEN, "CI_API_V4_URL": f"{server.url}/api/v4", "CI_PROJECT_ID": "7",
            "CI_DEFAULT_BRANCH": "main", "REGISTRY_USER": "ci", "REGISTRY_PASSWORD": "registry-pass",
        }  # fmt: skip
        script = job["script"]
        (fetch,) = [line for line in script if "jobs/artifacts" in line]

        # The first pipeline on the default branch: no artifacts yet (the API answers 404), no baseline.
        first = tmp_path / "pipeline1"
        first.mkdir()
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", fetch], cwd=first, env=env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "no baseline yet\n") and not (first / "baseline").exists()

        # A later one: the last successful pipeline's artifacts (its replays/, zipped as GitLab does).
        archive = io.BytesIO()
        with zipfile.ZipFile(archive, "w") as zipped:
            for path in project["recorded"].rglob("*"):
                zipped.write(path, Path("replays") / path.relative_to(project["recorded"]))
        server.gitlab_artifacts = archive.getvalue()
        pipeline = job_dir(project, tmp_path / "pipeline2")
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", "\n".join(script)], cwd=pipeline, env=env,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        after = subprocess.run(["bash", "-eo", "pipefail", "-c", "\n".join(job["after_script"])], cwd=pipeline,
                               env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert after.returncode == 0, after.stderr
        for path in job["artifacts"]["paths"] + [job["artifacts"]["reports"]["junit"]]:
            assert (pipeline / path).exists(), path
        assert (pipeline / "junit.xml").read_bytes() == (pipeline / "replays" / "compare.xml").read_bytes()
        assert not (tmp_path / "docker-config").exists()  # the runner's own Docker config was never written
        assert project["registry"] not in (pipeline / ".docker" / "config.json").read_text()  # logged out
        compared = json.loads((pipeline / "replays" / "compare.json").read_text())
        assert (compared["matched"], compared["changes"]) == (1, [])
        assert json.loads((pipeline / "replays" / "summary.json").read_text())["counts"] == {"ok": 1}
    finally:
        server.close()
