"""bench/viewer_scale.py end to end at a small size, so the benchmark keeps working; its
40,000-episode figures are the bench's own (docs/benchmarks.md, "Research tools at scale")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ResearchRuns

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_viewer_scale_bench_runs_at_a_small_size(research_runs: ResearchRuns, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    command = [sys.executable, "bench/viewer_scale.py", "--tasks", "4", "--samples", "3", "--templates", str(research_runs.local)]
    done = subprocess.run(
        [*command, "--dir", str(tmp_path), "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text(encoding="utf-8"))
    assert figures["episodes"] == 12 and figures["templates"] == research_runs.episodes
    assert figures["local"]["read_line"].startswith("read 12 episodes of ")
    assert figures["sharded_s3_4"]["read_line"].startswith("read 12 episodes of s3://")
    assert len(figures["local"]["open_episode_s"]["all"]) == 12 and figures["export_steps_local"]["rows"] > 0
    assert list(tmp_path.iterdir()) == [out]  # the runs it wrote are gone
