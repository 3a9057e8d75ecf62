"""Parts fetched several at a time (``SHOPSIMRL_STORE_READ_CONCURRENCY``) on real S3 servers
(moto and SeaweedFS): the same summary, records and order as reading one by one, the same
errors for a torn line, a part that keeps failing and a part deleted while the shard is read,
and a fetch window that stays bounded."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from shopsimrl.runner.reduce import reduce_run
from shopsimrl.schemas import EpisodeJob, fingerprint
from shopsimrl.storage.objectstore import READ_CONCURRENCY, RetryPolicy, RunLocationError, StoreUnavailableError
from shopsimrl.storage.reading import open_run
from shopsimrl.storage.sharded import ShardedRunStore, marker_document, part_entry, read_shard_parts

from .conftest import S3Server
from .faultproxy import FaultPlan, FaultProxy, Scripted

pytestmark = pytest.mark.slow

PARTS = 400
JOBS = [EpisodeJob(task_id=t, sample_id=0, seed=t * 3, split="val") for t in range(1, PARTS + 1)]
PLAN = {"experiment": "parallel-reads", "jobs": [job.to_dict() for job in JOBS]}
SHARDS = 2
FAST_RETRY = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05, budget_s=30)


def _trace(job: EpisodeJob) -> bytes:
    record = {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": job.episode_id,
        "status": "completed",
        "attempt": 1,
        "job": job.to_dict(),
        "final": {"done": True, "reward": (job.task_id % 5) / 4},
        "steps": [],
        "failure_class": None,
        "error": None,
    }
    return json.dumps(record).encode() + b"\n"


def write_run(
    uri: str, parts: int = PARTS, shards: int = SHARDS, *, torn_part: bool = True, retry: RetryPolicy | None = FAST_RETRY
) -> dict[int, list[str]]:
    """``parts`` committed parts, one episode each (and a torn part in shard 0), over ``shards``
    shards; written 16 at a time so that building the run does not take longer than reading it.
    Returns each shard's part names in part order (bench/part_reads.py builds its run here too)."""
    jobs = JOBS if parts == PARTS else [EpisodeJob(task_id=t, sample_id=0, seed=t * 3, split="val") for t in range(1, parts + 1)]
    plan = {"experiment": "parallel-reads", "jobs": [job.to_dict() for job in jobs]}
    store = ShardedRunStore(uri, retry=retry)
    store.freeze_plan(plan)
    shard_map = store.ensure_shard_map(jobs, shards, fingerprint(plan))
    by_id = {job.episode_id: job for job in jobs}
    names: dict[int, list[str]] = {}
    for index in range(shards):
        ids = shard_map.episode_ids[index]
        to_write = [(index, seq, "0badcafe", _trace(by_id[episode_id])) for seq, episode_id in enumerate(ids)]
        with ThreadPoolExecutor(16) as pool:
            written = list(pool.map(lambda part: store.write_part(*part), to_write))
        entries = [part_entry(name, data, 1) for name, data in written]
        if index == 0 and torn_part:
            name, data = store.write_part(0, len(ids), "0badcafe", _trace(by_id[ids[0]])[:30], compressed=False)
            written.append((name, data))
            entries.append(part_entry(name, data, 0))
        names[index] = [name for name, _ in written]
        marker = marker_document(
            shard=index,
            plan_fingerprint=fingerprint(plan),
            completed=len(ids),
            failed=0,
            episode_ids_sha256=fingerprint(ids),
            parts=entries,
            writer="0badcafe",
        )
        store.create_marker(index, marker)
    return names


@pytest.fixture
def run_uri(s3_server: S3Server) -> Iterator[tuple[str, dict[int, list[str]]]]:
    uri = f"s3://{s3_server.bucket}/many-parts"
    yield uri, write_run(uri)


def _reduced(uri: str, concurrency: int, retry: RetryPolicy = FAST_RETRY) -> tuple[dict[str, Any], float]:
    store = ShardedRunStore(uri, retry=retry, read_concurrency=concurrency)
    started = time.perf_counter()
    summary = reduce_run(store, write=False)
    return summary, time.perf_counter() - started


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: summary[key] for key in ("counts", "primary", "shards", "complete")}


