"""A dataset's outputs and results, for real: ``--collect changes`` keeps the changed files and a patch that
turns the starting workspace into the final one (in a git repository and out of one), ``--verify`` runs the
task's verifier in the sandbox (passing, failing, timing out, writing a reward), compare sees a verification
flip as a regression, and the results read back the same as CSV and Parquet."""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from trajgen import Call, Turn, claude_session, write_jsonl

#: What the replay does to the workspace: a changed file, an added one, a removed one, a mode change, a binary.
EDITS = [
    "printf 'def add(a, b):\\n    return a + b\\n' > calc.py",
    "mkdir -p tests && printf 'from calc import add\\nassert add(2, 2) == 4\\n' > tests/test_calc.py",
    "rm obsolete.txt",
    "chmod +x run.sh",
    "head -c 300 /dev/zero | tr '\\0' '\\1' > data.bin",
]


def edits_session() -> list[dict]:
    return claude_session("Fix calc.", [Turn([Call("Bash", {"command": command}, "")]) for command in EDITS])


def starting_workspace(root: Path, *, git: bool) -> Path:
    root.mkdir(parents=True)
    (root / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "obsolete.txt").write_text("gone soon\n")
    (root / "run.sh").write_text("#!/bin/sh\npython3 -c 'import calc'\n")
    (root / "README").write_text("a task\n" * 200)
    if git:
        for command in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-qm", "start"]):
            subprocess.run(["git", "-c", "user.email=t@example.invalid", "-c", "user.name=t", *command], cwd=root,
                           check=True)  # fmt: skip
    return root


def tree(root: Path) -> dict[str, tuple[bytes, bool]]:
    """Every file under ``root`` but .git/, with its content and executable bit."""
    return {
        str(path.relative_to(root)): (path.read_bytes(), bool(path.stat().st_mode & 0o100))
        for path in sorted(root.rglob("*"))
        if path.is_file() and ".git" not in path.relative_to(root).parts
    }


