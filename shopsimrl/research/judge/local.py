"""``shopsimrl judge JUDGE.yaml``: the judge stage in one process, resumable.

Writes into the config's ``output`` directory (never inside the run)::

    judge_manifest.json    what the outputs are bound to: source run, rubric (version, sha256),
                           judge model, frozen settings, and their fingerprint (create-once)
    judge_outputs.jsonl    one record per judged episode (call.py), appended as each finishes
    judge_summary.json     written at the end of every invocation (summary.py)

Resume: a restart reads ``judge_outputs.jsonl`` and skips the episodes already there with status
``ok`` or ``unparseable`` (:func:`~shopsimrl.research.judge.call.judged`). A torn last line (a
process killed mid-write) is cut off and logged; records with status ``error`` (the
infrastructure failed), and ``unparseable`` ones that counted replies that were not the API's
JSON, are dropped so that the episode is judged again; either way the file is first rewritten whole (a temporary file renamed into place)
with the kept records, so it never holds two records of one episode. A line that is not a
record anywhere else, or records of another rubric, are refused (exit 2): the output belongs to
another judge run.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import structlog

from shopsimrl.records import EpisodeTrace
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.judge.call import JUDGE_OUTPUT_VERSION, judge_episode, judge_model, judged, model_identity
from shopsimrl.research.judge.config import JudgeConfig, JudgeConfigError, Rubric, judge_fingerprint
from shopsimrl.research.judge.summary import judge_summary
from shopsimrl.research.labels import episode_labels
from shopsimrl.research.outputs import check_output_location, replacing
from shopsimrl.schemas import json_bytes, parse_json_exact
from shopsimrl.storage.reading import Run

__all__ = [
    "JUDGE_MANIFEST_VERSION",
    "MANIFEST_NAME",
    "OUTPUTS_NAME",
    "SUMMARY_NAME",
    "JudgeOutputError",
    "JudgeResult",
    "judge_header",
    "judge_stream",
    "read_outputs",
    "run_local_judge",
    "summarize",
]

log = structlog.get_logger("shopsimrl.research.judge")

JUDGE_MANIFEST_VERSION = "shopsimrl-judge-manifest-v1"
OUTPUTS_NAME = "judge_outputs.jsonl"
SUMMARY_NAME = "judge_summary.json"
MANIFEST_NAME = "judge_manifest.json"


class JudgeOutputError(ValueError):
    """An output location holding another judge run's files, or unreadable ones (exit 2)."""


def source_identity(run: Run) -> dict[str, Any]:
    identity = run.identity
    return {"location": run.location, "kind": run.kind, "plan_fingerprint": identity.get("plan_fingerprint")}


def judge_header(config: JudgeConfig, rubric: Rubric, run: Run) -> dict[str, Any]:
    """What outputs, manifest and summary name: the judge run's identity (no credentials)."""
    source = source_identity(run)
    return {
        "judge": {"name": config.name, "fingerprint": judge_fingerprint(config, rubric, source)},
        "rubric": {"rubric_version": rubric.version, "rubric_sha256": rubric.sha256, "path": rubric.path},
        "judge_model": model_identity(config),
        "source": source,
        "config": config.frozen(),
    }


@dataclass
class ExistingOutputs:
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    """Records of status ``error``: the episode is judged again on resume."""
    torn: bool = False
    duplicates: int = 0


def read_outputs(path: Path, rubric_sha256: str) -> ExistingOutputs:
    """The records already in ``path`` (see the module docstring for what is refused)."""
    found = ExistingOutputs()
    if not path.exists():
        return found
    data = path.read_bytes()
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = number == len(lines) or (number == len(lines) - 1 and not lines[-1])
        try:
            record = parse_json_exact(raw)
        except ValueError:
            record = None
        whole = number < len(lines)  # a line followed by a newline was written whole
        if not isinstance(record, dict) or not whole:
            if last:
                found.torn = True
                continue
            raise JudgeOutputError(f"{path}:{number}: not a judge output record; the file is damaged beyond a torn last line")
        if record.get("judge_output_version") != JUDGE_OUTPUT_VERSION:
            raise JudgeOutputError(f"{path}:{number}: unknown judge_output_version {record.get('judge_output_version')!r}")
        if record.get("rubric_sha256") != rubric_sha256:
            raise JudgeOutputError(
                f"{path}:{number}: a verdict of another rubric ({str(record.get('rubric_sha256'))[:12]}…); "
                "give this judge run another output"
            )
        if not judged(record):
            found.errors.append(record)
        elif record["episode_id"] in found.done:
            found.duplicates += 1
        else:
            found.done[record["episode_id"]] = record
    return found


