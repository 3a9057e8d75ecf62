"""The throughput benchmark's own arithmetic: the episode window, CPU over it, argument errors.

The benchmark itself is never run here (it measures; tests never time anything).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

throughput = load_bench("throughput")


def test_cpu_over_the_window_is_interpolated_between_samples() -> None:
    samples = throughput.Samples()
    samples.points["runner"] = [(10.0, 1.0), (11.0, 2.0), (13.0, 2.5)]
    # 10.5 -> 1.5 and 12.0 -> 2.25 on the straight lines between samples
    assert samples.cpu_between("runner", 10.5, 12.0) == pytest.approx(0.75)
    assert samples.cpu_between("runner", 10.0, 13.0) == pytest.approx(1.5)
    # a window outside the sampled span has no figure rather than a made-up one
    assert samples.cpu_between("runner", 9.0, 12.0) is None
    assert samples.cpu_between("runner", 10.0, 14.0) is None
    assert samples.cpu_between("shop", 10.0, 11.0) is None


def test_the_window_runs_from_the_earliest_start_to_the_latest_end(tmp_path: Path) -> None:
    records = [
        {"started_at": "2026-11-30T10:00:05+00:00", "ended_at": "2026-11-30T10:00:09+00:00"},
        {"started_at": "2026-11-30T10:00:01+00:00", "ended_at": "2026-11-30T10:00:04+00:00"},
        {"started_at": "2026-11-30T10:00:00+00:00", "ended_at": None},  # an episode that never ended
        {"started_at": "2026-11-30T10:00:06+00:00", "ended_at": "2026-11-30T10:00:12.5+00:00"},
    ]
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    start, end = throughput.trace_window(traces)
    assert end - start == pytest.approx(11.5)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    assert throughput.trace_window(empty) is None


@pytest.mark.slow
def test_cpu_seconds_reads_this_process_and_nothing_for_a_reaped_one() -> None:
    own = throughput.cpu_seconds(os.getpid())
    usage = os.times()
    assert own is not None and 0 < own <= usage.user + usage.system + 0.02  # /proc counts in 10 ms ticks
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert throughput.cpu_seconds(child.pid) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "0"], "argument --concurrency: expected integers >= 1, got '0'"),
        (["--concurrency", "1,x"], "argument --concurrency: expected comma-separated integers, got '1,x'"),
        (["--policy-latency-ms", "-5"], "argument --policy-latency-ms: expected finite milliseconds >= 0, got '-5'"),
        (["--shop-latency-ms", "inf"], "argument --shop-latency-ms: expected finite milliseconds >= 0, got 'inf'"),
        (["--episodes", "4000"], "argument --episodes: must be between 1 and 3726 (the train split), got 4000"),
        (["--json", "/nonexistent-dir/out.json"], "argument --json: directory /nonexistent-dir does not exist"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, throughput.__file__, *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"throughput.py: error: {message}"
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_the_busy_share_is_the_mean_of_episodes_in_flight_over_the_slots() -> None:
    # Two slots over 0..10 s: slot one busy 0-4 and 4-10, slot two busy 0-6 then empty (the drain).
    intervals = [(0.0, 4.0), (4.0, 10.0), (0.0, 6.0)]
    assert throughput.busy_share(intervals, 2, 0.0, 10.0) == pytest.approx(16 / 20)
    # up to the last start (4 s) both slots were busy: no drain in that span
    assert throughput.busy_share(intervals, 2, 0.0, 4.0) == pytest.approx(1.0)
    # episodes are clipped to the span asked for
    assert throughput.busy_share(intervals, 2, 5.0, 10.0) == pytest.approx((5 + 1) / 10)
    assert throughput.busy_share(intervals, 2, 3.0, 3.0) is None
