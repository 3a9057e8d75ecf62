"""A shard worker with several event-loop processes (`worker --processes N`): the same commit
protocol, one writer per process, every lease released on a stop."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from shopsimrl.runner.reduce import reduce_run
from shopsimrl.storage.sharded import PART_PATTERN, ShardedRunStore
from tests.sharded.conftest import Backend, Testbed, start_worker, worker_env, write_config

pytestmark = pytest.mark.slow


def writers(store: ShardedRunStore) -> Counter[str]:
    return Counter(PART_PATTERN.match(name).group(2) for name in store.list_shard(0).parts)  # type: ignore[union-attr]


def test_a_worker_with_three_processes_commits_its_shard_once(testbed: Testbed, tmp_path: Path) -> None:
    backend = Backend("local", str(tmp_path / "runs"))
    config = write_config(tmp_path, testbed, episodes=30, concurrency=2)
    uri = backend.uri("processes")
    worker = start_worker(backend, uri, config, 0, 1, tmp_path / "logs", args=["--processes", "3"])
    assert worker.wait(timeout=300) == 0, worker.log_path.read_text()[-3000:]
    store = ShardedRunStore(uri)
    assert len(writers(store)) == 3  # each process wrote its own parts
    summary = reduce_run(store)
    assert summary["counts"]["completed"] == 30 and summary["shards"]["duplicate_records"] == 0
    events = [line.get("event") for line in worker.log_lines()]
    assert events.count("shard_committed") == 1 and "worker_processes_started" in events


def test_sigterm_stops_every_process_and_a_restart_finishes_the_shard(testbed: Testbed, tmp_path: Path) -> None:
    backend = Backend("local", str(tmp_path / "runs"))
    config = write_config(tmp_path, testbed, episodes=60, concurrency=2)
    uri = backend.uri("processes-term")
    env = worker_env(backend, SHOPSIMRL_FLUSH_EPISODES="2")
    free_before = testbed.healthz()["free_slots"]
    worker = start_worker(backend, uri, config, 0, 1, tmp_path / "logs", env=env, args=["--processes", "2"])
    deadline = time.monotonic() + 120
    while len(worker.finished_episodes()) < 4:
        assert time.monotonic() < deadline and worker.process.poll() is None, worker.log_path.read_text()[-3000:]
        time.sleep(0.05)
    worker.process.send_signal(signal.SIGTERM)  # Kubernetes signals the pod's first process only
    assert worker.wait(timeout=120) == 3
    assert testbed.healthz()["free_slots"] == free_before
    resumed = start_worker(backend, uri, config, 0, 1, tmp_path / "logs", args=["--processes", "2"])
    assert resumed.wait(timeout=300) == 0, resumed.log_path.read_text()[-3000:]
    summary = reduce_run(ShardedRunStore(uri))
    assert summary["counts"]["completed"] == 60 and summary["shards"]["duplicate_records"] == 0