def _check_manifest(output: Path, header: dict[str, Any]) -> None:
    path = output / MANIFEST_NAME
    if path.exists():
        try:
            existing = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError:
            raise JudgeOutputError(f"{path}: not JSON") from None
        theirs = (existing.get("judge") or {}).get("fingerprint")
        if theirs != header["judge"]["fingerprint"]:
            raise JudgeOutputError(
                f"{output} holds judge run {str(theirs)[:12]}…, not {header['judge']['fingerprint'][:12]}… "
                "(another source, rubric, model or selection); give this judge run another output"
            )
        return
    manifest = {"judge_manifest_version": JUDGE_MANIFEST_VERSION, "created_at": datetime.now(UTC).isoformat(), **header}
    with replacing(path) as out:
        out.write(orjson.dumps(manifest, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))


@dataclass
class JudgeResult:
    summary: dict[str, Any]
    outputs: str
    summary_path: str
    written: int

    @property
    def errors(self) -> int:
        return int(self.summary["status"].get("error", 0)) + int(self.summary["episodes"]["missing"])


async def judge_stream(
    config: JudgeConfig,
    rubric: Rubric,
    items: Iterable[dict[str, Any]],
    sink: Callable[[dict[str, Any]], None],
) -> int:
    """Judge ``items`` (judge inputs), at most ``concurrency`` at once, handing each record to
    ``sink`` as it finishes; returns how many were judged. Items are drawn as slots free up,
    so a large run is never held in memory."""
    model = judge_model(config)
    model.check_api_key()
    identity = model_identity(config)
    tool = rubric.tool(length_bounds=config.model.send_length_bounds)
    slots = asyncio.Semaphore(config.concurrency)
    pending: set[asyncio.Task[None]] = set()
    written = 0

    async def one(item: dict[str, Any]) -> None:
        nonlocal written
        try:
            record = await judge_episode(model, rubric, item, max_repairs=config.max_repairs, identity=identity, tool=tool)
            sink(record)
            written += 1
        finally:
            slots.release()

    try:
        for item in items:
            await slots.acquire()
            task = asyncio.create_task(one(item))
            pending.add(task)
            task.add_done_callback(pending.discard)
        while pending:
            await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()
        await model.aclose()
    return written


def _facts(record: EpisodeTrace) -> tuple[dict[str, Any], list[str]]:
    """An episode's row and its rule labels."""
    return episode_row(record), episode_labels(record)["labels"]


def episode_facts(run: Run) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """episode id → (its row, its rule labels), for the summary (one more pass over the run)."""
    facts = run.winner_views(_facts)
    return {str(row["episode_id"]): (row, labels) for row, labels in facts}


def summarize(records: Iterable[dict[str, Any]], run: Run, selected: int, header: dict[str, Any]) -> dict[str, Any]:
    return judge_summary(records, episode_facts(run), selected=selected, header=header)


def run_local_judge(
    config: JudgeConfig,
    rubric: Rubric,
    run: Run,
    *,
    select_inputs: Callable[[Run], Iterator[tuple[dict[str, Any], dict[str, Any]]]],
) -> JudgeResult:
    """Judge every selected episode not yet judged in the output directory; write the summary."""
    if config.output is None:
        raise JudgeConfigError(f"{config.source_path}: output: required for `shopsimrl judge` (a directory outside the run)")
    if "://" in config.output:
        raise JudgeConfigError(
            f"{config.source_path}: output: `shopsimrl judge` writes a local directory; judge into a URI with `judge plan --out`"
        )
    output = Path(config.resolve(config.output))
    outputs = output / OUTPUTS_NAME
    check_output_location(run, outputs)
    header = judge_header(config, rubric, run)
    output.mkdir(parents=True, exist_ok=True)
    _check_manifest(output, header)
    existing = read_outputs(outputs, rubric.sha256)
    if existing.torn or existing.errors or existing.duplicates:
        log.warning(
            "judge_outputs_repaired",
            path=str(outputs),
            torn_last_line=existing.torn,
            error_records_dropped=len(existing.errors),
            duplicates_dropped=existing.duplicates,
        )
        with replacing(outputs) as out:
            for record in existing.done.values():
                out.write(json_bytes(record) + b"\n")
    if existing.done:
        log.info("judge_resumed", already_judged=len(existing.done))

    selected = 0

    def todo() -> Iterator[dict[str, Any]]:
        nonlocal selected
        for _row, item in select_inputs(run):
            selected += 1
            if item["episode_id"] not in existing.done:
                yield item

    handle = os.open(outputs, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def sink(record: dict[str, Any]) -> None:
        # One write per record on an O_APPEND descriptor: a kill leaves at most a torn last line.
        os.write(handle, json_bytes(record) + b"\n")

    try:
        written = asyncio.run(judge_stream(config, rubric, todo(), sink))
        os.fsync(handle)
    finally:
        os.close(handle)
    records = read_outputs(outputs, rubric.sha256)
    summary = summarize([*records.done.values(), *records.errors], run, selected, header)
    summary_path = output / SUMMARY_NAME
    with replacing(summary_path) as out:
        out.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))
    return JudgeResult(summary, str(outputs), str(summary_path), written)
