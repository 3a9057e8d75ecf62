"""``shopsimrl runs``: every run under a folder or an ``s3://`` prefix, with its identity and its
headline, grouped by job list: a leaderboard in one command.

Reading stays cheap, whatever the size of the runs: a listing per folder down to the runs, then
per run its manifest's head (the first bytes of ``manifest.json``, one ranged read; the whole
file only when its head does not parse, as for the earlier implementation's manifests), its
``summary.json``, a local run's ``progress.json``, and, for a sharded run without a summary, what
``status`` reads (shard map, commit markers, progress objects). Never a trace: neither
``traces.jsonl`` nor a part.

A folder is a run when it holds ``shards.json`` (sharded), ``manifest.json`` or ``traces.jsonl``
(local; without a manifest, traces of the earlier implementation); the search does not go below
a run. A run that cannot be read is listed with its error; the listing goes on.

Runs of one **job list** are grouped: those planned from the same split (name and task-id digest),
sampling seed, sample size, repeats and pipeline version, which fix the job list (so
``shopsimrl compare`` pairs them episode by episode). The key comes from the manifest's head,
not the job list itself, so grouping reads no more than the listing does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from shopsimrl.manifest import manifest_head, validate_manifest
from shopsimrl.records import MANIFEST_SCHEMA_VERSIONS, read_summary, to_plain
from shopsimrl.runner.progress import LOCAL_PROGRESS_SCHEMA
from shopsimrl.runner.status import progress_view, shard_status
from shopsimrl.schemas import fingerprint
from shopsimrl.storage.sharded import ShardedRunStore

__all__ = [
    "COLUMNS",
    "HEAD_BYTES",
    "RunEntry",
    "find_runs",
    "group_runs",
    "list_runs",
    "read_entry",
    "sort_runs",
]

HEAD_BYTES = 65536
"""Bytes of manifest.json read for a run's identity (the job list comes after them)."""
MAX_DEPTH = 8
"""How many folders deep the search goes by default."""

# The errors of reading one run: unreadable or foreign files, a store that failed or refused
# (ManifestError, RecordFormatError, RunLocationError, ShardMapError, RunNotPlannedError and
# pydantic's ValidationError are ValueErrors; StoreUnavailableError is a RuntimeError).
_READ_ERRORS = (ValueError, OSError, RuntimeError)


@dataclass
class RunEntry:
    """One run as ``runs`` lists it; every field but ``location``, ``name`` and ``kind`` may be null."""

    location: str
    """Where the run is (credentials removed)."""
    name: str
    """Its path under the listed location (``.``: the location itself)."""
    kind: str
    """``local``, ``sharded``, ``legacy`` (traces without a manifest) or ``unknown`` (unreadable)."""
    state: str = "unknown"
    """``finished``; ``partial`` (a summary without every shard); ``running``, ``running?``,
    ``stopped``, ``interrupted`` (a local run's process); ``in progress``, ``committed``
    (a sharded run without a summary: some or all shards committed); ``not started``;
    ``unreadable``."""
    detail: str | None = None
    error: str | None = None
    experiment: str | None = None
    model: str | None = None
    model_id: str | None = None
    checkpoint: str | None = None
    split: str | None = None
    fingerprint: str | None = None
    created: str | None = None
    """When the run was created (its manifest's ``created_at``)."""
    summary_created: str | None = None
    job_list: str | None = None
    """The job-list key runs are grouped by (12 hex digits), null without a readable plan."""
    job_list_label: str | None = None
    requested: int | None = None
    completed: int | None = None
    failed: int | None = None
    coverage: float | None = None
    score: float | None = None
    """Intent-to-treat reward × 100 (every planned episode with an outcome, a failure as 0)."""
    score_ci95: list[float] | None = None
    success: float | None = None
    """Intent-to-treat success rate."""
    success_ci95: list[float] | None = None
    tokens: int | None = None
    """Total tokens of every attempt (of completed episodes only in summaries older than that key)."""
    tokens_scope: str | None = None
    """``all attempts`` or ``completed episodes``: what ``tokens`` sums."""
    cost: float | None = None
    """The summary's ``cost.money.total``."""
    currency: str | None = None
    accelerator_hours: float | None = None
    active_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- columns and order


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    descending: bool = False
    """The default order: scores best first, everything else ascending."""
    show: Callable[[RunEntry], str] = field(default=lambda entry: "")


