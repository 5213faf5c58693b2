"""``make bench``: pvisor-host side by side with what a user would otherwise write, on this machine, in one run.

Every figure is a ratio (or a rate) against a baseline measured in the same run, interleaved so that load
drifts hit both alike; medians, with the spread of the per-pair ratios. Sections (``--only`` picks some), one
module each, whose docstring says what it measures:

* ``single``  (``single.py``) one replay against a docker-py script and ``docker run``; runsc against runc.
* ``batch``   (``batch.py``) 100 replay-only items at 2, 4 and 8 workers against ``xargs -P W docker run``.
* ``scale``   (``scale.py``) prepare-only batches of 100, 1,000 and 5,000 items: per-item time, peak RSS.
* ``plan``    (``plan.py``) the same for ``batch --plan --json`` over a 10,000-line manifest.
* ``cache``   (``cache.py``) ``build`` of an image that exists against a docker-py tag lookup.
* ``startup`` (``startup.py``) ``pvisor-host --help`` and ``replay --help`` against ``import typer``.
* ``dataset`` (``dataset.py``) task images in a real registry: against a shell loop and pulling every image first.
* ``swe``     (``dataset.py``) the SWE-shaped dataset, the same way; then ``--plan`` of 2,000 items.
* ``shared``  (``shared.py``) two batches of task images started side by side on one engine, against one batch.
* ``collect`` (``collect.py``) the bytes an item writes with ``--collect changes`` and with ``full``.
* ``report``  (``report.py``) ``report.html`` of 2,000 and of 100,000 items: size, memory, time to first rows.
* ``gateway`` (``gateway.py``) the model gateway's added latency and peak RSS. No engine needed.
* ``fork``    (``fork.py``) ``replay --fork 8`` against 8 independent replays: wall and core-seconds; the
  checkpoint's time and size, a fork's start from it, for Claude Code and Codex.
* ``cluster`` (``cluster.py``) ``batch --cluster`` on a real Ray cluster of node containers. Not in the default
  run: ``--only cluster``; its dataset of task images alone: ``--only cluster-tasks``.

Shared helpers are in ``common.py``, the machine's description in ``machine.py``, the printed table in
``table.py``. Run from the repository's root: ``python -m bench`` (``make bench`` does).

Writes ``bench-results.json`` and prints a compact table. ``BENCH_SCALE=0.1`` shrinks every count (a quick
look, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.batch import batch
from bench.cache import cache
from bench.cluster import cluster
from bench.collect import collect
from bench.common import ROOT, image
from bench.dataset import dataset, swe
from bench.fork import fork
from bench.gateway import gateway
from bench.machine import machine
from bench.plan import plan
from bench.report import report
from bench.scale import scale
from bench.shared import shared
from bench.single import single
from bench.startup import startup
from bench.table import table

#: The sections of a default run.
DEFAULT = ("single", "batch", "scale", "plan", "cache", "startup", "dataset", "swe", "shared", "collect", "report",
           "gateway", "fork")  # fmt: skip
#: The sections that need the engine.
ENGINE = {"single", "batch", "scale", "plan", "cache", "dataset", "swe", "shared", "cluster", "cluster-tasks", "fork"}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(DEFAULT))
    parser.add_argument("--results", default=str(ROOT / "bench-results.json"))
    args = parser.parse_args()
    sections = args.only.split(",")
    results: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory(prefix="pvh-bench-") as scratch:
        work = Path(scratch)
        engine = ENGINE & set(sections)
        tag, entrypoint = image() if engine else ("", "")
        if "startup" in sections:
            results["startup"] = startup()
        if "cache" in sections:
            results["cache"] = cache(tag)
        for name in ("single", "batch", "scale", "plan"):
            (work / name).mkdir()
        if "single" in sections:
            results["single"] = single(work / "single", tag, entrypoint)
        if "batch" in sections:
            results["batch"] = batch(work / "batch", tag, entrypoint)
        if "scale" in sections:
            results["scale"] = scale(work / "scale")
        if "plan" in sections:
            results["plan"] = plan(work / "plan")
        Path(args.results).write_text(json.dumps(results, indent=2) + "\n")  # what is measured so far, kept
        if "dataset" in sections:
            (work / "dataset").mkdir()
            results["dataset"] = dataset(work / "dataset")
        if "swe" in sections:
            (work / "swe").mkdir()
            results["swe"] = swe(work / "swe")
        if "shared" in sections:
            (work / "shared").mkdir()
            results["shared"] = shared(work / "shared")
        if "collect" in sections:
            (work / "collect").mkdir()
            results["collect"] = collect(work / "collect")
        if "report" in sections:
            (work / "report").mkdir()
            results["report"] = report(work / "report")
        if "gateway" in sections:
            (work / "gateway").mkdir()
            results["gateway"] = gateway(work / "gateway")
        if "fork" in sections:
            (work / "fork").mkdir()
            results["fork"] = fork(work / "fork", tag)
        if "cluster" in sections or "cluster-tasks" in sections:
            (work / "cluster").mkdir()
            results["cluster"] = cluster(work / "cluster", tasks_only="cluster" not in sections)
    results["controller_peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    Path(args.results).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"\nwritten: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
