"""The judge stage sharded like rollouts: ``judge plan`` → Indexed Job workers → ``judge reduce``.

It uses the sharded run layout's objects and protocol (:mod:`shopsimrl.storage.sharded`): parts
named by sequence and writer id (zstd), written once; commit markers ``_SUCCESS*.json`` that
list parts with their sha256 and are never replaced; a shard's committed parts are the union of
the parts of the markers that verify. At a judge location (a directory or any fsspec URI)::

    judge_plan.json                    the frozen plan: judge identity and fingerprint, the rubric's
                                       text, the frozen settings, the shard map (create-only,
                                       written last: its presence means the inputs are there)
    inputs/00003.jsonl.zst             shard 3's judge inputs, frozen by the planner (create-only)
    shards/00003/part-00000-<w>.jsonl.zst  judge output records written by worker <w>
    shards/00003/_SUCCESS*.json        commit markers (plan_fingerprint = the judge fingerprint)
    judge_outputs.jsonl                written by the reducer: one record per episode, by episode id
    judge_summary.json                 written by the reducer

The planner reads the run once; workers read only their inputs. A worker resumes its shard: the
records of every whole part already there (a killed predecessor's too) count as done when
their status is ``ok`` or ``unparseable``; a part cut short is not trusted. It writes a part every ``flush_every`` verdicts, commits
when its inputs are done, and exits 1 when some episodes ended in ``error`` (the Indexed Job's
per-index retry judges them again). At SIGTERM/SIGINT it cancels the calls in flight, writes the
verdicts it holds as a part, and exits 3 (retryable) without a marker: the next pod of the index
resumes from the parts. The reducer keeps one record per episode: a done record
before an ``error`` one, the first in part order otherwise.
"""

from __future__ import annotations

import io
import secrets
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any, TypeVar

import orjson
import structlog
import zstandard

from shopsimrl import eventloop
from shopsimrl.exitcodes import ExitCode
from shopsimrl.manifest import FingerprintMismatchError
from shopsimrl.records import ShardMarker
from shopsimrl.research.judge.call import judged
from shopsimrl.research.judge.config import JudgeConfig, Rubric, rubric_from_bytes
from shopsimrl.research.judge.local import OUTPUTS_NAME, SUMMARY_NAME, judge_header, judge_stream, summarize
from shopsimrl.schemas import fingerprint, json_bytes, parse_json_exact, sha256_hex
from shopsimrl.storage.reading import Run, open_run
from shopsimrl.storage.sharded import (
    ShardedRunStore,
    ShardMapError,
    marker_document,
    marker_part_problems,
    marker_problem,
    part_entry,
    part_lines,
)

__all__ = [
    "JUDGE_PLAN_VERSION",
    "JudgePlan",
    "JudgePlanError",
    "ShardOutput",
    "committed_parts",
    "freeze_shard_inputs",
    "judge_status",
    "part_records",
    "plan_judge",
    "read_plan_document",
    "reduce_judge",
    "run_judge_worker",
    "scan_parts",
    "shard_input",
    "shard_rows",
    "stream_inputs",
]

log = structlog.get_logger("shopsimrl.research.judge.sharded")

JUDGE_PLAN_VERSION = "shopsimrl-judge-plan-v1"
PLAN_NAME = "judge_plan.json"

_Plan = TypeVar("_Plan")


class JudgePlanError(ValueError):
    """No judge plan at the location, or one that cannot be read (exit 2)."""


def _inputs_name(index: int) -> str:
    return f"inputs/{index:05d}.jsonl.zst"