@pytest.mark.parametrize("git", [False, True], ids=["plain", "git"])
def test_collect_changes_keeps_the_changed_files_and_a_patch_that_gives_the_final_workspace(
    tmp_path, claude_image, git
):
    workspace = starting_workspace(tmp_path / "task", git=git)
    trajectory = write_jsonl(tmp_path / "t.jsonl", edits_session())
    runs = {}
    for mode in ("changes", "full"):
        out = tmp_path / mode
        result = run_cli(
            "replay", "--trajectory", trajectory, "--after-step", str(len(EDITS)), "--mode", "replay-only",
            "--workspace-dir", workspace, "--collect", mode, "--out", out,
        )  # fmt: skip
        assert result.code == 0, result.stderr
        runs[mode] = json.loads((out / "record.json").read_text())
    changes = runs["changes"]
    assert changes["collect"] == "changes"
    assert (
        changes["workspace_changes"]
        == runs["full"]["workspace_changes"]
        == {
            "added": ["data.bin", "tests/", "tests/test_calc.py"],
            "changed": ["calc.py", "run.sh"],
            "removed": ["obsolete.txt"],
            "complete": True,
        }
    )
    collected = tree(tmp_path / "changes" / "workspace")
    assert sorted(collected) == ["calc.py", "data.bin", "run.sh", "tests/test_calc.py"]  # README is not copied
    # the patch turns a copy of the starting workspace into the final one, text, binary and modes alike
    applied = tmp_path / "applied"
    shutil.copytree(workspace, applied, symlinks=True)
    done = subprocess.run(["git", "apply", "--whitespace=nowarn", str(tmp_path / "changes" / "workspace.patch")],
                          cwd=applied, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert tree(applied) == tree(tmp_path / "full" / "workspace")
    assert not filecmp.cmp(workspace / "calc.py", applied / "calc.py", shallow=False)
    patch = next(a for a in changes["artifacts"] if a["path"] == "workspace.patch")
    assert patch["size"] == (tmp_path / "changes" / "workspace.patch").stat().st_size > 0


def verify_manifest(root: Path, verifies: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "t.jsonl", claude_session("Make it.", [Turn([Call("Bash", {"command": "echo ok > done.txt"})])]))
    lines = [
        {"id": item, "trajectory": "t.jsonl", "after_step": 1, "verify": command, "verify_timeout": "3s"}
        for item, command in verifies.items()
    ]
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


VERIFIES = {
    "passes": "test -f done.txt",
    "fails": "echo 'no such file' >&2; test -f missing.txt",
    "hangs": "sleep 60",
    "rewarded": "echo 0.75 > /logs/verifier/reward.txt",
}


def test_verify_results_csv_parquet_and_a_verification_that_flips(tmp_path, claude_image):
    manifest = verify_manifest(tmp_path / "data", VERIFIES)
    out = tmp_path / "before"
    result = run_cli("batch", manifest, "--mode", "replay-only", "--out", out, "--workers", "2", "--json")
    assert result.code == 1, result.stderr  # every replay is ok, but two verifiers did not pass (--fail-on)
    summary = json.loads(result.stdout)
    assert summary["verification"] == {
        "items": 4, "passed": 2, "failed": 1, "timed_out": 1, "could_not_run": 0, "pass_rate": 0.5,
        "mean_reward": 0.4375,
    }  # fmt: skip
    assert summary["counts"] == {"ok": 4}
    rows = {row["id"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    seen = {item: (row["verification"], row["verification_passed"], row["verification_reward"])
            for item, row in rows.items()}  # fmt: skip
    assert seen == {
        "passes": ("passed", True, 1.0),
        "fails": ("failed", False, 0.0),
        "hangs": ("timed_out", False, 0.0),
        "rewarded": ("passed", True, 0.75),
    }
    record = json.loads((out / "fails" / "record.json").read_text())
    assert record["verification"]["exit_code"] == 1 and "no such file" in record["verification"]["output_tail"]
    assert json.loads((out / "rewarded" / "record.json").read_text())["verification"]["reward_source"] == "reward.txt"
    assert (out / "rewarded" / "verifier" / "reward.txt").read_text() == "0.75\n"
    assert rows["passes"]["after_step"] == 1 and rows["passes"]["replayed"] == 1 and rows["passes"]["diverged"] == 0
    assert result.stdout.count("verification") >= 1
    junit = (out / "junit.xml").read_text()
    assert junit.count('type="verification_failed"') == 1 and junit.count('type="verification_timed_out"') == 1

    # The same rows as CSV and as Parquet, read back.
    parquet = tmp_path / "rows.parquet"
    done = run_cli("results", out, "--format", "parquet", "--output", parquet)
    assert done.code == 0, done.stderr
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(parquet).to_pylist()
    assert [row["id"] for row in table] == list(rows)
    assert [row["verification_passed"] for row in table] == [r["verification_passed"] for r in rows.values()]
    assert [row["time_run"] for row in table] == [r["time_run"] for r in rows.values()]
    as_csv = run_cli("results", out, "--format", "csv")
    assert as_csv.code == 0 and as_csv.stdout.splitlines()[0].startswith("batch,id,line,after_step,repeat_of,")
    assert len(as_csv.stdout.splitlines()) == 5

    # The same batch where the item that passed no longer does: compare calls it a regression.
    flipped = verify_manifest(tmp_path / "data2", {**VERIFIES, "passes": "test -f missing.txt"})
    after = tmp_path / "after"
    again = run_cli(
        "batch", flipped, "--mode", "replay-only", "--out", after, "--workers", "2", "--fail-on", "failures"
    )
    assert again.code == 0, again.stderr  # every replay ok: only the verifications fail, which this run does not ask
    compared = run_cli("compare", out, after, "--json")
    assert compared.code == 1, compared.stderr
    changes = json.loads(compared.stdout)["changes"]
    assert [(c["id"], c["kind"]) for c in changes if c["kind"] == "regression"] == [("passes", "regression")]


def test_what_the_replay_leaves_cannot_forge_the_verifiers_reward(tmp_path, claude_image):
    """A replayed call writes a reward and leaves a process that would write it again; the verifier fails. The
    reward is the failure's 0, what the verifier wrote is not a change of the replay's, and the --env value the
    replay had is not in the verifier's environment."""
    forge = (
        "echo 1 > /logs/verifier/reward.txt; (sleep 3; echo 1 > /logs/verifier/reward.txt) >/dev/null 2>&1 & "
        "echo made > made.txt"
    )
    trajectory = write_jsonl(tmp_path / "t.jsonl", claude_session("Forge.", [Turn([Call("Bash", {"command": forge})])]))
    out = tmp_path / "run"
    result = run_cli(
        "replay", "--trajectory", trajectory, "--after-step", "1", "--mode", "replay-only", "--out", out,
        "--env", "PVH_VERIFY_SECRET", "--collect", "changes",
        "--verify", "sleep 5; touch by-verifier.txt; env | grep -c PVH_VERIFY_SECRET; exit 1",
        env={"PVH_VERIFY_SECRET": "s3cret-value"},
    )  # fmt: skip
    assert result.code == 0, result.stderr
    record = json.loads((out / "record.json").read_text())
    verification = record["verification"]
    assert (verification["passed"], verification["exit_code"], verification["reward"]) == (False, 1, 0.0)
    assert verification["reward_source"] == "exit_code" and verification["output_tail"] == "0\n"
    assert not (out / "verifier" / "reward.txt").exists()
    assert record["workspace_changes"]["added"] == ["made.txt"]  # not by-verifier.txt
    assert "s3cret-value" not in (out / "record.json").read_text()


def docs_examples() -> tuple[list[str], str]:
    """The console commands and the Python of docs/batch.md's results section (step 5), as the page has them."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "batch.md").read_text()
    section = page.split("**5. Results.**", 1)[1].split("compare replays-before/", 1)[0]
    console = section.split("```console\n", 1)[1].split("```", 1)[0]
    commands = [line.removeprefix("$ ").split("#")[0].strip() for line in console.splitlines() if line.startswith("$")]
    python = section.split("```python\n", 1)[1].split("```", 1)[0]
    return commands, python


def test_every_batch_has_the_same_columns_and_the_docs_examples_run(tmp_path, claude_image, monkeypatch):
    """Two real batches of one dataset: one with --verify and a rejected item, one with neither. Their rows have the
    same columns in the same order, their Parquet files the same schema (nullable ints and booleans), they
    concatenate, join back to the dataset by its own instance_id, and every example of the docs' results section
    runs as written."""
    pd = pytest.importorskip("pandas")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "t.jsonl", claude_session("Make it.", [Turn([Call("Bash", {"command": "echo ok > a"})])]))
    dataset = pd.DataFrame(
        {
            "instance_id": ["task__a-1", "task__b-2", "task__c-3"],
            "trajectory": ["t.jsonl", "t.jsonl", "t.jsonl"],
            "after_step": [1, 1, 9],  # the third boundary is past the trajectory's end: rejected, with a row
            "repo": ["x/a", "x/b", "x/c"],
        }
    )
    dataset.to_parquet(tmp_path / "swe-bench.parquet")
    common = ("swe-bench.parquet", "--map", "id=instance_id", "--mode", "replay-only", "--keep", "instance_id,repo")
    verified = run_cli("batch", *common, "--verify", "test -f a", "--out", "replays")
    assert verified.code == 1, verified.stderr  # the rejected item
    plain = run_cli("batch", *common, "--out", "replays-model-b")
    assert plain.code == 1, plain.stderr
    (tmp_path / "replays-model-a").symlink_to(tmp_path / "replays")

    lines = [json.loads(line) for line in (tmp_path / "replays" / "results.jsonl").read_text().splitlines()]
    other = [json.loads(line) for line in (tmp_path / "replays-model-b" / "results.jsonl").read_text().splitlines()]
    assert [list(row) for row in lines] == [list(row) for row in other]  # the same columns, in the same order
    assert list(lines[0])[-2:] == ["instance_id", "repo"]  # the dataset's own columns, after the fixed ones
    assert [(r["id"], r["line"], r["after_step"], r["status"]) for r in lines] == [
        ("task__a-1", 1, 1, "ok"), ("task__b-2", 2, 1, "ok"), ("task__c-3", 3, 9, "rejected"),
    ]  # fmt: skip
    assert lines[2]["trajectory"] == "t.jsonl" and lines[2]["path"] is None  # as the dataset gave it; no directory
    assert (lines[0]["verification"], other[0]["verification"]) == ("passed", None)

    commands, python = docs_examples()
    for command in commands:
        done = run_cli(*command.split()[1:])
        assert done.code == 0, f"{command}: {done.stderr}"
    schemas = [pq.read_schema(path) for path in ("replays.parquet", "both.parquet")]
    assert schemas[0].equals(schemas[1], check_metadata=False)
    kinds = {field.name: str(field.type) for field in schemas[0]}
    assert (kinds["replayed"], kinds["verification_passed"], kinds["time_total"]) == ("int64", "bool", "double")
    names = ("replays", "replays-model-b")
    frames = [pd.read_parquet(tmp_path / "replays.parquet")]
    run_cli("results", names[1], "--format", "parquet", "--output", "b.parquet")
    frames.append(pd.read_parquet("b.parquet"))
    assert pq.read_schema("b.parquet").equals(pq.read_schema("replays.parquet"), check_metadata=False)
    assert list(pd.concat(frames).columns) == list(frames[0].columns)
    both = pd.read_parquet("both.parquet")
    assert sorted(set(both["batch"])) == ["replays-model-a", "replays-model-b"] and len(both) == 6
    exec(compile(python, "docs/batch.md", "exec"), {})  # every line of the docs' Python runs as written
