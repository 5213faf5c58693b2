"""Every shell block the docs mark ``<!-- runnable -->`` runs, exactly as written, from the repository's root
(in a scratch copy of its examples), against the real engine and images: exit 0, and what it prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

MARKED = re.compile(r"<!-- runnable -->\s*\n```console\n(.*?)\n```", re.DOTALL)


def runnable_blocks() -> list[tuple[str, str]]:
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for n, block in enumerate(MARKED.findall(page.read_text()), start=1):
            found.append((f"{page.name}#{n}", block))
    return found


BLOCKS = runnable_blocks()


def test_the_docs_mark_blocks_to_run():
    assert [name for name, _ in BLOCKS] == ["continuation.md#1", "index.md#1", "recipes.md#1", "report.md#1"]


@pytest.mark.parametrize(("name", "block"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_a_runnable_block_runs_as_written(name, block, tmp_path, claude_image):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = "set -euo pipefail\n" + block.replace("\\\n", " ")
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{name}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    if name == "index.md#1":
        assert done.stdout.endswith("Hello, Ada\nHello, Grace\n")
        assert (tmp_path / "runs" / "demo" / "record.json").is_file()
    if name == "continuation.md#1":  # a cassette served back: no upstream, no key
        assert done.stdout == "ok 2 calls\n"
        record = json.loads((tmp_path / "demo" / "record.json").read_text())
        assert record["model"]["upstream"] is None and record["model"]["totals"]["cost"] > 0
    if name == "report.md#1":
        assert done.stdout.startswith("4 items: 4 ran, 0 skipped (finished earlier); ok 4;")
        assert done.stdout.splitlines()[-1].startswith(f"wrote {tmp_path / 'demo-batch' / 'report.html'} (")
        assert (tmp_path / "demo-batch" / "report.html").stat().st_size > 10_000
