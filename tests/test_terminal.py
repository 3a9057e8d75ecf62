"""What the user sees on the terminal: help at 80 columns, --version, -q/-v and the log settings,
log lines above (never inside) the live progress bar, the bar of a resumed and of a sharded run,
a sharded run's workers relayed through the coordinator, plan's table, summarize on a sharded run.

The bar only shows on a terminal: those tests run the real command on a pseudo-terminal and
replay its output on a small screen emulator (tests/terminal_screen.py), or give rich a console
that believes it is one."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import typer.main
from rich.console import Console
from typer.testing import CliRunner

from shopsimrl import logs
from shopsimrl.cli import app
from shopsimrl.records import EpisodeTrace, read_trace
from shopsimrl.runner.progress import RunProgress, ShardedRunProgress
from tests.terminal_screen import run_on_terminal, screen_lines
from tests.testbed_process import ROOT, LocalTestbed, start_testbed, write_config

BAR = re.compile(r"episodes\s+[━╸╺]+")  # the bar's description followed by its glyphs
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[")  # a console log line's timestamp and level
SHOPSIMRL = [sys.executable, "-m", "shopsimrl"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOPSIMRL_", "JOB_COMPLETION"))}
    return {**env, **extra}


def bed_env(bed: LocalTestbed, **extra: str) -> dict[str, str]:
    return clean_env(SHOPSIMRL_MODEL_BASE_URL=bed.model_url, SHOPSIMRL_ENV_BASE_URL=bed.shop_url, **extra)


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SHOPSIMRL, *args], capture_output=True, text=True, cwd=cwd, env=env or clean_env(), timeout=180)


@pytest.fixture(autouse=True)
def default_logging() -> Iterator[None]:
    """Tests here configure structlog in this process; later tests get its defaults back."""
    yield
    structlog.reset_defaults()


def commands() -> Iterator[tuple[list[str], Any]]:
    def walk(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        if getattr(command, "commands", None):
            for name, sub in command.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield path, command

    yield [], typer.main.get_command(app)
    yield from walk(typer.main.get_command(app), [])


# --------------------------------------------------------------------------- help and version


@pytest.mark.parametrize(("path", "command"), list(commands()), ids=[" ".join(path) or "shopsimrl" for path, _ in commands()])
def test_help_at_80_columns_shows_every_option_whole(path: list[str], command: Any) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, prog_name="shopsimrl")
    assert result.exit_code == 0, result.output
    text = result.output
    names = [
        name for param in command.params if param.param_type_name == "option" for name in (*param.opts, *param.secondary_opts)
    ]
    assert names, path
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (
            f"{name} is not shown whole in `{' '.join(path)} --help`:\n{text}"
        )
    assert "<bool>" not in text and "…" not in text
    assert max(map(len, text.splitlines())) <= 80, text


@pytest.mark.slow
def test_version_prints_the_package_version() -> None:
    result = cli("--version")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"shopsimrl {declared}" == f"shopsimrl {importlib.metadata.version('shopsimrl')}"


# --------------------------------------------------------------------------- plan and summarize


@pytest.mark.slow
def test_plan_prints_a_table_and_json_with_the_flag() -> None:
    table = cli("plan", "configs/qwen35_4b_val.yaml")
    machine = cli("plan", "configs/qwen35_4b_val.yaml", "--json")
    assert table.returncode == 0 and machine.returncode == 0, table.stderr + machine.stderr
    report = json.loads(machine.stdout)
    with pytest.raises(json.JSONDecodeError):
        json.loads(table.stdout)
    lines = table.stdout.splitlines()
    assert re.search(rf"^plan fingerprint\s+{report['plan_fingerprint']}$", table.stdout, re.M)
    assert re.search(r"^episodes\s+400$", table.stdout, re.M)
    assert "model" in lines and re.search(r"^  sampling\.temperature\s+0\.6$", table.stdout, re.M)
    assert "first 5 of 400 episodes" in lines
    for job in report["first_jobs"]:
        assert re.search(
            rf"^  {job['episode_id']}\s+{job['task_id']}\s+{job['sample_id']}\s+{job['seed']}\s+val$", table.stdout, re.M
        )


@pytest.mark.slow
def test_summarize_on_a_sharded_run_points_to_reduce(tmp_path: Path) -> None:
    config = write_config(tmp_path, name="sharded", sample_size=4)
    run_dir = tmp_path / "sharded-run"
    assert cli("plan", str(config), "--shards", "2", "--run", str(run_dir)).returncode == 0
    for location in (str(run_dir), f"file://{run_dir}", "s3://bucket/runs/x"):
        result = cli("summarize", location)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"shopsimrl reduce {location}" in lines[0], result.stderr


# --------------------------------------------------------------------------- log settings


@pytest.mark.slow
@pytest.mark.parametrize(("variable", "value"), [("SHOPSIMRL_LOG_LEVEL", "loud"), ("SHOPSIMRL_LOG_FORMAT", "xml")])
def test_a_bad_log_setting_is_bad_input_naming_the_variable(variable: str, value: str) -> None:
    result = cli("plan", "configs/qwen35_4b_val.yaml", env=clean_env(**{variable: value}))
    lines = result.stderr.strip().splitlines()
    assert (
        result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: invalid environment variable {variable}")
    ), result.stderr


@pytest.mark.slow
def test_quiet_and_verbose_exclude_each_other() -> None:
    result = cli("plan", "configs/qwen35_4b_val.yaml", "-q", "-v")
    assert result.returncode == 2 and result.stderr.strip() == "error: -q/--quiet and -v/--verbose exclude each other"


def emitted(capsys: pytest.CaptureFixture[str]) -> set[str]:
    log = structlog.get_logger("test")
    log.debug("at_debug")
    log.info("at_info")
    log.warning("at_warning")
    err = capsys.readouterr().err
    return {name for name in ("at_debug", "at_info", "at_warning") if name in err}


def test_flags_override_the_log_level_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SHOPSIMRL_LOG_FORMAT", "json")
    monkeypatch.delenv("SHOPSIMRL_LOG_LEVEL", raising=False)
    logs.configure_logging()
    assert emitted(capsys) == {"at_info", "at_warning"}
    monkeypatch.setenv("SHOPSIMRL_LOG_LEVEL", "WARNING")
    logs.configure_logging()
    assert emitted(capsys) == {"at_warning"}
    logs.configure_logging(verbosity=1)  # -v
    assert emitted(capsys) == {"at_debug", "at_info", "at_warning"}
    monkeypatch.setenv("SHOPSIMRL_LOG_LEVEL", "debug")
    logs.configure_logging(verbosity=-1)  # -q
    assert emitted(capsys) == {"at_warning"}


def test_a_log_line_to_a_closed_pipe_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard worker whose coordinator died logs into a pipe nobody reads: the line is lost,
    but the log call must return, or the worker's stop path (save, release leases) breaks."""
    monkeypatch.delenv("SHOPSIMRL_LOG_FORMAT", raising=False)
    logs.configure_logging()
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed_pipe = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stderr", closed_pipe)
    structlog.get_logger("test").warning("SIGTERM: stopping")
    structlog.get_logger("test").warning("worker_stopped", exit_code=3)
    monkeypatch.undo()
    with contextlib.suppress(BrokenPipeError):  # closing flushes what could not be written
        closed_pipe.close()


