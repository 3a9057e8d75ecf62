"""How a shard worker stops: finished traces are saved before the (possibly slow) lease cleanup,
a failing flush loses nothing, and workers never outlive a killed `run --shards` coordinator."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shopsimrl.records import read_trace
from shopsimrl.storage.objectstore import StoreUnavailableError
from shopsimrl.storage.sharded import PartWriter, ShardedRunStore
from shopsimrl.testbed.serving import running_server
from tests.sharded.conftest import REPO, Backend, Testbed, start_worker, worker_env, write_config

pytestmark = pytest.mark.slow


@contextmanager
def release_holding_proxy(upstream: str) -> Iterator[tuple[str, threading.Event, threading.Event]]:
    """A reverse proxy in front of the shop that, once ``hold`` is set, keeps every
    ``release_one`` waiting until ``let_go`` is set (a shop that stalls on releases)."""
    hold, let_go = threading.Event(), threading.Event()
    client = httpx.AsyncClient(base_url=upstream, timeout=60)

    async def forward(request: Request) -> Response:
        body = await request.body()
        if hold.is_set() and b'"release_one"' in body:
            await asyncio.to_thread(let_go.wait, 120)
        upstream_reply = await client.request(
            request.method, request.url.path, content=body, headers={"content-type": "application/json"}
        )
        return Response(upstream_reply.content, status_code=upstream_reply.status_code, media_type="application/json")

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
    with running_server(app) as url:
        try:
            yield url, hold, let_go
        finally:
            let_go.set()


@pytest.mark.slow
def test_stop_saves_finished_traces_before_the_lease_cleanup(testbed: Testbed, tmp_path: Path) -> None:
    backend = Backend("local", str(tmp_path / "runs"))
    config = write_config(tmp_path, testbed, episodes=40)
    uri = backend.uri("stall")
    with release_holding_proxy(testbed.shop_url) as (proxy, hold, let_go):
        # No flush by count or age: whatever is saved, the stop saved.
        env = worker_env(backend, SHOPSIMRL_FLUSH_EPISODES="1000", SHOPSIMRL_FLUSH_SECONDS="600", SHOPSIMRL_ENV_BASE_URL=proxy)
        worker = start_worker(backend, uri, config, 0, 1, tmp_path / "logs", env=env)
        deadline = time.monotonic() + 90
        while len(worker.finished_episodes()) < 2:
            assert time.monotonic() < deadline and worker.process.poll() is None, worker.log_path.read_text()[-3000:]
            time.sleep(0.05)
        hold.set()  # from now on every lease release stalls at the shop
        worker.process.send_signal(signal.SIGTERM)
        store = ShardedRunStore(uri)
        deadline = time.monotonic() + 60
        while not store.list_shard(0).parts:  # saved while the releases still hang
            assert time.monotonic() < deadline, "nothing was saved before the lease cleanup ended"
            assert worker.process.poll() is None, worker.log_path.read_text()[-3000:]
            time.sleep(0.05)
        let_go.set()
        assert worker.wait() == 3
    saved = {line for line in store.read_part(0, store.list_shard(0).parts[0]).splitlines() if line.strip()}
    assert len(saved) >= 2


async def test_a_failing_flush_is_retried_and_loses_nothing(tmp_path: Path) -> None:
    store = ShardedRunStore(str(tmp_path / "run"))
    failures = {"left": 2}
    write_part = store.write_part

    def flaky(index: int, seq: int, writer: str, data: bytes, *, compressed: bool = True) -> tuple[str, bytes]:
        if failures["left"]:
            failures["left"] -= 1
            raise StoreUnavailableError("object store still failing after 8 attempts (injected)")
        return write_part(index, seq, writer, data, compressed=compressed)

    store.write_part = flaky  # type: ignore[method-assign]
    sink = PartWriter(store, 0, "feedbeef", 0, flush_episodes=1000, flush_seconds=0.05, plan_fingerprint="0" * 64)
    sink.save_traces(
        [
            read_trace(
                {
                    "schema_version": "shopsimrl-episode-v4",
                    "episode_id": "task-000001__sample-000",
                    "status": "completed",
                    "job": {"task_id": 1, "sample_id": 0, "seed": 1, "split": "val"},
                }
            )
        ]
    )
    timer = asyncio.ensure_future(sink.flush_stale_parts())
    deadline = time.monotonic() + 30
    while sink.buffered:  # two failed flushes, then a part
        assert time.monotonic() < deadline and not timer.done()
        await asyncio.sleep(0.02)
    timer.cancel()
    assert failures["left"] == 0 and [part.entry["records"] for part in sink.written] == [1]


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_workers_stop_when_the_coordinator_is_killed(testbed: Testbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, testbed, episodes=200)
    env = {**worker_env(Backend("local", "")), "SHOPSIMRL_ENV_BASE_URL": testbed.shop_url}
    log_path = tmp_path / "run.log"  # the workers inherit the coordinator's stderr
    with log_path.open("wb") as log:
        coordinator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shopsimrl",
                "run",
                str(config),
                "--shards",
                "2",
                "--run",
                str(tmp_path / "run"),
                "--no-progress",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    free_before = testbed.healthz()["free_slots"]
    deadline = time.monotonic() + 60
    while len(workers := _children(coordinator.pid)) < 2:
        assert time.monotonic() < deadline and coordinator.poll() is None
        time.sleep(0.05)
    # Both workers are playing episodes (past planning, their graceful stop installed).
    while sum(line.get("event") == "lease budget" for line in map(_json_or_empty, log_path.read_text().splitlines())) < 2:
        assert time.monotonic() < deadline and coordinator.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.05)
    coordinator.kill()
    coordinator.wait()
    deadline = time.monotonic() + 90
    while alive := [pid for pid in workers if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]:
        assert time.monotonic() < deadline, f"workers {alive} outlived their coordinator"
        time.sleep(0.1)
    events = [line.get("event", "") for line in map(_json_or_empty, log_path.read_text().splitlines())]
    # Stopped by the signal the coordinator's death sent, not by running out of episodes.
    assert sum(e.startswith("SIGTERM: stopping") for e in events) == 2 and "shard_committed" not in events
    assert testbed.healthz()["free_slots"] == free_before  # they stopped gracefully, leases released


def _json_or_empty(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _state(pid: int) -> str:
    try:
        return {"Z": "zombie", "X": "dead"}.get(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0], "alive")
    except OSError:
        return "dead"


COORDINATOR_SIGNALLED_TWICE = """
import os, signal, sys
from pathlib import Path
from shopsimrl.runner.local_job import run_indexed

