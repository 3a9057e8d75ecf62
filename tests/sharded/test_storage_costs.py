"""What a sharded run costs in storage: compressed parts (and the plain ones of earlier runs),
torn parts, bytes read per byte stored on a real S3 server, status without reading parts, the
workers' heartbeats, and the frozen plan loaded without its job list."""

from __future__ import annotations

import hashlib
import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from shopsimrl.records import dump_line, read_trace
from shopsimrl.runner.reduce import reduce_run
from shopsimrl.runner.status import shard_status
from shopsimrl.schemas import EpisodeJob, canonical_json, fingerprint
from shopsimrl.storage.sharded import (
    PartWriter,
    ShardedRunStore,
    commit_shard,
    encode_part,
    iter_part_records,
    load_frozen_plan,
    scan_shard,
)

from .conftest import S3_TEST_ENV, Backend, Testbed, cli, worker_env, write_config
from .faultproxy import FaultPlan, FaultProxy

pytestmark = pytest.mark.slow

JOBS = [EpisodeJob(task_id=t, sample_id=0, seed=t * 7, split="val") for t in range(1, 9)]
PLAN = {"experiment": "costs", "jobs": [j.to_dict() for j in JOBS]}
PAGE = "搜索结果：第1页\n" + "".join(f"[{i}] 商品{i}：简约玻璃水杯 大容量 耐热 带盖 ￥{10 + i}.90\n" for i in range(40))


def trace(job: EpisodeJob, status: str = "completed", *, observation: str = PAGE) -> dict:
    done = status == "completed"
    steps = [
        {
            "step_index": k,
            "observation": observation,
            "model": {"latency_ms": 10.0 + k},
            "environment": {"reward": 0.0, "done": k == 5},
        }
        for k in range(6)
    ]
    return {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": job.episode_id,
        "status": status,
        "attempt": 1,
        "job": job.to_dict(),
        "steps": steps if done else [],
        "conversation": [{"role": "user", "content": observation}],
        "final": {"done": True, "reward": 0.5} if done else None,
        "failure_class": None if done else "infrastructure",
        "error": None if done else {"type": "ConnectError"},
    }


def lines(*records: dict) -> bytes:
    return b"".join(dump_line(r) for r in records)


def planned(uri: str, shards: int = 1) -> tuple[ShardedRunStore, list[list[str]]]:
    store = ShardedRunStore(uri)
    manifest = store.freeze_plan(PLAN)
    return store, store.ensure_shard_map(JOBS, shards, manifest.plan_fingerprint).episode_ids


# --------------------------------------------------------------------------- compressed parts


def test_parts_are_zstd_and_a_shard_mixing_plain_and_compressed_parts_reduces_whole(backend: Backend) -> None:
    store, (ids,) = planned(backend.uri("mixed"))
    jobs = [job for job in JOBS if job.episode_id in ids]
    # A plain part as an earlier version wrote it, then a compressed one as workers write now.
    old, old_bytes = store.write_part(0, 0, "0badc0de", lines(*[trace(j) for j in jobs[:3]]), compressed=False)
    new_lines = lines(*[trace(j) for j in jobs[3:]])
    new, new_bytes = store.write_part(0, 1, "1a2b3c4d", new_lines)
    assert old == "part-00000-0badc0de.jsonl" and new == "part-00001-1a2b3c4d.jsonl.zst"
    assert new_bytes == encode_part(new_lines) and len(new_bytes) * 4 <= len(new_lines)
    assert store.read_part(0, new) == new_bytes  # stored as compressed, checksummed as stored
    assert [r.episode_id for r in iter_part_records(new, new_bytes) if r is not None] == [j.episode_id for j in jobs[3:]]

    state = scan_shard(store, 0, set(ids))  # the worker's resume scan reads both kinds
    assert state.completed == set(ids) and state.next_seq == 2 and state.unreadable_lines == 0
    marker, completed = commit_shard(store, 0, ids, plan_fp=fingerprint(PLAN), writer="1a2b3c4d", state=state)
    assert completed == len(ids)
    listed = json.loads(store.read_bytes(f"shards/00000/{marker}"))["parts"]
    assert [(p["name"], p["records"]) for p in listed] == [(old, 3), (new, len(jobs) - 3)]
    assert listed[1]["sha256"] == hashlib.sha256(new_bytes).hexdigest() != hashlib.sha256(new_lines).hexdigest()
    summary = reduce_run(store, write=False)
    assert summary["complete"] and summary["counts"]["completed"] == len(ids) and summary["shards"]["unreadable_lines"] == 0
    assert summary["primary"]["reward_mean"] == 0.5 and old_bytes == lines(*[trace(j) for j in jobs[:3]])