def test_after_the_pipe_closes_logs_go_to_the_fallback_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker of a coordinator that died: its lines go on to the coordinator's stderr copy."""
    fallback_read, fallback_write = os.pipe()
    monkeypatch.setenv("SHOPSIMRL_LOG_FORMAT", "json")
    monkeypatch.setenv("SHOPSIMRL_LOG_FALLBACK_FD", str(fallback_write))
    logs.configure_logging()
    assert logs.current_settings().log_fallback_fd is None  # not for child processes
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed_pipe = io.TextIOWrapper(io.FileIO(write_end, "w"), write_through=True)  # unbuffered, as Python's stderr is
    monkeypatch.setattr(sys, "stderr", closed_pipe)
    structlog.get_logger("test").warning("SIGTERM: stopping")
    structlog.get_logger("test").warning("worker_stopped", exit_code=3)
    monkeypatch.undo()
    closed_pipe.close()  # now a copy of the fallback
    os.close(fallback_write)
    with os.fdopen(fallback_read) as fallback:
        assert [json.loads(line)["event"] for line in fallback] == ["SIGTERM: stopping", "worker_stopped"]


# --------------------------------------------------------------------------- the live bar, in process


def terminal_console(buffer: io.StringIO) -> Console:
    return Console(file=buffer, force_terminal=True, width=160, color_system="standard")


