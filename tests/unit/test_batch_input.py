"""Batch input and results without an engine: manifest validation (every bad line, with its number, before
anything runs), the shorthand, content keys, summaries, JUnit and exit codes. CLI cases run the CLI's own main
in this process (one, a real process) against an address where no engine answers, proving nothing reaches Docker."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from pvisor_host.errors import ExitCode, UsageError
from pvisor_host.fanout.manifest import BatchInput
from pvisor_host.fanout.resume import content_key
from pvisor_host.fanout.summary import allowed_failures, exit_code, junit, markdown, parse_fail_on, summarize
from pvisor_host.files.digest import tree_digest
from pvisor_host.models.batch import ItemResult, VerificationStats, percentile
from pvisor_host.models.record import ModelDrift
from pvisor_host.models.spec import ReplaySpec

from conftest import invoke_cli, run_cli
from trajgen import claude_files_session, write_jsonl

NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/pvisor-host-test.sock"}


@pytest.fixture
def trajectory(tmp_path) -> Path:
    return write_jsonl(tmp_path / "t.jsonl", claude_files_session())


def manifest(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "m.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_every_bad_line_is_reported_with_its_number_and_nothing_runs(tmp_path, trajectory):
    path = manifest(
        tmp_path,
        {"trajectory": "t.jsonl", "after_step": 1},
        "# a comment, then a blank line",
        "",
        "{not json",
        {"trajectory": "t.jsonl"},
        {"trajectory": "missing.jsonl", "after_step": 2},
        {"trajectory": "t.jsonl", "after_step": 2, "agent": "nope"},
        {"trajectory": "t.jsonl", "after_step": 2, "timeout": "soon"},
        {"trajectory": "t.jsonl", "after_step": 3, "out": "x"},
        {"trajectory": "t.jsonl", "after_step": 3, "id": "../up"},
        {"trajectory": "t.jsonl", "after_step": 4, "id": "dup"},
        {"trajectory": "t.jsonl", "after_step": 5, "id": "dup"},
        {"trajectory": "t.jsonl", "after_step": 1, "colour": "red"},
        "[1, 2]",
    )
    result = invoke_cli("batch", "--manifest", path, "--agent", "claude-code", "--out", tmp_path / "out", env=NO_ENGINE)
    assert result.code == ExitCode.USAGE, result.stderr
    assert "Traceback" not in result.stderr
    assert result.error_lines == [
        f"pvisor-host: {path}:4: not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        f"pvisor-host: {path}:5: after_step: is required",
        f"pvisor-host: {path}:6: trajectory {tmp_path}/missing.jsonl: does not exist",
        f"pvisor-host: {path}:7: unknown agent 'nope' (known agents: claude-code, codex, mini-swe-agent, opencode,"
        " openhands, pi-agent, swe-agent)",
        f"pvisor-host: {path}:8: timeout: 'soon' is not a duration"
        " (use a number of seconds or units like 90s, 5m, 1h30m)",
        f"pvisor-host: {path}:9: out: a batch sets it for every item (<batch out>/<id>/); drop it from the line",
        f"pvisor-host: {path}:10: id '../up' may contain only letters, digits, '.', '-' and '_' (at most 120)",
        f"pvisor-host: {path}:12: id 'dup' is already used on line 11",
        f"pvisor-host: {path}:13: colour: is not a known option",
        f"pvisor-host: {path}:14: not a JSON object",
        "pvisor-host: error: 10 of the batch's lines are wrong (listed above); nothing ran",
    ]
    assert not (tmp_path / "out").exists()


def test_the_manifest_may_be_given_as_an_argument_as_people_type_it(tmp_path, trajectory):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"trajectory": "t.jsonl"}) + "\n")
    result = invoke_cli("batch", broken, "--agent", "claude-code", "--out", tmp_path / "out", env=NO_ENGINE)
    assert result.code == ExitCode.USAGE, result.stderr
    assert result.error_lines == [
        f"pvisor-host: {broken}:1: after_step: is required",
        "pvisor-host: error: 1 of the batch's lines are wrong (listed above); nothing ran",
    ]
    dataset = manifest(tmp_path, {"trajectory": "t.jsonl", "after_step": 1})
    result = run_cli(  # a real process: no engine answers it
        "batch", dataset, "--agent", "claude-code", "--mode", "replay-only", "--out", tmp_path / "out", env=NO_ENGINE
    )
    assert result.code == ExitCode.PREREQUISITE, result.stderr  # read as the manifest: only the engine is missing
    assert result.error_lines[0].startswith("pvisor-host: error: no Docker engine answers at")
    both = invoke_cli("batch", dataset, "--manifest", broken, "--out", tmp_path / "out", env=NO_ENGINE)
    assert both.code == ExitCode.USAGE
    assert both.error_lines == [
        f"pvisor-host: error: two manifests given ({dataset} and --manifest {broken}); pass one"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--after-step", "1"],
            "pass a manifest (MANIFEST or --manifest FILE) or --trajectories GLOB (one of them)",
        ),
        (
            ["--trajectories", "*.jsonl"],
            "--trajectories needs --after-step (a number, all, last, a list or a range)",
        ),
        (["--trajectories", "*.jsonl", "--after-step", "0"], "--after-step: boundaries count from 1 (got 0)"),
        (["--trajectories", "*.jsonl", "--after-step", "1", "--id", "{x"], "--id '{x': expected '}' before end"),
        (["--trajectories", "*.jsonl", "--after-step", "1", "--map", "id=x"], "--map reads a manifest's columns"),
        (
            ["--trajectories", "nothing-*.jsonl", "--after-step", "1"],
            "--trajectories 'nothing-*.jsonl' matches no file",
        ),
        (["--trajectories", "*.jsonl", "--after-step", "1", "--timeout", "x"], "--timeout: 'x' is not a duration"),
        (["--trajectories", "*.jsonl", "--after-step", "1", "--env", "A=b"], "--env: A=...: pass only the name"),
        (
            ["--trajectories", "*.jsonl", "--after-step", "1", "--allow-failures", "lots"],
            "--allow-failures 'lots': pass a number of items (3) or a percentage (5%)",
        ),
    ],
)
def test_bad_batch_options_are_one_line(tmp_path, trajectory, args, line):
    result = invoke_cli("batch", "--out", tmp_path / "out", *args, env=NO_ENGINE, cwd=tmp_path)
    assert result.code == ExitCode.USAGE, result.stderr
    assert len(result.error_lines) == 1 and result.error_lines[0].startswith(f"pvisor-host: error: {line}")
    assert not (tmp_path / "out").exists()


def test_lines_override_command_line_defaults_and_paths_are_relative_to_the_manifest(tmp_path, trajectory):
    (tmp_path / "ws").mkdir()
    path = manifest(
        tmp_path,
        {"trajectory": "t.jsonl", "after_step": 1},
        {"trajectory": "t.jsonl", "after_step": 2, "mode": "prepare-only", "workspace_dir": "ws", "id": "two"},
    )
    source = BatchInput.parse(manifest=path, defaults={"agent": "claude-code", "mode": "replay-only", "memory": "1g"})
    checked = source.check()
    assert (checked.items, checked.problems, len(checked.image_specs)) == (2, [], 2)  # prepare-only needs no agent
    first, second = source.items()
    assert (first.id, first.spec.mode, first.spec.memory, first.spec.trajectory) == (
        "t-after1",
        "replay-only",
        2**30,
        trajectory,
    )
    assert (second.id, second.spec.mode, second.spec.workspace_dir) == ("two", "prepare-only", tmp_path / "ws")
    assert source.spec_default("memory") == 2**30 and source.spec_default("cpus") == 2.0


def test_shorthand_expands_every_boundary_with_the_host_pvisor(tmp_path, trajectory):
    (tmp_path / "broken.jsonl").write_text('{"type": "user"}\n')
    source = BatchInput.parse(
        trajectories=str(tmp_path / "*.jsonl"), after_step="all", defaults={"agent": "claude-code"}
    )
    assert source.check().items == 6
    # five complete batches in the files session; a file pvisor rejects still gets one item, to fail visibly
    assert [item.id for item in source.items()] == ["broken-after1"] + [f"t-after{n}" for n in range(1, 6)]


def test_a_manifest_is_validated_one_item_at_a_time(tmp_path, trajectory, monkeypatch):
    import pvisor_host.fanout.manifest as m

    lines = [{"trajectory": "t.jsonl", "after_step": 1 + n % 5, "id": f"i{n}"} for n in range(2000)]
    source = BatchInput.parse(manifest=manifest(tmp_path, *lines), defaults={"agent": "claude-code"})
    validated = []
    real = m._item
    monkeypatch.setattr(m, "_item", lambda number, *rest: validated.append(number) or real(number, *rest))
    items = source.items()
    assert next(items).id == "i0" and validated == [1]  # no spec is made before it is needed
    assert sum(1 for _ in items) == 1999


def test_the_items_of_one_image_run_together_images_in_order_of_first_appearance(tmp_path, trajectory):
    images = ["reg/a:1", "reg/b:1", "reg/a:1", None, "reg/b:1", "reg/c:1", "reg/a:1"]
    lines = [
        {"trajectory": "t.jsonl", "after_step": 1, "id": f"i{n}", **({"image": image, "inject": True} if image else {})}
        for n, image in enumerate(images, start=1)
    ]
    source = BatchInput.parse(manifest=manifest(tmp_path, *lines), defaults={"agent": "claude-code"})
    assert [item.id for item in source.items()] == ["i1", "i3", "i7", "i2", "i5", "i4", "i6"]
    assert [item.line for item in source.items()] == [1, 3, 7, 2, 5, 4, 6]  # each keeps its own line
    assert source.check().image_counts == {"reg/a:1": 3, "reg/b:1": 2, "reg/c:1": 1}


def spec(**fields) -> ReplaySpec:
    return ReplaySpec(**{"trajectory": Path("/t.jsonl"), "after_step": 1, "agent": "claude-code", **fields})


IMAGE = ("sha256:1", None)
#: Three verifications: one passed, one failed, one could not run.
VERIFIED = VerificationStats(items=3, passed=1, failed=1, could_not_run=1, pass_rate=0.5)


def test_the_content_key_changes_with_what_changes_the_outcome_only():
    key = content_key(spec(), "abc", IMAGE, None)
    assert content_key(spec(), "abc", IMAGE, None) == key
    assert content_key(spec(trajectory=Path("/elsewhere.jsonl")), "abc", IMAGE, None) == key  # same bytes
    assert content_key(spec(attempts=5, retry_backoff="1s"), "abc", IMAGE, None) == key
    changed = [
        content_key(spec(), "abd", IMAGE, None),
        content_key(spec(), "abc", ("sha256:2", None), None),
        content_key(spec(), "abc", ("sha256:1", "pvisor-host/claude-code:x"), None),
        content_key(spec(), "abc", IMAGE, "workspace-digest"),
        content_key(spec(after_step=2), "abc", IMAGE, None),
        content_key(spec(mode="replay-only"), "abc", IMAGE, None),
        content_key(spec(memory="1g"), "abc", IMAGE, None),
        content_key(spec(env=["HOME"]), "abc", IMAGE, None),
        content_key(spec(egress="pypi"), "abc", IMAGE, None),
        content_key(spec(egress="pypi", egress_limit="bytes=1m"), "abc", IMAGE, None),
    ]
    assert len({key, *changed}) == 1 + len(changed)
    assert content_key(spec(egress_limit="bytes=1m"), "abc", IMAGE, None) == key  # no egress: its caps change nothing
    # the key of an item without --egress is the one it had before --egress existed (a batch resumes across it)
    assert key == "9b63399dfa2e6a3c85cdaec455373c1ad4899da60f8f5eeaf231585fea6ffa37"


def test_tree_digest_sees_content_names_and_modes(tmp_path):
    (tmp_path / "a").write_text("1")
    first = tree_digest(tmp_path).sha256
    (tmp_path / "a").write_text("2")
    second = tree_digest(tmp_path).sha256
    (tmp_path / "a").chmod(0o755)
    third = tree_digest(tmp_path).sha256
    (tmp_path / "sub").mkdir()
    assert len({first, second, third, tree_digest(tmp_path).sha256}) == 4
    (tmp_path / "sub" / "b").write_bytes(b"x" * 1000)
    (tmp_path / "link").symlink_to(tmp_path / "sub" / "b")  # by its target, not its bytes
    assert tree_digest(tmp_path).bytes == 1001


def results() -> list[ItemResult]:
    return [
        ItemResult(id="a", line=1, status="ok", timings={"total": 1.0, "run": 0.5}),
        ItemResult(id="b", line=2, status="ok", timings={"total": 3.0, "run": 2.5}, skipped=True),
        ItemResult(
            id="c", line=3, status="replay_failed", category="malformed_trajectory", message="line 2: bad", attempts=1
        ),
        ItemResult(id="d", line=4, status="timeout", category="timeout", message="ran past 3s"),
        ItemResult(id="e", line=5, status="infra_error", category="infra_error", message="engine down", attempts=3),
        ItemResult(id="f", line=6, status="not_run"),
    ]


START = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_summary_counts_categories_percentiles_and_rate():
    summary = summarize(
        results(), total=6, started=START, finished=START + timedelta(minutes=2), interrupted=False, deadline=True
    )
    assert summary.counts == {"infra_error": 1, "not_run": 1, "ok": 2, "replay_failed": 1, "timeout": 1}
    assert summary.categories == {"infra_error": 1, "malformed_trajectory": 1, "timeout": 1}
    assert (summary.items, summary.ran, summary.skipped) == (6, 4, 1)
    assert summary.timings["total"] == {"p50": 1.0, "p90": 3.0, "p99": 3.0, "max": 3.0}
    assert summary.replays_per_minute == 2.0
    assert summary.failed == ["c", "d", "e", "f"]
    assert exit_code(summary, 0) == ExitCode.TIMEOUT  # the deadline left items not run
    assert exit_code(summary, 4) == ExitCode.OK
    assert exit_code(summary.model_copy(update={"deadline_reached": False}), 3) == ExitCode.REPLAY_FAILED
    assert exit_code(summary.model_copy(update={"interrupted": True}), 10) == ExitCode.INTERRUPTED
    text = markdown(summary, Path("/out"))
    assert "| replay_failed | 1 |" in text and "| malformed_trajectory | 1 |" in text and "deadline reached" in text


@pytest.mark.parametrize(
    ("fail_on", "regressed", "update", "code"),
    [
        ("failures", 0, {}, ExitCode.REPLAY_FAILED),  # 4 items not ok, none allowed
        ("failures", 1, {"counts": {"ok": 6}}, ExitCode.OK),  # all ok; a regression is not a failure
        ("failures,regressions", 1, {"counts": {"ok": 6}}, ExitCode.REPLAY_FAILED),
        ("regressions", 0, {}, ExitCode.OK),  # failing, but as the baseline did
        ("regressions", 1, {}, ExitCode.REPLAY_FAILED),
        ("never", 1, {}, ExitCode.OK),
        ("regressions", 0, {"deadline_reached": True}, ExitCode.TIMEOUT),  # cut short: it did not answer
        ("never", 0, {"stopped": "the disk is full"}, ExitCode.INFRASTRUCTURE),
        ("regressions", 0, {"interrupted": True}, ExitCode.INTERRUPTED),
        ("regressions", 4, {"counts": {"ok": 2, "infra_error": 4}}, ExitCode.INFRASTRUCTURE),  # the engine died
        ("never", 0, {"counts": {"ok": 2, "infra_error": 4}}, ExitCode.INFRASTRUCTURE),
        ("regressions", 1, {"counts": {"ok": 2, "infra_error": 3, "replay_failed": 1}}, ExitCode.REPLAY_FAILED),
        ("verification", 0, {"counts": {"ok": 6}, "verification": VERIFIED}, ExitCode.REPLAY_FAILED),
        ("failures", 0, {"counts": {"ok": 6}, "verification": VERIFIED}, ExitCode.OK),
        ("verification", 0, {"counts": {"ok": 6}, "verification": VERIFIED.model_copy(update={"failed": 0,
                                                                                               "passed": 3})},
         ExitCode.OK),
    ],
)  # fmt: skip
def test_fail_on_decides_what_exits_non_zero(fail_on, regressed, update, code):
    summary = summarize(results(), total=6, started=START, finished=START, interrupted=False, deadline=False)
    chosen = parse_fail_on(fail_on, baseline=True)
    assert exit_code(summary.model_copy(update=update), 0, fail_on=chosen, regressed=regressed) == code


@pytest.mark.parametrize(
    ("text", "baseline", "expected"),
    [
        (None, False, {"failures", "verification"}),
        (None, True, {"regressions"}),
        ("failures, verification", False, {"failures", "verification"}),
        ("never", True, {"never"}),
        ("never,failures", False, "--fail-on 'never,failures': never fails on nothing; pass it alone"),
        ("sometimes", False, "--fail-on 'sometimes': pass a comma list of regressions, failures, verification, never"),
        ("regressions", False, "--fail-on regressions needs --baseline DIR"),
    ],
)
def test_fail_on_is_a_comma_list(text, baseline, expected):
    if isinstance(expected, str):
        with pytest.raises(UsageError, match=re.escape(expected)):
            parse_fail_on(text, baseline=baseline)
    else:
        assert parse_fail_on(text, baseline=baseline) == expected


def test_the_step_summary_names_drifted_items_and_links_the_run(monkeypatch):
    drift = ModelDrift(call=2, field="messages", message=5, diff="- Linux 6.1\n+ Linux 6.8")
    drifted = [
        ItemResult(id=f"i{n}", line=n, status="ok", model_calls=2, model_drift_call=drift.call,
                   model_drift_field=drift.field, model_drift_message=drift.message)
        for n in range(22)
    ]  # fmt: skip
    summary = summarize(drifted, total=22, started=START, finished=START, interrupted=False, deadline=False)
    for name, value in (
        ("GITHUB_SERVER_URL", "https://github.com"),
        ("GITHUB_REPOSITORY", "o/r"),
        ("GITHUB_RUN_ID", "7"),
    ):
        monkeypatch.setenv(name, value)
    text = markdown(summary, Path("/out"), drifted)
    assert "| drifted from its cassette | model call | field | message |" in text
    assert "| `i0` | 2 | messages | 5 |" in text and "| `i19` |" in text and "| `i20` |" not in text
    assert "… and 2 more (see the report)." in text
    piped = [drifted[0].model_copy(update={"id": "django|1"})]
    assert "| `django\\|1` | 2 | messages | 5 |" in markdown(summary, Path("/out"), piped)  # one row, four cells
    assert (
        "Report: `/out/report.html` ([this run's artifacts](https://github.com/o/r/actions/runs/7#artifacts))." in text
    )


def test_junit_has_one_testcase_per_item_with_failures_and_errors():
    summary = summarize(results(), total=6, started=START, finished=START, interrupted=False, deadline=False)
    root = ET.fromstring(junit(results(), summary))
    suite = root.find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == (
        "6",
        "2",
        "1",
        "1",
    )
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert list(cases) == ["a", "b", "c", "d", "e", "f"]
    failure = cases["c"].find("failure")
    assert failure is not None and failure.get("type") == "malformed_trajectory"
    assert failure.get("message") == "malformed_trajectory: line 2: bad"
    error = cases["e"].find("error")
    assert error is not None and error.get("message") == "infra_error: engine down"
    assert cases["a"].find("failure") is None and cases["f"].find("skipped") is not None


def test_percentiles_and_allowed_failures():
    assert percentile([], 0.5) == 0.0
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile([float(n) for n in range(1, 101)], 0.9) == 90.0
    assert allowed_failures(None)(40) == 0
    assert allowed_failures("3")(40) == 3
    assert allowed_failures("10%")(40) == 4
    assert allowed_failures("12.5%")(7) == 0
    with pytest.raises(UsageError):
        allowed_failures("-1")
    with pytest.raises(UsageError):
        allowed_failures("101%")


def test_the_manifest_line_schema_has_every_option_a_line_may_set():
    from pvisor_host.fanout.manifest import manifest_line_model
    from pvisor_host.models.spec import MODEL_OPTIONS, ReplaySpec

    line = manifest_line_model()
    expected = {"id", *ReplaySpec.model_fields, *MODEL_OPTIONS, "no_model_bodies"} - {"out", "run_id", "upstream"}
    assert set(line.model_fields) == expected
    schema = line.model_json_schema()
    assert schema["required"] == ["trajectory"] and schema["additionalProperties"] is False
    steps = [kind.get("type") for kind in schema["properties"]["after_step"]["anyOf"]]
    assert steps == ["integer", "string", "array"]  # a number; all, last or a range; a list
    # The strings a manifest may use for sizes and durations are what the schema allows.
    accepted = line.model_validate({"trajectory": "t.jsonl", "after_step": 2, "timeout": "8s", "memory": "200m"})
    assert (accepted.timeout, accepted.memory) == (8.0, 200 * 2**20)  # type: ignore[attr-defined]
    assert [kind["type"] for kind in schema["properties"]["timeout"]["anyOf"]] == ["number", "string"]


def test_the_plans_write_estimate_counts_the_workspace_only_where_it_is_collected_whole(tmp_path):
    """``ItemPlan.write_bytes``: a run's own share, plus the workspace directory's bytes (one pass over it, with
    its digest) when ``full`` collects it; a workspace from the image is unknown until the image is here."""
    from pvisor_host.fanout.plan import RUN_BYTES, _write_bytes

    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "a").write_bytes(b"x" * 4096)
    workspace = tree_digest(tmp_path / "ws")
    full = spec(workspace_dir=tmp_path / "ws")
    assert _write_bytes(full, workspace) == RUN_BYTES + 4096
    assert _write_bytes(spec(workspace_dir=tmp_path / "ws", collect="changes"), workspace) == RUN_BYTES
    assert _write_bytes(spec(no_workspace=True), None) == RUN_BYTES
    assert _write_bytes(spec(image="task/x:1", image_workspace=True), None) is None  # the image's own directory
    assert _write_bytes(spec(), None) == RUN_BYTES  # an empty workspace of its own
