"""The research commands' one output rule (shopsimrl/research/outputs.py) and the readers' rule
for a run without a readable record (shopsimrl/storage/reading.py), command by command, through
the real CLI: never an output inside a run; missing folders created; a write that fails for
real (RLIMIT_FSIZE: the kernel answers EFBIG) leaves the earlier file as it was, exit 3; a run
of garbage or torn lines is refused with exit 2 naming the file and the line, while a torn last
line after good records is read as before."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from shopsimrl.storage.reading import RunReadError, open_run
from tests.sharded.conftest import REPO

from .conftest import FIXTURES, ResearchRuns
from .synthetic import sharded_copy
from .test_viewer import serving

pytestmark = pytest.mark.slow

Command = Callable[[Path, Path, Path], list[str]]
"""(run, second run, output) → the command line after ``shopsimrl``."""

COMMANDS: dict[str, Command] = {
    "report": lambda run, other, out: ["report", str(run), str(other), "-o", str(out)],
    "compare --json": lambda run, other, out: ["compare", str(run), str(other), "--json", str(out)],
    "labels": lambda run, other, out: ["labels", str(run), "-o", str(out)],
    "export sft": lambda run, other, out: ["export", "sft", str(run), "-o", str(out), "--select", "completed"],
    "export judge-input": lambda run, other, out: ["export", "judge-input", str(run), "-o", str(out)],
    "export judge-input --report": lambda run, other, out: [
        "export",
        "judge-input",
        str(run),
        "-o",
        str(run.parent / "elsewhere" / "judge-input.jsonl"),
        "--report",
        str(out),
    ],
    "export table csv": lambda run, other, out: ["export", "table", str(run), "--to", "csv", "-o", str(out)],
    "export table parquet steps": lambda run, other, out: [
        "export",
        "table",
        str(run),
        "--to",
        "parquet",
        "--level",
        "steps",
        "-o",
        str(out),
    ],
}
READERS: dict[str, Command] = {
    **{name: command for name, command in COMMANDS.items() if name != "export judge-input --report"},
    "view": lambda run, other, out: ["view", str(run), "--port", "0"],
    "show": lambda run, other, out: ["show", str(run), "task-000003__sample-000"],
}


def shopsimrl(*args: str, limit_bytes: int | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI; ``limit_bytes``: RLIMIT_FSIZE of the process (SIGXFSZ ignored, so a write
    past it fails with EFBIG, as on a full disk)."""

    def limit() -> None:
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
        preexec_fn=limit,
        timeout=300,
    )


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    """Two copies of a real run (the earlier implementation's traces: six episodes of every
    outcome), so that each command has what it reads."""
    pair = []
    for name in ("run-a", "run-b"):
        run = tmp_path / name
        run.mkdir()
        shutil.copy(FIXTURES / "legacy_v4_traces.jsonl", run / "traces.jsonl")
        pair.append(run)
    return pair[0], pair[1]


def _leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


# --------------------------------------------------------------------------- never into a run


@pytest.mark.parametrize("name", list(COMMANDS))
def test_no_command_writes_inside_a_run(name: str, runs: tuple[Path, Path]) -> None:
    run, other = runs
    read = runs if name in ("report", "compare --json") else (run,)
    for folder in read:
        for out in (folder / "derived.out", folder / "deeper" / "derived.out"):
            done = shopsimrl(*COMMANDS[name](run, other, out))
            assert done.returncode == 2, (out, done.stdout, done.stderr)
            assert f"{out} is inside the run" in done.stderr and "never into a run" in done.stderr
            assert "Traceback" not in done.stderr
    for folder in runs:
        assert [path.name for path in folder.iterdir()] == ["traces.jsonl"]


def test_the_judge_writes_nowhere_inside_its_run(tmp_path: Path, runs: tuple[Path, Path]) -> None:
    run, _ = runs
    config = _judge_config(tmp_path, run, run / "judged")
    done = shopsimrl("judge", str(config))
    assert done.returncode == 2 and f"{run / 'judged' / 'judge_outputs.jsonl'} is inside the run" in done.stderr
    assert not (run / "judged").exists()


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_directory_as_the_output_is_refused(name: str, tmp_path: Path, runs: tuple[Path, Path]) -> None:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    done = shopsimrl(*COMMANDS[name](*runs, folder))
    assert done.returncode == 2 and f"{folder} is a directory; give the file to write" in done.stderr, done.stderr
    assert list(folder.iterdir()) == []


# --------------------------------------------------------------------------- missing folders


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_creates_missing_folders(name: str, tmp_path: Path, runs: tuple[Path, Path]) -> None:
    out = tmp_path / "new" / "deeper" / "output.file"
    done = shopsimrl(*COMMANDS[name](*runs, out))
    assert done.returncode == 0, done.stderr
    assert out.is_file() and out.stat().st_size > 0
    assert _leftovers(out.parent) == []


