"""The public API without an engine: what it exports, that it validates as the CLI does before the engine is
asked, and that it prints nothing. (``make lint`` type-checks the examples under ``mypy --strict``.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import pvisor_host
from pvisor_host import UsageError

from conftest import ROOT
from trajgen import claude_files_session, write_jsonl

NO_ENGINE = "unix:///nonexistent/pvisor-host-test.sock"


def test_everything_public_is_named_once_and_imports_lazily():
    from pvisor_host import _EXPORTS

    assert sorted(pvisor_host.__all__) == sorted(["PVISOR_VERSION", "__version__", *_EXPORTS])
    for name in pvisor_host.__all__:
        assert getattr(pvisor_host, name) is not None
    assert (ROOT / "controller" / "py.typed").is_file()
    # A submodule of the same name would replace the function once anything imported it.
    assert [name for name in pvisor_host.__all__ if importlib.util.find_spec(f"pvisor_host.{name}")] == []
    importlib.import_module("pvisor_host.attempts")  # what `replay` once collided with
    assert callable(pvisor_host.replay) and callable(pvisor_host.batch)
    probe = "import sys, pvisor_host; print(sorted(m for m in ('docker', 'pydantic') if m in sys.modules))"
    fresh = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "[]" and fresh.stderr == ""


def test_a_bad_replay_is_refused_with_the_cli_words_before_any_engine(tmp_path, capfd):
    with pytest.raises(UsageError) as caught:
        pvisor_host.replay(trajectory=tmp_path / "t.jsonl", after_step=0, agent="claude-code", docker_host=NO_ENGINE)
    assert caught.value.one_line() == "--after-step: Input should be greater than or equal to 1"
    with pytest.raises(UsageError) as caught:
        pvisor_host.replay(trajectory=tmp_path / "missing.jsonl", after_step=1, agent="claude-code")
    assert caught.value.one_line() == f"trajectory {tmp_path}/missing.jsonl: does not exist"
    assert capfd.readouterr() == ("", "")  # the library prints nothing


def test_a_bad_batch_item_is_refused_by_its_position_and_nothing_starts(tmp_path):
    good = write_jsonl(tmp_path / "t.jsonl", claude_files_session())
    items = [
        {"trajectory": good, "after_step": 1},
        {"trajectory": good},
        {"trajectory": tmp_path / "missing.jsonl", "after_step": 1},
    ]
    with pytest.raises(UsageError) as caught:
        pvisor_host.batch(items, out=tmp_path / "out", defaults={"agent": "claude-code"})
    assert caught.value.one_line() == "item 2: after_step: is required (and 1 more)"
    assert not (tmp_path / "out").exists()
    specs = [pvisor_host.ReplaySpec(trajectory=good, after_step=n, agent="claude-code") for n in (1, 1, 2)]
    with pytest.raises(UsageError) as caught:  # a reason every item shares: one line, as the CLI says it
        pvisor_host.batch(specs, out=tmp_path / "out")
    assert caught.value.one_line().startswith("every item: --mode continue lets the agent call its model")
    run = pvisor_host.batch(specs, out=tmp_path / "out", mode="replay-only")
    rows = [{"trajectory": good}]  # a boundary for every item, as a number (the command line's is text)
    assert [i.spec.after_step for i in pvisor_host.batch(rows, out=tmp_path / "o", after_step=3, mode="replay-only")
            .items] == [3]  # fmt: skip
    with pytest.raises(UsageError) as caught:
        pvisor_host.batch(rows, out=tmp_path / "o", after_step=3, run_id="mine", mode="replay-only")
    assert caught.value.one_line() == "run_id is each item's own: give it in the items, not as every item's default"
    assert [item.id for item in run.items][:1] == ["t-after1"] and len({item.id for item in run.items}) == 3
    assert not (tmp_path / "out").exists()  # nothing happens until it is iterated


# That the generated pages are current is `make docs`'s check (the generators' --check); here, what they hold.


def test_the_api_reference_names_every_public_function_and_model():
    page = (ROOT / "docs" / "api.md").read_text()
    for name in ("replay", "batch", "abatch", "build", "gc", "Batch", "ReplaySpec", "ReplayRecord", "UsageError"):
        assert f"### `{name}" in page, name


def test_the_schemas_of_record_and_summary_describe_their_fields():
    schema = json.loads((ROOT / "docs" / "schemas" / "record.schema.json").read_text())
    statuses = ["ok", "replay_failed", "timeout", "oom", "infra_error", "interrupted"]
    assert schema["properties"]["status"]["enum"] == statuses
    assert schema["$defs"]["Failure"]["properties"]["category"]["description"].startswith("pvisor's")
    summary = json.loads((ROOT / "docs" / "schemas" / "summary.schema.json").read_text())
    assert set(summary["required"]) >= {"items", "ran", "counts", "categories", "timings", "failed"}


def test_the_cli_reference_has_every_command_exit_code_and_label():
    page = (ROOT / "docs" / "reference.md").read_text()
    for command in ("build", "replay", "batch", "compare", "gc", "agents", "images", "images prune", "doctor"):
        assert f"## `pvisor-host {command}`" in page, command
    assert "| `--baseline` | — | An earlier batch's --out" in page
    assert "| 130 | `INTERRUPTED` |" in page and "| `pvisor-host.owner` |" in page


def test_logs_turned_on_stay_on_when_more_of_the_library_loads():
    """An application enables our logs after `import pvisor_host`; modules imported later must not turn them
    off again (the CLI's pass-through warning once vanished that way)."""
    probe = "\n".join(
        [
            "import sys, pvisor_host",
            "from loguru import logger",
            "logger.remove(); logger.add(sys.stdout, format='{message}')",
            "logger.enable('pvisor_host')",
            "import pvisor_host.backend.docker.gateway",  # first imported now
            "exec(\"from pvisor_host._log import logger; logger.warning('still on')\", {'__name__': 'pvisor_host.x'})",
        ]
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout == "still on\n"
    library_log = "exec(\"from pvisor_host._log import logger; logger.warning('off')\", {'__name__': 'pvisor_host.x'})"
    silent = f"import pvisor_host; {library_log}"
    quiet = subprocess.run([sys.executable, "-c", silent], capture_output=True, text=True, check=True)
    assert quiet.stdout == quiet.stderr == ""  # off until someone turns them on


def test_the_api_checks_cluster_options_as_the_cli_does_before_anything_connects(tmp_path, monkeypatch):
    good = write_jsonl(tmp_path / "t.jsonl", claude_files_session())
    items = [{"trajectory": good, "after_step": 1}]
    defaults = {"agent": "claude-code", "mode": "replay-only"}
    out = tmp_path / "out"
    with pytest.raises(UsageError) as caught:
        pvisor_host.batch(items, out=out, defaults=defaults, cluster="nowhere")
    assert caught.value.one_line() == (
        "--cluster 'nowhere' is not HOST:PORT (the Ray head's address, e.g. 10.0.0.5:6379)"
    )
    with pytest.raises(UsageError) as caught:
        pvisor_host.batch(items, out=out, defaults=defaults, registry="127.0.0.1:5000")
    assert caught.value.one_line() == (
        "a registry is where cluster nodes pull images from; it needs a cluster (--cluster)"
    )
    with pytest.raises(UsageError, match="registry"):
        pvisor_host.batch(items, out=out, defaults=defaults, cluster="10.0.0.5:6379", registry="http://reg:5000")
    # Ray missing is found when the batch runs, before the engine is asked (the engine here does not exist).
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    batch = pvisor_host.batch(items, out=out, defaults=defaults, cluster="10.0.0.5:6379", docker_host=NO_ENGINE)
    with pytest.raises(pvisor_host.PrerequisiteError) as missing:
        list(batch)
    assert missing.value.one_line() == ("a cluster needs Ray, which is not installed (pip install 'pvisor-host[ray]')")
    assert not out.exists()
