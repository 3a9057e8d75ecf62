"""A local run seen from a second terminal: ``shopsimrl status RUN_DIR`` while another process
runs it (forced mid-way by a slow policy), after that process is killed, and once finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.testbed_process import ROOT, LocalTestbed, start_testbed, write_config

pytestmark = pytest.mark.slow

SHOPSIMRL = [sys.executable, "-m", "shopsimrl"]


def bed_env(bed: LocalTestbed) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOPSIMRL_")}
    return {**env, "SHOPSIMRL_MODEL_BASE_URL": bed.model_url, "SHOPSIMRL_ENV_BASE_URL": bed.shop_url}


def status(run_dir: Path, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SHOPSIMRL, "status", str(run_dir), *flags], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )


def status_json(run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    shown = status(run_dir, env, "--json")
    assert shown.returncode == 0, shown.stderr[-3000:]
    report: dict[str, Any] = json.loads(shown.stdout)
    return report


@pytest.fixture(scope="module")
def slow_bed() -> Iterator[LocalTestbed]:
    """Every model call takes 300 ms: 200 episodes at concurrency 2 take minutes, so the run is
    surely mid-way when status looks at it."""
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="300") as testbed:
        yield testbed


@pytest.mark.slow
def test_status_shows_a_local_run_that_another_process_is_running(slow_bed: LocalTestbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, name="watched", sample_size=200, concurrency=2)
    run_dir = tmp_path / "runs" / "watched"
    env = bed_env(slow_bed)
    with (tmp_path / "run.log").open("wb") as log:
        process = subprocess.Popen([*SHOPSIMRL, "run", str(config), "--no-progress"], stdout=log, stderr=log, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:  # until the running process has reported a completed episode
            try:
                if json.loads((run_dir / "progress.json").read_text())["completed"] >= 1:
                    break
            except (FileNotFoundError, ValueError):
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.1)

        report = status_json(run_dir, env)
        assert report["kind"] == "local" and report["state"] == "running", report
        assert report["process"]["pid"] == process.pid and report["jobs"] == 200
        assert 1 <= report["completed"] < 200 and report["invocation"]["settled_before"] == 0
        assert report["trace_lines"] >= report["completed"] and not report["summary"]
        assert report["leases_held"] <= 2  # the run's lease budget: its concurrency
        assert report["environment"]["url"] == slow_bed.shop_url and report["environment"]["environment_slots"] >= 2

        text = status(run_dir, env)
        assert text.returncode == 0, text.stderr
        assert f"running (pid {process.pid} on " in text.stdout and "/200 episodes completed" in text.stdout
        assert "this invocation" in text.stdout and f"shop {slow_bed.shop_url}" in text.stdout
        assert process.poll() is None  # status took no lock: the run goes on

        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        after = status_json(run_dir, env)
        # Killed without a word: its progress file still says running, but its process is gone.
        assert after["state"] == "stopped" and after["leases_held"] == 0, after
        assert after["completed"] >= report["completed"]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_status_of_a_finished_local_run_with_and_without_its_progress_file(tmp_path: Path) -> None:
    config = write_config(tmp_path, name="done", sample_size=3)
    run_dir = tmp_path / "runs" / "done"
    with start_testbed() as bed:
        env = bed_env(bed)
        done = subprocess.run(
            [*SHOPSIMRL, "run", str(config), "--no-progress"], capture_output=True, text=True, cwd=ROOT, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
        report = status_json(run_dir, env)
        assert report["state"] == "finished" and report["completed"] == report["jobs"] == 3 and report["summary"]
        text = status(run_dir, env).stdout
        assert "3/3 episodes completed · finished" in text and "latest invocation" in text and "summary.json written" in text
        assert report["invocation"]["completed"] == 3 and report["trace_lines"] == 3 and report["leases_held"] == 0

        # A run directory of an earlier version has no progress file: the traces are counted.
        (run_dir / "progress.json").unlink()
        counted = status_json(run_dir, env)
    assert counted["state"] == "finished" and counted["completed"] == 3 and "invocation" not in counted
    # No journal is left to name the shop (every lease released): SHOPSIMRL_ENV_BASE_URL does.
    assert counted["environment"]["url"] == bed.shop_url and counted["environment"]["free_slots"] >= 1


def test_status_refuses_kubernetes_flags_for_a_local_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOPSIMRL_")}
    flags = status(run_dir, env, "--namespace", "ns", "--release", "r")
    assert flags.returncode == 2 and "a local run" in flags.stderr
    broken = status(run_dir, env)
    assert broken.returncode == 2 and "manifest.json" in broken.stderr and "Traceback" not in broken.stderr
