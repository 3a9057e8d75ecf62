"""The run layout on a local dir and on real S3 servers: write-once objects, the frozen plan,
the shard map, parts, markers, retries of a failing store, and the reducer over hand-made parts."""

from __future__ import annotations

import errno
import json
import re
import threading
from pathlib import Path

import pytest

from shopsimrl.manifest import FingerprintMismatchError, ManifestError
from shopsimrl.records import ShardMarker, read_trace, to_plain
from shopsimrl.runner.reduce import reduce_run
from shopsimrl.runner.status import shard_status
from shopsimrl.schemas import EpisodeJob, fingerprint, redact_uri
from shopsimrl.storage.objectstore import RetryPolicy, StoreUnavailableError, is_create_conflict
from shopsimrl.storage.sharded import (
    ShardedRunStore,
    ShardMapError,
    WrittenPart,
    commit_shard,
    iter_part_records,
    marker_document,
    part_entry,
    record_outcome,
)

from .conftest import Backend, S3Server
from .faultproxy import FaultPlan, FaultProxy, Scripted

pytestmark = pytest.mark.slow

JOBS = [EpisodeJob(task_id=t, sample_id=0, seed=t * 7, split="val") for t in range(1, 11)]
PLAN = {"experiment": "x", "model": {"sampling": {"temperature": 0.0}}, "jobs": [j.to_dict() for j in JOBS]}
FAST_RETRY = RetryPolicy(base_delay_s=0.01, max_delay_s=0.05, budget_s=30, attempts=30)


def trace(job: EpisodeJob, status: str = "completed", reward: float = 0.5, attempt: int = 1) -> dict:
    return {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": job.episode_id,
        "status": status,
        "attempt": attempt,
        "job": job.to_dict(),
        "final": {"done": status == "completed", "reward": reward} if status == "completed" else None,
        "steps": [],
        "failure_class": None if status == "completed" else "infrastructure",
        "error": None if status == "completed" else {"type": "ConnectError"},
    }


def lines(*records: dict) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def write(store: ShardedRunStore, index: int, seq: int, writer: str, *records: dict) -> WrittenPart:
    """A part as a worker writes it (compressed), with what the worker knows of it."""
    name, stored = store.write_part(index, seq, writer, lines(*records))
    return WrittenPart(part_entry(name, stored, len(records)), tuple(record_outcome(read_trace(r)) for r in records))


def records_of(store: ShardedRunStore, index: int, name: str) -> list[dict]:
    return [to_plain(r) for r in iter_part_records(name, store.read_part(index, name) or b"") if r is not None]


def commit(store: ShardedRunStore, index: int, shard_map, parts: list[tuple[str, bytes, int]], completed: int) -> None:
    ids = shard_map.episode_ids[index]
    store.create_marker(
        index,
        marker_document(
            shard=index,
            plan_fingerprint=fingerprint(PLAN),
            completed=completed,
            failed=len(ids) - completed,
            episode_ids_sha256=fingerprint(ids),
            parts=[part_entry(n, d, r) for n, d, r in parts],
            writer="test",
        ),
    )


def test_manifest_is_create_only_and_mismatch_is_refused(backend: Backend) -> None:
    store = ShardedRunStore(backend.uri("m"))
    first = store.freeze_plan(PLAN, {"concurrency": 4})
    again = ShardedRunStore(backend.uri("m")).freeze_plan(PLAN, {"concurrency": 99})
    assert again.created_at == first.created_at  # the existing manifest is kept, not rewritten
    changed = {**PLAN, "model": {"sampling": {"temperature": 0.7}}}
    with pytest.raises(FingerprintMismatchError) as info:
        store.freeze_plan(changed)
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
    a, _ = store.write_part(0, 0, "aaaaaaaa", lines(trace(JOBS[0])))
    b, _ = store.write_part(0, 0, "bbbbbbbb", lines(trace(JOBS[0], reward=0.9)))
    assert a != b and store.list_shard(0).parts == [a, b]
    # A writer that reuses a sequence number moves on instead of replacing its earlier part.
    c, _ = store.write_part(0, 0, "aaaaaaaa", lines(trace(JOBS[3])))
    assert c == "part-00001-aaaaaaaa.jsonl.zst"
    assert records_of(store, 0, a)[0]["final"]["reward"] == 0.5


