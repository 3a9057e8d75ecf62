"""``shopsimrl status``: a run's progress, read from another process without disturbing it.

A sharded run per shard, without reading a trace part: committed shards are told by their
commit markers' counts; running ones by their writers' progress objects (state, heartbeat age,
completed episodes) and their lease journals (the leases each unfinished shard holds, and the
ShopSimulator they name).

A local run (:func:`local_status`) from its directory, without taking its lock: the manifest,
the ``progress.json`` its process rewrites every few seconds (counts, heartbeat, whether that
process is alive), the lines of ``traces.jsonl`` (counted, not parsed) and its lease journal.
Only a run without a usable progress file has its traces parsed for the counts.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shopsimrl.records import RunManifest
from shopsimrl.runner.lease_journal import DirectoryJournalStorage, ProcessIdentity, read_journals, shard_journal_storage
from shopsimrl.runner.progress import read_progress_file
from shopsimrl.schemas import episode_id_for
from shopsimrl.storage.local import LocalRunStore
from shopsimrl.storage.sharded import ShardedRunStore, ShardListing, load_frozen_plan

__all__ = ["is_local_run", "lease_status", "local_status", "progress_view", "shard_status"]


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
        markers = store.plan_markers(
            index, plan_fingerprint=plan_fp, episode_ids_sha256=shard_map.ids_sha256(index), names=listing.markers
        )
        if markers:
            # Progress from the markers' own counts (the reducer verifies the parts): the one
            # with the most completed episodes, then the most parts.
            best = max(markers, key=lambda m: (m.episodes.completed, len(m.parts)))
            row.update(
                state="committed",
                completed=best.episodes.completed,
                failed=best.episodes.failed,
                written_at=best.written_at,
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


# --------------------------------------------------------------------------- a local run


def is_local_run(location: str) -> bool:
    """A directory holding a local run (a manifest, no shard map)."""
    if "://" in location:
        return False
    path = Path(location)
    return (path / "manifest.json").is_file() and not (path / "shards.json").exists()


def _count_lines(path: Path) -> int:
    """Newline-terminated lines (a torn tail is not one), read in blocks: no JSON is parsed."""
    lines = 0
    try:
        with path.open("rb") as handle:
            while block := handle.read(1 << 20):
                lines += block.count(b"\n")
    except FileNotFoundError:
        return 0
    return lines


def local_status(run_dir: str | Path, *, now: datetime | None = None) -> dict[str, Any]:
    """The state and counts of a local run, whether a process runs it now or not.

    ``state``: ``running`` (its process is alive; on another host: its heartbeat is recent),
    ``running?`` (a process on another host, no heartbeat for three intervals), ``stopped`` (the
    process that ran it is gone without saying so: killed), ``interrupted``, ``finished`` (then
    ``summary.json`` has the numbers), ``not running`` / ``not started`` (no progress file).
    Raises ManifestError for a manifest that is not one."""
    store = LocalRunStore(run_dir)
    now = now or datetime.now(UTC)
    manifest = store.read_manifest()
    if manifest is None:
        raise FileNotFoundError(f"{store.manifest_path}: no such file (not a local run)")
    fingerprint = manifest.plan_fingerprint
    jobs = manifest.plan.get("jobs")
    job_count = len(jobs) if isinstance(jobs, list) else None
    report: dict[str, Any] = {
        "run": str(store.run_dir),
        "kind": "local",
        "plan_fingerprint": fingerprint,
        "jobs": job_count,
        "trace_lines": _count_lines(store.traces_path),
        "summary": store.summary_path.is_file(),
    }
    progress = read_progress_file(store.progress_path)
    if progress is not None and progress.get("plan_fingerprint") == fingerprint:
        report.update(progress_view(progress, now))
    else:
        report.update(_traces_view(store, manifest))
    journals = read_journals(DirectoryJournalStorage(store.run_dir / "leases"))
    report["leases_held"] = sum(j.leases for j in journals if j.alive is not False)
    stopped = sum(j.leases for j in journals if j.alive is False)
    if stopped:
        report["leases_left_by_stopped_processes"] = stopped
    report["environment_url"] = next((j.environment for j in journals if j.environment), None)
    return report


def progress_view(progress: dict[str, Any], now: datetime) -> dict[str, Any]:
    """A local run's state and counts from its ``progress.json`` (whether its process still runs)."""
    state = str(progress.get("state") or "running")
    age = _age_seconds(progress.get("updated_at"), now)
    interval = progress.get("heartbeat_seconds")
    process = ProcessIdentity.from_dict(progress.get("process"))
    here = ProcessIdentity.current()
    on_this_host = process is not None and (process.host, process.pid_namespace) == (here.host, here.pid_namespace)
    if state == "running":
        if on_this_host and process is not None:
            # Here the process itself answers; a late heartbeat (a loaded machine) is no sign.
            state = "running" if process.is_alive() else "stopped"
        elif age is not None and isinstance(interval, (int, float)) and age > _STALE_BEATS * interval:
            state = "running?"
    completed = _count(progress.get("completed"))
    failed = _count(progress.get("failed"))
    return {
        "state": state,
        "completed": _count(progress.get("completed_before")) + completed,
        "settled": _count(progress.get("settled_before")) + completed + failed,
        "invocation": {
            "started_at": progress.get("started_at"),
            "settled_before": _count(progress.get("settled_before")),
            "completed": completed,
            "failed": failed,
            "requeued": _count(progress.get("requeued")),
            "model_retries": _count(progress.get("model_retries")),
            "reward_mean": progress.get("reward_mean"),
        },
        "process": None if process is None else {"host": process.host, "pid": process.pid},
        "heartbeat_age_s": None if age is None else round(age, 1),
        "heartbeat_seconds": interval,
    }


def _traces_view(store: LocalRunStore, manifest: RunManifest) -> dict[str, Any]:
    """Counts from the traces themselves: a run without a progress file (never started here, or
    written by an earlier version). The one case that parses every line."""
    ids = {
        episode_id_for(job["task_id"], job["sample_id"])
        for job in manifest.plan.get("jobs") or []
        if isinstance(job, dict) and isinstance(job.get("task_id"), int) and isinstance(job.get("sample_id"), int)
    }
    index = store.load_index()
    tried = [state for episode_id, state in index.episodes.items() if episode_id in ids]
    return {
        "state": "finished" if store.summary_path.is_file() else ("not started" if not index.lines else "not running"),
        "completed": sum(1 for state in tried if state.completed),
        "settled": len(tried),
    }
