"""``shopsimrl reduce`` and ``shopsimrl status``: shards → one ``summary.json``, and progress.

The reducer trusts committed output only: a shard counts when its ``_SUCCESS.json`` belongs to
this plan and shard map and every part it lists is present with the recorded sha256. Parts a
marker does not list (a second writer that finished after the commit) are reported, never read.

Memory does not grow with the number of traces. Shards are reduced one at a time in two
streaming passes over their parts: the first keeps only a small winner index per episode of
that shard (part and line number), the second feeds the winners to the streaming
:class:`~shopsimrl.metrics.SummaryAccumulator`. At most one part's bytes are held at once.

Winner per ``episode_id``: the first completed record in part order (sequence number, writer);
if none completed, the latest failed attempt (highest ``attempt``, then ``ended_at``). Further
completed records are duplicates (a replaced pod, a retried write): counted, not re-scored.
Earlier failed attempts are superseded attempts, as in a local run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shopsimrl.manifest import manifest_head, run_identity
from shopsimrl.metrics import SummaryAccumulator
from shopsimrl.schemas import fingerprint, is_completed, sha256_hex
from shopsimrl.shardstore import (
    MARKER_SCHEMA_VERSION,
    ShardedRunStore,
    ShardMap,
    ShardMapError,
    iter_part_records,
    scan_shard,
)

__all__ = ["RunNotPlannedError", "reduce_run", "shard_status", "wait_for_markers"]

_SAMPLE = 20
_IDENTITY_HEAD_BYTES = 65536
"""Bytes of manifest.json read for the summary's identity; the job list comes after it."""


class RunNotPlannedError(ValueError):
    """The location has no manifest.json or no shards.json (exit 2)."""


@dataclass
class _ShardResult:
    index: int
    state: str = "uncommitted"
    """``committed``, ``uncommitted`` (no marker yet), ``corrupt`` (marker does not verify)."""
    jobs: int = 0
    completed: int = 0
    failed: int = 0
    parts: int = 0
    uncommitted_parts: int = 0
    temporary_objects: int = 0
    duplicates: int = 0
    episodes_rerun: int = 0
    superseded: int = 0
    unreadable_lines: int = 0
    not_in_shard: int = 0
    problems: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        row = {k: v for k, v in self.__dict__.items() if k not in ("problems", "foreign")}
        if self.problems:
            row["problems"] = self.problems[:_SAMPLE]
        if self.foreign:
            row["foreign_objects"] = self.foreign[:_SAMPLE]
        return row


def _load_plan(store: ShardedRunStore) -> tuple[str, Any, ShardMap]:
    identity = store.read_manifest_identity()
    if identity is None:
        raise RunNotPlannedError(f"{store.display_uri} has no manifest.json; plan or start a worker first")
    shard_map = store.read_shard_map()
    if shard_map is None:
        raise RunNotPlannedError(f"{store.display_uri} has no shards.json; it is not a sharded run")
    plan_fp, experiment = identity
    if shard_map.plan_fingerprint != plan_fp:
        raise ShardMapError(f"{store.display_uri}/shards.json belongs to another plan than manifest.json")
    return plan_fp, experiment, shard_map


def _verified_marker(store: ShardedRunStore, index: int, plan_fp: str, shard_map: ShardMap, result: _ShardResult) -> dict[str, Any] | None:
    marker = store.read_marker(index)
    if marker is None:
        return None
    if marker.get("unreadable"):
        result.problems.append("_SUCCESS.json is not valid JSON")
    elif marker.get("schema_version") != MARKER_SCHEMA_VERSION:
        result.problems.append(f"_SUCCESS.json has unknown schema_version {marker.get('schema_version')!r}")
    elif marker.get("plan_fingerprint") != plan_fp:
        result.problems.append("_SUCCESS.json belongs to another plan fingerprint")
    elif marker.get("shard") != index or marker.get("episode_ids_sha256") != shard_map.ids_sha256(index):
        result.problems.append("_SUCCESS.json belongs to another shard or shard map")
    elif not isinstance(marker.get("parts"), list) or not all(
        isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("sha256"), str) for p in marker["parts"]
    ):
        result.problems.append("_SUCCESS.json has no valid 'parts' list")
    else:
        return marker
    result.state = "corrupt"
    return None


