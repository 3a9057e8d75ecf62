"""`shopsimrl evalset` end to end on the real testbed: three members (three checkpoints standing
in for rounds), interrupted with SIGINT and resumed, `--status`, fingerprints equal to `run`'s."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.testbed_process import ROOT, start_testbed, write_config

pytestmark = pytest.mark.slow

SET = """location: sets/rounds
config: base.yaml
set: {runtime.max_steps: 20}
concurrency: 3
members:
  - {name: round-1, checkpoint: ck-1}
  - {name: round-2, checkpoint: ck-2}
  - {name: round-3, checkpoint: ck-3, set: {model.temperature: 0.5}}
"""


def shopsimrl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def trace_ids(run_dir: Path) -> list[str]:
    path = run_dir / "traces.jsonl"
    if not path.exists():
        return []
    ids = []
    for line in path.read_bytes().split(b"\n"):
        try:
            ids.append(json.loads(line)["episode_id"])
        except (ValueError, KeyError):
            continue  # a line torn by the interruption
    return ids


def test_a_set_interrupted_by_sigint_resumes_every_member_without_redoing_episodes(tmp_path: Path) -> None:
    write_config(tmp_path, name="base", sample_size=4)
    set_path = tmp_path / "set.yaml"
    set_path.write_text(SET, encoding="utf-8")
    location = tmp_path / "sets/rounds"
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="40") as bed:
        process = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "evalset", str(set_path), "--no-progress"],
            env=bed.env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        # Interrupt inside the second member: the first is done, the third not started.
        while time.monotonic() < deadline and not trace_ids(location / "round-2"):
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 3, stderr[-2000:]
        assert "round-2" in stderr
        status = shopsimrl(bed.env(), "evalset", str(set_path), "--status", "--json")
        states = {row["member"]: row["state"] for row in map(json.loads, status.stdout.splitlines())}
        assert states["round-1"] == "done" and states["round-3"] == "pending", status.stdout
        first_done = trace_ids(location / "round-1")
        second_before = trace_ids(location / "round-2")

        resumed = shopsimrl(bed.env(), "evalset", str(set_path), "--no-progress")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert all(name in resumed.stdout for name in ("round-1", "round-2", "round-3"))  # the leaderboard
        assert trace_ids(location / "round-1") == first_done  # nothing of a finished member reruns
        second_after = trace_ids(location / "round-2")
        assert second_after[: len(second_before)] == second_before
        assert len(set(second_after)) == len(second_after)  # no episode done twice
        for name in ("round-1", "round-2", "round-3"):
            summary = json.loads((location / name / "summary.json").read_text())
            assert summary["counts"]["completed"] == 4

        # A member's fingerprint is that of the same `run` with the same overrides.
        alone = shopsimrl(
            bed.env(),
            "run",
            str(tmp_path / "base.yaml"),
            "--set",
            "runtime.max_steps=20",
            "--checkpoint",
            "ck-3",
            "--set",
            "model.temperature=0.5",
            "--run",
            str(tmp_path / "alone"),
            "--no-progress",
        )
        assert alone.returncode == 0, alone.stderr[-3000:]
        fingerprints = [
            json.loads((where / "manifest.json").read_text())["plan_fingerprint"]
            for where in (tmp_path / "alone", location / "round-3")
        ]
        assert fingerprints[0] == fingerprints[1]

        # An edit that changes a member's plan after it froze is refused naming the member.
        # Checked before any member runs: a new fourth member is not started.
        edited = SET.replace("checkpoint: ck-2}", "checkpoint: ck-2b}") + "  - {name: round-4, checkpoint: ck-4}\n"
        set_path.write_text(edited, encoding="utf-8")
        changed = shopsimrl(bed.env(), "evalset", str(set_path), "--no-progress")
        assert changed.returncode == 42 and "round-2" in changed.stderr, changed.stderr[-2000:]
        assert not (location / "round-4").exists()
