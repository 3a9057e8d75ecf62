"""The run layout on a local dir and on real S3 servers: write-once objects, the frozen plan,
the shard map, parts, markers, retries of a failing store, and the reducer over hand-made parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shopsimrl.manifest import FingerprintMismatchError, ManifestError
from shopsimrl.reduce import reduce_run
from shopsimrl.schemas import EpisodeJob, fingerprint, redact_uri
from shopsimrl.shardstore import (
    RetryPolicy,
    ShardedRunStore,
    ShardMapError,
    StoreUnavailableError,
    marker_document,
    part_entry,
)

from .conftest import Backend
from .faultproxy import FaultPlan, FaultProxy

JOBS = [EpisodeJob(task_id=t, sample_id=0, seed=t * 7, split="val") for t in range(1, 11)]
PLAN = {"experiment": "x", "model": {"sampling": {"temperature": 0.0}}, "jobs": [j.to_dict() for j in JOBS]}


def trace(job: EpisodeJob, status: str = "completed", reward: float = 0.5, attempt: int = 1) -> dict:
    return {"schema_version": "shopsimrl-episode-v4", "episode_id": job.episode_id, "status": status, "attempt": attempt,
            "job": job.to_dict(), "final": {"done": status == "completed", "reward": reward} if status == "completed" else None,
            "steps": [], "failure_class": None if status == "completed" else "infrastructure",
            "error": None if status == "completed" else {"type": "ConnectError"}}


def lines(*records: dict) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def commit(store: ShardedRunStore, index: int, shard_map, parts: list[tuple[str, bytes, int]], completed: int) -> None:
    ids = shard_map.episode_ids[index]
    store.create_marker(index, marker_document(
        shard=index, plan_fingerprint=fingerprint(PLAN), completed=completed, failed=len(ids) - completed,
        episode_ids_sha256=fingerprint(ids), parts=[part_entry(n, d, r) for n, d, r in parts], writer="test"))


def test_manifest_is_create_only_and_mismatch_is_refused(backend: Backend) -> None:
    store = ShardedRunStore(backend.uri("m"))
    first = store.initialize(PLAN, {"concurrency": 4})
    again = ShardedRunStore(backend.uri("m")).initialize(PLAN, {"concurrency": 99})
    assert again["created_at"] == first["created_at"]  # the existing manifest is kept, not rewritten
    changed = {**PLAN, "model": {"sampling": {"temperature": 0.7}}}
    with pytest.raises(FingerprintMismatchError) as info:
        store.initialize(changed)
    assert "model.sampling.temperature: 0.0 -> 0.7" in str(info.value)
    # A create of different bytes never overwrites; an identical retry is recognised as ours.
    assert store.create("manifest.json", b"{}") is False
    data = store.read_bytes("manifest.json")
    assert data is not None and store.create("manifest.json", data) is True


def test_shard_map_is_frozen_round_robin(backend: Backend) -> None:
    store = ShardedRunStore(backend.uri("s"))
    fp = fingerprint(PLAN)
    shard_map = store.ensure_shard_map(JOBS, 3, fp)
    assert shard_map.episode_ids[1] == [JOBS[1].episode_id, JOBS[4].episode_id, JOBS[7].episode_id]
    assert store.ensure_shard_map(JOBS, 3, fp).episode_ids == shard_map.episode_ids
    with pytest.raises(ShardMapError, match="frozen with 3 shards, not 4"):
        store.ensure_shard_map(JOBS, 4, fp)
    raw = json.loads(store.read_bytes("shards.json"))
    assert raw["assignment"] == "round-robin-v1" and raw["count"] == 3 and raw["jobs"] == 10
    jobs_lines = store.read_bytes("jobs.jsonl").decode().splitlines()
    assert [json.loads(line)["shard"] for line in jobs_lines[:4]] == [0, 1, 2, 0]


def test_two_writers_never_overwrite_each_other(backend: Backend) -> None:
    store = ShardedRunStore(backend.uri("w"))
    a = store.write_part(0, 0, "aaaaaaaa", lines(trace(JOBS[0])))
    b = store.write_part(0, 0, "bbbbbbbb", lines(trace(JOBS[0], reward=0.9)))
    assert a != b and store.list_shard(0).parts == [a, b]
    # A writer that reuses a sequence number moves on instead of replacing its earlier part.
    c = store.write_part(0, 0, "aaaaaaaa", lines(trace(JOBS[3])))
    assert c == "part-00001-aaaaaaaa.jsonl"
    assert json.loads(store.read_part(0, a))["final"]["reward"] == 0.5


def test_reducer_dedupes_verifies_and_tolerates_junk(backend: Backend) -> None:
    store = ShardedRunStore(backend.uri("r"))
    store.initialize(PLAN)
    shard_map = store.ensure_shard_map(JOBS, 2, fingerprint(PLAN))
    ids0 = [j for j in JOBS if j.episode_id in shard_map.episode_ids[0]]
    ids1 = [j for j in JOBS if j.episode_id in shard_map.episode_ids[1]]
    # Shard 0: a failed attempt, then the completed retry; a second writer's duplicate;
    # a torn part and a foreign object.
    p1 = lines(trace(ids0[0], "failed"), *[trace(j) for j in ids0[1:3]])
    p2 = lines(trace(ids0[0], attempt=2), *[trace(j) for j in ids0[3:]])
    p3 = lines(trace(ids0[1], reward=0.0))  # duplicate of a completed episode
    torn = lines(trace(ids0[2]))[:40]
    n1 = store.write_part(0, 0, "11111111", p1)
    n2 = store.write_part(0, 1, "11111111", p2)
    n3 = store.write_part(0, 0, "22222222", p3)
    n4 = store.write_part(0, 5, "33333333", torn)
    store.create("shards/00000/notes.txt", b"left here by a human")
    commit(store, 0, shard_map, [(n1, p1, 3), (n2, p2, 3), (n3, p3, 1), (n4, torn, 0)], completed=5)
    # Shard 1: parts but no marker yet.
    store.write_part(1, 0, "44444444", lines(*[trace(j) for j in ids1]))

    summary = reduce_run(store)
    shards = summary["shards"]
    assert summary["counts"]["completed"] == 5 and summary["counts"]["missing"] == 5
    assert shards["committed"] == 1 and shards["uncommitted"] == [1] and shards["corrupt"] == []
    assert shards["duplicate_records"] == 1 and shards["episodes_rerun"] == 1
    assert shards["superseded_attempts"] == 1 and shards["unreadable_lines"] == 1
    assert shards["foreign_objects"] == ["shards/00000/notes.txt"]
    assert summary["primary"]["reward_mean"] == pytest.approx(0.5)  # the first completed record won
    assert json.loads(store.read_bytes("summary.json"))["counts"]["completed"] == 5

    partial = reduce_run(store, include_uncommitted=True, write=False)
    assert partial["counts"]["completed"] == 10 and partial["counts"]["missing"] == 0

    # Tampering with committed output: the shard is reported corrupt and not trusted.
    store.overwrite(f"shards/00000/{n2}", p2.replace(b'"reward": 0.5', b'"reward": 1.0'))
    tampered = reduce_run(store, write=False)
    assert tampered["shards"]["corrupt"] == [0] and tampered["counts"]["completed"] == 0
    assert any("sha256 differs" in p for p in tampered["shards"]["problems"])


def test_retries_ride_out_faults_and_a_dead_store_is_unavailable(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3fs")
    from .conftest import S3_TEST_ENV, _make_bucket

    for key, value in S3_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    bucket = _make_bucket(moto_endpoint, S3_TEST_ENV["AWS_ACCESS_KEY_ID"], S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    proxy = FaultProxy(moto_endpoint, FaultPlan(seed=7, burst_probability=0.06, burst_length=3, drop_probability=0.05, lost_response_probability=0.05))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    try:
        store = ShardedRunStore(f"s3://{bucket}/faulty", retry=RetryPolicy(base_delay_s=0.01, max_delay_s=0.05, budget_s=30, attempts=30))
        store.initialize(PLAN)
        names = [store.write_part(0, i, "abcdef01", lines(trace(JOBS[i]))) for i in range(8)]
        assert store.list_shard(0).parts == names
        assert all(json.loads(store.read_part(0, n))["episode_id"] == JOBS[i].episode_id for i, n in enumerate(names))
        assert sum(proxy.injected.values()) > 0, proxy.injected
    finally:
        proxy.stop()

    dead = FaultProxy(moto_endpoint, FaultPlan(always_503=True))
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead.start())
    try:
        store = ShardedRunStore(f"s3://{bucket}/dead", retry=RetryPolicy(attempts=3, base_delay_s=0.01, budget_s=5))
        with pytest.raises(StoreUnavailableError, match="still failing after 3 attempts"):
            store.write_part(0, 0, "abcdef01", b"{}\n")
    finally:
        dead.stop()


def test_uri_credentials_are_redacted() -> None:
    assert redact_uri("s3://AKIA:secret@bucket/x") == "s3://bucket/x"
    assert redact_uri("./runs/x") == "./runs/x"


def test_reducer_refuses_a_manifest_of_an_unknown_version(tmp_path: Path) -> None:
    store = ShardedRunStore(str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text('{\n  "schema_version": "shopsimrl-run-manifest-v9",\n  "plan_fingerprint": "' + "0" * 64 + '"\n}')
    with pytest.raises(ManifestError, match="unsupported schema_version"):
        store.read_manifest_identity()
