"""A batch's results for people and machines: ``summary.json``, ``results.jsonl``, ``junit.xml``, a GitHub
step summary, and the batch's exit code. The models they are made of live in :mod:`pvisor_host.models.batch`."""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

from ..errors import ExitCode, UsageError
from ..files.atomic import write_atomic
from ..models.batch import PHASES, RESULTS_FILE, BatchSummary, ItemResult, VerificationStats, percentile
from ..models.egress import EgressStats
from ..models.record import add_totals

#: Item statuses JUnit reports as failures (the replay's outcome) and as errors (the machinery's).
JUNIT_FAILURES = frozenset({"replay_failed", "timeout", "oom", "rejected"})
JUNIT_ERRORS = frozenset({"infra_error", "interrupted"})
#: A further report written when a batch ends, from its directory and results (``report.html``, say).
BatchReport = Callable[[Path, list[ItemResult]], object]
#: ``batch --fail-on``: what makes a finished batch exit 1 (see :func:`exit_code`).
FailOn = Literal["regressions", "failures", "verification", "never"]
FAIL_ON: tuple[FailOn, ...] = ("regressions", "failures", "verification", "never")
#: What fails a batch when ``--fail-on`` is not given: without a baseline, and with one.
FAIL_ON_DEFAULT: frozenset[FailOn] = frozenset({"failures", "verification"})
FAIL_ON_BASELINE: frozenset[FailOn] = frozenset({"regressions"})
#: Items the step summary names in each of its lists; the rest are counted.
STEP_SUMMARY_ITEMS = 20


def summarize(
    results: list[ItemResult],
    *,
    total: int,
    started: datetime,
    finished: datetime,
    interrupted: bool,
    deadline: bool,
) -> BatchSummary:
    """Counts, categories, percentiles and throughput of a batch."""
    ran = [r for r in results if r.ran]
    minutes = max((finished - started).total_seconds() / 60, 1e-9)
    timings = {}
    for phase in PHASES:
        values = [seconds for r in results if (seconds := getattr(r, f"time_{phase}")) is not None]
        timings[phase] = {
            "p50": percentile(values, 0.5),
            "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99),
            "max": max(values, default=0.0),
        }
    return BatchSummary(
        started_at=started,
        finished_at=finished,
        items=total,
        ran=len(ran),
        skipped=sum(r.skipped for r in results),
        interrupted=interrupted,
        deadline_reached=deadline,
        counts=dict(sorted(Counter(r.status for r in results).items())),
        categories=dict(sorted(Counter(r.category for r in results if r.category).items())),
        timings=timings,
        replays_per_minute=round(len(ran) / minutes, 2),
        failed=[r.id for r in results if r.status != "ok"],
        model=add_totals([t for r in results if not r.skipped and (t := r.model_totals()) is not None]),
        verification=_verification(results),
        egress=EgressStats.over([e for r in results if not r.skipped and (e := r.egress_totals()) is not None]),
    )


def _verification(results: list[ItemResult]) -> VerificationStats | None:
    verified = [r for r in results if r.verification is not None]
    if not verified:
        return None
    outcomes = Counter(r.verification for r in verified)
    judged = len(verified) - outcomes["could_not_run"]
    rewards = [r.verification_reward for r in verified if r.verification_reward is not None]
    return VerificationStats(
        items=len(verified),
        passed=outcomes["passed"],
        failed=outcomes["failed"],
        timed_out=outcomes["timed_out"],
        could_not_run=outcomes["could_not_run"],
        pass_rate=round(outcomes["passed"] / judged, 4) if judged else 0.0,
        mean_reward=round(sum(rewards) / len(rewards), 4) if rewards else None,
    )


def junit(results: list[ItemResult], summary: BatchSummary) -> bytes:
    """One testcase per item; failures carry the category and message, errors the infrastructure ones."""
    suite = ET.Element(
        "testsuite",
        name="pvisor-host batch",
        tests=str(len(results)),
        failures=str(sum(r.status in JUNIT_FAILURES or _unverified(r) for r in results)),
        errors=str(sum(r.status in JUNIT_ERRORS for r in results)),
        skipped=str(sum(r.status == "not_run" for r in results)),
        time=f"{(summary.finished_at - summary.started_at).total_seconds():.3f}",
        timestamp=summary.started_at.isoformat(timespec="seconds"),
    )
    for r in results:
        case = ET.SubElement(
            suite,
            "testcase",
            name=r.id,
            classname=f"pvisor-host.{r.agent or 'replay'}",
            time=f"{r.time_total or 0:.3f}",
        )
        message = f"{r.category}: {r.message}" if r.message else (r.category or r.status)
        if _unverified(r):
            text = f"the task's verification: {r.describe_verification()}"
            ET.SubElement(case, "failure", type=f"verification_{r.verification}", message=text).text = text
        elif r.status in JUNIT_FAILURES:
            ET.SubElement(case, "failure", type=r.category or r.status, message=message).text = message
        elif r.status in JUNIT_ERRORS:
            ET.SubElement(case, "error", type=r.category or r.status, message=message).text = message
        elif r.status == "not_run":
            ET.SubElement(case, "skipped", message=r.message or "the batch deadline passed before this item started")
        if r.path:
            ET.SubElement(case, "system-out").text = f"run directory: {r.path}"
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))