def completed_trace(number: int, reward: float = 1.0) -> EpisodeTrace:
    return read_trace(
        {
            "schema_version": "shopsimrl-episode-v4",
            "episode_id": f"task-{number:06d}__sample-000",
            "status": "completed",
            "job": {"task_id": number, "sample_id": 0, "seed": number, "split": "val"},
            "final": {"reward": reward, "done": True},
        }
    )


def assert_logs_above_the_bar(lines: list[str], expected_logs: int) -> None:
    mixed = [line for line in lines if BAR.search(line) and (LOG_LINE.search(line) or '"event"' in line)]
    assert not mixed, "a log line landed inside the progress bar:\n" + "\n".join(mixed)
    assert sum(1 for line in lines if LOG_LINE.search(line) or '"event"' in line) >= expected_logs, "\n".join(lines)


def test_log_lines_print_above_the_live_bar_never_inside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHOPSIMRL_LOG_FORMAT", raising=False)
    monkeypatch.delenv("SHOPSIMRL_LOG_LEVEL", raising=False)
    logs.configure_logging()
    log = structlog.get_logger("test")
    buffer = io.StringIO()
    with RunProgress(20, enabled=True, console=terminal_console(buffer)) as bar:
        for number in range(20):
            log.warning("model call retried", attempt=number)
            bar.on_trace(completed_trace(number))
    lines = screen_lines(buffer.getvalue())
    assert_logs_above_the_bar(lines, expected_logs=20)
    assert [int(m.group(1)) for line in lines if (m := re.search(r"model call retried\s+attempt=(\d+)", line))] == list(range(20))
    final = [line for line in lines if BAR.search(line)][-1]
    assert re.search(r"20/20 reward 1\.000\s+failed 0\s+retried 0", final), final


def test_the_bar_of_a_resumed_run_counts_the_whole_plan() -> None:
    buffer = io.StringIO()
    with RunProgress(400, before=73, enabled=True, console=terminal_console(buffer)) as bar:
        for number in range(327):
            bar.on_trace(completed_trace(number, reward=0.5))
    final = [line for line in screen_lines(buffer.getvalue()) if BAR.search(line)][-1]
    assert "73 + 327 / 400" in final and "reward 0.500" in final


def test_sharded_progress_follows_restarts_retries_and_committed_shards() -> None:
    buffer = io.StringIO()
    progress = ShardedRunProgress([4, 4, 4], enabled=True, console=terminal_console(buffer))

    def finished(shard: int, episode: str, status: str = "completed", will_retry: bool = False, reward: float = 1.0) -> None:
        progress.on_worker_event(
            shard,
            {"event": "episode_finished", "episode_id": episode, "status": status, "reward": reward, "will_retry": will_retry},
        )

    with progress:
        progress.on_worker_event(0, {"event": "shard_resumed", "jobs": 4, "completed": 1})
        progress.on_worker_event(1, {"event": "shard_resumed", "jobs": 4, "completed": 0})
        progress.on_worker_event(2, {"event": "shard_already_committed", "completed": 4})
        finished(0, "a", reward=0.0)
        finished(1, "b", status="failed", will_retry=True)
        finished(1, "b", status="failed")
        finished(1, "c")
        # Shard 1's worker crashes; its restart finds "c" saved, retries "b" and runs the rest.
        progress.on_worker_event(1, {"event": "shard_resumed", "jobs": 4, "completed": 1})
        for episode in ("b", "d", "e"):
            finished(1, episode)
        finished(0, "f")
        finished(0, "g", status="failed")
        progress.on_worker_event(0, {"event": "model_request_retry", "status": 429, "attempt": 1})
        progress.on_worker_event(1, {"event": "model_request_retry", "status": 500, "attempt": 1})
    final = [line for line in screen_lines(buffer.getvalue()) if BAR.search(line)][-1]
    # before: 1 (shard 0) + 0 (shard 1) + 4 (shard 2); this invocation: 3 on shard 0, 4 on shard 1.
    assert "5 + 7 / 12" in final, final
    assert re.search(r"reward 0\.833\s+failed 1\s+retried 1\s+model retries 2", final), final