def _reduce_shard(
    store: ShardedRunStore,
    index: int,
    shard_map: ShardMap,
    plan_fp: str,
    accumulator: SummaryAccumulator,
    not_in_plan_sample: list[str],
    include_uncommitted: bool,
) -> _ShardResult:
    ids = shard_map.episode_ids[index]
    result = _ShardResult(index=index, jobs=len(ids))
    listing = store.list_shard(index)
    result.foreign = listing.foreign
    result.temporary_objects = len(listing.temporary)
    marker = _verified_marker(store, index, plan_fp, shard_map, result) if listing.marker else None
    expected: dict[str, str | None]
    if marker is not None:
        expected = {p["name"]: p["sha256"] for p in marker["parts"]}
        result.state = "committed"
        result.uncommitted_parts = sum(1 for name in listing.parts if name not in expected)
    elif include_uncommitted and result.state != "corrupt":
        expected = {name: None for name in listing.parts}
    else:
        result.failed = 0
        return result
    names = list(expected)
    result.parts = len(names)
    shard_ids = set(ids)

    # Pass 1: verify checksums, pick a winner location per episode.
    winners: dict[str, tuple[tuple[Any, ...], tuple[int, int]]] = {}
    completed_records: dict[str, int] = {}
    for part_index, name in enumerate(names):
        data = store.read_part(index, name)
        if data is None:
            result.problems.append(f"{name}: listed in _SUCCESS.json but missing")
            continue
        if expected[name] is not None and sha256_hex(data) != expected[name]:
            result.problems.append(f"{name}: sha256 differs from _SUCCESS.json")
            continue
        for line_index, record in enumerate(iter_part_records(data)):
            if record is None:
                result.unreadable_lines += 1
                continue
            episode_id = record["episode_id"]
            if episode_id not in shard_ids:
                result.not_in_shard += 1
                if len(not_in_plan_sample) < _SAMPLE:
                    not_in_plan_sample.append(episode_id)
                continue
            done = is_completed(record)
            if done:
                completed_records[episode_id] = completed_records.get(episode_id, 0) + 1
                rank: tuple[Any, ...] = (1, -part_index, -line_index)
            else:
                attempt = record.get("attempt")
                rank = (0, attempt if isinstance(attempt, int) else 0, str(record.get("ended_at") or ""), part_index, line_index)
            current = winners.get(episode_id)
            if current is None or rank > current[0]:
                winners[episode_id] = (rank, (part_index, line_index))
    if marker is not None and result.problems:
        result.state = "corrupt"  # committed output that does not verify is not trusted at all
        return result

    # Pass 2: stream again and feed the accumulator.
    for part_index, name in enumerate(names):
        data = store.read_part(index, name)
        if data is None or (expected[name] is not None and sha256_hex(data) != expected[name]):
            continue
        for line_index, record in enumerate(iter_part_records(data)):
            if record is None or record["episode_id"] not in shard_ids:
                continue
            winner = winners[record["episode_id"]]
            if winner[1] == (part_index, line_index):
                accumulator.add(record)
                if is_completed(record):
                    result.completed += 1
                else:
                    result.failed += 1
            elif is_completed(record):
                result.duplicates += 1
            else:
                result.superseded += 1
                accumulator.note_superseded_attempt(record)
    result.episodes_rerun = sum(1 for count in completed_records.values() if count > 1)
    return result


def reduce_run(store: ShardedRunStore, *, include_uncommitted: bool = False, write: bool = True) -> dict[str, Any]:
    """Merge the shards into the summary (with a ``shards`` report block) and write summary.json."""
    plan_fp, _, shard_map = _load_plan(store)
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
    summary["run"] = run_identity(_identity_manifest(store), uri=store.display_uri)
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
    if write:
        store.write_summary(summary)
    return summary


def _identity_manifest(store: ShardedRunStore) -> dict[str, Any] | None:
    """The manifest's keys before the job list, from a bounded head read (whole file as fallback)."""
    path = store.path("manifest.json")

    def head() -> bytes | None:
        try:
            return bytes(store.fs.cat_file(path, start=0, end=_IDENTITY_HEAD_BYTES))
        except FileNotFoundError:
            return None

    data = store.retry.call(f"read manifest.json in {store.display_uri}", head)
    parsed = manifest_head(data) if data else None
    return parsed if parsed is not None else store.read_manifest()


def wait_for_markers(store: ShardedRunStore, *, timeout: float, interval: float = 5.0) -> list[int]:
    """Poll until every shard has a marker; returns the indices still without one at the end."""
    _, _, shard_map = _load_plan(store)
    deadline = time.monotonic() + timeout
    pending = list(range(shard_map.count))
    while True:
        pending = [i for i in pending if not store.list_shard(i).marker]
        if not pending or time.monotonic() + interval > deadline:
            return pending
        time.sleep(interval)


def shard_status(store: ShardedRunStore) -> dict[str, Any]:
    """Per-shard progress from markers (committed shards) and parts (running ones)."""
    plan_fp, _, shard_map = _load_plan(store)
    rows = []
    for index in range(shard_map.count):
        ids = shard_map.episode_ids[index]
        listing = store.list_shard(index)
        row: dict[str, Any] = {"shard": index, "jobs": len(ids), "parts": len(listing.parts)}
        marker = store.read_marker(index) if listing.marker else None
        if marker and marker.get("plan_fingerprint") == plan_fp and marker.get("episode_ids_sha256") == fingerprint(ids):
            episodes = marker.get("episodes") or {}
            row.update(state="committed", completed=episodes.get("completed"), failed=episodes.get("failed"), written_at=marker.get("written_at"))
        else:
            state = scan_shard(store, index, set(ids))
            row.update(
                state="running" if listing.parts else "pending",
                completed=len(state.completed),
                attempted=len(state.attempts),
                unreadable_lines=state.unreadable_lines,
            )
            if marker is not None:
                row["state"] = "corrupt-marker"
        if listing.foreign:
            row["foreign_objects"] = len(listing.foreign)
        rows.append(row)
    completed = sum(int(r.get("completed") or 0) for r in rows)
    return {
        "run": store.display_uri,
        "plan_fingerprint": plan_fp,
        "jobs": shard_map.jobs,
        "completed": completed,
        "committed_shards": sum(r["state"] == "committed" for r in rows),
        "shards": rows,
    }