def part_records(name: str, data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON object lines of a stored part (the skill builder's sharded stage reads its
    parts the same way); a torn tail yields nothing."""
    lines, _whole = part_lines(name, data)
    for raw in lines.split(b"\n"):
        if raw.strip():
            try:
                record = parse_json_exact(raw)
            except ValueError:
                continue  # a torn tail of a part cut short: its episodes are done again
            if isinstance(record, dict):
                yield record


@dataclass
class JudgePlan:
    document: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return str(self.document["judge"]["fingerprint"])

    @property
    def shards(self) -> int:
        return len(self.document["shard_map"])

    def rubric(self, uri: str) -> Rubric:
        return rubric_from_bytes(self.document["rubric_text"].encode("utf-8"), f"{uri}/{PLAN_NAME}#rubric_text")


def read_plan_document(
    store: ShardedRunStore,
    name: str,
    make: Callable[[dict[str, Any]], _Plan],
    error: Callable[[str], Exception],
    *,
    stage: str,
    version_key: str,
    version: str,
) -> _Plan:
    """``make(document)`` of the plan ``name`` at ``store`` (the judge's and the skills stage's
    plans share this shape); ``error(message)`` raised when it is missing (naming ``shopsimrl
    STAGE plan``), not JSON, or not of ``version`` under ``version_key``."""
    data = store.read_bytes(name)
    if data is None:
        raise error(f"{store.display_uri} has no {name}; run `shopsimrl {stage} plan` first")
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise error(f"{store.display_uri}/{name} is not JSON") from None
    if not isinstance(document, dict) or document.get(version_key) != version:
        raise error(f"{store.display_uri}/{name}: unknown {version_key}")
    return make(document)


def read_plan(store: ShardedRunStore) -> JudgePlan:
    return read_plan_document(
        store, PLAN_NAME, JudgePlan, JudgePlanError, stage="judge", version_key="judge_plan_version", version=JUDGE_PLAN_VERSION
    )


def _encoded_shard(spool: IO[bytes], spans: list[tuple[int, int]]) -> bytes:
    """One shard's judge inputs as a zstd part, compressed line by line from the spool (the
    uncompressed shard is never held whole)."""
    compressor = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj()
    chunks = []
    for offset, size in spans:
        spool.seek(offset)
        chunks.append(compressor.compress(spool.read(size)))
    chunks.append(compressor.flush())
    return b"".join(chunks)


def freeze_shard_inputs(
    store: ShardedRunStore, lines: Iterable[tuple[str, bytes]], shards: int
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Write one input object per shard (``inputs/NNNNN.jsonl.zst``, create-only) from
    ``(episode id, JSON line)`` pairs, streamed: round-robin over the episode ids in sorted
    order. Returns the shard map and each input's ``name``, ``sha256``, ``records`` and
    ``ids_sha256``."""
    with tempfile.TemporaryFile("w+b") as spool:
        # One line per episode in a spool, its span kept: memory holds ids and offsets only.
        spans: dict[str, tuple[int, int]] = {}
        for episode_id, body in lines:
            line = body + b"\n"
            spans[episode_id] = (spool.tell(), len(line))
            spool.write(line)
        if shards < 1 or shards > max(1, len(spans)):
            raise ShardMapError(f"--shards {shards}: choose 1 to {max(1, len(spans))} (the episodes selected)")
        ordered = sorted(spans)
        shard_map, inputs = [], []
        for index in range(shards):
            ids = ordered[index::shards]
            data = _encoded_shard(spool, [spans[episode] for episode in ids])
            if not store.create(_inputs_name(index), data):
                raise ShardMapError(f"{store.display_uri}/{_inputs_name(index)} holds other inputs; use another location")
            shard_map.append(ids)
            inputs.append(
                {"name": _inputs_name(index), "sha256": sha256_hex(data), "records": len(ids), "ids_sha256": fingerprint(ids)}
            )
    return shard_map, inputs


def plan_judge(
    config: JudgeConfig, rubric: Rubric, rubric_text: str, run: Run, uri: str, shards: int, selected: Iterable[dict[str, Any]]
) -> JudgePlan:
    """Freeze the judge inputs (``selected``, one judge input per episode, streamed) into
    ``shards`` shards at ``uri``: round-robin over the episode ids in sorted order. Planning again
    with the same config, rubric and shard count finds the plan."""
    store = ShardedRunStore(uri)
    header = judge_header(config, rubric, run)
    if store.read_bytes(PLAN_NAME) is not None:
        plan = read_plan(store)
        if plan.fingerprint != header["judge"]["fingerprint"]:
            raise FingerprintMismatchError(store.display_uri, plan.fingerprint, header["judge"]["fingerprint"], [])
        if plan.shards != shards:
            raise ShardMapError(f"{store.display_uri} is frozen with {plan.shards} shards, not {shards}")
        return plan
    shard_map, inputs = freeze_shard_inputs(store, ((str(item["episode_id"]), json_bytes(item)) for item in selected), shards)
    document = {
        "judge_plan_version": JUDGE_PLAN_VERSION,
        "created_at": datetime.now(UTC).isoformat(),
        **header,
        "rubric_text": rubric_text,
        "selected": sum(len(ids) for ids in shard_map),
        "flush_every": config.flush_every,
        "shard_map": shard_map,
        "inputs": inputs,
    }
    if not store.create(PLAN_NAME, orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)):
        plan = read_plan(store)  # a concurrent planner won: the same plan, or a mismatch
        if plan.fingerprint != header["judge"]["fingerprint"] or plan.shards != shards:
            raise FingerprintMismatchError(store.display_uri, plan.fingerprint, header["judge"]["fingerprint"], [])
        return plan
    return JudgePlan(document)


