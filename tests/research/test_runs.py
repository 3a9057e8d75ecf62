"""The research tools' run reader: local, sharded on S3 (committed shards, no merged file) and v4."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.records import EpisodeTrace, dump_line, read_trace
from shopsimrl.storage.local import LocalRunStore
from shopsimrl.storage.reading import RunReadError, open_run
from tests.fakes import written

from .conftest import ResearchRuns
from .synthetic import sharded_copy, trace_line


@pytest.mark.slow
def test_local_and_sharded_runs_of_one_plan_read_the_same_episodes(research_runs: ResearchRuns, s3_env: dict[str, str]) -> None:
    local = open_run(research_runs.local)
    sharded = open_run(research_runs.sharded)
    assert local.kind == "local" and sharded.kind == "sharded"
    assert local.manifest is not None and sharded.manifest is not None
    assert local.manifest.plan_fingerprint == sharded.manifest.plan_fingerprint
    assert "testing-secret" not in json.dumps(sharded.identity)

    by_id = {record.episode_id: record for record in local.records()}
    sharded_by_id = {record.episode_id: record for record in sharded.records()}
    assert len(by_id) == research_runs.episodes and set(by_id) == set(sharded_by_id)
    assert set(by_id) == {job.episode_id for job in local.jobs or []}
    assert sharded.shard_states == {0: "committed", 1: "committed", 2: "committed", 3: "committed"}
    for episode_id, record in by_id.items():
        assert record.completed
        assert written(sharded_by_id[episode_id])["final"]["reward"] == written(record)["final"]["reward"]
        # One episode without reading the run again: a byte offset locally, a part on S3.
        assert local.record(episode_id) == record
        assert sharded.record(episode_id) == sharded_by_id[episode_id]
    assert {source.shard for source in sharded.index().values()} == {0, 1, 2, 3}


def test_the_winning_attempt_is_read_and_torn_lines_are_counted(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path / "run")
    failed = {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": "e1",
        "status": "failed",
        "job": {"task_id": 1, "sample_id": 0, "seed": 1, "split": "val"},
        "attempt": 1,
        "final": None,
    }
    won = {**failed, "status": "completed", "attempt": 2, "final": {"done": True, "reward": 0.5}}
    store.save_traces([read_trace(failed), read_trace(won)])
    with store.traces_path.open("ab") as handle:
        handle.write(b'{"episode_id": "e2", "sta')  # a torn last line
    run = open_run(store.run_dir)
    assert list(run.records()) == [read_trace(won)]
    assert run.unreadable_lines == 1 and run.index()["e1"].attempts == 2
    with pytest.raises(RunReadError, match="no episode 'e2'"):
        run.record("e2")


@pytest.mark.slow
def test_v4_traces_without_a_manifest(research_runs: ResearchRuns) -> None:
    run = open_run(research_runs.legacy)
    records = list(run.records())
    assert run.manifest is None and run.jobs is None and len(records) == 6
    assert run.identity["plan_fingerprint"] is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "not a run directory"),
        (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "is a file"),
    ],
)
def test_what_is_not_a_run_is_named(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RunReadError, match=message):
        open_run(make(tmp_path))


def test_a_bad_manifest_is_named(tmp_path: Path) -> None:
    (tmp_path / "traces.jsonl").write_text("")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(RunReadError, match=r"manifest\.json"):
        open_run(tmp_path)


@pytest.mark.slow
def test_all_records_flags_the_winner_among_every_attempt(
    tmp_path: Path, research_runs: ResearchRuns, s3_env: dict[str, str]
) -> None:
    store = LocalRunStore(tmp_path / "run")
    failed = {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": "e1",
        "status": "failed",
        "job": {"task_id": 1, "sample_id": 0, "seed": 1, "split": "val"},
        "attempt": 1,
        "final": None,
    }
    won = {**failed, "status": "completed", "attempt": 2, "final": {"done": True, "reward": 0.5}}
    again = {**won, "attempt": 3}
    store.save_traces([read_trace(record) for record in (failed, won, again)])
    run = open_run(store.run_dir)
    assert list(run.all_records()) == [(False, read_trace(failed)), (True, read_trace(won)), (False, read_trace(again))]

    sharded = open_run(research_runs.sharded)
    flagged = list(sharded.all_records())
    assert [record for is_winner, record in flagged if is_winner] == list(sharded.records())
    assert len(flagged) >= research_runs.episodes


def _local_plan_and_records(research_runs: ResearchRuns) -> tuple[dict[str, Any], dict[str, EpisodeTrace]]:
    manifest = json.loads((research_runs.local / "manifest.json").read_text(encoding="utf-8"))
    return manifest["plan"], {record.episode_id: record for record in open_run(research_runs.local).records()}


@pytest.mark.slow
def test_plain_parts_of_earlier_versions_are_read(research_runs: ResearchRuns, tmp_path: Path) -> None:
    plan, records = _local_plan_and_records(research_runs)
    sharded_copy(
        str(tmp_path / "plain"), plan, lambda episode_id: dump_line(records[episode_id]), 2, per_part=5, compressed=False
    )
    run = open_run(tmp_path / "plain")
    assert {source.name.endswith(".jsonl") for source in run.index().values()} == {True}
    assert {record.episode_id: record for record in run.records()} == records
    assert run.unreadable_lines == 0
    some = next(iter(records))
    assert open_run(tmp_path / "plain").record(some) == records[some]


@pytest.mark.slow
def test_winner_views_are_the_records_views_in_one_pass(
    research_runs: ResearchRuns, s3_env: dict[str, str], tmp_path: Path
) -> None:
    plan, records = _local_plan_and_records(research_runs)
    ids = sorted(records)
    retried, failed_twice = ids[0], ids[1]

    def attempts(episode_id: str) -> bytes:
        # A failed attempt before the completed one; two failed attempts, the later one winning.
        record = written(records[episode_id])
        failed = {**record, "status": "failed", "final": None, "failure_class": "infrastructure", "attempt": 1}
        if episode_id == retried:
            return trace_line(failed) + trace_line({**record, "attempt": 2})
        if episode_id == failed_twice:
            return trace_line(failed) + trace_line({**failed, "attempt": 2, "ended_at": "2099-01-01T00:00:00+00:00"})
        return trace_line(record)

    sharded_copy(str(tmp_path / "retried"), plan, attempts, 3, per_part=4)
    local_retried = tmp_path / "local-retried"
    local_retried.mkdir()
    (local_retried / "traces.jsonl").write_bytes(b"".join(attempts(episode_id) for episode_id in ids) + b'{"torn')

    def view(record: EpisodeTrace) -> tuple[str, str, int | None]:
        return record.episode_id, record.status, record.attempt

    for location in (research_runs.local, research_runs.sharded, research_runs.legacy, tmp_path / "retried", local_retried):
        viewed, streamed = open_run(location), open_run(location)
        assert viewed.winner_views(view) == [view(record) for record in streamed.records()], location
        assert viewed.index() == streamed.index() and viewed.unreadable_lines == streamed.unreadable_lines
        for episode_id, source in streamed.index().items():  # one episode found without an index: the same
            assert open_run(location).find(episode_id) == (streamed.record(episode_id), source)
        with pytest.raises(RunReadError, match="has no episode 'task-424242__sample-000'"):
            open_run(location).find("task-424242__sample-000")
    run = open_run(tmp_path / "retried")
    views = {episode_id: (status, attempt) for episode_id, status, attempt in run.winner_views(view)}
    assert views[retried] == ("completed", 2) and views[failed_twice] == ("failed", 2)
    assert run.index()[retried].attempts == 2 and run.record(retried).status == "completed"


def test_find_parses_every_line_for_an_id_json_may_escape(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path / "run")
    odd = {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": "épisode/1",
        "status": "completed",
        "job": {"task_id": 1, "sample_id": 0, "seed": 1, "split": "val"},
        "final": {"done": True},
    }
    store.save_traces([read_trace({**odd, "episode_id": "other"}), read_trace(odd)])
    (tmp_path / "run" / "traces.jsonl").write_text(
        (tmp_path / "run" / "traces.jsonl").read_text(encoding="utf-8").replace("épisode/1", "\\u00e9pisode\\/1"),
        encoding="utf-8",
    )
    record, source = open_run(tmp_path / "run").find("épisode/1")
    assert record == read_trace(odd) and source.attempts == 1 and source.position > 0