# --------------------------------------------------------------------------- whole or nothing


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_write_that_fails_leaves_the_earlier_file(name: str, tmp_path: Path, runs: tuple[Path, Path]) -> None:
    """The earlier output is 14 KB; the process may write at most 512 bytes into any file, so
    the new output fails partway for real (EFBIG), as on a full disk."""
    out = tmp_path / "outputs" / "output.file"
    out.parent.mkdir()
    earlier = b"the earlier output, whole\n" * 540
    out.write_bytes(earlier)
    done = shopsimrl(*COMMANDS[name](*runs, out), limit_bytes=512)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "File too large" in done.stderr and "Traceback" not in done.stderr  # the failure happened
    assert out.read_bytes() == earlier
    assert _leftovers(out.parent) == []
    done = shopsimrl(*COMMANDS[name](*runs, out))  # with room again, the same command succeeds
    assert done.returncode == 0 and out.read_bytes() != earlier, done.stderr


# --------------------------------------------------------------------------- runs without a record


def _garbage_run(tmp_path: Path, lines: bytes) -> Path:
    run = tmp_path / "garbage-run"
    run.mkdir()
    (run / "traces.jsonl").write_bytes(lines)
    return run


GARBAGE = {
    "garbage lines": (b"\n" + b"this is not json\n{broken\n" + orjson.dumps({"not": "a trace"}) + b"\n", 2),
    "one torn line": (b'{"episode_id": "task-000001__sample-000", "status": "compl', 1),
}


@pytest.mark.parametrize("name", list(READERS))
@pytest.mark.parametrize("garbage", list(GARBAGE))
def test_a_run_without_a_readable_record_is_refused(name: str, garbage: str, tmp_path: Path, runs: tuple[Path, Path]) -> None:
    lines, first_bad = GARBAGE[garbage]
    run = _garbage_run(tmp_path, lines)
    out = tmp_path / "outputs" / "output.file"
    done = shopsimrl(*READERS[name](run, run, out))
    assert done.returncode == 2, (done.stdout, done.stderr)
    if name == "show":  # one episode looked up: it is not there
        assert "has no episode 'task-000003__sample-000'" in done.stderr
    else:
        assert f"{run / 'traces.jsonl'} line {first_bad}: not a trace record" in done.stderr, done.stderr
        assert "holds no readable episode record" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert not out.exists()


@pytest.mark.parametrize("name", list(READERS))
def test_a_torn_last_line_after_good_records_is_read_as_before(name: str, tmp_path: Path, runs: tuple[Path, Path]) -> None:
    run, other = runs
    with (run / "traces.jsonl").open("ab") as handle:
        handle.write(b'{"episode_id": "task-000099__sample-000", "stat')  # a process killed mid-write
    (other / "traces.jsonl").write_bytes((run / "traces.jsonl").read_bytes())
    if name == "view":
        with serving(str(run)) as viewer:
            page = viewer.get("/").text
        assert "6 of 6 episodes" in page and "1 unreadable lines skipped" in page
        return
    done = shopsimrl(*READERS[name](run, other, tmp_path / "outputs" / "output.file"))
    assert done.returncode == 0, done.stderr


def test_the_judge_refuses_a_run_without_a_readable_record(tmp_path: Path) -> None:
    run = _garbage_run(tmp_path, GARBAGE["garbage lines"][0])
    done = shopsimrl("judge", str(_judge_config(tmp_path, run, tmp_path / "judged")))
    assert done.returncode == 2 and f"{run / 'traces.jsonl'} line 2: not a trace record" in done.stderr, done.stderr


def test_a_sharded_run_without_a_readable_record_is_refused(tmp_path: Path, research_runs: ResearchRuns) -> None:
    """Shards committed as a worker commits them, every line garbage: the reader names the
    shard, the part and the line."""
    run = open_run(research_runs.local)
    assert run.manifest is not None
    location = tmp_path / "sharded-garbage"
    sharded_copy(str(location), run.manifest.plan.as_dict(), lambda episode_id: b"garbage, not a record\n", 2, per_part=5)
    with pytest.raises(
        RunReadError, match=r"sharded-garbage shard 0, part [^,]+, line 1: not a trace record; .* holds no readable"
    ):
        open_run(str(location)).winner_views(lambda record: record)
    done = shopsimrl("labels", str(location), "-o", str(tmp_path / "labels.jsonl"))
    assert done.returncode == 2 and "shard 0, part" in done.stderr and "holds no readable episode record" in done.stderr
    assert not (tmp_path / "labels.jsonl").exists()


def _judge_config(tmp_path: Path, run: Path, output: Path) -> Path:
    path = tmp_path / "judge.yaml"
    path.write_text(
        f"""name: rule-judge
source: {run}
rubric: {REPO / "configs" / "judge_rubric.v1.yaml"}
output: {output}
model:
  model: never-called
  base_url: http://127.0.0.1:9/v1
  max_retries: 1
selection: {{select: all}}
""",
        encoding="utf-8",
    )
    return path
