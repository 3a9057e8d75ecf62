"""`shopsimrl evalset` end to end on the real testbed: three members (three checkpoints standing
in for rounds) sharing the set's slots, interrupted with SIGINT and resumed, `--status`,
fingerprints equal to `run`'s; a member with fewer episodes than slots leaves the rest to the next."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from datetime import datetime
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


def traces(run_dir: Path) -> list[dict]:
    path = run_dir / "traces.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_bytes().split(b"\n"):
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line torn by the interruption
    return records


def trace_ids(run_dir: Path) -> list[str]:
    return [record["episode_id"] for record in traces(run_dir) if "episode_id" in record]


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
        # Interrupt once the second member has saved an episode: the members run at once, so
        # each may have some episodes saved and some not.
        while time.monotonic() < deadline and not trace_ids(location / "round-2"):
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 3, stderr[-2000:]
        assert "interrupted" in stderr
        status = shopsimrl(bed.env(), "evalset", str(set_path), "--status", "--json")
        states = {row["member"]: row["state"] for row in map(json.loads, status.stdout.splitlines())}
        assert states["round-2"] == "started", status.stdout
        before = {name: trace_ids(location / name) for name in ("round-1", "round-2", "round-3")}

        resumed = shopsimrl(bed.env(), "evalset", str(set_path), "--no-progress")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert all(name in resumed.stdout for name in ("round-1", "round-2", "round-3"))  # the leaderboard
        # ... and the comparison of every member against the first, as `shopsimrl compare` prints it.
        assert "runs (the first is the baseline):" in resumed.stdout
        assert resumed.stdout.count("(baseline)") == 2, resumed.stdout[-3000:]
        for name in ("round-1", "round-2", "round-3"):
            after = trace_ids(location / name)
            assert after[: len(before[name])] == before[name]  # what was saved stays
            assert len(set(after)) == len(after)  # no episode done twice
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


def test_the_next_member_fills_the_slots_a_member_with_few_episodes_leaves(tmp_path: Path) -> None:
    write_config(tmp_path, name="base", sample_size=6)
    set_path = tmp_path / "set.yaml"
    # Member 1 has 1 episode and the set 3 slots: members one after another would start member
    # 2 only once member 1's episode had ended.
    set_path.write_text(
        "location: sets/fill\nconfig: base.yaml\nset: {runtime.max_steps: 20}\nconcurrency: 3\nmembers:\n"
        "  - {name: small, set: {tasks.sample_size: 1}}\n"
        "  - {name: large}\n",
        encoding="utf-8",
    )
    location = tmp_path / "sets/fill"
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="40") as bed:
        done = shopsimrl(bed.env(), "evalset", str(set_path), "--no-progress", "--no-report")
    assert done.returncode == 0, done.stderr[-3000:]
    (small,) = traces(location / "small")
    large = traces(location / "large")
    assert len(large) == 6
    small_ended = datetime.fromisoformat(small["ended_at"])
    assert min(datetime.fromisoformat(record["started_at"]) for record in large) < small_ended


def test_members_on_one_model_server_keep_its_budget_and_share_one_adaptive_limit(tmp_path: Path) -> None:
    """`model.max_concurrent_requests: 1` makes the policy server's budget one slot for the whole
    set (without it, the set's 3 slots would run both members' episodes at once), and the two
    adaptive members on that server log one shared limit."""
    write_config(tmp_path, name="base", sample_size=3)
    set_path = tmp_path / "set.yaml"
    set_path.write_text(
        "location: sets/budget\nconfig: base.yaml\n"
        "set: {runtime.max_steps: 20, model.max_concurrent_requests: 1}\nconcurrency: 3\n"
        "members:\n  - {name: first}\n  - {name: second}\n",
        encoding="utf-8",
    )
    location = tmp_path / "sets/budget"
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="40") as bed:
        done = shopsimrl(bed.env(), "evalset", str(set_path), "--no-progress", "--no-report")
    assert done.returncode == 0, done.stderr[-3000:]
    spans = sorted(
        (datetime.fromisoformat(record["started_at"]), datetime.fromisoformat(record["ended_at"]), member)
        for member in ("first", "second")
        for record in traces(location / member)
    )
    assert len(spans) == 6 and {member for *_, member in spans} == {"first", "second"}
    for (_, ended, _), (started, _, _) in itertools.pairwise(spans):
        assert started >= ended, spans  # one episode at a time across the set
    for member in ("first", "second"):
        (record,) = [json.loads(line) for line in (location / member / "model_inflight.jsonl").read_text().splitlines()]
        assert record["shared"] is True and record["configured"] == 1
