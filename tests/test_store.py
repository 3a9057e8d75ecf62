"""Local run directory: torn tails, garbage lines, fingerprint refusal with a diff, the lock."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shopsimrl.manifest import FingerprintMismatchError, ManifestError
from shopsimrl.store import LocalRunStore, RunLockedError


def trace(episode_id: str, status: str = "completed", reward: float = 1.0) -> dict:
    return {"schema_version": "shopsimrl-episode-v4", "episode_id": episode_id, "status": status,
            "final": {"done": status == "completed", "reward": reward}, "steps": []}


PLAN = {"experiment": "x", "model": {"model": "m", "sampling": {"temperature": 0.6}}, "jobs": [{"task_id": 1}]}


def test_torn_tail_and_garbage_are_skipped_and_sealed(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path / "run")
    store.save_trace(trace("task-000001__sample-000"))
    with store.traces_path.open("ab") as handle:  # a crash mid-write, cut inside a multi-byte character
        handle.write(json.dumps(trace("task-000002__sample-000"), ensure_ascii=False).encode()[:30] + "中".encode()[:2])
    index = store.load_index()
    assert index.is_complete("task-000001__sample-000") and "task-000002__sample-000" not in index.episodes
    assert index.bad_lines == 1
    store.save_trace(trace("task-000002__sample-000"))
    with store.traces_path.open("ab") as handle:
        handle.write(b"not json at all\n[1,2]\n\xff\xfe\n\n")
    index = store.load_index()
    assert index.is_complete("task-000002__sample-000") and index.bad_lines == 4
    assert store.traces_path.read_bytes().count(b"\n") == 7  # the torn fragment stays a line of its own


def test_latest_record_wins_and_attempts_count(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    store.save_trace(trace("e", "failed"))
    store.save_trace(trace("e", "completed", 0.5))
    store.save_trace(trace("f", "failed"))
    index = store.load_index()
    assert index.attempts("e") == 2 and index.is_complete("e") and not index.is_complete("f")
    latest = [(flag, r["status"]) for flag, r in store.iter_records(index) if r["episode_id"] == "e"]
    assert latest == [(False, "failed"), (True, "completed")]


def test_unserialisable_payload_is_repaired_not_fatal(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    record = trace("e")
    record["final"]["reward"] = math.nan
    record["final"]["odd"] = object()
    store.save_trace(record)
    (saved,) = [r for _, r in store.iter_records()]
    assert saved["final"]["reward"] is None and saved["serialization_repaired"] is True


def test_fingerprint_mismatch_names_the_keys(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    first = store.initialize(PLAN, {"concurrency": 4})
    again = store.initialize(PLAN, {"concurrency": 64})  # execution settings never block resume
    assert again["created_at"] == first["created_at"]
    changed = {**PLAN, "model": {"model": "m", "sampling": {"temperature": 0.7}}, "jobs": [{"task_id": 2}]}
    with pytest.raises(FingerprintMismatchError) as info:
        store.initialize(changed)
    message = str(info.value)
    assert "model.sampling.temperature: 0.6 -> 0.7" in message and "jobs: 1 jobs" in message


def test_edited_manifest_is_refused(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    store.initialize(PLAN)
    manifest = json.loads(store.manifest_path.read_text())
    manifest["plan"]["experiment"] = "edited"
    store.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="edited"):
        store.read_manifest()
    store.manifest_path.write_text('{"schema_version": "shopsimrl-run-manifest-v9"}')
    with pytest.raises(ManifestError, match="unsupported manifest schema_version"):
        store.read_manifest()


def test_summary_write_is_atomic_and_refuses_nan(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    store.write_summary({"a": 1})
    with pytest.raises(ValueError):
        store.write_summary({"a": math.nan})
    assert json.loads(store.summary_path.read_text()) == {"a": 1}
    assert not list(tmp_path.glob(".summary.json.*"))


def test_one_process_per_run_directory(tmp_path: Path) -> None:
    with LocalRunStore(tmp_path):
        with pytest.raises(RunLockedError):
            LocalRunStore(tmp_path).acquire()
    with LocalRunStore(tmp_path):
        pass


def test_completion_is_sticky_when_a_failed_record_follows(tmp_path: Path) -> None:
    # e.g. traces concatenated from two machines: a completed episode must never be rerun
    store = LocalRunStore(tmp_path)
    store.save_trace(trace("e", "completed", 0.5))
    store.save_trace(trace("e", "failed"))
    index = store.load_index()
    assert index.is_complete("e") and index.attempts("e") == 2
    winners = [r["status"] for flag, r in store.iter_records(index) if flag]
    assert winners == ["completed"]


def test_local_and_sharded_layouts_never_mix(tmp_path: Path) -> None:
    (tmp_path / "shards.json").write_text("{}")
    with pytest.raises(ManifestError, match="sharded run"):
        LocalRunStore(tmp_path).initialize(PLAN)
