"""The winner rule (shopsimrl.records.winner), once, and that both run stores apply it; the line codec."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.episode import new_trace
from shopsimrl.records import EpisodeTrace, dump_line, parse_trace_line, read_trace, to_plain
from shopsimrl.records.winner import Verdict, WinnerPicker
from shopsimrl.runner.reduce import reduce_run
from shopsimrl.schemas import EpisodeJob, fingerprint, json_bytes, parse_json, parse_json_exact
from shopsimrl.storage.local import LocalRunStore
from shopsimrl.storage.sharded import ShardedRunStore, commit_shard


def record(
    episode_id: str, status: str, *, attempt: int | None = None, ended_at: str | None = None, error: str = ""
) -> EpisodeTrace:
    rec: dict[str, Any] = {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": episode_id,
        "job": {"task_id": 1, "sample_id": 0, "seed": 0, "split": "val"},
        "status": status,
        "final": {"done": True, "reward": 1.0} if status == "completed" else None,
        "ended_at": ended_at,
        "error": {"type": error} if error else None,
        "failure_class": None if status == "completed" else "infrastructure",
        "steps": [],
    }
    if attempt is not None:
        rec["attempt"] = attempt
    return read_trace(rec)


def winners(records: list[EpisodeTrace]) -> tuple[dict[str, str], list[str], list[Verdict]]:
    """(episode → tag of its winner, tags of superseded attempts, verdicts) with each record tagged by its position."""
    picker: WinnerPicker[str] = WinnerPicker()
    losers, verdicts = [], []
    for position, rec in enumerate(records):
        offer = picker.offer(rec, f"#{position}")
        verdicts.append(offer.verdict)
        if offer.loser is not None:
            losers.append(offer.loser)
    found = {rec.episode_id: picker.winner(rec.episode_id) for rec in records}
    return {k: v for k, v in found.items() if v is not None}, losers, verdicts


@pytest.mark.parametrize(
    ("records", "winner", "superseded"),
    [
        # a completed record beats every unfinished attempt, even one with a higher attempt number
        (
            [record("e", "failed", attempt=1), record("e", "completed", attempt=2), record("e", "failed", attempt=3)],
            "#1",
            ["#0", "#2"],
        ),
        # the first completed record in reading order wins; the next one is a duplicate, not superseded
        ([record("e", "completed", attempt=2), record("e", "completed", attempt=1)], "#0", []),
        # no completed record: the highest attempt, whatever the reading order
        ([record("e", "failed", attempt=3), record("e", "failed", attempt=2)], "#0", ["#1"]),
        # same attempt (two writers of one shard): the later ended_at
        (
            [
                record("e", "failed", attempt=1, ended_at="2026-01-01T00:00:02+00:00"),
                record("e", "failed", attempt=1, ended_at="2026-01-01T00:00:01+00:00"),
            ],
            "#0",
            ["#1"],
        ),
        # records of the earlier implementation (no attempt, no ended_at): the one read later
        ([record("e", "failed"), record("e", "failed")], "#1", ["#0"]),
    ],
)
def test_the_winner_rule(records: list[dict[str, Any]], winner: str, superseded: list[str]) -> None:
    found, losers, _ = winners(records)
    assert found == {"e": winner} and sorted(losers) == sorted(superseded)


def test_verdicts_and_the_order_of_unfinished_winners() -> None:
    picker: WinnerPicker[str] = WinnerPicker()
    offers = [
        picker.offer(rec, tag)
        for rec, tag in [
            (record("b", "failed", attempt=1), "b1"),
            (record("a", "failed", attempt=1), "a1"),
            (record("c", "completed"), "c1"),
            (record("c", "completed"), "c2"),
            (record("b", "failed", attempt=2), "b2"),
        ]
    ]
    assert [o.verdict for o in offers] == [
        Verdict.UNFINISHED,
        Verdict.UNFINISHED,
        Verdict.COMPLETED,
        Verdict.DUPLICATE,
        Verdict.UNFINISHED,
    ]
    assert offers[4].loser == "b1" and picker.completed == {"c": "c1"}
    assert picker.unfinished() == ["a1", "b2"]  # in the reading order of the winning records


def test_both_run_stores_pick_the_same_winners(tmp_path: Path) -> None:
    # Attempt 3 read before attempt 2: reading order alone (the local store before this rule)
    # picks attempt 2; the attempt number picks 3. Both stores must say 3.
    jobs = [EpisodeJob(task_id=t, sample_id=0, seed=t, split="val") for t in (1, 2)]
    first, second = (job.episode_id for job in jobs)
    records = [
        record(first, "failed", attempt=3, error="Third"),
        record(first, "failed", attempt=2, error="Second"),
        record(second, "failed", attempt=1, error="Early"),
        record(second, "completed", attempt=2),
        record(second, "completed", attempt=3),
    ]
    local = LocalRunStore(tmp_path / "local")
    for rec in records:
        local.save_traces([rec])
    index = local.load_index()
    local_winners = {
        (r.episode_id, r.status, r.error.type if r.error else None, r.attempt) for won, r in local.iter_records(index) if won
    }
    assert local_winners == {(first, "failed", "Third", 3), (second, "completed", None, 2)}

    plan = {"experiment": "x", "jobs": [job.to_dict() for job in jobs]}
    sharded = ShardedRunStore(str(tmp_path / "sharded"))
    sharded.freeze_plan(plan)
    ids = sharded.ensure_shard_map(jobs, 1, fingerprint(plan)).episode_ids[0]
    sharded.write_part(0, 0, "abcdef01", b"".join(dump_line(rec) for rec in records))
    commit_shard(sharded, 0, ids, plan_fp=fingerprint(plan), writer="abcdef01")
    summary = reduce_run(sharded, write=False)
    assert summary["errors"] == {"Third": 1}
    assert summary["counts"]["completed"] == 1 and summary["counts"]["failed"] == 1
    assert summary["shards"]["duplicate_records"] == 1 and summary["shards"]["superseded_attempts"] == 2


def test_the_skeleton_holds_every_v4_key_of_an_unstarted_episode() -> None:
    skeleton = to_plain(new_trace(EpisodeJob(task_id=7, sample_id=1, seed=3, split="val")))
    assert list(skeleton) == list(EpisodeTrace.ALWAYS_WRITTEN)
    assert skeleton["status"] == "failed" and skeleton["final"] is None and skeleton["episode_id"] == "task-000007__sample-001"


def test_lone_surrogates_are_stored_exactly_as_json_escapes() -> None:
    """A model's text that is not valid Unicode (orjson refuses it) is written as ``\\uXXXX``
    escapes: a valid UTF-8 line that reads back to the same record, not a repaired one."""
    raw = to_plain(record("task-000001__sample-000", "completed"))
    raw["steps"] = [{"step_index": 1, "model": {"content": "台灯\ud800", "raw_response": {"\udfff": ["x\udc80y", "😀"]}}}]
    line = dump_line(read_trace(raw))
    line.decode("utf-8")  # valid UTF-8
    assert b'"\\udfff":["x\\udc80y","\xf0\x9f\x98\x80"]' in line and b"\xe5\x8f\xb0\xe7\x81\xaf\\ud800" in line
    back = parse_trace_line(line)
    assert back is not None and to_plain(back) == raw and back.serialization_repaired is None
    # NaN and a lone surrogate together: the NaN is repaired (null), the text still kept exactly
    raw["final"]["reward"] = math.nan
    again = parse_trace_line(dump_line(read_trace(raw)))
    assert again is not None and again.serialization_repaired is True and again.final is not None
    assert again.final.get("reward", "absent") is None and to_plain(again)["steps"] == raw["steps"]


def test_files_this_package_writes_read_back_strictly() -> None:
    assert parse_json_exact(json_bytes({"q": "\ud800"})) == {"q": "\ud800"}
    with pytest.raises(ValueError, match="NaN is not JSON"):
        parse_json_exact(b'{"reward": NaN}')
    assert parse_json(b'{"reward": NaN, "q": "\\ud83d\\ude00", "r": "\xed\xa0\xbd\xed\xb8\x80"}') == {
        "reward": None,
        "q": "😀",
        "r": "😀",  # the raw bytes of a pair: one character too
    }