def stream_inputs(data: bytes) -> Iterator[dict[str, Any]]:
    """A shard's judge inputs, decompressed line by line."""
    reader = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)))
    for raw in reader:
        if raw.strip():
            yield parse_json_exact(raw)


def scan_parts(
    store: ShardedRunStore, index: int, is_done: Callable[[dict[str, Any]], bool] = judged
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], int]:
    """(done records by episode id, part entries of whole parts, next sequence number) of the
    parts already in shard ``index`` (a killed predecessor's too); ``is_done``: which records
    count as done."""
    done: dict[str, dict[str, Any]] = {}
    entries, next_seq = [], 0
    for name in store.list_shard(index).parts:
        next_seq = max(next_seq, int(name.split("-")[1]) + 1)
        data = store.read_part(index, name)
        if data is None:
            continue
        _lines, whole = part_lines(name, data)
        records = list(part_records(name, data))
        if not whole:
            continue  # a torn part is not trusted: no marker lists it, so its episodes are done again
        entries.append(part_entry(name, data, len(records)))
        for record in records:
            if is_done(record):
                done.setdefault(str(record["episode_id"]), record)
    return done, entries, next_seq


class ShardOutput:
    """What a shard worker writes: records buffered into immutable parts (every ``flush_every``
    records, and at every ``flush()``), then the shard's marker naming them. Resumes from
    :func:`scan_parts`: what a predecessor left counts as done, new parts continue its sequence."""

    def __init__(
        self, store: ShardedRunStore, index: int, *, flush_every: int, is_done: Callable[[dict[str, Any]], bool] = judged
    ) -> None:
        self.store, self.index, self.flush_every = store, index, flush_every
        self.done, self.entries, self._seq = scan_parts(store, index, is_done)
        self.writer = secrets.token_hex(4)
        self.errors = 0
        self._buffer: list[bytes] = []

    def add(self, record: dict[str, Any], *, ok: bool) -> None:
        """Buffer ``record``; ``ok``: it is done, else an error that leaves the shard unfinished."""
        self._buffer.append(json_bytes(record) + b"\n")
        if ok:
            self.done[str(record["episode_id"])] = record
        else:
            self.errors += 1
        if len(self._buffer) >= self.flush_every:
            self.flush()  # from the event loop's thread: a part is small and the store call is short

    def flush(self) -> None:
        if not self._buffer:
            return
        name, stored = self.store.write_part(self.index, self._seq, self.writer, b"".join(self._buffer))
        self.entries.append(part_entry(name, stored, len(self._buffer)))
        log.info("part_written", shard=self.index, part=name, records=len(self._buffer))
        self._seq += 1
        self._buffer.clear()

    def commit(self, *, plan_fingerprint: str, ids_sha256: str) -> str:
        """Create the shard's marker over every whole part; its name."""
        marker = marker_document(
            shard=self.index,
            plan_fingerprint=plan_fingerprint,
            completed=len(self.done),
            failed=self.errors,
            episode_ids_sha256=ids_sha256,
            parts=self.entries,
            writer=self.writer,
        )
        return self.store.create_marker(self.index, marker)


def shard_input(store: ShardedRunStore, spec: dict[str, Any], error: Callable[[str], Exception]) -> bytes:
    """The frozen inputs of one shard, checked against the plan's sha256."""
    data = store.read_bytes(spec["name"])
    if data is None or sha256_hex(data) != spec["sha256"]:
        raise error(f"{store.display_uri}/{spec['name']} is missing or differs from the plan")
    return data


async def _judge_until_stopped(
    config: JudgeConfig, rubric: Rubric, todo: Iterable[dict[str, Any]], sink: Callable[[dict[str, Any]], None]
) -> bool:
    """Judge ``todo``; True when SIGTERM/SIGINT stopped it (in-flight calls are cancelled, the
    verdicts already handed to ``sink`` stay)."""
    from shopsimrl.runner.driver import drive

    driven = await drive(judge_stream(config, rubric, todo, sink), cleanup="saving the verdicts judged so far")
    return driven.interrupted


