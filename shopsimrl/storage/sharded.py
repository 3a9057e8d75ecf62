"""The layout of a sharded run on an object store (:mod:`shopsimrl.storage.objectstore`):
manifest, shard map, trace parts, commit markers, progress objects, summary.

Layout (every object is written once, except ``summary.json`` which ``reduce`` rewrites)::

    manifest.json                          frozen plan + fingerprint (create-only)
    jobs.jsonl                             one job per line with its shard (create-only)
    shards.json                            the frozen shard map (create-only)
    shards/00007/part-00003-1a2b3c4d.jsonl.zst  trace parts (zstd; plain .jsonl from earlier
                                           versions is read too): sequence number, then the writer id
    shards/00007/_SUCCESS.json             the shard's first commit marker (create-only)
    shards/00007/_SUCCESS-1a2b3c4d.json    a later commit of the shard by writer 1a2b3c4d (create-only)
    shards/00007/_PROGRESS-1a2b3c4d.json   writer 1a2b3c4d's progress and heartbeat (rewritten; for status)
    summary.json                           written by ``shopsimrl reduce``

Object storage has neither append nor atomic rename, so traces are buffered and written as
whole, immutable part objects. Each worker process picks a random writer id; the id is part of
every part name, so two writers on one shard (a replaced pod that is not quite dead yet) can
never overwrite each other's parts.

Commit markers are never replaced either: every commit adds one, and what a shard has
committed is the union of the parts listed by the markers that verify (each listed part present
with the recorded sha256). Adding a marker can only add verified parts, so the outcome does not
depend on the order in which concurrent committers write.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

import orjson
import structlog
import zstandard

from shopsimrl.manifest import (
    FingerprintMismatchError,
    ManifestError,
    build_manifest,
    manifest_head,
    plan_diff,
    validate_manifest,
)
from shopsimrl.planning import SHARD_ASSIGNMENT, PlanError, shard_jobs
from shopsimrl.records import (
    MARKER_SCHEMA_VERSION,
    EpisodeTrace,
    MarkerEpisodes,
    MarkerPart,
    RecordFormatError,
    RecordVersionError,
    RunManifest,
    ShardMarker,
    dump_document,
    dump_line,
    parse_trace_line,
    read_marker,
    read_summary,
)
from shopsimrl.schemas import (
    MANIFEST_SCHEMA_VERSIONS,
    EpisodeJob,
    TraceFormatError,
    canonical_json,
    escape_lone_surrogates,
    fingerprint,
    sha256_hex,
)
from shopsimrl.storage.objectstore import TEMP_PREFIX, ObjectStore, RetryPolicy, StoreUnavailableError

__all__ = [
    "MARKER_NAME",
    "MARKER_PATTERN",
    "MARKER_SCHEMA_VERSION",
    "PART_PATTERN",
    "PROGRESS_PATTERN",
    "PROGRESS_SCHEMA_VERSION",
    "REPORT_SAMPLE",
    "SHARD_MAP_SCHEMA_VERSION",
    "FrozenPlan",
    "MarkerCheck",
    "PartWriter",
    "RecordOutcome",
    "RunNotPlannedError",
    "ShardListing",
    "ShardMap",
    "ShardMapError",
    "ShardParts",
    "ShardResult",
    "ShardState",
    "ShardedRunStore",
    "WrittenPart",
    "check_markers",
    "check_shard_map",
    "commit_shard",
    "iter_part_records",
    "load_frozen_plan",
    "marker_document",
    "marker_part_problems",
    "marker_problem",
    "part_entry",
    "part_lines",
    "part_name",
    "part_order",
    "read_shard_parts",
    "record_outcome",
    "scan_shard",
]

SHARD_MAP_SCHEMA_VERSION = "shopsimrl-shard-map-v1"
MARKER_NAME = "_SUCCESS.json"
MARKER_PATTERN = re.compile(r"^_SUCCESS(?:-([0-9a-f]{8,32}))?\.json$")
PART_PATTERN = re.compile(r"^part-(\d{5,})-([0-9a-f]{8,32})\.jsonl(\.zst)?$")
"""Trace parts: ``.jsonl.zst`` as written now, plain ``.jsonl`` as written before (both are read)."""
PROGRESS_SCHEMA_VERSION = "shopsimrl-shard-progress-v1"
PROGRESS_PATTERN = re.compile(r"^_PROGRESS-([0-9a-f]{8,32})\.json$")
REPORT_SAMPLE = 20
"""How many problems, foreign objects or stray ids a shard report lists."""
_ZSTD_LEVEL = 3
"""zstd level of the parts: ratio 15 on testbed traces at ~350 MB/s to compress and ~1 GB/s to
read back; higher levels gain little ratio for a fraction of the speed (docs/benchmarks.md)."""


class ShardMapError(ValueError):
    """shards.json is unreadable or disagrees with the requested shard count (exit 2)."""


def part_name(seq: int, writer: str, *, compressed: bool = True) -> str:
    return f"part-{seq:05d}-{writer}.jsonl" + (".zst" if compressed else "")


# A compressor is not safe for concurrent use; one per thread (the sinks flush from asyncio.to_thread threads).
log = structlog.get_logger("shopsimrl.storage.sharded")
_codecs = threading.local()


def encode_part(lines: bytes) -> bytes:
    """The stored bytes of a compressed part: one zstd frame with the content size and checksum."""
    compressor = getattr(_codecs, "compressor", None)
    if compressor is None:
        compressor = _codecs.compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True)
    return compressor.compress(lines)


def part_lines(name: str, data: bytes) -> tuple[bytes, bool]:
    """The JSONL bytes of a stored part, and whether they are whole.

    A compressed part cut short (a copy that stopped half-way) gives the lines decoded before
    the cut and False; bytes that are not a zstd frame give nothing and False. Plain parts are
    their own lines."""
    if not name.endswith(".zst"):
        return data, True
    decoder = zstandard.ZstdDecompressor().decompressobj()
    try:
        lines = decoder.decompress(data)
    except zstandard.ZstdError:
        return b"", False
    return lines, decoder.eof and not decoder.unused_data


# --------------------------------------------------------------------------- shard map


@dataclass
class ShardMap:
    count: int
    plan_fingerprint: str
    episode_ids: list[list[str]]
    assignment: str = SHARD_ASSIGNMENT
    manifest_sha256: str | None = None
    """sha256 of the manifest.json bytes this map was frozen with (None: not recorded, as before)."""
    plan_ids_sha256: str | None = None
    """As recorded in shards.json: the digest of the plan's episode ids in plan order."""

    @property
    def jobs(self) -> int:
        return sum(len(ids) for ids in self.episode_ids)

    def plan_order_ids(self) -> list[str] | None:
        """The episode ids in plan order, undoing the round-robin; None when the shard sizes
        cannot come from it."""
        ids: list[Any] = [None] * self.jobs
        try:
            for index, shard in enumerate(self.episode_ids):
                ids[index :: self.count] = shard
        except ValueError:  # extended slice of another length
            return None
        return ids

    def matches_frozen_plan(self, manifest_sha256: str) -> bool:
        """True when this map was frozen beside exactly these manifest bytes and still assigns
        the plan's episodes as it did then: what the freezer checked need not be checked again."""
        if self.manifest_sha256 is None or self.plan_ids_sha256 is None or self.manifest_sha256 != manifest_sha256:
            return False
        ids = self.plan_order_ids()
        return ids is not None and fingerprint(ids) == self.plan_ids_sha256

    def ids_sha256(self, index: int) -> str:
        return fingerprint(self.episode_ids[index])

    @classmethod
    def build(cls, jobs: Sequence[EpisodeJob], count: int, plan_fingerprint: str) -> ShardMap:
        return cls(count, plan_fingerprint, _assign([job.episode_id for job in jobs], count))

    def to_dict(self) -> dict[str, Any]:
        head: dict[str, Any] = {
            "schema_version": SHARD_MAP_SCHEMA_VERSION,
            "plan_fingerprint": self.plan_fingerprint,
            "assignment": self.assignment,
            "count": self.count,
            "jobs": self.jobs,
            "created_at": datetime.now(UTC).isoformat(),
        }
        if self.manifest_sha256 is not None:
            head["manifest_sha256"] = self.manifest_sha256
            head["episode_ids_sha256"] = fingerprint(self.plan_order_ids())
        return {
            **head,
            "shards": [
                {"index": i, "jobs": len(ids), "episode_ids_sha256": self.ids_sha256(i), "episode_ids": ids}
                for i, ids in enumerate(self.episode_ids)
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ShardMap:
        if not isinstance(data, dict) or data.get("schema_version") != SHARD_MAP_SCHEMA_VERSION:
            version = data.get("schema_version") if isinstance(data, dict) else None
            raise ShardMapError(f"{where}: not a shard map of version {SHARD_MAP_SCHEMA_VERSION} (schema_version {version!r})")
        if data.get("assignment") != SHARD_ASSIGNMENT:
            raise ShardMapError(
                f"{where}: unknown shard assignment {data.get('assignment')!r}; this shopsimrl knows {SHARD_ASSIGNMENT}"
            )
        shards = data.get("shards")
        count = data.get("count")
        if not isinstance(count, int) or not isinstance(shards, list) or len(shards) != count:
            raise ShardMapError(f"{where}: 'count' must equal the number of entries in 'shards'")
        ids: list[list[str]] = []
        for i, entry in enumerate(shards):
            episode_ids = entry.get("episode_ids") if isinstance(entry, dict) else None
            if not isinstance(episode_ids, list) or entry.get("index") != i:
                raise ShardMapError(f"{where}: shards[{i}] needs 'index' {i} and an 'episode_ids' list")
            if fingerprint(episode_ids) != entry.get("episode_ids_sha256"):
                raise ShardMapError(
                    f"{where}: shards[{i}].episode_ids_sha256 does not match its episode ids; the file was edited"
                )
            ids.append(episode_ids)
        manifest_sha, plan_ids_sha = data.get("manifest_sha256"), data.get("episode_ids_sha256")
        return cls(
            count,
            str(data.get("plan_fingerprint")),
            ids,
            data["assignment"],
            manifest_sha if isinstance(manifest_sha, str) else None,
            plan_ids_sha if isinstance(plan_ids_sha, str) else None,
        )


@dataclass
class ShardListing:
    """What a shard folder holds, by kind."""

    parts: list[str] = field(default_factory=list)
    """Part names, in write order (sequence number, then writer)."""
    markers: list[str] = field(default_factory=list)
    """Commit marker names, sorted."""
    progress: list[str] = field(default_factory=list)
    """Progress objects, one per writer (read by ``status`` only)."""
    temporary: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    @property
    def marker(self) -> bool:
        return bool(self.markers)


def part_order(name: str) -> tuple[int, str]:
    match = PART_PATTERN.match(name)
    return (int(match.group(1)), match.group(2)) if match else (1 << 62, name)


# --------------------------------------------------------------------------- the store


class ShardedRunStore(ObjectStore):
    """One run location: manifest, shard map, trace parts, commit markers, summary."""

    def __init__(self, uri: str, *, retry: RetryPolicy | None = None, read_concurrency: int | None = None) -> None:
        super().__init__(uri, retry=retry, read_concurrency=read_concurrency)
        self.manifest_sha256: str | None = None
        """sha256 of manifest.json as last read or written here."""

    @staticmethod
    def shard_dir(index: int) -> str:
        return f"shards/{index:05d}"

    # -- manifest and plan ------------------------------------------------------------------

    def read_manifest(self) -> RunManifest | None:
        data = self.read_bytes("manifest.json")
        return None if data is None else self.parse_manifest(data)

    def parse_manifest(self, data: bytes) -> RunManifest:
        """manifest.json's bytes, checked: valid JSON, a known version, the plan matching its
        fingerprint. Remembers their sha256 (``manifest_sha256``) for the shard map."""
        manifest = validate_manifest(self._parse_json("manifest.json", data), f"{self.display_uri}/manifest.json")
        self.manifest_sha256 = sha256_hex(data)
        return manifest

    def freeze_plan(self, plan: dict[str, Any], execution: dict[str, Any] | None = None) -> RunManifest:
        """Create manifest.json, or verify that the one there freezes the same plan.

        Planning is deterministic, so any number of workers may call this at once: one creates
        the manifest, the others find it and compare fingerprints.
        """
        if self._call("look for traces.jsonl in", lambda: self.fs.exists(self.path("traces.jsonl"))):
            # Resume state lives in the layout: a sharded worker would not see the local traces
            # and would run every episode again.
            raise ManifestError(
                f"{self.display_uri} holds a single-process run (traces.jsonl); resume it with `shopsimrl run` "
                "without --shards, or give the sharded run another location (--run)"
            )
        new_fp = fingerprint(plan)
        for _ in range(3):
            existing = self.read_manifest()
            if existing is not None:
                if existing.plan_fingerprint != new_fp:
                    raise FingerprintMismatchError(
                        self.display_uri, existing.plan_fingerprint, new_fp, plan_diff(existing.plan.as_dict(), plan)
                    )
                return existing
            manifest = build_manifest(plan, execution, plan_fingerprint=new_fp)
            data = dump_document(manifest)
            if self.create("manifest.json", data):
                self.manifest_sha256 = sha256_hex(data)
                return manifest
        raise StoreUnavailableError(f"{self.display_uri}/manifest.json keeps changing under us")

    def read_shard_map(self) -> ShardMap | None:
        data = self.read_json("shards.json")
        return None if data is None else ShardMap.from_dict(data, f"{self.display_uri}/shards.json")

    def ensure_shard_map(self, jobs: Sequence[EpisodeJob], count: int, plan_fingerprint: str) -> ShardMap:
        """Create shards.json (and jobs.jsonl) or verify the frozen one has ``count`` shards."""
        for _ in range(3):
            existing = self.read_shard_map()
            if existing is not None:
                if existing.count != count:
                    raise ShardMapError(
                        f"{self.display_uri} is frozen with {existing.count} shards, not {count}; "
                        f"use --shards {existing.count} (or SHOPSIMRL_SHARDS={existing.count}) or another run location"
                    )
                check_shard_map(existing, jobs, plan_fingerprint, self.display_uri)
                return existing
            ids = [job.episode_id for job in jobs]
            shard_map = ShardMap(count, plan_fingerprint, _assign(ids, count), manifest_sha256=self.manifest_sha256)
            # jobs.jsonl first: a reader that finds shards.json can rely on it. One left by a
            # planner that crashed with another shard count must not stand beside a new map.
            data = _jobs_jsonl(jobs, ids, count)
            if not self.create("jobs.jsonl", data):  # False: different bytes are already there
                raise ShardMapError(
                    f"{self.display_uri}/jobs.jsonl was frozen for another shard count or plan; remove it or use another run location"
                )
            if self.create("shards.json", _json_bytes(shard_map.to_dict())):
                return shard_map
        raise StoreUnavailableError(f"{self.display_uri}/shards.json keeps changing under us")

    # -- shards -----------------------------------------------------------------------------

    def list_shard(self, index: int) -> ShardListing:
        listing = ShardListing()
        for name in self.listdir(self.shard_dir(index)):
            if PART_PATTERN.match(name):
                listing.parts.append(name)
            elif MARKER_PATTERN.match(name):
                listing.markers.append(name)
            elif PROGRESS_PATTERN.match(name):
                listing.progress.append(name)
            elif name.startswith(TEMP_PREFIX):
                listing.temporary.append(name)
            else:
                listing.foreign.append(name)
        listing.parts.sort(key=part_order)
        listing.markers.sort()
        return listing

    def read_part(self, index: int, name: str) -> bytes | None:
        return self.read_bytes(f"{self.shard_dir(index)}/{name}")

    def read_parts(self, index: int, names: Iterable[str]) -> Iterator[tuple[str, bytes | None]]:
        """``(name, read_part(index, name))`` for each part, in the order given, fetched
        :attr:`read_concurrency` at a time (:meth:`ObjectStore.read_many`)."""
        prefix = f"{self.shard_dir(index)}/"
        for rel, data in self.read_many(prefix + name for name in names):
            yield rel[len(prefix) :], data

    def write_part(self, index: int, seq: int, writer: str, lines: bytes, *, compressed: bool = True) -> tuple[str, bytes]:
        """Write one immutable part of JSONL ``lines`` (zstd-compressed unless told otherwise);
        returns its name and the bytes stored. The name is unique to this writer, so it never
        collides, and it is not read back."""
        data = encode_part(lines) if compressed else lines
        for _ in range(100):
            name = part_name(seq, writer, compressed=compressed)
            if self.create(f"{self.shard_dir(index)}/{name}", data, read_back=False):
                return name, data
            seq += 1  # only reachable if two processes share a writer id
        raise StoreUnavailableError(f"{self.display_uri}: cannot find a free part name in shard {index}")

    def write_progress(self, index: int, progress: dict[str, Any]) -> None:
        """Replace writer ``progress["writer"]``'s progress object of the shard (for ``status``)."""
        self.overwrite(f"{self.shard_dir(index)}/_PROGRESS-{progress['writer']}.json", orjson.dumps(progress), retry=False)

    def read_progress(self, index: int, names: Sequence[str]) -> list[dict[str, Any]]:
        """The shard's progress objects (listed as ``names``) that are readable and of this version."""
        found = []
        for name in names:
            try:
                progress = self.read_json(f"{self.shard_dir(index)}/{name}")
            except ManifestError:
                continue  # a torn or foreign object: progress is advisory, markers are the truth
            if isinstance(progress, dict) and progress.get("schema_version") == PROGRESS_SCHEMA_VERSION:
                found.append(progress)
        return found

    def read_marker(self, index: int, name: str = MARKER_NAME) -> ShardMarker | str | None:
        """The commit marker, None when absent, or why it is not one (not JSON, another version,
        a field that does not fit)."""
        rel = f"{self.shard_dir(index)}/{name}"
        try:
            document = self.read_json(rel)
        except ManifestError:
            return "not valid JSON"
        if document is None:
            return None
        try:
            return read_marker(document, f"{self.display_uri}/{rel}")
        except RecordVersionError:
            return f"unknown schema_version {document.get('schema_version')!r}"
        except RecordFormatError as exc:
            return f"not a commit marker ({str(exc).rpartition(': ')[0].rpartition(': ')[2] or 'shape'})"

    def read_markers(self, index: int, names: Sequence[str] | None = None) -> list[tuple[str, ShardMarker | str]]:
        """Every commit marker of the shard (listed now, or ``names``), by name: the marker, or why
        the object is not one."""
        found = []
        for name in self.list_shard(index).markers if names is None else names:
            marker = self.read_marker(index, name)
            if marker is not None:  # listed, then gone
                found.append((name, marker))
        return found

    def plan_markers(
        self, index: int, *, plan_fingerprint: str, episode_ids_sha256: str, names: Sequence[str] | None = None
    ) -> list[ShardMarker]:
        """The shard's commit markers that belong to this plan and shard map (their parts not yet
        checked): what ``status`` counts without reading a part."""
        return [
            marker
            for _, marker in self.read_markers(index, names)
            if isinstance(marker, ShardMarker)
            and marker_problem(marker, index=index, plan_fingerprint=plan_fingerprint, episode_ids_sha256=episode_ids_sha256)
            is None
        ]

    def create_marker(self, index: int, marker: ShardMarker) -> str:
        """Add a commit marker; returns its name. Markers are never replaced: the first commit
        of a shard is ``_SUCCESS.json``, every later one ``_SUCCESS-<writer>.json``."""
        data = dump_document(marker)
        for name in (MARKER_NAME, f"_SUCCESS-{marker.writer}.json"):
            if self.create(f"{self.shard_dir(index)}/{name}", data):
                return name
        raise StoreUnavailableError(f"{self.display_uri}: shard {index} already has a marker of writer {marker.writer}")

    def write_summary(self, summary: dict[str, Any]) -> None:
        canonical_json(summary)  # refuse NaN before touching the store
        read_summary(summary, f"{self.display_uri}/summary.json")  # what is written fits its schema version
        self.overwrite("summary.json", _json_bytes(summary))


@dataclass
class ShardState:
    """What the shard's parts say: per part entry, completed episodes, attempts per episode."""

    parts: dict[str, dict[str, Any]] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)
    best_unfinished: dict[str, RecordOutcome] = field(default_factory=dict)
    """Per episode: its best unfinished record by the winner rule (the winner when none completed)."""
    part_completed: dict[str, set[str]] = field(default_factory=dict)
    """Per part read: the episodes it holds a completed record of."""
    completed_records: int = 0
    unreadable_lines: int = 0
    not_in_shard: int = 0
    next_seq: int = 0

    def fold(self, entry: dict[str, Any], outcomes: Iterable[RecordOutcome], shard_ids: Collection[str]) -> None:
        """Add one part: its marker entry and the outcome of each valid record."""
        records = 0
        completed: set[str] = set()
        for outcome in outcomes:
            episode_id = outcome.episode_id
            if episode_id not in shard_ids:
                self.not_in_shard += 1
                continue
            records += 1
            self.attempts[episode_id] = self.attempts.get(episode_id, 0) + 1
            if outcome.completed:
                self.completed_records += 1
                completed.add(episode_id)
            else:
                best = self.best_unfinished.get(episode_id)
                if best is None or outcome.rank >= best.rank:  # ties: the record read later wins
                    self.best_unfinished[episode_id] = outcome
        self.completed |= completed
        self.part_completed[entry["name"]] = completed
        self.parts[entry["name"]] = {**entry, "records": records}

    def final_failures(self) -> dict[str, str | None]:
        """Episode → ``failure_class``, for episodes without a completed record whose winning
        record is a failure that is an outcome (final unless re-rolled)."""
        return {
            eid: outcome.failure_class
            for eid, outcome in self.best_unfinished.items()
            if outcome.final and eid not in self.completed
        }


class RecordOutcome(NamedTuple):
    """What resume needs of one stored record."""

    episode_id: str
    completed: bool
    rank: tuple[int, str]
    final: bool
    """A failure that is an outcome of the episode (:attr:`EpisodeTrace.failed_as_outcome`)."""
    failure_class: str | None


def record_outcome(record: EpisodeTrace) -> RecordOutcome:
    return RecordOutcome(record.episode_id, record.completed, record.attempt_rank, record.failed_as_outcome, record.failure_class)


@dataclass(frozen=True)
class WrittenPart:
    """A part this process wrote: what a scan of it would find, known without reading it back."""

    entry: dict[str, Any]
    """``{name, sha256, records}`` as the commit marker lists it."""
    outcomes: tuple[RecordOutcome, ...]
    """Per record, in order."""


def scan_shard(
    store: ShardedRunStore,
    index: int,
    shard_ids: set[str],
    state: ShardState | None = None,
    *,
    exclude: Collection[str] = (),
    written: Sequence[WrittenPart] = (),
) -> ShardState:
    """Read the parts not yet in ``state`` (all of them the first time) and fold them in.

    ``exclude``: parts not to trust (their records are ignored). ``written``: parts this process
    wrote; they are folded in from what the writer knows, never read back, and included by name
    even when a listing does not show them yet.
    """
    state = state or ShardState()
    listed = store.list_shard(index).parts
    ours = {part.entry["name"]: part for part in written}
    for name in [*listed, *(name for name in ours if name not in listed)]:
        match = PART_PATTERN.match(name)
        if match:
            state.next_seq = max(state.next_seq, int(match.group(1)) + 1)
        if name in state.parts or name in exclude:
            continue
        if name in ours:
            state.fold(ours[name].entry, ours[name].outcomes, shard_ids)
            continue
        data = store.read_part(index, name)
        if data is None:
            continue  # listed, then gone: nothing to account for
        outcomes = []
        for record in iter_part_records(name, data):
            if record is None:
                state.unreadable_lines += 1
            else:
                outcomes.append(record_outcome(record))
        state.fold(part_entry(name, data, len(outcomes)), outcomes, shard_ids)
    return state


def check_shard_map(shard_map: ShardMap, jobs: Sequence[EpisodeJob], plan_fingerprint: str, where: str) -> None:
    """The one check that shards.json is the plan's shard map (worker, reducer and status)."""
    if shard_map.plan_fingerprint != plan_fingerprint:
        raise ShardMapError(
            f"{where}/shards.json belongs to plan {shard_map.plan_fingerprint[:12]}…, not {plan_fingerprint[:12]}…"
        )
    try:
        expected = _assign([job.episode_id for job in jobs], shard_map.count)
    except PlanError as exc:
        raise ShardMapError(f"{where}/shards.json: {exc}") from None
    if expected != shard_map.episode_ids:
        raise ShardMapError(f"{where}/shards.json assigns episodes differently from {SHARD_ASSIGNMENT}")


def marker_problem(marker: ShardMarker | str, *, index: int, plan_fingerprint: str, episode_ids_sha256: str) -> str | None:
    """Why ``marker`` is not a commit of this shard of this plan, or None when it is one."""
    if isinstance(marker, str):
        return marker
    if marker.plan_fingerprint != plan_fingerprint:
        return "belongs to another plan fingerprint"
    if marker.shard != index or marker.episode_ids_sha256 != episode_ids_sha256:
        return "belongs to another shard or shard map"
    return None


def marker_part_problems(marker: ShardMarker, actual_sha256: Mapping[str, str | None]) -> list[str]:
    """The listed parts that are missing or whose bytes differ from the marker's sha256."""
    problems = []
    for part in marker.parts:
        sha = actual_sha256.get(part.name)
        if sha is None:
            problems.append(f"{part.name}: listed but missing")
        elif sha != part.sha256:
            problems.append(f"{part.name}: sha256 differs from the marker")
    return problems


def _json_bytes(value: Any) -> bytes:
    """A document as stored: indented UTF-8 JSON. orjson writes a 100,000-job manifest in a few
    dozen ms where the standard library's indenting encoder (pure Python) takes seconds; values
    it does not take (integers beyond 64 bits, a lone surrogate: written as its \\uXXXX escape) go
    through the standard library."""
    try:
        return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        text = json.dumps(value, ensure_ascii=False, indent=2, allow_nan=False) + "\n"
        return escape_lone_surrogates(text).encode("utf-8")


def _assign(ids: list[str], count: int) -> list[list[str]]:
    """The round-robin assignment of episode ids in plan order (``planning.shard_jobs``)."""
    shard_jobs(ids, count)  # the same refusals (bad count, empty shards)
    return [ids[index::count] for index in range(count)]


def _jobs_jsonl(jobs: Sequence[EpisodeJob], ids: list[str], count: int) -> bytes:
    """jobs.jsonl: per job the canonical JSON (sorted keys, compact) of its fields, episode id
    and shard. Every key is fixed and every value an integer but the split name (JSON-encoded
    once per split) and the episode id (``task-000001__sample-000``, nothing to escape), so the
    lines are formatted directly: byte for byte ``canonical_json`` (tested), 20x faster."""
    splits = {split: canonical_json(split).encode("utf-8") for split in {job.split for job in jobs}}
    line = b'{"episode_id":"%s","sample_id":%d,"seed":%d,"shard":%d,"split":%s,"task_id":%d}\n'
    return b"".join(
        line % (episode_id.encode("ascii"), job.sample_id, job.seed, position % count, splits[job.split], job.task_id)
        for position, (job, episode_id) in enumerate(zip(jobs, ids, strict=True))
    )


def marker_document(
    *,
    shard: int,
    plan_fingerprint: str,
    completed: int,
    failed: int,
    episode_ids_sha256: str,
    parts: list[dict[str, Any]],
    writer: str,
) -> ShardMarker:
    return ShardMarker(
        schema_version=MARKER_SCHEMA_VERSION,
        shard=shard,
        plan_fingerprint=plan_fingerprint,
        episodes=MarkerEpisodes(completed=completed, failed=failed),
        episode_ids_sha256=episode_ids_sha256,
        parts=[MarkerPart.model_validate(part) for part in parts],
        writer=writer,
        written_at=datetime.now(UTC).isoformat(),
    )


def iter_part_records(name: str, data: bytes) -> Iterator[EpisodeTrace | None]:
    """Every non-blank line of a stored part: the record, or None for a torn/garbled/foreign
    line. A compressed part that is not whole ends with one None more (its torn tail)."""
    lines, whole = part_lines(name, data)
    for raw in lines.split(b"\n"):
        line = raw.strip()
        if line:
            yield parse_trace_line(line, name)
    if not whole and (not lines or lines.endswith(b"\n")):
        yield None  # the cut fell on a line boundary (or nothing decoded): still a torn part


def part_entry(name: str, data: bytes, records: int) -> dict[str, Any]:
    return {"name": name, "sha256": sha256_hex(data), "records": records}


# --------------------------------------------------------------------------- the frozen plan

_IDENTITY_HEAD_BYTES = 65536
"""Bytes of manifest.json parsed for the summary's identity; the job list comes after it."""


class RunNotPlannedError(ValueError):
    """The location has no manifest.json or no shards.json (exit 2)."""


@dataclass
class FrozenPlan:
    fingerprint: str
    shard_map: ShardMap
    identity: RunManifest | dict[str, Any]
    """The manifest, or its head (what the summary's ``run`` block needs)."""
    manifest_data: bytes = field(default=b"", repr=False)

    def execution(self) -> dict[str, Any]:
        """The manifest's ``execution`` block (the prices the summary uses), {} without one.
        Parsed on demand: it follows the job list, which the fast path above never parses."""
        if isinstance(self.identity, RunManifest):
            return dict(self.identity.execution)
        try:
            document = orjson.loads(self.manifest_data)
        except orjson.JSONDecodeError:
            return {}
        execution = document.get("execution") if isinstance(document, dict) else None
        return execution if isinstance(execution, dict) else {}


def load_frozen_plan(store: ShardedRunStore) -> FrozenPlan:
    """The frozen plan of a sharded run, for the reducer and ``status``, with the worker's checks, no fewer: a manifest whose stored plan matches its fingerprint, and a
    shards.json that assigns that plan's jobs as the frozen assignment does.

    When shards.json records the sha256 of the manifest it was frozen with and the digest of the
    plan's episode ids, and both still hold, the freezer's checks stand and the job list is not
    parsed (for 100,000 jobs: tens of ms instead of seconds). Otherwise (runs frozen before these
    were recorded, or an edited file) the full checks run and say what is wrong."""
    data = store.read_bytes("manifest.json")
    if data is None:
        raise RunNotPlannedError(f"{store.display_uri} has no manifest.json; plan or start a worker first")
    shard_map = store.read_shard_map()
    if shard_map is None:
        store.parse_manifest(data)  # a bad manifest is the first thing to report
        raise RunNotPlannedError(f"{store.display_uri} has no shards.json; it is not a sharded run")
    head = manifest_head(data[:_IDENTITY_HEAD_BYTES])
    if (
        head is not None
        and head.get("schema_version") in MANIFEST_SCHEMA_VERSIONS
        and head.get("plan_fingerprint") == shard_map.plan_fingerprint
        and shard_map.matches_frozen_plan(sha256_hex(data))
    ):
        return FrozenPlan(shard_map.plan_fingerprint, shard_map, head, data)
    manifest = store.parse_manifest(data)
    plan_fp = manifest.plan_fingerprint
    try:
        jobs = [EpisodeJob.from_dict(job) for job in manifest.plan.get("jobs")]
    except TraceFormatError as exc:
        raise ManifestError(f"{store.display_uri}/manifest.json: {exc}") from None
    check_shard_map(shard_map, jobs, plan_fp, store.display_uri)
    return FrozenPlan(plan_fp, shard_map, head or manifest, data)


# --------------------------------------------------------------------------- committed output


@dataclass
class ShardResult:
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
            row["problems"] = self.problems[:REPORT_SAMPLE]
        if self.foreign:
            row["foreign_objects"] = self.foreign[:REPORT_SAMPLE]
        return row


def _read_parts(store: ShardedRunStore, index: int, names: list[str]) -> dict[str, tuple[str, bytes] | None]:
    """Read each part once: its sha256 and its bytes as held until the shard is tallied
    (compressed: a plain part of an earlier version is compressed here), None when missing."""
    held: dict[str, tuple[str, bytes] | None] = {}
    # Fetched several at a time (the store's read window); hashed and held in part order.
    for name, data in store.read_parts(index, names):
        held[name] = None if data is None else (sha256_hex(data), data if name.endswith(".zst") else encode_part(data))
    return held


@dataclass
class ShardParts:
    """The parts of one shard that count, each read once: those a verified commit marker lists
    (or, with ``include_uncommitted``, every listed part of a shard without a marker)."""

    result: ShardResult
    parts: list[tuple[str, bytes]] = field(default_factory=list)
    """``(part name, compressed bytes)`` in part order."""


def read_shard_parts(
    store: ShardedRunStore, index: int, shard_map: ShardMap, plan_fp: str, *, include_uncommitted: bool = False
) -> ShardParts:
    """Verify a shard's commit markers and read the parts they commit (the reducer's and the
    research readers' one view of a shard's output)."""
    ids = shard_map.episode_ids[index]
    result = ShardResult(index=index, jobs=len(ids))
    listing = store.list_shard(index)
    result.foreign = listing.foreign
    result.temporary_objects = len(listing.temporary)
    result.listed_parts = len(listing.parts)

    candidates: list[tuple[str, ShardMarker]] = []
    for name, marker in store.read_markers(index, listing.markers):
        problem = marker_problem(marker, index=index, plan_fingerprint=plan_fp, episode_ids_sha256=shard_map.ids_sha256(index))
        if problem is None and isinstance(marker, ShardMarker):
            candidates.append((name, marker))
        else:
            result.problems.append(f"{name} {problem}")
    names: list[str]
    if candidates:
        names = sorted({part.name for _, marker in candidates for part in marker.parts}, key=part_order)
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
        committed = {part.name for marker in verified for part in marker.parts}
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


# --------------------------------------------------------------------------- writing a shard


class PartWriter:
    """A shard's trace writer: buffers encoded traces and writes them as whole parts.

    ``save_traces`` and ``flush_if_stale`` run in threads (``asyncio.to_thread``, off the event loop); one lock
    keeps buffer and part sequence consistent between the episode path and the flush timer.
    It remembers what each part it wrote holds (``written``), so the commit never reads its own
    parts back, and keeps the writer's progress object up to date: after every part and, as a
    heartbeat, every ``heartbeat_seconds`` while the flush timer runs. ``resumed``: the episodes
    the shard had completed when the worker started; ``session``: the worker's writer id, shared
    by the event-loop processes it starts (``status`` adds up the processes of one session).
    """

    def __init__(
        self,
        store: ShardedRunStore,
        shard: int,
        writer: str,
        first_seq: int,
        *,
        flush_episodes: int,
        flush_seconds: float,
        plan_fingerprint: str,
        resumed: Collection[str] = (),
        session: str | None = None,
        heartbeat_seconds: float = 30.0,
    ) -> None:
        self.store, self.shard, self.writer = store, shard, writer
        self.flush_episodes, self.flush_seconds = flush_episodes, flush_seconds
        self._seq = first_seq
        self._buffer: list[bytes] = []
        self._outcomes: list[RecordOutcome] = []
        self._oldest = 0.0
        self._lock = threading.Lock()
        self.written: list[WrittenPart] = []
        self._resumed = frozenset(resumed)
        self._completed: set[str] = set()
        self._failed_attempts = 0
        self._records = 0
        self._progress: dict[str, Any] = {
            "schema_version": PROGRESS_SCHEMA_VERSION,
            "shard": shard,
            "writer": writer,
            "plan_fingerprint": plan_fingerprint,
            "session": session or writer,
            "resumed": len(self._resumed),
            "heartbeat_seconds": heartbeat_seconds,
            "started_at": datetime.now(UTC).isoformat(),
        }
        self._progress_lock = threading.Lock()
        self._last_beat = -math.inf

    def save_traces(self, records: list[EpisodeTrace]) -> None:
        """Buffer ``records`` (the scheduler's group commit, one lock for the batch); a part is
        written once the buffer holds ``flush_episodes`` records."""
        lines = [dump_line(record) for record in records]
        outcomes = [record_outcome(record) for record in records]
        with self._lock:
            if not self._buffer:
                self._oldest = time.monotonic()
            self._buffer.extend(lines)
            self._outcomes.extend(outcomes)
            wrote = len(self._buffer) >= self.flush_episodes and self._flush_locked()
        if wrote:
            self.report_progress()

    def flush(self) -> None:
        with self._lock:
            wrote = self._flush_locked()
        if wrote:
            self.report_progress()

    def flush_if_stale(self) -> None:
        """The timer's call: flush a buffer older than ``flush_seconds``, beat the heartbeat when due."""
        with self._lock:
            wrote = bool(self._buffer) and time.monotonic() - self._oldest >= self.flush_seconds and self._flush_locked()
        if wrote or time.monotonic() - self._last_beat >= self._progress["heartbeat_seconds"]:
            self.report_progress()

    async def flush_stale_parts(self) -> None:
        """Flush a buffer older than ``flush_seconds``, until cancelled. A failed write is logged
        and tried again: the buffer stays until a part holds it (this one, or the final flush)."""
        while True:
            await asyncio.sleep(min(1.0, self.flush_seconds / 4))
            try:
                await asyncio.to_thread(self.flush_if_stale)
            except Exception as exc:
                log.warning("part_flush_failed", error=f"{type(exc).__name__}: {exc}", buffered=self.buffered)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def _flush_locked(self) -> bool:
        if not self._buffer:
            return False
        # The buffer is kept until the part is safely stored, so a failed write loses nothing
        # that a later flush (or the SIGTERM path) could still save.
        name, stored = self.store.write_part(self.shard, self._seq, self.writer, b"".join(self._buffer))
        part = WrittenPart(part_entry(name, stored, len(self._buffer)), tuple(self._outcomes))
        self._seq = int(PART_PATTERN.match(name).group(1)) + 1  # type: ignore[union-attr]
        self.written.append(part)
        self._records += len(self._outcomes)
        self._completed.update(o.episode_id for o in self._outcomes if o.completed and o.episode_id not in self._resumed)
        self._failed_attempts += sum(1 for o in self._outcomes if not o.completed)
        log.info("part_written", part=name, records=len(self._buffer), bytes=len(stored), lines_bytes=sum(map(len, self._buffer)))
        self._buffer.clear()
        self._outcomes.clear()
        return True

    def report_progress(self, state: str = "running") -> None:
        """Rewrite this writer's progress object. Advisory: one try, a failure is only logged
        (the next part or heartbeat writes it again)."""
        with self._progress_lock:
            self._last_beat = time.monotonic()
            progress = {
                **self._progress,
                "state": state,
                "completed": len(self._completed),
                "failed_attempts": self._failed_attempts,
                "parts_written": len(self.written),
                "records_written": self._records,
                "updated_at": datetime.now(UTC).isoformat(),
            }
            try:
                self.store.write_progress(self.shard, progress)
            except Exception as exc:
                log.warning("progress_not_written", error=f"{type(exc).__name__}: {exc}")


def commit_shard(
    store: ShardedRunStore,
    index: int,
    episode_ids: list[str],
    *,
    plan_fp: str,
    writer: str,
    state: ShardState | None = None,
    exclude: Collection[str] = (),
    written: Sequence[WrittenPart] = (),
) -> tuple[str, int]:
    """Add a commit marker for the shard; returns its name and the completed episode count.

    The marker lists exactly the parts hashed: every part now listed (ours and any concurrent
    writer's, less ``exclude``) and every part this process wrote (``written``), by name even
    when a listing does not show it yet. Parts already in ``state`` and the ones this process
    wrote (whose bytes and sha256 it knows) are not read again; only a concurrent writer's new
    parts are. The marker is a new object, never a replacement: the reducer takes the union of
    the verified markers, whatever order they were written in.
    """
    state = scan_shard(store, index, set(episode_ids), state, exclude=exclude, written=written)
    completed = len(state.completed)
    document = marker_document(
        shard=index,
        plan_fingerprint=plan_fp,
        completed=completed,
        failed=len(episode_ids) - completed,
        episode_ids_sha256=fingerprint(episode_ids),
        parts=[state.parts[name] for name in sorted(state.parts, key=part_order)],
        writer=writer,
    )
    return store.create_marker(index, document), completed


@dataclass
class MarkerCheck:
    """A shard's markers checked against its parts as read (the reducer's rules)."""

    verified: list[ShardMarker] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    distrusted: set[str] = field(default_factory=set)
    """Parts whose bytes differ from the sha256 a marker recorded for them."""


def check_markers(store: ShardedRunStore, index: int, plan_fp: str, ids_sha: str, state: ShardState) -> MarkerCheck:
    """The shard's markers against the parts as read: the same rules as the reducer's."""
    check = MarkerCheck()
    actual = {name: entry["sha256"] for name, entry in state.parts.items()}
    for name, marker in store.read_markers(index):
        problem = marker_problem(marker, index=index, plan_fingerprint=plan_fp, episode_ids_sha256=ids_sha)
        if problem is not None or not isinstance(marker, ShardMarker):
            check.ignored.append((name, problem or "not a commit marker"))
            continue
        problems = marker_part_problems(marker, actual)
        if not problems:
            check.verified.append(marker)
            continue
        check.ignored.append((name, "; ".join(problems[:5])))
        check.distrusted |= {p.name for p in marker.parts if actual.get(p.name) not in (None, p.sha256)}
    return check