def _unverified(result: ItemResult) -> bool:
    """An ok replay whose task verifier did not pass (a JUnit failure of its own)."""
    return result.status == "ok" and result.verification is not None and result.verification != "passed"


def markdown(summary: BatchSummary, out: Path, results: Sequence[ItemResult] = ()) -> str:
    """The GitHub step summary: the counts, the items whose model requests drifted from their cassette (where,
    and in which field), and where the report is."""
    lines = [
        "### pvisor-host batch",
        "",
        f"{summary.items} items: {summary.ran} ran, {summary.skipped} skipped (finished earlier); "
        f"{summary.replays_per_minute} replays/minute"
        + (" — **interrupted**" if summary.interrupted else "")
        + (" — **deadline reached**" if summary.deadline_reached else ""),
        "",
        "| status | items |",
        "|---|---|",
        *(f"| {status} | {count} |" for status, count in summary.counts.items()),
    ]
    if summary.categories:
        lines += ["", "| failure category | items |", "|---|---|"]
        lines += [f"| {category} | {count} |" for category, count in summary.categories.items()]
    if summary.model is not None:
        lines += ["", f"Model: {summary.model.describe()}."]
    if summary.verification is not None:
        lines += ["", f"Verification: {summary.verification.describe()}."]
    if summary.egress is not None:
        lines += ["", f"Egress: {cell(summary.egress.describe())}."]
    drifted = [r for r in results if r.model_drift_call is not None]
    if drifted:
        lines += ["", "| drifted from its cassette | model call | field | message |", "|---|---|---|---|"]
        for r in drifted[:STEP_SUMMARY_ITEMS]:
            message = "" if r.model_drift_message is None else r.model_drift_message
            lines.append(f"| `{cell(r.id)}` | {r.model_drift_call} | {cell(r.model_drift_field)} | {cell(message)} |")
        lines += more_line(len(drifted))
    if summary.flaky:
        lines += ["", "| flaky between repeats | boundary | each repeat | files that differ |", "|---|---|---|---|"]
        for flaky in summary.flaky[:STEP_SUMMARY_ITEMS]:
            files = ", ".join(flaky.files) or "-"
            lines.append(
                f"| `{cell(flaky.id)}` | {flaky.after_step} | {cell('; '.join(flaky.outcomes))} | {cell(files)} |"
            )
        lines += more_line(len(summary.flaky))
    run = summary.timings.get("total", {})
    lines += ["", f"Per item: p50 {run.get('p50', 0):.1f}s, p90 {run.get('p90', 0):.1f}s. {report_link(out)}", ""]
    return "\n".join(lines)


