"""``pvisor-host inspect``: what a trajectory file is, as pvisor-host and the pinned pvisor see it.

Per file: the agent (detected from its format, or as given), the agent version it was recorded with, its
number of boundaries (pvisor's own count of complete tool batches), the tools of each batch, the working
directory it was recorded in, and which boundaries the pinned pvisor accepts, with its reason for those it
refuses. It runs the same survey a batch's pre-flight runs (:mod:`.survey`), plus one pvisor run for the
tools of each batch where the survey did not need one. Nothing reaches an engine.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from ..errors import UsageError
from ..models.profiles import get_profile
from ..models.result import ResultFailure
from .checks import detect_agent
from .hostpvisor import probe
from .survey import Survey, survey
from .trajectory import read_trajectory


class TrajectoryReport(BaseModel):
    """One trajectory file, inspected."""

    path: Path
    sha256: str | None = None
    agent: str | None = None
    """The agent whose format it is (detected, unless given)."""
    recorded_version: str | None = None
    """The agent version the file says recorded it (None: the format does not say)."""
    pinned_version: str | None = None
    """The version pvisor replays (a recorded version that differs is refused)."""
    boundaries: int | None = None
    """pvisor's count of complete tool batches (None: pvisor refuses the file before counting)."""
    batches: list[list[str]] = []
    """The tool names of each batch, as pvisor selects them (up to the last boundary it accepts)."""
    cwd: str | None = None
    """The working directory the recording ran in (where the workspace goes in the sandbox)."""
    accepted: tuple[int, int] | None = None
    """The first and last boundary pvisor accepts (None: none)."""
    refused: list[tuple[int, int, ResultFailure]] = []
    """Ranges of boundaries pvisor refuses (first, last), with its reason."""
    problem: str | None = None
    """Why the file cannot be inspected at all (not a trajectory, not readable, an unknown agent)."""
    pvisor_runs: int = 0
    """Host pvisor runs the inspection took."""

    @property
    def ok(self) -> bool:
        """pvisor accepts every one of its boundaries."""
        return self.problem is None and not self.refused and self.accepted is not None


def inspect_trajectory(path: Path, agent: str | None = None) -> TrajectoryReport:
    """Inspect one trajectory file (see the module docstring); a problem with the file is reported, not raised.

    Raises:
        PrerequisiteError: the host's pvisor is missing.
        InfrastructureError: it hung or could not be run.
    """
    report = TrajectoryReport(path=path.expanduser().absolute())
    try:
        checked = read_trajectory(report.path)
        report.sha256 = checked.sha256
        report.agent = agent or detect_agent(checked)
        profile = get_profile(report.agent)
    except UsageError as exc:
        report.problem = exc.one_line()
        return report
    report.pinned_version = profile.version
    report.recorded_version = checked.versions.get(report.agent)
    report.cwd = checked.cwd.get(report.agent)
    found = survey(report.agent, checked)
    report.pvisor_runs = found.pvisor_runs
    report.boundaries = found.complete
    report.accepted = found.accepted
    report.batches = found.batches or []
    if report.accepted is not None and len(report.batches) < report.accepted[1]:
        listed = probe(report.agent, checked.path, report.accepted[1])
        report.pvisor_runs += 1
        report.batches = listed.batches or []
    report.refused = _refused_ranges(found)
    return report


def _refused_ranges(found: Survey) -> list[tuple[int, int, ResultFailure]]:
    """The refused boundaries of a survey as ranges, with pvisor's reason (past the count: not boundaries)."""
    ranges: list[tuple[int, int, ResultFailure]] = []
    last = found.complete if found.complete is not None else found.refused_from
    if found.refused_below is not None and found.below is not None and found.refused_below > 1:
        ranges.append((1, min(found.refused_below - 1, last or found.refused_below - 1), found.below))
    if found.refused_from is not None and found.failure is not None:
        ranges.append((found.refused_from, max(found.refused_from, last or found.refused_from), found.failure))
    return ranges


def inspect_files(paths: list[Path], agent: str | None = None) -> list[TrajectoryReport]:
    """Inspect each file (``agent``: the same agent for all; default: detected per file)."""
    if agent is not None:
        get_profile(agent)
    return [inspect_trajectory(path, agent) for path in paths]
