"""The v3 result parser, fed with what the real pvisor 0.3.1 prints on this host."""

import json
import subprocess

import pytest

from pvisor_host.errors import ResultProtocolError
from pvisor_host.models.result import parse_result
from pvisor_host.preflight.hostpvisor import pvisor_binary

from trajgen import claude_files_session, write_jsonl


def _pvisor(tmp_path, *args):
    trajectory = write_jsonl(tmp_path / "s.jsonl", claude_files_session())
    (tmp_path / "ws").mkdir(exist_ok=True)
    return subprocess.run(
        [
            str(pvisor_binary()),
            "replay",
            "--agent",
            "claude-code",
            "--trajectory",
            str(trajectory),
            "--prepare-only",
            "--workspace",
            str(tmp_path / "ws"),
            "--state-dir",
            str(tmp_path / "st"),
            "--output-dir",
            str(tmp_path / "out"),
            *args,
        ],
        capture_output=True,
        check=False,
    )


def test_full_shape_from_real_pvisor(tmp_path):
    done = _pvisor(tmp_path, "--after-step", "5", "--run-id", "r1")
    assert done.returncode == 0
    raw, result = parse_result(done.stdout)
    assert raw == done.stdout.strip()
    assert result.ok and not result.early_failure
    assert result.phase == "prepared" and result.quality == "verified" and result.agent_status == "not_started"
    assert (
        result.agent is not None and result.agent.version == "2.1.220" and result.agent.launch_source == "prepare_only"
    )
    assert (result.after_step, result.prefix_model_turns, result.replayed_tool_calls) == (5, 5, 0)
    assert {a.role for a in result.artifacts} >= {"playback_plan", "prepared_native_prefix"}


def test_early_failure_shape_from_real_pvisor(tmp_path):
    done = _pvisor(tmp_path, "--after-step", "9", "--run-id", "r2")
    assert done.returncode == 10
    _, result = parse_result(done.stdout)
    assert result.early_failure and result.phase is None and result.quality is None
    assert result.agent is None and result.after_step is None and result.metadata is None
    assert result.failure is not None and result.failure.category == "trajectory_error"
    assert result.failure.message == "requested after-step 9, trajectory has 5 complete batches"
    assert result.run_id == "r2"


def test_unknown_schema_version_is_a_clear_error():
    line = json.dumps({"schema_version": "sandbox-playback.result/v4", "phase": "prepared"}).encode()
    with pytest.raises(ResultProtocolError) as caught:
        parse_result(line)
    assert "schema_version 'sandbox-playback.result/v4'" in caught.value.one_line()
    assert "understands sandbox-playback.result/v3" in caught.value.one_line()


@pytest.mark.parametrize(
    ("stdout", "message"),
    [
        (b"", "printed no result"),
        (b"\n  \n", "printed no result"),
        (b"Error: pvisor-replay companion is not installed\n", "is not JSON"),
        (b"[1, 2]\n", "not an object"),
        (b'{"schema_version": "sandbox-playback.result/v3", "phase": "weird"}\n', "unexpected shape"),
    ],
)
def test_not_a_result(stdout, message):
    with pytest.raises(ResultProtocolError, match=message):
        parse_result(stdout)


def test_unknown_fields_inside_v3_are_kept():
    value = {
        "schema_version": "sandbox-playback.result/v3",
        "phase": None,
        "quality": None,
        "agent_status": "not_started",
        "run_id": None,
        "artifacts": [],
        "failure": None,
        "retryable": False,
        "something_new": 1,
    }
    _, result = parse_result(json.dumps(value).encode())
    assert result.model_extra == {"something_new": 1}


def test_a_result_glued_to_a_tool_s_output_is_still_found():
    result = {
        "schema_version": "sandbox-playback.result/v3",
        "phase": "replayed",
        "quality": "verified",
        "agent_status": "not_started",
        "run_id": "r",
        "failure": None,
        "artifacts": [],
    }
    line = json.dumps(result).encode()
    raw, parsed = parse_result(b"noise\n" + b"x" * 100_000 + b"{not json} {" + line + b"\n")
    assert raw == line and parsed.phase == "replayed"
    with pytest.raises(ResultProtocolError, match="not JSON"):
        parse_result(b"x" * 1000 + b"{broken\n")


def test_a_record_holds_no_secret_value_whoever_set_it():
    from pvisor_host.models.record import recorded_environment

    image = {"PATH": "/usr/bin", "HF_TOKEN": "hf_abc", "OPENAI_API_KEY": "sk-x", "DB_PASSWORD": "p", "TZ": "UTC"}
    assert recorded_environment(image, ["MINE"]) == {
        "PATH": "/usr/bin", "HF_TOKEN": None, "OPENAI_API_KEY": None, "DB_PASSWORD": None, "TZ": "UTC", "MINE": None,
    }  # fmt: skip