def test_a_torn_compressed_part_keeps_the_lines_before_the_cut(backend: Backend) -> None:
    store, (ids,) = planned(backend.uri("torn"))
    jobs = [job for job in JOBS if job.episode_id in ids]
    rng = random.Random(11)
    # Observations that do not compress, so the frame spans several 128 KB zstd blocks and a cut
    # in the middle leaves whole blocks (and lines) before it.
    records = [trace(j, observation="".join(rng.choice("0123456789abcdef") for _ in range(150_000))) for j in jobs[:4]]
    whole = encode_part(lines(*records))
    store.create("shards/00000/part-00000-aaaaaaaa.jsonl.zst", whole[: len(whole) * 6 // 10])
    store.create("shards/00000/part-00001-bbbbbbbb.jsonl.zst", b"not a zstd frame\n")
    state = scan_shard(store, 0, set(ids))
    recovered = [j.episode_id for j in jobs[:4] if j.episode_id in state.completed]
    assert 1 <= len(recovered) < 4 and recovered == [j.episode_id for j in jobs[: len(recovered)]]
    assert state.unreadable_lines == 2  # the torn tail of one part, the whole of the other
    partial = reduce_run(store, include_uncommitted=True, write=False)
    assert partial["counts"]["completed"] == len(recovered) and partial["shards"]["unreadable_lines"] == 2


def test_jobs_jsonl_lines_are_the_canonical_json_of_each_job(tmp_path: Path) -> None:
    jobs = [
        EpisodeJob(task_id=t, sample_id=s, seed=t * 977 + s, split=split)
        for t in (0, 7, 123456)
        for s in (0, 3)
        for split in ("val", 'tëst"\\\n\x01\x7f\u2028😀')
    ]
    store = ShardedRunStore(str(tmp_path / "run"))
    store.freeze_plan({"experiment": "canon", "jobs": [j.to_dict() for j in jobs]})
    store.ensure_shard_map(jobs, 5, fingerprint({"experiment": "canon", "jobs": [j.to_dict() for j in jobs]}))
    expected = "".join(
        canonical_json({**j.to_dict(), "episode_id": j.episode_id, "shard": i % 5}) + "\n" for i, j in enumerate(jobs)
    )
    assert store.read_bytes("jobs.jsonl") == expected.encode("utf-8")


# --------------------------------------------------------------------------- reads per stored byte


@pytest.mark.s3
def test_a_run_and_its_reduce_read_each_stored_byte_at_most_once_on_s3(
    moto_endpoint: str, testbed: Testbed, tmp_path: Path
) -> None:
    """Every request goes through a counting proxy in front of moto: the workers never read a
    part (not after writing it, not at commit), the reducer reads each once, status none."""
    from .conftest import _make_bucket

    bucket = _make_bucket(moto_endpoint, S3_TEST_ENV["AWS_ACCESS_KEY_ID"], S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    proxy = FaultProxy(moto_endpoint, FaultPlan())
    endpoint = proxy.start()
    try:
        backend = Backend("s3", f"s3://{bucket}/runs", {**S3_TEST_ENV, "AWS_ENDPOINT_URL": endpoint})
        config = write_config(tmp_path, testbed, episodes=6)
        uri = backend.uri("costs")
        env = worker_env(backend, SHOPSIMRL_FLUSH_EPISODES="2")
        result = cli("run", str(config), "--shards", "2", "--run", uri, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        after_run = proxy.transferred.copy()
        status = cli("status", uri, env=env)
        assert status.returncode == 0 and "2/2 shards committed" in status.stdout, status.stderr[-2000:]
    finally:
        proxy.stop()

    def total(method: str, traffic=after_run, parts: bool | None = None) -> int:  # type: ignore[no-untyped-def]
        return sum(
            size
            for (m, key), size in traffic.items()
            if m == method and not key.endswith("?list") and (parts is None or ("/part-" in key) == parts)
        )

    part_keys = {key for (method, key) in after_run if method == "PUT" and "/part-" in key}
    assert part_keys and all(key.endswith(".jsonl.zst") for key in part_keys)
    # Each part was read exactly once, whole: by the reducer (so by no worker).
    assert all(after_run[("GET", key)] == after_run[("PUT", key)] for key in part_keys), after_run
    assert total("GET", parts=True) == total("PUT", parts=True) > 0
    stored, read = total("PUT"), total("GET")
    # The frozen plan (manifest.json, shards.json, jobs.jsonl) is read whole by every worker to
    # check it, by the reducer, and once after its create-only write: a fixed cost per worker
    # (docs/sharded_runs.md §2); every other object is read at most once per byte stored.
    plan = sum(
        size
        for (m, key), size in after_run.items()
        if m == "GET" and key.rsplit("/", 1)[-1] in ("manifest.json", "shards.json", "jobs.jsonl")
    )
    print(
        f"\n[storage] stored {stored} B ({total('PUT', parts=True)} B of parts), read {read} B ({plan} B of the frozen plan): "
        f"{read / stored:.2f} reads per stored byte, {(read - plan) / stored:.2f} without the plan"
    )
    assert read - plan <= stored
    # status read no part: only markers, progress objects and the plan.
    assert not any("/part-" in key and size for (method, key), size in (proxy.transferred - after_run).items() if method == "GET")
    store_env = {**S3_TEST_ENV, "AWS_ENDPOINT_URL": moto_endpoint}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in store_env.items():
            patch.setenv(name, value)
        store = ShardedRunStore(uri)
        assert all(store.list_shard(i).progress for i in range(2))  # one progress object per worker ...
        summary = json.loads(store.read_bytes("summary.json"))
        assert summary["shards"]["foreign_objects"] == []  # ... which is no foreign object


# --------------------------------------------------------------------------- status and heartbeats


class NoPartReads(ShardedRunStore):
    def read_part(self, index: int, name: str) -> bytes | None:
        raise AssertionError(f"status read part {name} of shard {index}")


def test_status_reads_progress_objects_never_parts_and_shows_a_stale_heartbeat(backend: Backend) -> None:
    uri = backend.uri("beat")
    store, shard_ids = planned(uri, shards=2)
    jobs = [job for job in JOBS if job.episode_id in shard_ids[0]]
    sink = PartWriter(
        store, 0, "5eed5eed", 0, flush_episodes=2, flush_seconds=60, plan_fingerprint=fingerprint(PLAN), heartbeat_seconds=30
    )
    sink.report_progress()  # as a worker does when it starts
    sink.save_traces([read_trace(trace(jobs[0]))])
    sink.save_traces([read_trace(trace(jobs[1], "failed"))])  # the second record fills the buffer: a part, then progress
    sink.save_traces([read_trace(trace(jobs[2]))])  # buffered, not yet in a part
    assert len(sink.written) == 1 and [(o.episode_id, o.completed) for o in sink.written[0].outcomes] == [
        (jobs[0].episode_id, True),
        (jobs[1].episode_id, False),
    ]
    store.write_part(1, 0, "01d01d00", lines(trace(JOBS[1])), compressed=False)  # a worker that writes no progress

    report = shard_status(NoPartReads(uri))
    running, old = report["shards"]
    assert running["state"] == "running" and running["completed"] == 1 and running["failed_attempts"] == 1
    assert running["parts"] == 1 and running["writers"] == 1 and running["heartbeat_age_s"] < 60 and not running.get("stale")
    assert old["state"] == "running?" and old["completed"] is None and old["parts"] == 1

    progress = json.loads(store.read_bytes("shards/00000/_PROGRESS-5eed5eed.json"))
    assert progress["parts_written"] == 1 and progress["records_written"] == 2 and progress["heartbeat_seconds"] == 30
    later = datetime.fromisoformat(progress["updated_at"]) + timedelta(minutes=12)
    stale = shard_status(NoPartReads(uri), now=later)["shards"][0]
    assert stale["state"] == "running?" and stale["stale"] and 715 <= stale["heartbeat_age_s"] <= 725

    # The command line: a worker that stopped 12 minutes ago without a word.
    store.write_progress(0, {**progress, "updated_at": (datetime.now(UTC) - timedelta(minutes=12)).isoformat()})
    shown = cli("status", uri, env=worker_env(backend))
    assert shown.returncode == 0, shown.stderr[-2000:]
    row = next(line for line in shown.stdout.splitlines() if line.strip().startswith("shard     0"))
    assert "running?" in row and "1/4" in row and "(no heartbeat for 12 min)" in row, shown.stdout
    assert "no progress object" in next(line for line in shown.stdout.splitlines() if line.strip().startswith("shard     1"))


def test_a_finished_interval_beats_again_from_the_flush_timer(tmp_path: Path) -> None:
    """The flush timer's call rewrites the progress object once a heartbeat interval passed, and
    not before."""
    store, _ = planned(str(tmp_path / "run"))
    sink = PartWriter(
        store, 0, "abcdabcd", 0, flush_episodes=10, flush_seconds=60, plan_fingerprint=fingerprint(PLAN), heartbeat_seconds=0.05
    )
    path = tmp_path / "run" / "shards" / "00000" / "_PROGRESS-abcdabcd.json"
    sink.flush_if_stale()
    first = path.read_bytes()
    sink.flush_if_stale()  # within the interval: nothing written
    assert path.read_bytes() == first
    deadline = datetime.now(UTC) + timedelta(seconds=30)
    while json.loads(path.read_bytes())["updated_at"] == json.loads(first)["updated_at"] and datetime.now(UTC) < deadline:
        sink.flush_if_stale()
    assert json.loads(path.read_bytes())["updated_at"] > json.loads(first)["updated_at"]


# --------------------------------------------------------------------------- the frozen plan


def test_reduce_loads_a_frozen_plan_without_parsing_its_job_list(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = planned(backend.uri("bound"), shards=3)
    raw = json.loads(store.read_bytes("shards.json"))
    assert raw["manifest_sha256"] == hashlib.sha256(store.read_bytes("manifest.json")).hexdigest()
    parsed: list[int] = []
    original = EpisodeJob.from_dict
    monkeypatch.setattr(EpisodeJob, "from_dict", classmethod(lambda cls, data: parsed.append(1) or original(data)))
    plan = load_frozen_plan(ShardedRunStore(backend.uri("bound")))
    assert plan.fingerprint == fingerprint(PLAN) and plan.shard_map.count == 3 and parsed == []
    assert plan.identity["plan"]["experiment"] == "costs" and "jobs" not in plan.identity["plan"]

    # A run frozen before shards.json recorded the manifest's sha256: the full checks, as before.
    raw.pop("manifest_sha256")
    store.overwrite("shards.json", json.dumps(raw, indent=2).encode())
    assert load_frozen_plan(ShardedRunStore(backend.uri("bound"))).fingerprint == fingerprint(PLAN)
    assert len(parsed) == len(JOBS)


def test_status_adds_up_the_processes_of_one_worker(tmp_path: Path) -> None:
    """A worker's event-loop processes (--processes) share its session: their completions add up
    on top of what the shard held when the worker started; a later worker's session does not."""
    uri = str(tmp_path / "run")
    store, (ids,) = planned(uri)
    jobs = [job for job in JOBS if job.episode_id in ids]
    resumed = {jobs[0].episode_id}
    for writer, job in (("1111aaaa", jobs[1]), ("2222bbbb", jobs[2])):
        sink = PartWriter(
            store,
            0,
            writer,
            1,
            flush_episodes=1,
            flush_seconds=60,
            plan_fingerprint=fingerprint(PLAN),
            resumed=resumed,
            session="0000ffff",
            heartbeat_seconds=30,
        )
        sink.save_traces([read_trace(trace(job))])
    row = shard_status(NoPartReads(uri))["shards"][0]
    assert row["completed"] == 3 and row["writers"] == 2
    # A later worker that found those 3 and completed 1 more: 4, not 3 + 4.
    later = PartWriter(
        store,
        0,
        "3333cccc",
        3,
        flush_episodes=1,
        flush_seconds=60,
        plan_fingerprint=fingerprint(PLAN),
        resumed={j.episode_id for j in jobs[:3]},
        heartbeat_seconds=30,
    )
    later.save_traces([read_trace(trace(jobs[3]))])
    assert shard_status(NoPartReads(uri))["shards"][0]["completed"] == 4