def cell(value: object) -> str:
    """``value`` as one cell of a Markdown table, as text: on one line, ``|`` escaped (GitHub honours that
    inside code spans too), and no HTML, link or code span of its own (a file or an id may be named so)."""
    text = " ".join(str(value).split("\n")).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|").replace("`", "'").replace("[", "\\[").replace("]", "\\]")


def more_line(count: int) -> list[str]:
    """``… and N more`` when a list of ``count`` items was cut at :data:`STEP_SUMMARY_ITEMS`."""
    return ["", f"… and {count - STEP_SUMMARY_ITEMS} more (see the report)."] if count > STEP_SUMMARY_ITEMS else []


def report_link(out: Path) -> str:
    """Where the report is: in GitHub Actions, the run's page (whose artifacts hold the batch's directory, when
    the job uploads it), and the path in any case."""
    where = f"Report: `{out / 'report.html'}`"
    server, repository, run_id = (
        os.environ.get(k) for k in ("GITHUB_SERVER_URL", "GITHUB_REPOSITORY", "GITHUB_RUN_ID")
    )
    if server and repository and run_id:
        where += f" ([this run's artifacts]({server}/{repository}/actions/runs/{run_id}#artifacts))"
    return where + "."


def append_step_summary(text: str) -> None:
    """Add ``text`` to the GitHub step summary, when the job asks for one (``$GITHUB_STEP_SUMMARY``)."""
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as handle:
            handle.write(text + "\n")


def write_reports(
    out: Path, results: list[ItemResult], summary: BatchSummary, *, more: Sequence[BatchReport] = ()
) -> None:
    """``summary.json``, ``results.jsonl`` and ``junit.xml`` (atomically), then each of ``more`` (the layers above
    pass ``report.html``'s writer), and the GitHub step summary when it is asked for."""
    write_atomic(out / "summary.json", summary.model_dump_json(indent=2).encode() + b"\n")
    write_atomic(out / RESULTS_FILE, b"".join(r.model_dump_json().encode() + b"\n" for r in results))
    write_atomic(out / "junit.xml", junit(results, summary))
    for report in more:
        report(out, results)
    append_step_summary(markdown(summary, out, results))


def allowed_failures(text: str | None) -> Callable[[int], int]:
    """``--allow-failures``: ``N`` items, or ``P%`` of the total (rounded down); none when not given.

    Returns how many failures a batch of a given size may have (parsed now, so a bad value fails first).
    """
    if text is None:
        return lambda total: 0
    value = text.strip()
    try:
        if value.endswith("%"):
            percent = float(value[:-1])
            if not 0 <= percent <= 100:
                raise ValueError
            return lambda total: math.floor(total * percent / 100)
        count = int(value)
        if count < 0:
            raise ValueError
        return lambda total: count
    except ValueError:
        raise UsageError(f"--allow-failures {text!r}: pass a number of items (3) or a percentage (5%)") from None


def parse_fail_on(text: str | None, *, baseline: bool) -> frozenset[FailOn]:
    """``--fail-on``: a comma list of :data:`FAIL_ON` (``never`` alone); the default when not given.

    Raises:
        UsageError: an unknown name, ``never`` with another, or ``regressions`` without a baseline.
    """
    if text is None:
        return FAIL_ON_BASELINE if baseline else FAIL_ON_DEFAULT
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in FAIL_ON]
    if unknown or not names:
        raise UsageError(f"--fail-on {text!r}: pass a comma list of {', '.join(FAIL_ON)}")
    if "never" in names and len(set(names)) > 1:
        raise UsageError(f"--fail-on {text!r}: never fails on nothing; pass it alone")
    if "regressions" in names and not baseline:
        raise UsageError("--fail-on regressions needs --baseline DIR: the earlier batch to find regressions against")
    return frozenset(names)  # type: ignore[arg-type]


def exit_code(
    summary: BatchSummary, allowed: int, *, fail_on: frozenset[FailOn] = FAIL_ON_DEFAULT, regressed: int = 0
) -> ExitCode:
    """The batch's exit code: 130 when interrupted, whatever ``fail_on``; 6 when a full disk stopped it, 4 if its
    deadline cut it short, 6 when every item that is not ok failed on the infrastructure (the engine, a build),
    each only when more than ``allowed`` items are not ok (items never started count as not ok), whatever
    ``fail_on``: the batch did not answer. Otherwise 1 when something ``fail_on`` names happened, else 0:

    - ``failures``: more than ``allowed`` items are not ok;
    - ``regressions``: an item ``regressed`` against the baseline (or is new and not ok);
    - ``verification``: an item's verifier did not pass (it failed, timed out or could not run);
    - ``never``: none of these.
    """
    if summary.interrupted:
        return ExitCode.INTERRUPTED
    failed = _failures(summary, allowed)
    if failed in (ExitCode.INFRASTRUCTURE, ExitCode.TIMEOUT):
        return failed
    if "failures" in fail_on and failed == ExitCode.REPLAY_FAILED:
        return failed
    if "regressions" in fail_on and regressed:
        return ExitCode.REPLAY_FAILED
    verification = summary.verification
    if "verification" in fail_on and verification is not None and verification.passed < verification.items:
        return ExitCode.REPLAY_FAILED
    return ExitCode.OK


def _failures(summary: BatchSummary, allowed: int) -> ExitCode:
    not_ok = summary.items - summary.counts.get("ok", 0)
    if not_ok <= allowed:
        return ExitCode.OK
    if summary.stopped is not None:
        return ExitCode.INFRASTRUCTURE
    if summary.deadline_reached:
        return ExitCode.TIMEOUT
    if summary.counts.get("infra_error", 0) == not_ok:
        return ExitCode.INFRASTRUCTURE
    return ExitCode.REPLAY_FAILED
