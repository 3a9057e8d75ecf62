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
from shopsimrl.schemas import sha256_hex
from shopsimrl.sharded.layout import (
    ShardedRunStore,
    ShardMap,
    encode_part,
    iter_part_records,
    load_frozen_plan,
    marker_part_problems,
    marker_problem,
    part_order,
)

__all__ = ["WaitResult", "reduce_run", "wait_for_markers"]

_SAMPLE = 20
_HELD_NAME = "held.jsonl.zst"
"""How held part bytes are decoded: the reducer holds every part compressed."""


@dataclass
class _ShardResult:
    index: int
    state: str = "uncommitted"
    """``committed``, ``uncommitted`` (no marker yet), ``corrupt`` (no marker verifies)."""
    jobs: int = 0
    completed: int = 0
    failed: int = 0
    parts: int = 0
    markers: int = 0
    ignored_markers: int = 0
    uncommitted_parts: int = 0
    temporary_objects: int = 0
    duplicates: int = 0
    episodes_rerun: int = 0
    superseded: int = 0
    unreadable_lines: int = 0
    not_in_shard: int = 0
    listed_parts: int = 0
    problems: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        row = {k: v for k, v in self.__dict__.items() if k not in ("problems", "foreign", "listed_parts")}
        if self.problems:
            row["problems"] = self.problems[:_SAMPLE]
        if self.foreign:
            row["foreign_objects"] = self.foreign[:_SAMPLE]
        return row


def _read_parts(store: ShardedRunStore, index: int, names: list[str]) -> dict[str, tuple[str, bytes] | None]:
    """Read each part once: its sha256 and its bytes as held until the shard is tallied
    (compressed: a plain part of an earlier version is compressed here), None when missing."""
    held: dict[str, tuple[str, bytes] | None] = {}
    # Fetched several at a time (the store's read window); hashed and held in part order.
    for name, data in store.read_parts(index, names):
        held[name] = None if data is None else (sha256_hex(data), data if name.endswith(".zst") else encode_part(data))
    return held


def _tally(
    parts: list[bytes], shard_ids: set[str], accumulator: SummaryAccumulator, result: _ShardResult, not_in_plan_sample: list[str]
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
                if len(not_in_plan_sample) < _SAMPLE:
                    not_in_plan_sample.append(episode_id)
                continue
            offer = picker.offer(record, None if record.completed else unfinished_view(record))
            if offer.verdict is Verdict.DUPLICATE:
                result.duplicates += 1
                rerun.add(episode_id)
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


@dataclass
class ShardParts:
    """The parts of one shard that count, each read once: those a verified commit marker lists
    (or, with ``include_uncommitted``, every listed part of a shard without a marker)."""

    result: _ShardResult
    parts: list[tuple[str, bytes]] = field(default_factory=list)
    """``(part name, compressed bytes)`` in part order."""


def read_shard_parts(
    store: ShardedRunStore, index: int, shard_map: ShardMap, plan_fp: str, *, include_uncommitted: bool = False
) -> ShardParts:
    """Verify a shard's commit markers and read the parts they commit (the reducer's and the
    research readers' one view of a shard's output)."""
    ids = shard_map.episode_ids[index]
    result = _ShardResult(index=index, jobs=len(ids))
    listing = store.list_shard(index)
    result.foreign = listing.foreign
    result.temporary_objects = len(listing.temporary)
    result.listed_parts = len(listing.parts)

    candidates: list[tuple[str, dict[str, Any]]] = []
    for name, marker in store.read_markers(index, listing.markers):
        problem = marker_problem(marker, index=index, plan_fingerprint=plan_fp, episode_ids_sha256=shard_map.ids_sha256(index))
        if problem is None:
            candidates.append((name, marker))
        else:
            result.problems.append(f"{name} {problem}")
    names: list[str]
    if candidates:
        names = sorted({part["name"] for _, marker in candidates for part in marker["parts"]}, key=part_order)
        held = _read_parts(store, index, names)
        actual = {name: None if part is None else part[0] for name, part in held.items()}
        verified = []
        for name, marker in candidates:
            problems = marker_part_problems(marker, actual)
            if problems:
                result.problems.extend(f"{name} does not verify, ignored: {problem}" for problem in problems)
            else:
                verified.append(marker)
        result.markers, result.ignored_markers = len(verified), len(candidates) - len(verified)
        if not verified:
            result.state = "corrupt"  # committed output that does not verify is not trusted at all
            return ShardParts(result)
        committed = {part["name"] for marker in verified for part in marker["parts"]}
        names = [name for name in names if name in committed]  # a marker was ignored: only what the others verify
        result.state = "committed"
        result.uncommitted_parts = sum(1 for name in listing.parts if name not in committed)
    elif listing.markers:
        result.state = "corrupt"
        return ShardParts(result)
    elif include_uncommitted:
        names = list(listing.parts)
        held = _read_parts(store, index, names)
    else:
        return ShardParts(result)
    result.parts = len(names)
    return ShardParts(result, [(name, part[1]) for name, part in ((name, held[name]) for name in names) if part is not None])


def _reduce_shard(
    store: ShardedRunStore,
    index: int,
    shard_map: ShardMap,
    plan_fp: str,
    accumulator: SummaryAccumulator,
    not_in_plan_sample: list[str],
    include_uncommitted: bool,
) -> _ShardResult:
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


def _why_missing(result: _ShardResult) -> str:
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
    accumulator = SummaryAccumulator(requested=shard_map.jobs)
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
        "foreign_objects": [f"shards/{r.index:05d}/{name}" for r in results for name in r.foreign][:_SAMPLE],
        "problems": [f"shard {r.index}: {p}" for r in results for p in r.problems][:_SAMPLE],
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