def test_parallel_reads_give_what_reading_one_by_one_gives(
    run_uri: tuple[str, dict[int, list[str]]], s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, names = run_uri
    sequential, sequential_s = _reduced(uri, 1)
    parallel, parallel_s = _reduced(uri, READ_CONCURRENCY)
    assert _comparable(parallel) == _comparable(sequential)
    assert parallel["counts"]["completed"] == PARTS and parallel["shards"]["unreadable_lines"] == 1  # the torn part
    assert parallel["shards"]["parts_read"] == PARTS + 1
    # Seen by hand, never asserted: the machine is shared.
    print(
        f"\n{s3_server.kind}: reduce over {PARTS + 1} parts: one by one {sequential_s:.2f} s, {READ_CONCURRENCY} at a time {parallel_s:.2f} s"
    )

    # The parts each reader holds: the same names, bytes and order.
    frozen = ShardedRunStore(uri).read_shard_map()
    assert frozen is not None
    for index in range(SHARDS):
        one = read_shard_parts(ShardedRunStore(uri, read_concurrency=1), index, frozen, fingerprint(PLAN))
        many = read_shard_parts(ShardedRunStore(uri, read_concurrency=16), index, frozen, fingerprint(PLAN))
        assert [name for name, _ in many.parts] == [name for name, _ in one.parts] == names[index]
        assert [data for _, data in many.parts] == [data for _, data in one.parts]

    # The research readers (view, compare) through the environment variable: the same records in the same order.
    orders = []
    for concurrency in ("1", "16"):
        monkeypatch.setenv("SHOPSIMRL_STORE_READ_CONCURRENCY", concurrency)
        run = open_run(uri)
        orders.append([record.episode_id for record in run.records()])
        assert run.unreadable_lines == 1
    assert orders[0] == orders[1] and len(orders[0]) == PARTS


def test_a_part_that_keeps_failing_fails_the_read_with_the_same_error(
    run_uri: tuple[str, dict[int, list[str]]], s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part in the middle of shard 1 answers 503 SlowDown to every try: the reduce stops with
    the error that reading one by one gives, naming the part. Answered 503 once, it is retried
    and the result is the one without faults."""
    uri, names = run_uri
    expected, _ = _reduced(uri, 1)
    victim = f"shards/00001/{names[1][137]}"
    messages = []
    for concurrency in (1, READ_CONCURRENCY):
        # Every try of it, whichever layer makes the try (s3fs retries a 503 itself before ours does).
        script = [Scripted("GET", re.escape(victim), "503") for _ in range(100)]
        proxy = FaultProxy(s3_server.endpoint, FaultPlan(script=script))
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
        try:
            with pytest.raises(StoreUnavailableError) as caught:
                _reduced(uri, concurrency)
        finally:
            proxy.stop()
        assert proxy.injected["503"] >= FAST_RETRY.attempts
        messages.append(re.sub(r"\(\d+\.\d s\)", "(… s)", str(caught.value)))
    assert messages[0] == messages[1]
    assert victim in messages[1] and "still failing after 3 attempts" in messages[1] and "reduce your request rate" in messages[1]

    once = [Scripted("GET", re.escape(f"shards/0000{i}/{names[i][n]}"), "503") for i, n in ((0, 5), (1, 180))]
    proxy = FaultProxy(s3_server.endpoint, FaultPlan(script=once))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    try:
        retried, _ = _reduced(uri, READ_CONCURRENCY)
    finally:
        proxy.stop()
    assert proxy.injected["503"] == 2 and _comparable(retried) == _comparable(expected)


def test_a_part_deleted_while_the_shard_is_read_is_reported_missing(
    run_uri: tuple[str, dict[int, list[str]]], s3_server: S3Server
) -> None:
    """Shard 0's part 150 is deleted once the reader has taken the first part (its fetch is not
    in the window yet): the marker no longer verifies, with the same problem as one by one."""
    uri, names = run_uri
    victim = names[0][150]
    store = ShardedRunStore(uri, read_concurrency=READ_CONCURRENCY)
    reader = store.read_parts(0, names[0])
    first_name, first = next(reader)
    assert first_name == names[0][0] and first is not None
    store.fs.rm_file(store.path(store.shard_dir(0), victim))
    seen = dict(reader)
    assert seen[victim] is None and all(data is not None for name, data in seen.items() if name != victim)
    assert list(seen) == names[0][1:]

    problems = []
    for concurrency in (1, READ_CONCURRENCY):
        summary, _ = _reduced(uri, concurrency)
        assert summary["shards"]["corrupt"] == [0] and summary["counts"]["completed"] == len(names[1])
        problems.append(summary["shards"]["problems"])
    assert problems[0] == problems[1] and any(victim in problem and "missing" in problem for problem in problems[0])


class _CountingStore(ShardedRunStore):
    """A real store that counts the object reads it has started."""

    def __init__(self, uri: str, read_concurrency: int) -> None:
        super().__init__(uri, read_concurrency=read_concurrency)
        self.started = 0
        self._lock = threading.Lock()

    def read_bytes(self, rel: str) -> bytes | None:
        with self._lock:
            self.started += 1
        return super().read_bytes(rel)


def test_the_fetch_window_stays_bounded(run_uri: tuple[str, dict[int, list[str]]]) -> None:
    """However slow the consumer, at most ``read_concurrency`` parts are fetched ahead of the
    one it is on: the bound holds after every part, and the window refills once one is taken."""
    uri, names = run_uri
    window = 8
    store = _CountingStore(uri, window)
    reader = store.read_parts(1, names[1])
    taken = 0
    for name, data in reader:
        assert name == names[1][taken] and data is not None
        taken += 1
        assert store.started <= taken + window, (taken, store.started)
        if taken == 1:
            deadline = time.monotonic() + 60
            while store.started < 1 + window and time.monotonic() < deadline:
                time.sleep(0.01)
            assert store.started == 1 + window  # the window refilled, and no further
    assert taken == len(names[1]) and store.started == len(names[1])  # every part read once


def test_the_read_concurrency_setting_is_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for bad in ("0", "-3", "many", "1000"):
        monkeypatch.setenv("SHOPSIMRL_STORE_READ_CONCURRENCY", bad)
        with pytest.raises(
            RunLocationError, match=rf"SHOPSIMRL_STORE_READ_CONCURRENCY must be a whole number from 1 to 256, got '{bad}'"
        ):
            ShardedRunStore(str(tmp_path / "r"))
    monkeypatch.setenv("SHOPSIMRL_STORE_READ_CONCURRENCY", "4")
    assert ShardedRunStore(str(tmp_path / "r")).read_concurrency == 4
