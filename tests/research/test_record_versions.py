"""A trace of another schema version in a run: every research command that reads it refuses it
with exit 2 and the reader's one-line message (naming the version), never a traceback; the viewer
answers 409. Records are read as a command goes, so the refusal comes after the run opened."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.sharded.conftest import cli

from .conftest import ResearchRuns
from .test_gate_cli import CHUNKS, research_config, write_draft, write_gate
from .test_judge import _config, _env
from .test_viewer import serving

pytestmark = pytest.mark.slow

FOREIGN = "shopsimrl-episode-v5"


@pytest.fixture
def foreign_run(tmp_path: Path, research_runs: ResearchRuns) -> tuple[Path, str]:
    """A copy of the fixture's local run whose third trace line is of version v5; its episode id."""
    run = tmp_path / "run"
    shutil.copytree(research_runs.local, run)
    lines = (run / "traces.jsonl").read_bytes().splitlines(keepends=True)
    assert lines[2].startswith(b'{"schema_version":"shopsimrl-episode-v4","episode_id":"')
    lines[2] = lines[2].replace(b"shopsimrl-episode-v4", FOREIGN.encode(), 1)
    (run / "traces.jsonl").write_bytes(b"".join(lines))
    (run / "progress.json").unlink(missing_ok=True)
    episode_id = lines[2].split(b'"episode_id":"', 1)[1].split(b'"', 1)[0].decode()
    return run, episode_id


def test_every_research_command_refuses_a_trace_of_another_version_with_exit_2(
    tmp_path: Path, research_runs: ResearchRuns, foreign_run: tuple[Path, str]
) -> None:
    run, episode_id = foreign_run
    out = tmp_path / "out"
    out.mkdir()
    location = str(run)
    judge = _config(tmp_path, location, "http://127.0.0.1:9/v1", output=out / "judge")
    gate = write_gate(
        tmp_path / "gate.yaml",
        output_dir=str(out / "gate"),
        experiment_config=str(research_config(research_runs)),
        bare_run_dir=location,
        draft_path=str(write_draft(tmp_path / "draft", CHUNKS)),
    )
    commands = {
        "show": ["show", location, episode_id],
        "view": ["view", location, "--port", "0"],
        "compare": ["compare", str(research_runs.local), location],
        "report": ["report", str(research_runs.local), location, "-o", str(out / "report.html")],
        "labels": ["labels", location, "-o", str(out / "labels.jsonl")],
        "export table": ["export", "table", location, "--to", "csv", "-o", str(out / "table.csv")],
        "export sft": ["export", "sft", location, "-o", str(out / "sft.jsonl")],
        "export judge-input": ["export", "judge-input", location, "-o", str(out / "judge-input.jsonl")],
        "summarize": ["summarize", location],
        "status": ["status", location],  # without progress.json: counted from the traces
        "gate plan": ["gate", "plan", str(gate)],
        "judge plan": ["judge", "plan", str(judge), "--shards", "2", "--out", str(out / "judge-plan")],
    }
    env = {**_env(), "COLUMNS": "2000"}  # the message on one line
    for name, args in commands.items():
        done = cli(*args, env=env)
        assert done.returncode == 2, (name, done.returncode, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (name, done.stderr[-2000:])
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, (name, done.stderr[-2000:])
        assert f"trace record schema_version '{FOREIGN}' is not one this shopsimrl reads" in errors[0], (name, errors)
    assert sorted(os.listdir(out)) == []  # nothing written from a run that could not be read


def test_the_viewer_answers_409_for_a_record_rewritten_to_another_version(tmp_path: Path, research_runs: ResearchRuns) -> None:
    """The viewer indexes the run once; an episode's line rewritten to v5 afterwards (same length,
    so the index still points at it) is refused on its page as a changed record is: 409, its
    message; the other pages still answer."""
    run = tmp_path / "run"
    shutil.copytree(research_runs.local, run)
    traces = run / "traces.jsonl"
    lines = traces.read_bytes().splitlines(keepends=True)
    episode_id = lines[1].split(b'"episode_id":"', 1)[1].split(b'"', 1)[0].decode()
    other_id = lines[0].split(b'"episode_id":"', 1)[1].split(b'"', 1)[0].decode()
    with serving(str(run)) as viewer:
        assert viewer.get(f"/episodes/{episode_id}").status_code == 200
        lines[1] = lines[1].replace(b"shopsimrl-episode-v4", FOREIGN.encode(), 1)
        traces.write_bytes(b"".join(lines))
        answer = viewer.get(f"/episodes/{episode_id}")
        assert answer.status_code == 409, (answer.status_code, answer.text[-1000:])
        assert f"schema_version &#x27;{FOREIGN}&#x27; is not one this shopsimrl reads" in answer.text
        assert viewer.get(f"/episodes/{other_id}").status_code == 200