def _text(value: Any) -> str:
    return "–" if value is None else str(value)


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _score(entry: RunEntry) -> str:
    if entry.score is None:
        return "–"
    ci = entry.score_ci95
    return f"{entry.score:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _money(entry: RunEntry) -> str:
    if entry.cost is None:
        return "–"
    amount = f"{entry.cost:.2f}" if abs(entry.cost) >= 1 else f"{entry.cost:.4f}"
    return f"{amount} {entry.currency or ''}".strip()


def _created(value: str | None) -> str:
    if value is None:
        return "–"
    try:
        return datetime.fromisoformat(value).astimezone(UTC).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return value


def _hours(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if value >= 0.001 or value == 0 else f"{value:.1g}"


def _tokens(entry: RunEntry) -> str:
    if entry.tokens is None:
        return "–"
    return f"{entry.tokens:,}" + ("*" if entry.tokens_scope == "completed episodes" else "")


COLUMNS: tuple[Column, ...] = (
    Column("name", "run", show=lambda e: e.name),
    Column("experiment", "experiment", show=lambda e: _text(e.experiment)),
    Column("model", "model", show=lambda e: _text(e.model)),
    Column("checkpoint", "checkpoint", show=lambda e: _text(e.checkpoint)),
    Column("split", "split", show=lambda e: _text(e.split)),
    Column("fingerprint", "plan", show=lambda e: _text(e.fingerprint[:12] if e.fingerprint else None)),
    Column("created", "created (UTC)", show=lambda e: _created(e.created)),
    Column("state", "state", show=lambda e: e.state),
    Column("score", "score ITT [95% CI]", descending=True, show=_score),
    Column("success", "success ITT", descending=True, show=lambda e: _percent(e.success)),
    Column("coverage", "coverage", descending=True, show=lambda e: _percent(e.coverage)),
    Column("completed", "done", show=lambda e: _text(e.completed)),
    Column("failed", "failed", show=lambda e: _text(e.failed)),
    Column("requested", "planned", show=lambda e: _text(e.requested)),
    Column("tokens", "tokens", show=_tokens),
    Column("cost", "cost", show=_money),
    Column("accelerator_hours", "GPU h", show=lambda e: _hours(e.accelerator_hours)),
    Column("kind", "kind", show=lambda e: e.kind),
)
"""The table's columns, in order; each one's key is a ``--sort`` choice."""
COLUMN_KEYS = tuple(column.key for column in COLUMNS)


def sort_runs(entries: Sequence[RunEntry], key: str, *, descending: bool | None = None) -> list[RunEntry]:
    """``entries`` ordered by the column ``key`` (default direction: scores best first), runs
    without a value last whatever the direction, ties by name."""
    column = next(column for column in COLUMNS if column.key == key)
    reverse = column.descending if descending is None else descending
    by_name = sorted(entries, key=lambda entry: entry.name)
    present = [entry for entry in by_name if getattr(entry, key) is not None]
    absent = [entry for entry in by_name if getattr(entry, key) is None]
    return sorted(present, key=lambda entry: getattr(entry, key), reverse=reverse) + absent


def group_runs(entries: Sequence[RunEntry]) -> list[tuple[str | None, str | None, list[RunEntry]]]:
    """``(job_list, label, runs)`` per job list, in the order the groups' first runs come in
    ``entries``; runs without a key (unreadable, no manifest) in one group last."""
    groups: dict[str | None, list[RunEntry]] = {}
    for entry in entries:
        groups.setdefault(entry.job_list, []).append(entry)
    keyed = [(key, runs[0].job_list_label, runs) for key, runs in groups.items() if key is not None]
    return keyed + ([(None, None, groups[None])] if None in groups else [])


# --------------------------------------------------------------------------- finding runs

_RUN_MARKS = ("shards.json", "manifest.json", "traces.jsonl")


Listing = tuple[list[str], list[str]] | str
"""A folder's (objects, folders), or why it could not be listed."""


def find_runs(
    store: ShardedRunStore,
    *,
    max_depth: int = MAX_DEPTH,
    map_each: Callable[[Callable[[str], Listing], list[str]], Iterable[Listing]] = map,
) -> Iterator[tuple[str, list[str] | None, str | None]]:
    """``(path under the location, the run folder's object names, error)`` of every run under
    ``store``, breadth first, one listing per folder (the folders of one level listed through
    ``map_each``: several at a time with a pool's ``map``); a folder that cannot be listed comes
    with its error (and no names) instead of ending the search."""

    def listing(rel: str) -> Listing:
        try:
            return store.list_entries(rel)
        except _READ_ERRORS as exc:
            return _describe(exc)

    level, depth = [""], 0
    while level:
        below: list[str] = []
        for rel, found in zip(level, map_each(listing, level), strict=True):
            if isinstance(found, str):
                yield rel or ".", None, found
                continue
            files, folders = found
            if any(mark in files for mark in _RUN_MARKS):
                yield rel or ".", files, None
            elif depth < max_depth:
                below.extend(f"{rel}/{name}" if rel else name for name in folders if not name.startswith("."))
        level, depth = below, depth + 1


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# --------------------------------------------------------------------------- reading one run


def read_entry(store: ShardedRunStore, rel: str, files: Sequence[str], *, now: datetime | None = None) -> RunEntry:
    """One run's entry from its manifest head, summary and progress; never raises for a run that
    cannot be read (the entry carries the error)."""
    run = store if rel == "." else store.beneath(rel)
    kind = "sharded" if "shards.json" in files else "local" if "manifest.json" in files else "legacy"
    entry = RunEntry(run.display_uri, rel, kind)
    try:
        _fill(entry, run, files, now or datetime.now(UTC))
    except _READ_ERRORS as exc:
        entry.state, entry.error = "unreadable", _describe(exc)
    return entry


def _fill(entry: RunEntry, run: ShardedRunStore, files: Sequence[str], now: datetime) -> None:
    head = _manifest_head(run) if "manifest.json" in files else None
    if head is not None:
        _identity(entry, head)
    summary = _summary(run, head) if "summary.json" in files else None
    if summary is not None:
        _headline(entry, summary)
        if head is None:  # traces of the earlier implementation: what the summary says
            _identity_from_summary(entry, summary)
    if entry.kind == "sharded":
        _sharded_state(entry, run, summary)
    else:
        _local_state(entry, run, files, head, summary, now)


def _manifest_head(run: ShardedRunStore) -> dict[str, Any]:
    """The manifest's keys before the job list: from its first bytes, or from the whole file when
    they do not parse that way (an earlier layout, a plan whose identity is larger)."""
    data = run.read_head("manifest.json", HEAD_BYTES)
    if data is None:
        raise ValueError(f"{run.display_uri}/manifest.json was listed but is gone")
    head = manifest_head(data)
    if head is not None and head.get("schema_version") in MANIFEST_SCHEMA_VERSIONS:
        return head
    whole = data if len(data) < HEAD_BYTES else run.read_bytes("manifest.json")
    if whole is None:
        raise ValueError(f"{run.display_uri}/manifest.json was listed but is gone")
    try:
        document = orjson.loads(whole)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{run.display_uri}/manifest.json is not valid JSON: {exc}") from None
    manifest = validate_manifest(document, f"{run.display_uri}/manifest.json")
    plan = {key: value for key, value in manifest.plan.as_dict().items() if key != "jobs"}
    return {
        "schema_version": manifest.schema_version,
        "created_at": manifest.created_at,
        "plan_fingerprint": manifest.plan_fingerprint,
        "plan": plan,
    }


def _object(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _pair(value: Any, scale: float = 1.0) -> list[float] | None:
    if isinstance(value, list) and len(value) == 2 and all(_float(item) is not None for item in value):
        return [float(item) * scale for item in value]
    return None


def _identity(entry: RunEntry, head: Mapping[str, Any]) -> None:
    plan = _object(head.get("plan"))
    model = _object(plan.get("model"))
    split = _object(plan.get("task_split"))
    sampling = _object(plan.get("sampling"))
    entry.experiment = _str(plan.get("experiment"))
    entry.model = _str(model.get("model"))
    entry.model_id = _str(plan.get("model_id"))
    entry.checkpoint = _str(model.get("checkpoint_id"))
    entry.split = _str(split.get("name"))
    entry.fingerprint = _str(head.get("plan_fingerprint"))
    entry.created = _str(head.get("created_at"))
    if split.get("task_ids_sha256") is not None:
        key = {
            "pipeline_version": plan.get("pipeline_version"),
            "split": {name: split.get(name) for name in ("name", "split_version", "task_count", "task_ids_sha256")},
            "sampling": {name: sampling.get(name) for name in ("seed", "sample_size", "repeats")},
        }
        entry.job_list = fingerprint(key)[:12]
        size = sampling.get("sample_size")
        tasks = split.get("task_count")
        entry.job_list_label = (
            f"split {split.get('name')} · {'all' if size is None else size} of {tasks} tasks"
            f" · seed {sampling.get('seed')} · repeats {sampling.get('repeats')}"
        )


def _identity_from_summary(entry: RunEntry, summary: Mapping[str, Any]) -> None:
    run = _object(summary.get("run"))
    entry.experiment = entry.experiment or _str(run.get("experiment"))
    entry.model = entry.model or _str(run.get("model_name"))
    entry.model_id = entry.model_id or _str(run.get("model_id"))
    entry.checkpoint = entry.checkpoint or _str(run.get("checkpoint_id"))
    entry.split = entry.split or _str(_object(run.get("split")).get("name"))
    entry.fingerprint = entry.fingerprint or _str(run.get("plan_fingerprint"))


def _summary(run: ShardedRunStore, head: Mapping[str, Any] | None) -> dict[str, Any] | None:
    document = run.read_json("summary.json")
    if document is None:
        return None
    where = f"{run.display_uri}/summary.json"
    # A summary that is not one raises RecordFormatError / RecordVersionError (ValueErrors).
    summary: dict[str, Any] = to_plain(read_summary(document, where))
    planned = None if head is None else head.get("plan_fingerprint")
    written = _object(summary.get("run")).get("plan_fingerprint")
    if planned is not None and written is not None and planned != written:
        raise ValueError(f"{where} belongs to plan {str(written)[:12]}…, the manifest is plan {str(planned)[:12]}…")
    return summary


def _headline(entry: RunEntry, summary: Mapping[str, Any]) -> None:
    counts = _object(summary.get("counts"))
    itt = _object(summary.get("intent_to_treat"))
    cost = _object(summary.get("cost"))
    money = _object(cost.get("money"))
    entry.summary_created = _str(summary.get("created_at"))
    entry.requested = _int(counts.get("requested"))
    entry.completed = _int(counts.get("completed"))
    entry.failed = _int(counts.get("failed"))
    entry.coverage = _float(counts.get("coverage"))
    entry.score = _float(itt.get("score"))
    entry.score_ci95 = _pair(itt.get("reward_ci95"), 100.0)
    entry.success = _float(itt.get("success_rate"))
    entry.success_ci95 = _pair(itt.get("success_ci95"))
    spent = _int(_object(cost.get("tokens_all_attempts")).get("total_tokens"))
    if spent is not None:
        entry.tokens, entry.tokens_scope = spent, "all attempts"
    else:
        completed_only = _int(_object(cost.get("tokens")).get("total_tokens"))
        if completed_only is not None:
            entry.tokens, entry.tokens_scope = completed_only, "completed episodes"
    entry.cost = _float(money.get("total"))
    entry.currency = _str(money.get("currency"))
    entry.accelerator_hours = _float(cost.get("accelerator_hours"))
    entry.active_seconds = _float(_object(summary.get("throughput")).get("active_seconds"))


def _sharded_state(entry: RunEntry, run: ShardedRunStore, summary: Mapping[str, Any] | None) -> None:
    if summary is not None:
        shards = _object(summary.get("shards"))
        complete = summary.get("complete")
        entry.state = "partial" if complete is False else "finished"
        if complete is False:
            entry.detail = f"the summary holds {shards.get('committed')} of {shards.get('count')} shards (reduce again once all are committed)"
        return
    # No summary yet: what status reads (commit markers, the workers' progress objects).
    report = shard_status(run)
    rows = report["shards"]
    committed = report["committed_shards"]
    entry.requested = _int(report.get("jobs"))
    entry.completed = _int(report.get("completed"))
    entry.failed = sum(int(row.get("failed") or 0) for row in rows if row.get("state") == "committed")
    entry.coverage = entry.completed / entry.requested if entry.requested and entry.completed is not None else None
    started = any(row.get("state") != "pending" for row in rows)
    entry.state = "committed" if committed == len(rows) else "in progress" if started else "not started"
    entry.detail = f"{committed}/{len(rows)} shards committed, no summary yet" + (
        " (reduce to write it)" if committed == len(rows) else ""
    )


def _local_state(
    entry: RunEntry,
    run: ShardedRunStore,
    files: Sequence[str],
    head: Mapping[str, Any] | None,
    summary: Mapping[str, Any] | None,
    now: datetime,
) -> None:
    progress = _progress(run) if "progress.json" in files else None
    if progress is not None and head is not None and progress.get("plan_fingerprint") == head.get("plan_fingerprint"):
        view = progress_view(progress, now)
        entry.state = view["state"]
        process = view.get("process")
        if entry.state in ("running", "running?", "stopped") and process:
            entry.detail = f"pid {process['pid']} on {process['host']}"
        if summary is None or entry.state != "finished":
            # The counts of the invocation under way (or the last one): newer than any summary.
            entry.requested = _int(progress.get("jobs"))
            entry.completed = view["completed"]
            entry.failed = view["settled"] - view["completed"]
            entry.coverage = entry.completed / entry.requested if entry.requested else None
            note = (
                "headline from an earlier summary" if summary is not None else "no summary.json: `shopsimrl summarize` writes it"
            )
            if summary is not None or entry.state == "finished":
                entry.detail = f"{entry.detail}; {note}" if entry.detail else note
        return
    if summary is not None:
        entry.state = "finished"
    else:
        entry.state = "not started"
        entry.detail = "no summary and no progress file"


def _progress(run: ShardedRunStore) -> dict[str, Any] | None:
    try:
        progress = run.read_json("progress.json")
    except ValueError:
        return None  # advisory: a torn progress file says nothing
    if isinstance(progress, dict) and progress.get("schema_version") == LOCAL_PROGRESS_SCHEMA:
        return dict(progress)
    return None


# --------------------------------------------------------------------------- the listing


def list_runs(location: str, *, max_depth: int = MAX_DEPTH, now: datetime | None = None) -> list[RunEntry]:
    """Every run under ``location`` (a folder, ``file://`` or ``s3://`` prefix), unsorted; the
    location itself may be a run. Raises RunLocationError for a location that cannot be one."""
    root = ShardedRunStore(location)
    now = now or datetime.now(UTC)

    def read(found: tuple[str, list[str] | None, str | None]) -> RunEntry:
        rel, files, error = found
        if files is not None:
            return read_entry(root, rel, files, now=now)
        entry = RunEntry(root.display_uri if rel == "." else root.beneath(rel).display_uri, rel, "unknown")
        entry.state, entry.error = "unreadable", error
        return entry

    if root.local:  # local reads take microseconds: threads would only add their overhead
        return [read(found) for found in find_runs(root, max_depth=max_depth)]
    # On S3 the folders of a level are listed, and the runs read, several at a time (the store's
    # read window, SHOPSIMRL_STORE_READ_CONCURRENCY): each costs a few requests, mostly round trips.
    with ThreadPoolExecutor(root.read_concurrency, thread_name_prefix="runs-read") as pool:
        return list(pool.map(read, list(find_runs(root, max_depth=max_depth, map_each=pool.map))))
