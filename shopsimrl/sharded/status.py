"""``shopsimrl status``: a sharded run's progress per shard, without reading a trace part.

Committed shards are told by their commit markers' counts; running ones by their writers'
progress objects (state, heartbeat age, completed episodes) and their lease journals (the
leases each unfinished shard holds, and the ShopSimulator they name).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from shopsimrl.lease_journal import read_journals, shard_journal_storage
from shopsimrl.sharded.layout import ShardedRunStore, ShardListing, load_frozen_plan, marker_problem

__all__ = ["lease_status", "shard_status"]


def _claimed(marker: dict[str, Any], key: str) -> int:
    episodes = marker.get("episodes")
    value = episodes.get(key) if isinstance(episodes, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


_STALE_BEATS = 3
"""A running shard whose newest heartbeat is older than this many of its intervals is shown as
possibly stopped."""


def _age_seconds(stamp: Any, now: datetime) -> float | None:
    try:
        when = datetime.fromisoformat(str(stamp))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (now - when).total_seconds())


def shard_status(store: ShardedRunStore, *, now: datetime | None = None) -> dict[str, Any]:
    """Per-shard progress from commit markers (committed shards) and the writers' progress
    objects (running ones). Never reads a part: a status call costs a listing and a few small
    objects per shard, whatever the size of the run."""
    plan = load_frozen_plan(store)
    plan_fp, shard_map = plan.fingerprint, plan.shard_map
    now = now or datetime.now(UTC)
    rows = []
    for index in range(shard_map.count):
        ids = shard_map.episode_ids[index]
        listing = store.list_shard(index)
        row: dict[str, Any] = {"shard": index, "jobs": len(ids), "parts": len(listing.parts)}
        markers = [
            marker
            for _, marker in store.read_markers(index, listing.markers)
            if marker_problem(marker, index=index, plan_fingerprint=plan_fp, episode_ids_sha256=shard_map.ids_sha256(index))
            is None
        ]
        if markers:
            # Progress from the markers' own counts (the reducer verifies the parts): the one
            # with the most completed episodes, then the most parts.
            best = max(markers, key=lambda m: (_claimed(m, "completed"), len(m["parts"])))
            row.update(
                state="committed",
                completed=_claimed(best, "completed"),
                failed=_claimed(best, "failed"),
                written_at=best.get("written_at"),
                markers=len(markers),
            )
        else:
            row.update(_running_row(store, index, listing, plan_fp, now))
            if listing.markers:
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


def _running_row(store: ShardedRunStore, index: int, listing: ShardListing, plan_fp: str, now: datetime) -> dict[str, Any]:
    """An uncommitted shard as its writers' progress objects tell it: the newest one's state and
    heartbeat age, and the completed episodes of the session that has seen the most."""
    progress = [p for p in store.read_progress(index, listing.progress) if p.get("plan_fingerprint") == plan_fp]
    if not progress:
        # No progress object: nothing started, or parts of a worker that wrote none (an earlier version).
        return {"state": "running?" if listing.parts else "pending", "completed": None}
    newest = max(progress, key=lambda p: str(p.get("updated_at")))
    age = _age_seconds(newest.get("updated_at"), now)
    interval = newest.get("heartbeat_seconds")
    # A worker's processes share a session and the episodes completed when it started; a later
    # worker (a restarted pod) starts from what earlier ones saved: the best session counts.
    sessions: dict[str, list[dict[str, Any]]] = {}
    for p in progress:
        sessions.setdefault(str(p.get("session") or p.get("writer")), []).append(p)
    row: dict[str, Any] = {
        "state": str(newest.get("state") or "running"),
        "completed": max(
            max(_count(p.get("resumed")) for p in members) + sum(_count(p.get("completed")) for p in members)
            for members in sessions.values()
        ),
        "failed_attempts": sum(_count(p.get("failed_attempts")) for p in progress),
        "writers": len(progress),
        "heartbeat_age_s": None if age is None else round(age, 1),
        "heartbeat_seconds": interval,
    }
    if row["state"] == "running" and age is not None and isinstance(interval, (int, float)) and age > _STALE_BEATS * interval:
        row["state"] = "running?"
        row["stale"] = True
    return row


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def lease_status(store: ShardedRunStore, report: dict[str, Any]) -> str | None:
    """Add to ``report`` (:func:`shard_status`'s) the leases each unfinished shard's journals
    hold; return the shop URL they name."""
    url = None
    for row in report["shards"]:
        if row["state"] == "committed":
            continue
        journals = read_journals(shard_journal_storage(store, row["shard"]))
        live = [j for j in journals if j.alive is not False]
        row["leases_held"] = sum(j.leases for j in live)
        stopped = sum(j.leases for j in journals if j.alive is False)
        if stopped:
            row["leases_left_by_stopped_workers"] = stopped
        url = url or next((j.environment for j in journals if j.environment), None)
    return url
