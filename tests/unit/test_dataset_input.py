"""A dataset as it is, without an engine: boundary selections, templates (SWE-bench's image names), CSV and
Parquet manifests with --map, the agent detected from each file, and the counts of ``all`` from the real
host pvisor."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pvisor_host.errors import ExitCode, UsageError
from pvisor_host.fanout.manifest import BatchInput
from pvisor_host.fanout.steps import parse_steps
from pvisor_host.fanout.templates import parse_template, swebench_id

from conftest import run_cli
from trajgen import Call, Turn, claude_session, codex_rollout, write_jsonl

NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/pvisor-host-test.sock"}


def turns(n: int) -> list[Turn]:
    return [Turn([Call("Bash", {"command": f"echo {i}"}, f"{i}\n")]) for i in range(1, n + 1)]


def claude(path: Path, batches: int, cwd: str = "/testbed") -> Path:
    return write_jsonl(path, claude_session("Do it.", turns(batches), cwd=cwd))


def codex(path: Path, batches: int, cwd: str = "/testbed") -> Path:
    return write_jsonl(path, codex_rollout("Do it.", turns(batches), cwd=cwd))


@pytest.mark.parametrize(
    ("value", "count", "steps", "plain"),
    [
        (5, 9, [5], True),
        ("5", 9, [5], True),
        ("all", 3, [1, 2, 3], False),
        ("ALL", 3, [1, 2, 3], False),
        ("last", 4, [4], False),
        ("3-5", None, [3, 4, 5], False),
        ("1,4-5", None, [1, 4, 5], False),
        ("[2, 1, 2]", None, [2, 1], False),
        ([1, 3], None, [1, 3], False),
        ([2.0], None, [2], False),
        ("all", None, [1], False),  # pvisor refused the file: one item, so the refusal shows
    ],
)
def test_boundary_selections(value, count, steps, plain):
    selection = parse_steps(value)
    assert selection.expand(count) == steps
    assert selection.plain is plain


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "after_step: boundaries count from 1 (got 0)"),
        ("7-3", "after_step: range '7-3' runs backwards; write it 3-7"),
        ("first", "after_step: 'first' is not a boundary"),
        (True, "after_step: True is not a boundary"),
        ([], "after_step: an empty list names no boundary"),
        ("1-999999", "after_step: range '1-999999' names more than 100000 boundaries (use 'all')"),
        ([1, "x"], "after_step: [1, 'x'] is not a boundary"),
    ],
)
def test_bad_boundary_selections_are_one_line(value, message):
    with pytest.raises(UsageError) as caught:
        parse_steps(value)
    assert caught.value.one_line().startswith(message)


def test_templates_fill_fields_through_filters():
    assert swebench_id("django__django-11099") == "django_1776_django-11099"
    assert swebench_id("Project__Repo-7") == "project_1776_repo-7"
    preset = parse_template("@swebench", flag="--image")
    assert preset.render({"id": "astropy__astropy-12907"}) == (
        "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    )
    template = parse_template("reg:5000/{parent|lower}/{stem|slug}:{{v}}", flag="--image")
    assert template.render({"parent": "Tasks", "stem": "a b"}) == "reg:5000/tasks/a_b:{v}"
    assert template.fields == {"parent", "stem"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("@nope", "--image @nope: no preset 'nope'; presets: @swebench"),
        ("x/{stem|shout}", "--image 'x/{stem|shout}': no filter 'shout'; filters: lower, upper, slug, swebench"),
        ("x/{stem:>9}", "--image 'x/{stem:>9}': {stem}: use filters ({x|lower}), not format specs"),
        ("x/{stem", "--image 'x/{stem': expected '}' before end of string"),
        ("x/{}", "--image 'x/{}': {} names no field"),
    ],
)
def test_bad_templates_are_one_line(text, message):
    with pytest.raises(UsageError) as caught:
        parse_template(text, flag="--image")
    assert caught.value.one_line() == message


def test_a_swebench_glob_maps_each_file_to_its_image_with_every_boundary_and_no_agent(tmp_path):
    """trajs/<instance_id>.jsonl, Claude Code and Codex mixed, no --agent, after_step all: each file's
    boundaries counted by pvisor, each file's agent detected, each file's image named by the preset."""
    trajs = tmp_path / "trajs"
    trajs.mkdir()
    claude(trajs / "django__django-11099.jsonl", 3)
    codex(trajs / "astropy__astropy-12907.jsonl", 2)
    source = BatchInput.parse(
        trajectories=str(trajs / "*.jsonl"), after_step="all", defaults={"image": "@swebench", "inject": True}
    )
    checked = source.check()
    assert checked.problems == [] and checked.items == 5
    items = list(source.items())
    assert [(item.id, item.spec.agent, item.spec.after_step) for item in items] == [
        ("astropy__astropy-12907-after1", "codex", 1),
        ("astropy__astropy-12907-after2", "codex", 2),
        ("django__django-11099-after1", "claude-code", 1),
        ("django__django-11099-after2", "claude-code", 2),
        ("django__django-11099-after3", "claude-code", 3),
    ]
    assert {item.spec.image for item in items} == {
        "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest",
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
    }
    assert checked.image_counts == {
        "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest": 2,
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest": 3,
    }


def test_id_templates_and_last(tmp_path):
    (tmp_path / "a").mkdir()
    claude(tmp_path / "a" / "t1.jsonl", 4)
    source = BatchInput.parse(
        trajectories=str(tmp_path / "*" / "*.jsonl"), after_step="last", id="{parent}-{stem}", defaults={}
    )
    assert [(i.id, i.spec.after_step) for i in source.items()] == [("a-t1-after4", 4)]
    plain = BatchInput.parse(trajectories=str(tmp_path / "*" / "*.jsonl"), after_step="2", id="{stem}", defaults={})
    assert [(i.id, i.spec.after_step) for i in plain.items()] == [("t1", 2)]


def write_csv(path: Path, header: list[str], *rows: list[object]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_a_csv_dataset_with_columns_named_otherwise(tmp_path):
    claude(tmp_path / "one.jsonl", 3)
    codex(tmp_path / "two.jsonl", 2)
    path = write_csv(
        tmp_path / "dataset.csv",
        ["instance_id", "traj", "steps", "env", "problem_statement"],
        ["django__django-1", "one.jsonl", "2-3", "A,B", "Fix the bug, please."],
        ["sympy__sympy-2", "two.jsonl", "", "", "Another one."],
    )
    source = BatchInput.parse(
        manifest=path,
        after_step="last",
        map=["id=instance_id", "trajectory=traj", "after_step=steps"],
        defaults={"image": "reg:5000/{id|swebench}:v1", "inject": True},
    )
    checked = source.check()
    assert checked.problems == []
    items = list(source.items())
    assert [(i.id, i.spec.after_step, i.spec.image, i.spec.env) for i in items] == [
        ("django__django-1-after2", 2, "reg:5000/django_1776_django-1:v1", ["A", "B"]),
        ("django__django-1-after3", 3, "reg:5000/django_1776_django-1:v1", ["A", "B"]),
        ("sympy__sympy-2-after2", 2, "reg:5000/sympy_1776_sympy-2:v1", []),  # the empty cell: the default, last
    ]
    assert items[0].spec.trajectory == tmp_path / "one.jsonl"
    assert items[2].line == 3  # the CSV file's line


def test_a_parquet_dataset_reads_as_its_csv(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the parquet extra is part of the dev install")
    import pyarrow.parquet as pq

    claude(tmp_path / "one.jsonl", 2)
    table = pa.table({"instance_id": ["x__y-1"], "trajectory": ["one.jsonl"], "after_step": ["all"], "n": [3.5]})
    pq.write_table(table, tmp_path / "d.parquet")
    source = BatchInput.parse(manifest=tmp_path / "d.parquet", map=["id=instance_id"], defaults={})
    assert [(i.id, i.spec.agent, i.spec.after_step) for i in source.items()] == [
        ("x__y-1-after1", "claude-code", 1),
        ("x__y-1-after2", "claude-code", 2),
    ]


def test_rows_that_cannot_be_told_are_one_line_each(tmp_path):
    claude(tmp_path / "good.jsonl", 1)
    (tmp_path / "unknown.jsonl").write_text('{"hello": "world"}\n')
    lines = [
        {"trajectory": "good.jsonl", "after_step": 1},
        {"trajectory": "unknown.jsonl", "after_step": 1},
        {"trajectory": "good.jsonl", "after_step": "1-x"},
        {"trajectory": "good.jsonl", "after_step": 1, "image": "r/{instance_id}:v1"},
        {"trajectory": "good.jsonl", "after_step": 1, "colour": "red"},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_cli("batch", path, "--out", tmp_path / "out", env=NO_ENGINE)
    assert result.code == ExitCode.USAGE, result.stderr
    assert result.error_lines == [
        f"pvisor-host: {path}:2: trajectory {tmp_path}/unknown.jsonl: is no trajectory format pvisor replays (none"
        " of claude-code, codex, mini-swe-agent, opencode, openhands, pi-agent, swe-agent) (pass agent explicitly"
        " if it is one)",
        f"pvisor-host: {path}:3: after_step: '1-x' is not a boundary; pass a number, 'all', 'last', a list or a"
        " range such as 3-7",
        f"pvisor-host: {path}:4: r/{{instance_id}}:v1: no value for {{instance_id}} (this item has after_step, id,"
        " image, name, parent, stem, trajectory)",
        f"pvisor-host: {path}:5: colour: is not a known option",
        "pvisor-host: error: 4 of the batch's lines are wrong (listed above); nothing ran",
    ]


def test_the_python_api_expands_rows_as_a_manifest_does(tmp_path):
    trajectory = claude(tmp_path / "t.jsonl", 3)
    source = BatchInput.parse(
        entries=[{"trajectory": trajectory, "after_step": "all", "id": "task"}], defaults={"mode": "replay-only"}
    )
    items = list(source.items())
    assert [(i.id, i.spec.agent, i.spec.after_step) for i in items] == [
        ("task-after1", "claude-code", 1),
        ("task-after2", "claude-code", 2),
        ("task-after3", "claude-code", 3),
    ]


def test_a_missing_trajectory_with_all_is_one_line_not_a_crash(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"trajectory": "gone.jsonl", "after_step": "all", "agent": "claude-code"}) + "\n")
    checked = BatchInput.parse(manifest=path, defaults={}).check()
    assert [p.message for p in checked.problems] == [f"trajectory {tmp_path}/gone.jsonl: does not exist"]


def test_a_large_csv_cell_is_read(tmp_path):
    claude(tmp_path / "t.jsonl", 1)
    big = write_csv(tmp_path / "big.csv", ["trajectory", "after_step", "patch"], ["t.jsonl", "1", "x" * 300_000])
    assert BatchInput.parse(manifest=big, defaults={}).check().items == 1


def test_text_cells_say_false_and_a_parquet_float_is_a_boundary(tmp_path):
    claude(tmp_path / "t.jsonl", 3)
    path = write_csv(
        tmp_path / "d.csv",
        ["trajectory", "after_step", "no_workspace", "inject", "image"],
        ["t.jsonl", "1", "false", "false", "reg/x:1"],
        ["t.jsonl", "2", "true", "", ""],
    )
    items = list(BatchInput.parse(manifest=path, defaults={}).items())
    assert [(i.spec.collect_mode, i.spec.inject) for i in items] == [("changes", False), ("none", False)]
    assert parse_steps(3.0).expand(None) == [3]


def test_the_id_template_does_not_change_what_id_means_in_the_image_template(tmp_path):
    (tmp_path / "trajs").mkdir()
    claude(tmp_path / "trajs" / "django__django-11099.jsonl", 1)
    source = BatchInput.parse(
        trajectories=str(tmp_path / "trajs" / "*.jsonl"), after_step="1", id="{parent}-{stem}",
        defaults={"image": "@swebench", "inject": True},
    )  # fmt: skip
    [item] = list(source.items())
    assert item.id == "trajs-django__django-11099"
    assert item.spec.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"


def test_a_json_array_is_one_line(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"trajectory": "t.jsonl", "after_step": 1}]))
    with pytest.raises(UsageError, match="is one JSON array; write JSON Lines"):
        BatchInput.parse(manifest=path, defaults={}).check()


def test_a_reader_that_stops_early_runs_no_more_rows(tmp_path):
    from pvisor_host.fanout.manifest import Rows

    rows = Rows(defaults={"after_step": 1, "agent": "claude-code"}, base=tmp_path, strict=True)
    claude(tmp_path / "t.jsonl", 1)
    expanded: list[int] = []
    original = rows._expanded

    def counted(number, row):
        expanded.append(number)
        return original(number, row)

    rows._expanded = counted  # type: ignore[method-assign]
    stream = rows.expand_all((n, {"trajectory": "t.jsonl"}) for n in range(1, 100_000))
    next(stream)
    stream.close()
    assert len(expanded) < 1000  # the window's rows at most, not the other 99,000


def test_repeat_runs_every_item_k_times_under_ids_of_their_own(tmp_path):
    claude(tmp_path / "t1.jsonl", 4)
    source = BatchInput.parse(trajectories=str(tmp_path / "*.jsonl"), after_step="2-3", repeat=2, defaults={})
    assert source.check().items == 4
    assert [(i.id, i.repeat_of, i.spec.after_step) for i in source.items()] == [
        ("t1-after2.r1", "t1-after2", 2),
        ("t1-after2.r2", "t1-after2", 2),
        ("t1-after3.r1", "t1-after3", 3),
        ("t1-after3.r2", "t1-after3", 3),
    ]
    entries = BatchInput.parse(entries=[{"trajectory": tmp_path / "t1.jsonl", "after_step": 1, "id": "x"}], repeat=3)
    assert [(i.id, i.repeat_of) for i in entries.items()] == [("x.r1", "x"), ("x.r2", "x"), ("x.r3", "x")]
    with pytest.raises(UsageError, match="repeat: Input should be greater than or equal to 1"):
        BatchInput.parse(trajectories=str(tmp_path / "*.jsonl"), after_step="2", repeat=0, defaults={})
    with pytest.raises(UsageError, match="repeat: Input should be less than or equal to 100"):
        BatchInput.parse(entries=[{"trajectory": tmp_path / "t1.jsonl", "after_step": 1}], repeat=101)