def run_judge_worker(config: JudgeConfig, uri: str, index: int) -> ExitCode:
    """Judge shard ``index`` of the plan at ``uri`` (resuming it) and commit it."""
    store = ShardedRunStore(uri)
    plan = read_plan(store)
    if not 0 <= index < plan.shards:
        raise ShardMapError(f"shard index {index} is outside the plan's {plan.shards} shards")
    rubric = plan.rubric(store.display_uri)
    source = plan.document["source"]
    ours = fingerprint({"source": source, "rubric": rubric.to_dict(), "config": config.frozen()})
    if ours != plan.fingerprint:
        raise FingerprintMismatchError(store.display_uri, plan.fingerprint, ours, [])
    spec = plan.document["inputs"][index]
    data = shard_input(store, spec, JudgePlanError)
    output = ShardOutput(store, index, flush_every=int(plan.document.get("flush_every") or config.flush_every))
    todo = (item for item in stream_inputs(data) if str(item["episode_id"]) not in output.done)
    log.info("judge_shard_started", shard=index, episodes=spec["records"], already_judged=len(output.done), writer=output.writer)
    try:
        stopped = eventloop.run(_judge_until_stopped(config, rubric, todo, lambda record: output.add(record, ok=judged(record))))
    finally:
        output.flush()  # on every path, a signal's too: what was judged is saved before the exit
    if stopped:
        log.warning("judge_shard_interrupted", shard=index, judged=len(output.done), parts=len(output.entries))
        return ExitCode.RETRYABLE  # no marker: the index's next pod resumes from the parts
    name = output.commit(plan_fingerprint=plan.fingerprint, ids_sha256=spec["ids_sha256"])
    log.info("judge_shard_committed", shard=index, marker=name, judged=len(output.done), errors=output.errors)
    return ExitCode.EPISODES_FAILED if output.errors or len(output.done) < spec["records"] else ExitCode.OK


@dataclass
class ReduceResult:
    summary: dict[str, Any]
    outputs: str
    summary_path: str
    missing_shards: list[int]

    @property
    def code(self) -> ExitCode:
        if self.missing_shards or self.summary["status"].get("error") or self.summary["episodes"]["missing"]:
            return ExitCode.EPISODES_FAILED
        return ExitCode.OK


def _committed(store: ShardedRunStore, plan: JudgePlan, index: int) -> list[tuple[str, bytes]] | None:
    spec = plan.document["inputs"][index]
    return committed_parts(store, index, plan_fingerprint=plan.fingerprint, ids_sha256=spec["ids_sha256"])


def committed_parts(
    store: ShardedRunStore, index: int, *, plan_fingerprint: str, ids_sha256: str
) -> list[tuple[str, bytes]] | None:
    """The shard's committed parts (union over the markers that verify: this plan and shard
    map, every listed part present with its sha256), None without one."""
    cache: dict[str, bytes | None] = {}
    names: dict[str, None] = {}
    verified = False
    for marker_name, marker in store.read_markers(index):
        problem = marker_problem(marker, index=index, plan_fingerprint=plan_fingerprint, episode_ids_sha256=ids_sha256)
        if problem is not None or not isinstance(marker, ShardMarker):
            log.warning("marker_ignored", shard=index, marker=marker_name, reason=problem)
            continue
        for part in marker.parts:
            if part.name not in cache:
                cache[part.name] = store.read_part(index, part.name)
        actual = {name: None if data is None else sha256_hex(data) for name, data in cache.items()}
        problems = marker_part_problems(marker, actual)
        if problems:
            log.warning("marker_ignored", shard=index, marker=marker_name, reason="; ".join(problems))
            continue
        verified = True
        names.update({part.name: None for part in marker.parts})
    if not verified:
        return None
    return [(name, data) for name in names if (data := cache[name]) is not None]