def test_reducer_dedupes_verifies_and_tolerates_junk(backend: Backend) -> None:
    store = ShardedRunStore(backend.uri("r"))
    store.freeze_plan(PLAN)
    shard_map = store.ensure_shard_map(JOBS, 2, fingerprint(PLAN))
    ids0 = [j for j in JOBS if j.episode_id in shard_map.episode_ids[0]]
    ids1 = [j for j in JOBS if j.episode_id in shard_map.episode_ids[1]]
    # Shard 0: a failed attempt, then the completed retry; a second writer's duplicate;
    # a torn part and a foreign object.
    p1 = lines(trace(ids0[0], "failed"), *[trace(j) for j in ids0[1:3]])
    p2 = lines(trace(ids0[0], attempt=2), *[trace(j) for j in ids0[3:]])
    p3 = lines(trace(ids0[1], reward=0.0))  # duplicate of a completed episode
    torn = lines(trace(ids0[2]))[:40]
    n1, s1 = store.write_part(0, 0, "11111111", p1)
    n2, s2 = store.write_part(0, 1, "11111111", p2, compressed=False)  # a part of an earlier version
    n3, s3 = store.write_part(0, 0, "22222222", p3)
    n4, s4 = store.write_part(0, 5, "33333333", torn, compressed=False)
    store.create("shards/00000/notes.txt", b"left here by a human")
    commit(store, 0, shard_map, [(n1, s1, 3), (n2, s2, 3), (n3, s3, 1), (n4, s4, 0)], completed=5)
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
    proxy = FaultProxy(
        moto_endpoint,
        FaultPlan(seed=7, burst_probability=0.06, burst_length=3, drop_probability=0.05, lost_response_probability=0.05),
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    try:
        store = ShardedRunStore(
            f"s3://{bucket}/faulty", retry=RetryPolicy(base_delay_s=0.01, max_delay_s=0.05, budget_s=30, attempts=30)
        )
        store.freeze_plan(PLAN)
        names = [store.write_part(0, i, "abcdef01", lines(trace(JOBS[i])))[0] for i in range(8)]
        assert store.list_shard(0).parts == names
        assert all(records_of(store, 0, n)[0]["episode_id"] == JOBS[i].episode_id for i, n in enumerate(names))
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
    (tmp_path / "run" / "manifest.json").write_text(
        '{\n  "schema_version": "shopsimrl-run-manifest-v9",\n  "plan_fingerprint": "' + "0" * 64 + '"\n}'
    )
    with pytest.raises(ManifestError, match="unsupported manifest schema_version"):
        reduce_run(store)


# --------------------------------------------------------------------------- create-only answers


def test_each_server_answers_a_conflicting_create_and_every_answer_means_exists(s3_server: S3Server) -> None:
    store = ShardedRunStore(f"s3://{s3_server.bucket}/conflict")
    assert store.create("a.json", b"first") is True
    with pytest.raises(OSError) as info:
        store.fs.pipe_file(store.path("a.json"), b"second", mode="create")
    answer = info.value
    error = answer.__cause__.response  # type: ignore[union-attr]
    assert error["Error"]["Code"] == "PreconditionFailed" and error["ResponseMetadata"]["HTTPStatusCode"] == 412
    if s3_server.kind == "seaweedfs":
        # SeaweedFS leaves out <Condition>, so s3fs cannot tell this from any other 412.
        assert type(answer) is OSError and answer.errno == errno.EINVAL and "Condition" not in error["Error"]
    else:
        assert isinstance(answer, FileExistsError) and error["Error"]["Condition"] == "If-None-Match"
    assert is_create_conflict(answer)
    assert store.create("a.json", b"second") is False  # another object is there
    assert store.create("a.json", b"first") is True  # our own, from a retried write
    assert store.read_bytes("a.json") == b"first"


def test_a_lost_put_response_is_not_an_error(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each create-only object once: the PUT lands, its answer is lost, the retry meets the object."""
    lost = [
        Scripted("PUT", rf"/{re.escape(name)}$", "lost_response")
        for name in ("manifest.json", "jobs.jsonl", "shards.json", "part-00000-abcdef01.jsonl.zst", "_SUCCESS.json")
    ]
    proxy = FaultProxy(s3_server.endpoint, FaultPlan(script=lost))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    try:
        store = ShardedRunStore(f"s3://{s3_server.bucket}/lost", retry=FAST_RETRY)
        store.freeze_plan(PLAN)
        shard_map = store.ensure_shard_map(JOBS, 2, fingerprint(PLAN))
        ids = shard_map.episode_ids[0]
        part = write(store, 0, 0, "abcdef01", *[trace(job) for job in JOBS if job.episode_id in ids])
        assert part.entry["name"] == "part-00000-abcdef01.jsonl.zst"  # not moved on to 00001
        marker, completed = commit_shard(store, 0, ids, plan_fp=fingerprint(PLAN), writer="abcdef01", written=[part])
    finally:
        proxy.stop()
    assert all(entry.fired for entry in lost) and proxy.injected["lost_response"] == len(lost)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    listing = ShardedRunStore(f"s3://{s3_server.bucket}/lost").list_shard(0)
    assert (
        marker == "_SUCCESS.json" and listing.markers == ["_SUCCESS.json"] and listing.parts == ["part-00000-abcdef01.jsonl.zst"]
    )
    assert completed == len(ids)


def test_a_409_conditional_conflict_means_ask_again(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS answers 409 ConditionalRequestConflict while another conditional PUT of the key is in
    flight; the key may or may not exist afterwards, so the answer is read from the store."""
    store = ShardedRunStore(f"s3://{s3_server.bucket}/busy", retry=FAST_RETRY)
    assert store.create("taken.json", b"theirs") is True
    script = [Scripted("PUT", r"/free\.json$", "409_conflict"), Scripted("PUT", r"/taken\.json$", "409_conflict")]
    proxy = FaultProxy(s3_server.endpoint, FaultPlan(script=script))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    try:
        busy = ShardedRunStore(f"s3://{s3_server.bucket}/busy", retry=FAST_RETRY)
        assert busy.create("free.json", b"ours") is True  # the other write never landed: ours does
        assert busy.create("taken.json", b"ours") is False  # the other write landed first
    finally:
        proxy.stop()
    assert proxy.injected["409_conflict"] == 2
    assert store.read_bytes("free.json") == b"ours" and store.read_bytes("taken.json") == b"theirs"


# --------------------------------------------------------------------------- commit markers


class TurnGate:
    """Holds every committer at its marker write until all have arrived (so every read of every
    committer is done), then lets them write one at a time in ``order``."""

    def __init__(self, order: list[str]) -> None:
        self.order = list(order)
        self._arrived: set[str] = set()
        self._done: set[str] = set()
        self._cond = threading.Condition()

    def arrive(self, label: str) -> None:
        with self._cond:
            self._arrived.add(label)
            self._cond.notify_all()
            turn = self.order.index(label)
            if not self._cond.wait_for(
                lambda: self._arrived >= set(self.order) and set(self.order[:turn]) <= self._done, timeout=60
            ):
                raise TimeoutError(f"committer {label} never got its turn")

    def leave(self, label: str) -> None:
        with self._cond:
            self._done.add(label)
            self._cond.notify_all()

    def wait_arrived(self, label: str) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: label in self._arrived, timeout=60)


class GatedStore(ShardedRunStore):
    """A real store whose marker writes wait for their turn at a :class:`TurnGate`."""

    def __init__(self, uri: str, label: str, gate: TurnGate) -> None:
        super().__init__(uri)
        self.label, self.gate = label, gate

    def create_marker(self, index: int, marker: ShardMarker) -> str:
        self.gate.arrive(self.label)
        try:
            return super().create_marker(index, marker)
        finally:
            self.gate.leave(self.label)


class LaggingStore(ShardedRunStore):
    """A real store whose listings do not show ``hidden`` parts yet (an eventually consistent
    listing, a paginated listing cut short)."""

    def __init__(self, uri: str, hidden: set[str]) -> None:
        super().__init__(uri)
        self.hidden = hidden

    def list_shard(self, index: int):  # type: ignore[no-untyped-def]
        listing = super().list_shard(index)
        listing.parts = [name for name in listing.parts if name not in self.hidden]
        return listing


def _one_shard_run(uri: str) -> tuple[ShardedRunStore, list[str], list[EpisodeJob]]:
    store = ShardedRunStore(uri)
    store.freeze_plan(PLAN)
    ids = store.ensure_shard_map(JOBS, 1, fingerprint(PLAN)).episode_ids[0]
    return store, ids, [job for job in JOBS if job.episode_id in ids]


@pytest.mark.parametrize("order", [["newer", "older"], ["older", "newer"]])
def test_concurrent_committers_end_with_the_same_commit_whatever_the_write_order(backend: Backend, order: list[str]) -> None:
    uri = backend.uri("race")
    store, ids, jobs = _one_shard_run(uri)
    plan_fp = fingerprint(PLAN)
    # A first commit with failures: 5 of 10 completed.
    first = write(store, 0, 0, "11111111", *[trace(j) for j in jobs[:5]], *[trace(j, "failed") for j in jobs[5:]])
    assert commit_shard(store, 0, ids, plan_fp=plan_fp, writer="11111111", written=[first]) == ("_SUCCESS.json", 5)
    # Two retries of the failed episodes on the same shard (a replaced pod and its replacement):
    # "older" has read the shard before "newer" wrote its part, so its snapshot has less.
    gate = TurnGate(order)
    older_part = write(store, 0, 1, "22222222", *[trace(j, attempt=2) for j in jobs[5:7]])
    results: dict[str, tuple[str, int]] = {}

    def commit(label: str, writer: str, written: list[WrittenPart]) -> None:
        results[label] = commit_shard(GatedStore(uri, label, gate), 0, ids, plan_fp=plan_fp, writer=writer, written=written)

    older = threading.Thread(target=commit, args=("older", "22222222", [older_part]))
    older.start()
    gate.wait_arrived("older")  # its scan is over: everything it will list is in its document
    newer_part = write(store, 0, 2, "33333333", *[trace(j, attempt=2) for j in jobs[5:]])
    newer = threading.Thread(target=commit, args=("newer", "33333333", [newer_part]))
    newer.start()
    older.join(90)
    newer.join(90)
    assert results["older"][1] == 7 and results["newer"][1] == 10
    assert sorted(store.list_shard(0).markers) == ["_SUCCESS-22222222.json", "_SUCCESS-33333333.json", "_SUCCESS.json"]

    summary = reduce_run(store, write=False)
    assert summary["counts"]["completed"] == 10 and summary["shards"]["committed"] == 1 and summary["complete"]
    assert summary["shards"]["per_shard"][0]["markers"] == 3 and summary["shards"]["uncommitted_parts"] == 0
    assert shard_status(store)["shards"][0]["completed"] == 10


def test_the_marker_lists_the_parts_the_writer_wrote_even_when_a_listing_lags(backend: Backend) -> None:
    uri = backend.uri("lag")
    store, ids, jobs = _one_shard_run(uri)
    earlier, _ = store.write_part(0, 0, "11111111", lines(*[trace(j) for j in jobs[:5]]))
    ours = write(store, 0, 1, "22222222", *[trace(j) for j in jobs[5:]])
    lagging = LaggingStore(uri, hidden={ours.entry["name"]})
    assert lagging.list_shard(0).parts == [earlier]  # the lag is in force
    marker, completed = commit_shard(lagging, 0, ids, plan_fp=fingerprint(PLAN), writer="22222222", written=[ours])
    assert completed == 10
    listed = [p["name"] for p in json.loads(store.read_bytes(f"shards/00000/{marker}"))["parts"]]
    assert listed == [earlier, ours.entry["name"]]
    assert reduce_run(store, write=False)["counts"]["completed"] == 10


def test_a_marker_that_does_not_verify_is_ignored_beside_one_that_does(backend: Backend) -> None:
    store, ids, jobs = _one_shard_run(backend.uri("heal"))
    p1 = lines(*[trace(j) for j in jobs[:5]])
    p2 = lines(*[trace(j) for j in jobs[5:]])
    n1, s1 = store.write_part(0, 0, "11111111", p1)
    n2, s2 = store.write_part(0, 1, "11111111", p2)
    bad = marker_document(
        shard=0,
        plan_fingerprint=fingerprint(PLAN),
        completed=10,
        failed=0,
        episode_ids_sha256=fingerprint(ids),
        parts=[{**part_entry(n1, s1, 5), "sha256": "0" * 64}, part_entry(n2, s2, 5)],
        writer="11111111",
    )
    assert store.create_marker(0, bad) == "_SUCCESS.json"
    alone = reduce_run(store, write=False)
    assert alone["shards"]["corrupt"] == [0] and alone["counts"]["completed"] == 0 and not alone["complete"]
    assert "does not verify" in alone["incomplete"]["missing_shards"][0]["why"]

    good = marker_document(
        shard=0,
        plan_fingerprint=fingerprint(PLAN),
        completed=5,
        failed=5,
        episode_ids_sha256=fingerprint(ids),
        parts=[part_entry(n2, s2, 5)],
        writer="22222222",
    )
    assert store.create_marker(0, good) == "_SUCCESS-22222222.json"
    healed = reduce_run(store, write=False)
    row = healed["shards"]["per_shard"][0]
    assert healed["shards"]["committed"] == 1 and row["markers"] == 1 and row["ignored_markers"] == 1
    # Only what a verified marker lists counts: n1 is known to nobody trustworthy.
    assert healed["counts"]["completed"] == 5 and row["uncommitted_parts"] == 1
    assert any("_SUCCESS.json does not verify, ignored" in p for p in healed["shards"]["problems"])