def test_a_tap_counts_an_info_event_that_quiet_hides(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SHOPSIMRL_LOG_LEVEL", raising=False)
    logs.configure_logging(verbosity=-1)  # -q
    seen: list[dict[str, Any]] = []
    log = structlog.get_logger("test")
    with logs.tap("model_request_retry", seen.append):
        log.info("model_request_retry", status=429)
        log.info("something_else")
        log.warning("model_request_retry", status=503)
    log.info("model_request_retry", status=500)  # after the block: not seen
    assert [fields["status"] for fields in seen] == [429, 503]
    err = capsys.readouterr().err
    assert "status=429" not in err and "something_else" not in err and "status=503" in err


def test_brief_keeps_an_error_to_one_short_line() -> None:
    body = '{"error":{"message":"injected rate limit","type":"RateLimitError","param":null,"code":429}}'
    assert logs.brief(f"HTTP 429: {body}") == "HTTP 429: injected rate limit"
    assert logs.brief("model request failed after 6 attempts:\n  HTTP 500: {not json}") == (
        "model request failed after 6 attempts: HTTP 500: {not json}"
    )
    long = logs.brief("x" * 500, 120)
    assert len(long) == 120 and long.endswith("…")


def test_load_refusals_give_one_warning_then_one_a_minute(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHOPSIMRL_LOG_FORMAT", "json")
    logs.configure_logging(verbosity=-1)
    now = [0.0]
    bar = RunProgress(10, enabled=False, clock=lambda: now[0])
    log = structlog.get_logger("test")
    with bar:
        for second in range(0, 150, 5):  # a refusal every 5 s for 150 s, and one plain server error
            now[0] = float(second)
            log.info("model_request_retry", status=429 if second % 10 else 503, episode_id="task-000001__sample-000")
        log.info("model_request_retry", status=500)
    warnings = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert bar.model_retries == 31
    # The first at once, one at 60 s and 120 s with the refusals since, the rest when the bar closes.
    assert [w["refused"] for w in warnings] == [1, 12, 12, 5] and warnings[-1]["refused_total"] == 30
    assert "refuses requests for load" in warnings[0]["event"] and "max_concurrent_requests" in warnings[0]["event"]
    assert warnings[1]["statuses"] == "HTTP 429 ×6, HTTP 503 ×6" and warnings[1]["window_s"] == 60.0
    assert all(w["level"] == "warning" and "episode_id" not in w for w in warnings)


# --------------------------------------------------------------------------- end to end on a terminal


@pytest.fixture(scope="module")
def bed() -> Iterator[LocalTestbed]:
    with start_testbed() as testbed:
        yield testbed


def keep_first_records(traces: Path, count: int) -> int:
    """Cut the trace file to its first ``count`` lines (a run stopped early); returns the episodes completed in them."""
    lines = traces.read_text(encoding="utf-8").splitlines(keepends=True)[:count]
    traces.write_text("".join(lines), encoding="utf-8")
    return len({record["episode_id"] for record in map(json.loads, lines) if read_trace(record).completed})


@pytest.mark.slow
def test_a_local_run_on_a_terminal_logs_above_the_bar_and_counts_a_resume(tmp_path: Path) -> None:
    # Shop 5xx answers make the run log warnings (retries) while the bar is on screen.
    with start_testbed(SHOPSIM_FAULT_RATE_5XX="0.15", SHOPSIM_SEED="11") as faulty:
        config = write_config(tmp_path, name="tty", sample_size=12)
        code, output = run_on_terminal([*SHOPSIMRL, "run", str(config)], env=bed_env(faulty), cwd=ROOT)
        lines = screen_lines(output)
        assert code in (0, 1), output[-3000:]
        assert_logs_above_the_bar(lines, expected_logs=1)
        assert any(BAR.search(line) and "12/12" in line for line in lines), "\n".join(lines)

        before = keep_first_records(tmp_path / "runs/tty/traces.jsonl", 5)
        code, output = run_on_terminal([*SHOPSIMRL, "run", str(config)], env=bed_env(faulty), cwd=ROOT)
        lines = screen_lines(output)
        assert code in (0, 1), output[-3000:]
        assert_logs_above_the_bar(lines, expected_logs=0)
        assert any(BAR.search(line) and f"{before} + {12 - before} / 12" in line for line in lines), "\n".join(lines)


@pytest.mark.slow
def test_retries_and_failures_are_counted_in_the_bar_one_info_line_each(tmp_path: Path) -> None:
    """Rate limits from the policy (seeded): some model calls are retried, some give up (one
    retry allowed) and fail their episode, which is requeued. Each is one short line at info (no
    JSON error body); with -q none shows, the bar counts them, and the refusals for load
    come as one warning (then one a minute)."""
    with start_testbed(SHOPSIM_POLICY_RATE_429="0.3", SHOPSIM_POLICY_RETRY_AFTER_S="0", SHOPSIM_POLICY_FAULT_SEED="5") as bed:
        runs = {}
        for name, flags in (("loud", []), ("quiet", ["-q"])):
            config = write_config(tmp_path, name=name, sample_size=8)
            config.write_text(config.read_text().replace("max_retries: 6", "max_retries: 2"))
            code, output = run_on_terminal([*SHOPSIMRL, "run", str(config), *flags], env=bed_env(bed), cwd=ROOT)
            assert code in (0, 1), output[-3000:]
            runs[name] = screen_lines(output)

    def bar_counts(lines: list[str]) -> dict[str, int]:
        final = [line for line in lines if BAR.search(line)][-1]
        found = re.search(r"failed (\d+)\s+retried (\d+)\s+model retries (\d+)", final)
        assert found, final
        return dict(zip(("failed", "retried", "model_retries"), map(int, found.groups()), strict=True))

    loud, quiet = runs["loud"], runs["quiet"]
    counts = bar_counts(loud)
    retries = [line for line in loud if "model_request_retry" in line]
    failures = [line for line in loud if "episode_failed" in line]
    assert counts["model_retries"] >= 1 and counts["retried"] >= 1, "\n".join(loud)  # the seed gives both
    assert len(retries) == counts["model_retries"] and len(failures) == counts["failed"] + counts["retried"]
    for line in retries + failures:
        assert "[info" in line and ("status=429" in line or line in failures), line
        assert "{" not in line and "Traceback" not in line, line  # short: the error body and traceback stay in the trace
    assert_logs_above_the_bar(loud, expected_logs=len(retries))

    assert not [line for line in quiet if "model_request_retry" in line or "episode_failed" in line], "\n".join(quiet)
    load = [line for line in quiet if "refuses requests for load" in line]
    assert 1 <= len(load) <= 2, "\n".join(quiet)  # at once, and the rest when the run ends (it takes seconds)
    assert f"refused_total={bar_counts(quiet)['model_retries']}" in load[-1], load[-1]
    assert bar_counts(quiet)["model_retries"] >= 1


@pytest.mark.slow
def test_a_sharded_run_on_a_terminal_shows_one_bar_over_all_shards(bed: LocalTestbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, name="sharded-tty", sample_size=12)
    run = tmp_path / "sharded-run"
    command = [*SHOPSIMRL, "run", str(config), "--shards", "2", "--run", str(run)]
    code, output = run_on_terminal(command, env=bed_env(bed), cwd=ROOT)
    lines = screen_lines(output)
    assert code == 0, output[-3000:]
    assert_logs_above_the_bar(lines, expected_logs=4)  # index_started, shard_resumed, … per shard
    assert any(BAR.search(line) and "12/12" in line and "failed 0" in line for line in lines), "\n".join(lines)
    assert not [line for line in lines if "episode_finished" in line or "part_written" in line]  # per-episode lines are debug

    # Shard 1 lost (its folder deleted): the resume runs its 6 episodes; -v shows one line per episode.
    for path in sorted((run / "shards" / "00001").iterdir()):
        path.unlink()
    code, output = run_on_terminal([*command, "-v"], env=bed_env(bed), cwd=ROOT)
    lines = screen_lines(output)
    assert code == 0, output[-3000:]
    assert_logs_above_the_bar(lines, expected_logs=6)
    assert any(BAR.search(line) and "6 + 6 / 12" in line for line in lines), "\n".join(lines)
    episode_lines = [line for line in lines if "episode_finished" in line]
    assert len(episode_lines) == 6 and all("[debug" in line and "shard=1" in line for line in episode_lines), "\n".join(
        episode_lines
    )


class Coordinator:
    """``shopsimrl run --shards`` in the background (no terminal); its stderr is collected line by line."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                seen += 1
                if predicate(self.lines[seen - 1]):
                    return self.lines[seen - 1]
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError("not seen in the coordinator's output:\n" + "\n".join(self.lines[-40:]))

    def finish(self, timeout: float = 180) -> tuple[int, str]:
        """Wait for the exit; returns the exit code and stdout (stderr stays with the reader thread)."""
        code = self.process.wait(timeout=timeout)
        self._reader.join(10)
        assert self.process.stdout is not None
        return code, self.process.stdout.read()

    def drain(self, timeout: float = 30) -> None:
        """Read stderr to its end: every process writing to it (the workers too) has exited."""
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "stderr still open"

    def worker_pids(self) -> list[int]:
        return [int(m.group(1)) for line in self.lines if "index_started" in line and (m := re.search(r"pid=(\d+)", line))]


@pytest.fixture(scope="module")
def slow_bed() -> Iterator[LocalTestbed]:
    """Every model call takes 300 ms: a shard is still running when the test acts on it."""
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="300") as testbed:
        yield testbed


@pytest.mark.slow
def test_the_slot_sizing_warning_of_every_worker_is_shown_once(tmp_path: Path) -> None:
    """4 shards × concurrency 8 against 8 slots: each worker warns that its episodes will wait
    for slots, word for word the same; the coordinator shows it once, the repeats at debug."""
    with start_testbed(SHOPSIM_ENV_SLOTS="8") as small:
        config = write_config(tmp_path, name="oversubscribed", sample_size=16, concurrency=8)
        command = ["run", str(config), "--shards", "4", "--run", str(tmp_path / "run"), "--no-progress", "-v"]
        done = cli(*command, env=bed_env(small, SHOPSIMRL_LOG_FORMAT="json"))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    sizing = [r for r in records if "episodes in flight, but ShopSimulator has 8 slots" in r["event"]]
    assert sorted(r["shard"] for r in sizing) == [0, 1, 2, 3], sizing
    assert [r["level"] for r in sizing].count("warning") == 1 and [r["level"] for r in sizing].count("debug") == 3


@pytest.mark.slow
def test_a_crashed_worker_shows_its_traceback_and_exit_code(slow_bed: LocalTestbed, tmp_path: Path) -> None:
    # 16 episodes at 300 ms a model call: the shard is still running when the signal lands, however
    # late a loaded machine delivers it (6 could finish between the line and the kill).
    config = write_config(tmp_path, name="crash", sample_size=16, concurrency=2)
    env = bed_env(slow_bed, PYTHONFAULTHANDLER="1")  # a fatal signal makes the worker print its Python traceback
    coordinator = Coordinator([*SHOPSIMRL, "run", str(config), "--shards", "1", "--run", str(tmp_path / "run")], env)
    coordinator.wait_for(lambda line: "shard_resumed" in line)
    os.kill(coordinator.worker_pids()[0], signal.SIGSEGV)
    code, stdout = coordinator.finish()
    text = "\n".join(coordinator.lines)
    assert code == 0, text[-3000:]  # restarted once, then the shard completed
    assert "shard 0 | Fatal Python error: Segmentation fault" in text
    assert re.search(r"shard 0 \| +File \".*\", line \d+ in ", text), text[-3000:]
    restarting = coordinator.wait_for(lambda line: "index_restarting" in line)
    assert "exit_code=-11" in restarting and "index=0" in restarting
    assert "1/1 committed" in stdout


def all_slots_free(bed: LocalTestbed, timeout: float = 90) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = bed.healthz()
        if health["free_slots"] == health["environment_slots"]:
            return True
        time.sleep(0.2)
    return False


def wait_for_leases(bed: LocalTestbed, timeout: float = 120) -> None:
    """Until the shop holds a lease: "lease budget" is logged before a worker's first reset, so
    right after it the episodes may not have started yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = bed.healthz()
        if health["free_slots"] < health["environment_slots"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"no lease taken within {timeout:g} s: {bed.healthz()}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; whoever adopted it has not reaped it yet


@pytest.mark.slow
def test_sigterm_to_the_coordinator_stops_every_worker_and_frees_their_leases(slow_bed: LocalTestbed, tmp_path: Path) -> None:
    # Far more episodes than a shard can run while the other worker starts (workers start seconds
    # apart on a loaded machine): both are mid-shard when the signal comes; they stop at once anyway.
    config = write_config(tmp_path, name="term", sample_size=200, concurrency=2)
    run = tmp_path / "run"
    coordinator = Coordinator([*SHOPSIMRL, "run", str(config), "--shards", "2", "--run", str(run)], bed_env(slow_bed))
    for shard in (0, 1):
        coordinator.wait_for(lambda line, shard=shard: "lease budget" in line and f"shard={shard}" in line)
    wait_for_leases(slow_bed)
    coordinator.process.send_signal(signal.SIGTERM)
    code, _ = coordinator.finish()
    text = "\n".join(coordinator.lines)
    assert code == 3, text[-3000:]
    assert text.count("SIGTERM: stopping") == 2 and text.count("worker_stopped") == 2, text[-3000:]  # the workers' own lines
    assert all_slots_free(slow_bed)
    assert not list(run.glob("shards/*/_SUCCESS*.json")), "a shard ran to the end before the signal"


@pytest.mark.slow
def test_a_killed_coordinator_leaves_no_worker_holding_leases(slow_bed: LocalTestbed, tmp_path: Path) -> None:
    """kill -9 of the coordinator: its workers get SIGTERM (PR_SET_PDEATHSIG) and find their log
    pipe closed. They log on to the coordinator's stderr (the fallback descriptor), release
    every lease and exit without running their shards to the end."""
    config = write_config(tmp_path, name="orphans", sample_size=200, concurrency=2)
    run = tmp_path / "run"
    coordinator = Coordinator([*SHOPSIMRL, "run", str(config), "--shards", "2", "--run", str(run)], bed_env(slow_bed))
    for shard in (0, 1):
        coordinator.wait_for(lambda line, shard=shard: "lease budget" in line and f"shard={shard}" in line)
    wait_for_leases(slow_bed)  # episodes in flight
    pids = coordinator.worker_pids()
    coordinator.process.kill()
    coordinator.finish()
    assert all_slots_free(slow_bed)
    deadline = time.monotonic() + 60
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, pids))
    assert not list(run.glob("shards/*/_SUCCESS*.json")), "a worker ran its shard to the end instead of stopping"
    coordinator.drain()
    last_words = [json.loads(line) for line in coordinator.lines if line.startswith("{")]
    assert sorted(record["shard"] for record in last_words if record["event"].startswith("SIGTERM: stopping")) == [0, 1]
