"""End to end on the real testbed processes: `shopsimrl run` as users run it (subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from shopsimrl.records import read_trace
from tests.testbed_process import ROOT, start_testbed, write_config

pytestmark = pytest.mark.slow


def run(config: Path, env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", "run", str(config), "--no-progress", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def records(run_dir: Path) -> list[dict]:
    """Every whole record; a line torn by kill -9 (even inside a UTF-8 sequence) is skipped."""
    from shopsimrl.records import parse_trace_line, to_plain

    lines = (run_dir / "traces.jsonl").read_bytes().split(b"\n")
    return [to_plain(record) for record in map(parse_trace_line, lines) if record is not None]


def test_smoke_config_completes_and_releases_every_lease(tmp_path: Path) -> None:
    with start_testbed() as bed:
        config = write_config(tmp_path, name="smoke", sample_size=3)
        result = run(config, bed.env())
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((tmp_path / "runs/smoke/summary.json").read_text())
        assert summary["counts"]["completed"] == 3 and summary["counts"]["coverage"] == 1.0
        assert all(read_trace(r).completed for r in records(tmp_path / "runs/smoke"))
        health = bed.healthz()
        assert health["free_slots"] == health["environment_slots"]


def test_injected_faults_are_retried_or_recorded_and_no_lease_leaks(tmp_path: Path) -> None:
    knobs = {
        "SHOPSIM_POLICY_RATE_429": "0.15",
        "SHOPSIM_POLICY_RATE_500": "0.1",
        "SHOPSIM_POLICY_RETRY_AFTER_S": "0",
        "SHOPSIM_POLICY_RATE_NON_JSON": "0.05",
        "SHOPSIM_POLICY_RATE_NO_TOOL_CALL": "0.1",
        "SHOPSIM_POLICY_RATE_LENGTH": "0.03",
        "SHOPSIM_FAULT_RATE_5XX": "0.03",
        "SHOPSIM_SEED": "7",
    }
    with start_testbed(**knobs) as bed:
        config = write_config(tmp_path, name="faults", sample_size=12)
        result = run(config, bed.env())
        assert result.returncode in (0, 1), result.stderr[-3000:]
        summary = json.loads((tmp_path / "runs/faults/summary.json").read_text())
        counts = summary["counts"]
        assert counts["completed"] + counts["failed"] == 12 and counts["missing"] == 0
        assert summary["retries"]["model_calls_retried"] > 0  # 429/500 were retried by the adapter
        assert summary["behavior"]["protocol_errors"] > 0  # text replies got repair turns
        for record in records(tmp_path / "runs/faults"):
            if record["status"] == "failed":
                assert record["failure_class"] and record["error"]["stage"]
        health = bed.healthz()
        assert health["free_slots"] == health["environment_slots"]


def test_resume_after_kill_9_reruns_no_completed_episode(tmp_path: Path) -> None:
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="40") as bed:
        config = write_config(tmp_path, name="crash", sample_size=24, concurrency=3)
        run_dir = tmp_path / "runs/crash"
        process = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "run", str(config), "--no-progress"],
            env=bed.env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (run_dir / "traces.jsonl").exists() and len(records(run_dir)) >= 6:
                break
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        before = {r["episode_id"] for r in records(run_dir) if read_trace(r).completed}
        assert 0 < len(before) < 24
        result = run(config, bed.env())
        assert result.returncode == 0, result.stderr[-3000:]
        completed = Counter(r["episode_id"] for r in records(run_dir) if read_trace(r).completed)
        assert len(completed) == 24 and set(completed.values()) == {1}  # nothing completed twice
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["counts"]["requested"] == 24 and summary["counts"]["completed"] == 24


def test_api_key_never_reaches_run_files_or_logs(tmp_path: Path) -> None:
    secret = "sk-test-4f9c2e7d1a8b6053"
    with start_testbed() as bed:
        config = (
            write_config(tmp_path, name="secret", sample_size=2)
            .read_text()
            .replace("api_key_env: null", "api_key_env: SHOPSIMRL_TEST_KEY")
        )
        (tmp_path / "secret.yaml").write_text(config)
        result = run(tmp_path / "secret.yaml", bed.env(SHOPSIMRL_TEST_KEY=secret, SHOPSIMRL_LOG_FORMAT="json"))
        assert result.returncode == 0, result.stderr[-3000:]
        for path in (tmp_path / "runs/secret").rglob("*"):
            if path.is_file():
                assert secret not in path.read_text(encoding="utf-8", errors="replace"), path
        assert secret not in result.stdout and secret not in result.stderr
        missing = run(tmp_path / "secret.yaml", bed.env(SHOPSIMRL_LOG_FORMAT="json"))
        assert missing.returncode == 2 and "SHOPSIMRL_TEST_KEY" in missing.stderr


def test_fingerprint_mismatch_exits_42_naming_the_keys(tmp_path: Path) -> None:
    with start_testbed() as bed:
        config = write_config(tmp_path, name="fp", sample_size=2)
        assert run(config, bed.env()).returncode == 0
        config.write_text(config.read_text().replace("max_retries: 6", "max_retries: 6\n  temperature: 0.3"))
        result = run(config, bed.env())
        assert result.returncode == 42 and "model.sampling.temperature: 0.0 -> 0.3" in result.stderr


def test_sigterm_stops_a_local_run_with_exit_3_and_releases_every_lease(tmp_path: Path) -> None:
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="60") as bed:
        config = write_config(tmp_path, name="term", sample_size=40, concurrency=4)
        run_dir = tmp_path / "runs/term"
        process = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "run", str(config), "--no-progress"],
            env=bed.env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ((run_dir / "traces.jsonl").exists() and len(records(run_dir)) >= 3):
            time.sleep(0.05)
        assert bed.healthz()["free_slots"] < bed.healthz()["environment_slots"]  # episodes in flight
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 3, stderr[-2000:]
        health = bed.healthz()
        assert health["free_slots"] == health["environment_slots"]
        assert run(config, bed.env()).returncode == 0  # and the run resumes to the end