def _summary_shards(store: ShardedRunStore) -> int | None:
    """How many committed shards the last ``judge reduce`` summarized (None: no summary yet)."""
    data = store.read_bytes(SUMMARY_NAME)
    if data is None:
        return None
    try:
        return int(orjson.loads(data)["shards"]["committed"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def shard_rows(store: ShardedRunStore, inputs: list[dict[str, Any]], plan_fingerprint: str, *, done: str) -> list[dict[str, Any]]:
    """One row per shard of a planned stage from its listing and commit markers (no part read):
    ``state`` committed (``done`` and ``errors`` from the best marker), corrupt-marker, started
    or not started; ``inputs`` are the plan's per-shard input specs."""
    rows = []
    for index, spec in enumerate(inputs):
        listing = store.list_shard(index)
        row: dict[str, Any] = {"shard": index, "episodes": spec["records"], "parts": len(listing.parts)}
        markers = store.plan_markers(
            index, plan_fingerprint=plan_fingerprint, episode_ids_sha256=spec["ids_sha256"], names=listing.markers
        )
        if markers:
            best = max(markers, key=lambda m: (m.episodes.completed, len(m.parts)))
            row.update({"state": "committed", done: best.episodes.completed, "errors": best.episodes.failed})
        else:
            row["state"] = "corrupt-marker" if listing.markers else "started" if listing.parts else "not started"
        rows.append(row)
    return rows


def judge_status(uri: str) -> dict[str, Any]:
    """Per-shard progress of a judge location from its commit markers and part listings; no
    part is read, so a call costs a listing and the markers whatever the number of verdicts.
    A committed shard's counts are its marker's (the reducer verifies the parts); an
    uncommitted one shows its parts (each holds at most ``flush_every`` verdicts)."""
    store = ShardedRunStore(uri)
    plan = read_plan(store)
    rows = shard_rows(store, plan.document["inputs"][: plan.shards], plan.fingerprint, done="judged")
    committed = [row for row in rows if row["state"] == "committed"]
    return {
        "judge_location": store.display_uri,
        "judge_fingerprint": plan.fingerprint,
        "episodes": int(plan.document["selected"]),
        "flush_every": int(plan.document.get("flush_every") or 0) or None,
        "committed_shards": len(committed),
        "judged_in_committed_shards": sum(row["judged"] for row in committed),
        "summary_over_shards": _summary_shards(store),
        "shards": rows,
    }


def wait_for_commits(uri: str, *, timeout_s: float, interval_s: float = 5.0) -> list[int]:
    """Wait until every shard of the plan has a commit marker that verifies, at most
    ``timeout_s``; returns the shards still without one (the reducer Job of the chart starts
    beside the workers)."""
    store = ShardedRunStore(uri)
    deadline = time.monotonic() + timeout_s
    while True:
        plan = read_plan(store)
        missing = [index for index in range(plan.shards) if _committed(store, plan, index) is None]
        if not missing or time.monotonic() >= deadline:
            return missing
        log.info("waiting_for_shards", missing=len(missing))
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


def reduce_judge(uri: str, *, wait_s: float | None = None) -> ReduceResult:
    """One record per episode from the committed shards → ``judge_outputs.jsonl`` and
    ``judge_summary.json`` at the judge location. ``wait_s``: first wait that long at most for
    every shard to commit (the plan too: a reducer may start before the planner is done)."""
    store = ShardedRunStore(uri)
    if wait_s is not None:
        deadline = time.monotonic() + wait_s
        while store.read_bytes(PLAN_NAME) is None and time.monotonic() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        wait_for_commits(uri, timeout_s=max(0.0, deadline - time.monotonic()))
    plan = read_plan(store)
    chosen: dict[str, dict[str, Any]] = {}
    missing = []
    for index in range(plan.shards):
        parts = _committed(store, plan, index)
        if parts is None:
            missing.append(index)
            continue
        for name, data in parts:
            for record in part_records(name, data):
                episode = str(record["episode_id"])
                held = chosen.get(episode)
                if held is None or (not judged(held) and judged(record)):
                    chosen[episode] = record
    records = [chosen[episode] for episode in sorted(chosen)]
    store.overwrite(OUTPUTS_NAME, b"".join(json_bytes(record) + b"\n" for record in records))
    run = open_run(plan.document["source"]["location"])
    header = {key: plan.document[key] for key in ("judge", "rubric", "judge_model", "source", "config")}
    summary = summarize(records, run, int(plan.document["selected"]), header)
    summary["shards"] = {"count": plan.shards, "committed": plan.shards - len(missing), "missing": missing}
    store.overwrite(SUMMARY_NAME, orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))
    return ReduceResult(summary, store.path(OUTPUTS_NAME), store.path(SUMMARY_NAME), missing)
