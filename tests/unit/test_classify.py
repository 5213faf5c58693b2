import pytest

from pvisor_host.backend.docker.container import WaitOutcome
from pvisor_host.backend.docker.sandbox.outcome import classify
from pvisor_host.errors import ExitCode, exit_code_for_status
from pvisor_host.models.result import ReplayResult

OK = ReplayResult.model_validate(
    {
        "schema_version": "sandbox-playback.result/v3",
        "phase": "replayed",
        "quality": "verified",
        "agent_status": "not_started",
        "run_id": "r",
        "artifacts": [],
        "failure": None,
        "retryable": False,
    }
)
FAILED = ReplayResult.model_validate(
    {**OK.model_dump(), "failure": {"category": "model_rate_limit", "message": "status 429"}, "retryable": True}
)


def decide(outcome, result=OK, **kw):
    return classify(outcome, result, timeout=90.0, memory=256 * 2**20, **kw)


@pytest.mark.parametrize(
    ("outcome", "result", "kw", "status", "category"),
    [
        (WaitOutcome(exit_code=0), OK, {}, "ok", None),
        (WaitOutcome(exit_code=40), FAILED, {}, "replay_failed", "model_rate_limit"),
        (WaitOutcome(exit_code=137, timed_out=True), None, {}, "timeout", "timeout"),
        (WaitOutcome(exit_code=137, timed_out=True, oom_killed=True), None, {}, "timeout", "timeout"),
        (WaitOutcome(exit_code=137, oom_killed=True), None, {}, "oom", "oom"),
        (WaitOutcome(exit_code=0, oom_killed=True), OK, {}, "oom", "oom"),
        (
            WaitOutcome(exit_code=1),
            None,
            {"protocol_error": "pvisor's stdout is not JSON: 'Error'"},
            "infra_error",
            "infra_error",
        ),
        (WaitOutcome(exit_code=3), OK, {}, "infra_error", "infra_error"),
        (WaitOutcome(exit_code=0), OK, {"infra_error": "could not collect"}, "infra_error", "infra_error"),
        (WaitOutcome(exit_code=None), None, {"interrupted": True}, "interrupted", "interrupted"),
    ],
)
def test_status(outcome, result, kw, status, category):
    got, failure = decide(outcome, result, **kw)
    assert got == status
    assert (failure.category if failure else None) == category


def test_messages_are_specific():
    _, failure = decide(WaitOutcome(exit_code=137, timed_out=True), None)
    assert failure.message == "the sandbox ran past --timeout 1m30s and was killed"
    _, failure = decide(WaitOutcome(exit_code=137, oom_killed=True), None)
    assert failure.message == "the sandbox ran out of memory (--memory 256.0 MiB); the kernel killed a process"
    _, failure = decide(WaitOutcome(exit_code=40), FAILED)
    assert failure.message == "status 429" and failure.retryable
    _, failure = decide(WaitOutcome(exit_code=1), None, protocol_error="pvisor printed no result on stdout")
    assert failure.message == "pvisor printed no result on stdout (exit code 1)"


def test_every_status_has_a_distinct_exit_code():
    codes = {
        s: exit_code_for_status(s) for s in ("ok", "replay_failed", "timeout", "oom", "infra_error", "interrupted")
    }
    assert codes == {
        "ok": ExitCode.OK,
        "replay_failed": 1,
        "timeout": 4,
        "oom": 5,
        "infra_error": 6,
        "interrupted": 130,
    }
    assert len(set(codes.values())) == len(codes)


def test_pvisor_finding_the_run_directory_full_is_the_disk_not_the_replay():
    full = ReplayResult.model_validate(
        {
            **OK.model_dump(),
            "failure": {"category": "internal_error", "message": "write x.tmp: No space left on device (os error 28)"},
        }
    )
    status, failure = decide(WaitOutcome(exit_code=50), full)
    assert status == "infra_error" and failure.category == "disk_full"
    assert (
        failure.message == "the run directory's filesystem is full: write x.tmp: No space left on device (os error 28)"
    )


def test_a_version_probe_past_its_budget_is_a_busy_host_and_worth_another_sandbox():
    slow = ReplayResult.model_validate(
        {**OK.model_dump(), "failure": {"category": "unsupported_version",
         "message": "version probe exceeded time/output budget"}, "retryable": False}
    )  # fmt: skip
    status, failure = decide(WaitOutcome(exit_code=11), slow)
    assert (status, failure.category, failure.retryable) == ("infra_error", "infra_error", True)
    assert failure.message == (
        "pvisor's version probe of the agent ran past its 5 s budget (a busy host): "
        "version probe exceeded time/output budget"
    )
    wrong = ReplayResult.model_validate(
        {**slow.model_dump(), "failure": {"category": "unsupported_version",
         "message": "claude-code profile requires 2.1.220, got \"2.1.100 (Claude Code)\" from /usr/bin/claude"}}
    )  # fmt: skip
    assert decide(WaitOutcome(exit_code=11), wrong)[0] == "replay_failed"  # a real mismatch is not retried