sent = []
def first_signal() -> None:  # the first signal, from inside the coordinator's loop
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)

result = run_indexed(sys.argv[1], Path(sys.argv[2]), 2, on_tick=first_signal, poll_interval_s=0.02)
os.kill(os.getpid(), signal.SIGTERM)  # a second one after the workers ended, while it reports
print("interrupted" if result.interrupted else "not interrupted", result.exit_code.name)
"""


def test_a_second_signal_after_the_workers_ended_does_not_kill_the_coordinator(tmp_path: Path) -> None:
    """`run --shards`: the first SIGTERM stops the workers; one arriving after they exited, while
    the coordinator reports, used to meet the restored default action and kill it (exit -15)."""
    missing = tmp_path / "no-such-config.yaml"  # the workers exit at once: the race needs no timing
    result = subprocess.run(
        [sys.executable, "-c", COORDINATOR_SIGNALLED_TWICE, str(tmp_path / "run"), str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    output = result.stdout + result.stderr  # structlog is not configured here: its lines go to stdout
    assert "interrupted RETRYABLE" in output.splitlines()
    assert "already_stopping" in output


STARTUP_HOLD = '''
"""Test hook (sitecustomize): a shard worker stops in its start-up and waits for the test."""
import os, sys, time
from pathlib import Path

_dir, _where = os.environ.get("SHOPSIMRL_TEST_HOLD_DIR"), os.environ.get("SHOPSIMRL_TEST_HOLD_AT")


def _hold():
    Path(_dir, f"holding-{os.getpid()}").touch()
    while not Path(_dir, "go").exists():
        time.sleep(0.01)


if _dir and "JOB_COMPLETION_INDEX" in os.environ:  # the workers, not the coordinator
    if _where == "interpreter":  # before any of shopsimrl's code runs
        _hold()
    else:  # as the entry point imports the CLI (a second or so of imports)
        class _HoldAtCli:
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name == "shopsimrl.cli":
                    sys.meta_path.remove(_HoldAtCli)
                    _hold()
                return None

        sys.meta_path.insert(0, _HoldAtCli)
'''


def _signal_pending(pid: int, signum: int) -> bool:
    """``signum`` is blocked in ``pid`` and waits there (from /proc/PID/status)."""
    try:
        fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    except OSError:
        return False
    bit = 1 << (signum - 1)
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return bool(int(fields["SigBlk"], 16) & bit) and bool(pending & bit)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads signal masks from /proc")
@pytest.mark.parametrize("where", ["interpreter", "cli"])
def test_ctrl_c_while_the_workers_start_prints_no_traceback(testbed: Testbed, tmp_path: Path, where: str) -> None:
    """Issue 22: Ctrl-C while `run --shards` started its workers printed a traceback (1 of 25): a
    worker still starting its interpreter, or importing the CLI, got the terminal's SIGINT before
    any handler of shopsimrl was installed. A hook holds each worker at that point; the Ctrl-C
    reaches the workers first, then the coordinator (the terminal signals the whole group)."""
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(STARTUP_HOLD)
    config = write_config(tmp_path, testbed, episodes=20)
    env = {
        **worker_env(Backend("local", "")),
        "SHOPSIMRL_ENV_BASE_URL": testbed.shop_url,
        "PYTHONPATH": str(hold),
        "SHOPSIMRL_TEST_HOLD_DIR": str(hold),
        "SHOPSIMRL_TEST_HOLD_AT": where,
    }
    command = [sys.executable, "-m", "shopsimrl", "run", str(config), "--shards", "2", "--run", str(tmp_path / "run")]
    coordinator = subprocess.Popen(
        [*command, "--no-progress"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 90
        while len(workers := [int(p.name.split("-")[1]) for p in hold.glob("holding-*")]) < 2:
            assert time.monotonic() < deadline and coordinator.poll() is None, "the workers never reached the hook"
            time.sleep(0.02)
        assert not (hold / "go").exists()  # both are held in the window when the signal comes
        for pid in workers:
            os.kill(pid, signal.SIGINT)
        # Each worker took it: held for later (blocked), or acted on it (exited, or a traceback).
        while alive := [p for p in workers if _state(p) == "alive" and not _signal_pending(p, signal.SIGINT)]:
            assert time.monotonic() < deadline, f"workers {alive} neither hold nor acted on the SIGINT"
            time.sleep(0.01)
        coordinator.send_signal(signal.SIGINT)
        (hold / "go").touch()
        _, stderr = coordinator.communicate(timeout=120)
    finally:
        (hold / "go").touch()
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert coordinator.returncode == 3, stderr[-3000:]
    assert "shard_committed" not in stderr  # the workers stopped; they ran no shard to its end
