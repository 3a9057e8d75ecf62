"""``shopsimrl show RUN EPISODE_ID``: one episode's transcript in the terminal."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from shopsimrl.storage.reading import open_run
from tests.fakes import written
from tests.sharded.conftest import cli

from .conftest import RUN_KINDS, ResearchRuns, run_location
from .synthetic import HOSTILE, HOSTILE_ID, LONG_THINKING_END, hostile_record, trace_line

pytestmark = pytest.mark.slow

WIDE = {"COLUMNS": "2000"}
"""A terminal width no line of these transcripts reaches: the assertions read whole lines (a pipe is 80 wide)."""


def show(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli("show", *args, env={**(env or os.environ), **WIDE})


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_show_prints_every_step(research_runs: ResearchRuns, s3_env: dict[str, str], kind: str) -> None:
    location, env = run_location(research_runs, kind)
    records = [written(record) for record in open_run(location).records()]
    record = max(records, key=lambda record: len(record["steps"]))
    done = show(location, record["episode_id"], env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert record["episode_id"] in out and record["reset"]["task_instruction"] in out
    for key in record["reset"]["user_persona"]:
        assert f"{key}:" in out
    for step in record["steps"]:
        assert f"step {step['step_index']} · " in out
        assert step["observation"].splitlines()[0] in out
        if step.get("action"):
            assert f"action: {step['action']}" in out
            feedback = step["environment"]["action_feedback"]
            assert f"{feedback['reason']}: {feedback['message']}" in out
        assert f"{step['model']['latency_ms']:.0f} ms" in out
        assert f"tokens {step['model']['usage']['prompt_tokens']} in / {step['model']['usage']['completion_tokens']} out" in out
    if record["status"] == "completed":
        assert "reward detail" in out and "r_strict" in out and record["final"]["termination_reason"] in out
    assert "testing-secret" not in out + done.stderr


def test_show_marks_repairs_and_policy_failures(research_runs: ResearchRuns) -> None:
    repaired = show(str(research_runs.legacy), "task-000006__sample-000")
    assert repaired.returncode == 0
    assert "protocol error tool_call_count: expected exactly one tool call, got 0" in repaired.stdout
    assert "sent back: " in repaired.stdout and '"code": "tool_call_count"' in repaired.stdout
    assert "text: Action: search[台灯]" in repaired.stdout  # the visible text, not read as rich markup
    cut_off = show(str(research_runs.legacy), "task-000005__sample-001")
    assert "policy failure generation_length" in cut_off.stdout and "(4000 thinking)" in cut_off.stdout
    failed = show(str(research_runs.legacy), "task-000011__sample-000")
    assert failed.returncode == 0 and "error at evaluator_boundary: RuntimeError: custom runtime crashed" in failed.stdout


@pytest.fixture
def hostile_run(research_runs: ResearchRuns, tmp_path: Path) -> Path:
    """A run directory (v4 traces, no manifest) whose one episode holds hostile text."""
    template = written(next(open_run(research_runs.local).records()))
    run = tmp_path / "hostile"
    run.mkdir()
    (run / "traces.jsonl").write_bytes(trace_line(template) + trace_line(hostile_record(template)))
    return run


def test_show_shortens_thinking_and_defuses_terminal_text(hostile_run: Path) -> None:
    done = show(str(hostile_run), HOSTILE_ID)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout  # escape sequences shown, not sent
    assert LONG_THINKING_END not in done.stdout and "chars; --thinking shows all)" in done.stdout
    assert "[bold red]rich markup[/]" in done.stdout and HOSTILE in done.stdout.replace("\n", "")
    assert (
        "1 retry" in done.stdout
        and "HTTP attempt 1: status 503 · HTTP 503 <overloaded> · 12 ms, then 200 ms backoff" in done.stdout
    )

    full = show(str(hostile_run), HOSTILE_ID, "--thinking")
    flat = full.stdout.replace("\n", "")
    assert LONG_THINKING_END in flat and "\\x1b]0;pwned\\x07\\x1b[2J" in flat and "\x1b" not in full.stdout


def test_show_names_a_missing_episode(research_runs: ResearchRuns, s3_env: dict[str, str]) -> None:
    location, env = run_location(research_runs, "sharded")
    done = show(location, "task-424242__sample-000", env=env)
    assert done.returncode == 2 and done.stderr.strip() == f"error: {location} has no episode 'task-424242__sample-000'"
    done = show(str(research_runs.local / "traces.jsonl"), "x")
    assert done.returncode == 2 and "is a file; give the run directory" in done.stderr
