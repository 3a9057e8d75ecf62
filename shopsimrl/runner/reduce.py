"""``shopsimrl reduce``: the committed shards of a sharded run → one ``summary.json``.

The reducer trusts committed output only: a shard counts when at least one of its commit
markers (``_SUCCESS.json``, ``_SUCCESS-<writer>.json``) belongs to this plan and shard map and
lists only parts that are present with the recorded sha256. The shard's committed parts are the
union of the parts of every such marker, so the outcome does not depend on the order in which
markers were written. Parts no verified marker lists (a second writer that finished after the
commit) are reported, never read; a marker that does not verify is reported and ignored.

Every stored byte is read once. Shards are reduced one at a time: each part is read and hashed
(for the markers) and held compressed, as stored (a plain part of an earlier version is
compressed in memory); once the shard's markers are verified, one pass over its committed
parts parses each record once and feeds the winners to the streaming
:class:`~shopsimrl.metrics.SummaryAccumulator`. Held per shard: its compressed parts, the ids
of its completed episodes and a small view of each unfinished attempt still waiting for a
later one, so memory follows the largest shard's stored bytes, not the run.

Winner per ``episode_id``: the rule of :mod:`shopsimrl.records.winner`, shared with the local run
store, over the parts in part order (sequence number, writer): the first completed record; if
none completed, the latest attempt (``attempt``, then ``ended_at``). Further completed records
are duplicates (a replaced pod, a retried write): counted, not re-scored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shopsimrl.manifest import run_identity
from shopsimrl.metrics import SummaryAccumulator, unfinished_view
from shopsimrl.records import EpisodeTrace
from shopsimrl.records.winner import Verdict, WinnerPicker
from shopsimrl.storage.sharded import (
    REPORT_SAMPLE,
    ShardedRunStore,
    ShardMap,
    ShardResult,
    iter_part_records,
    load_frozen_plan,
    read_shard_parts,
)

__all__ = ["WaitResult", "reduce_run", "wait_for_markers"]

_HELD_NAME = "held.jsonl.zst"
"""How held part bytes are decoded: the reducer holds every part compressed."""


def _tally(
    parts: list[bytes], shard_ids: set[str], accumulator: SummaryAccumulator, result: ShardResult, not_in_plan_sample: list[str]
) -> None:
    """One pass over the committed parts, in part order, through the winner rule of
    :mod:`shopsimrl.records.winner`: a completed winner is counted at once; an unfinished attempt waits
    (as a small view) until a completed record or a later attempt supersedes it; those still
    waiting at the end win."""
    # Items: a completed record is counted at once and holds nothing (None); an unfinished one
    # holds its small view, the only thing a reducer keeps per episode.
    picker: WinnerPicker[EpisodeTrace | None] = WinnerPicker()
    rerun: set[str] = set()
    for data in parts:
        for record in iter_part_records(_HELD_NAME, data):
            if record is None:
                result.unreadable_lines += 1
                continue
            episode_id = record.episode_id
            if episode_id not in shard_ids:
                result.not_in_shard += 1
                if len(not_in_plan_sample) < REPORT_SAMPLE:
                    not_in_plan_sample.append(episode_id)
                continue
            offer = picker.offer(record, None if record.completed else unfinished_view(record))
            if offer.verdict is Verdict.DUPLICATE:
                result.duplicates += 1
                rerun.add(episode_id)
                accumulator.note_duplicate(record)
            elif offer.verdict is Verdict.COMPLETED:
                accumulator.add(record)
                result.completed += 1
            if offer.loser is not None:
                result.superseded += 1
                accumulator.note_superseded_attempt(offer.loser)
    for view in picker.unfinished():
        assert view is not None
        accumulator.add(view)
        result.failed += 1
    result.episodes_rerun = len(rerun)


def _reduce_shard(
    store: ShardedRunStore,
    index: int,
    shard_map: ShardMap,
    plan_fp: str,
    accumulator: SummaryAccumulator,
    not_in_plan_sample: list[str],
    include_uncommitted: bool,
) -> ShardResult:
    shard = read_shard_parts(store, index, shard_map, plan_fp, include_uncommitted=include_uncommitted)
    if shard.result.state == "committed" or (include_uncommitted and shard.result.state == "uncommitted"):
        _tally(
            [data for _, data in shard.parts],
            set(shard_map.episode_ids[index]),
            accumulator,
            shard.result,
            not_in_plan_sample,
        )
    return shard.result


def _why_missing(result: ShardResult) -> str:
    if result.state == "corrupt":
        return "no commit marker verifies: " + (result.problems[0] if result.problems else "unknown")
    if result.listed_parts:
        return f"no commit marker; {result.listed_parts} parts written: the worker did not finish (still running, crashed or interrupted)"
    return (
        "no commit marker and no parts: the worker never wrote an episode (not started, or it failed before, e.g. in wait-ready)"
    )


def reduce_run(
    store: ShardedRunStore,
    *,
    include_uncommitted: bool = False,
    write: bool = True,
    incomplete_reason: str | None = None,
    missing_why: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """Merge the shards into the summary (with a ``shards`` report block) and write summary.json.

    A summary that lacks shards says so: ``complete`` false and ``incomplete`` naming every
    missing shard and why (``incomplete_reason``: why the reducer stopped waiting, if it did;
    ``missing_why``: what the scheduler knows about a shard, put before what the store shows)."""
    plan = load_frozen_plan(store)
    plan_fp, shard_map = plan.fingerprint, plan.shard_map
    accumulator = SummaryAccumulator(requested=shard_map.jobs, execution=plan.execution())
    not_in_plan_sample: list[str] = []
    results = [
        _reduce_shard(store, i, shard_map, plan_fp, accumulator, not_in_plan_sample, include_uncommitted)
        for i in range(shard_map.count)
    ]
    summary = accumulator.result()
    counts = summary.setdefault("counts", {})
    completed = sum(r.completed for r in results)
    failed = sum(r.failed for r in results)
    counts["missing"] = max(0, shard_map.jobs - completed - failed)
    counts["not_in_plan"] = counts.get("not_in_plan", 0) + sum(r.not_in_shard for r in results)
    if not_in_plan_sample:
        counts["not_in_plan_ids_sample"] = not_in_plan_sample
    counts["unreadable_lines"] = sum(r.unreadable_lines for r in results)
    summary["run"] = run_identity(plan.identity, uri=store.display_uri)
    summary["shards"] = {
        "count": shard_map.count,
        "assignment": shard_map.assignment,
        "committed": sum(r.state == "committed" for r in results),
        "uncommitted": [r.index for r in results if r.state == "uncommitted"],
        "corrupt": [r.index for r in results if r.state == "corrupt"],
        "with_failures": [r.index for r in results if r.failed],
        "include_uncommitted": include_uncommitted,
        "coverage": completed / shard_map.jobs if shard_map.jobs else 0.0,
        "parts_read": sum(r.parts for r in results),
        "duplicate_records": sum(r.duplicates for r in results),
        "episodes_rerun": sum(r.episodes_rerun for r in results),
        "superseded_attempts": sum(r.superseded for r in results),
        "uncommitted_parts": sum(r.uncommitted_parts for r in results),
        "temporary_objects": sum(r.temporary_objects for r in results),
        "unreadable_lines": counts["unreadable_lines"],
        "foreign_objects": [f"shards/{r.index:05d}/{name}" for r in results for name in r.foreign][:REPORT_SAMPLE],
        "problems": [f"shard {r.index}: {p}" for r in results for p in r.problems][:REPORT_SAMPLE],
        "per_shard": [r.row() for r in results],
    }
    missing = [r for r in results if r.state != "committed"]
    summary["complete"] = not missing
    if missing:
        summary["incomplete"] = {
            "reason": incomplete_reason or "not every shard has a verified commit marker",
            "missing_shards": [
                {
                    "shard": r.index,
                    "state": r.state,
                    "why": "; ".join(filter(None, [(missing_why or {}).get(r.index), _why_missing(r)])),
                }
                for r in missing
            ],
        }
    if write:
        store.write_summary(summary)
    return summary


@dataclass
class WaitResult:
    pending: list[int]
    """Shards still without a commit marker when the wait ended."""
    reason: str | None = None
    """Why the wait ended with shards pending: the timeout, or what ``give_up`` said."""
    why: dict[int, str] = field(default_factory=dict)
    """Per pending shard, what is known about it (e.g. its index failed in the worker Job)."""


GiveUp = Callable[[list[int]], tuple[str, dict[int, str]] | None]


def wait_for_markers(
    store: ShardedRunStore, *, timeout: float, interval: float = 5.0, give_up: GiveUp | None = None
) -> WaitResult:
    """Poll until every shard has a marker, the timeout passes, or ``give_up`` (asked with the
    pending shards after every poll) returns a reason and per-shard notes: those shards will
    never commit (their Job indexes failed for good)."""
    shard_map = load_frozen_plan(store).shard_map
    deadline = time.monotonic() + timeout
    pending = list(range(shard_map.count))
    while True:
        pending = [i for i in pending if not store.list_shard(i).marker]
        if not pending:
            return WaitResult(pending)
        verdict = give_up(pending) if give_up is not None else None
        if verdict is not None:
            return WaitResult(pending, verdict[0], verdict[1])
        if time.monotonic() + interval > deadline:
            return WaitResult(
                pending, f"the reducer stopped waiting after {timeout:g} s (--timeout) with {len(pending)} shards uncommitted"
            )
        time.sleep(interval)
