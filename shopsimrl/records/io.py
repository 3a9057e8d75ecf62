"""Reading and writing records: one JSON line per trace, JSON documents for the rest.

Writing goes through orjson (a record's known keys it has, in declaration order, then its other
keys); a trace costs about twice the plain dict encoding, tens of microseconds per episode
(docs/benchmarks.md). Reading parses with orjson and validates with the record's model. Every
reader checks the schema version first: a newer version of the same kind is refused with
:class:`RecordVersionError` naming it, a record that does not fit its model with
:class:`RecordFormatError` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from shopsimrl.records._base import Record, RecordVersionError, check_version
from shopsimrl.records.manifest import MANIFEST_SCHEMA_VERSIONS, RunManifest
from shopsimrl.records.marker import MARKER_SCHEMA_VERSION, ShardMarker
from shopsimrl.records.summary import SUMMARY_SCHEMA_VERSIONS, EvalSummary
from shopsimrl.records.trace import TRACE_SCHEMA_VERSIONS, EpisodeTrace
from shopsimrl.schemas import TraceFormatError, escape_lone_surrogates, fingerprint, json_bytes, json_safe

__all__ = [
    "ManifestIntegrityError",
    "RecordFormatError",
    "RecordVersionError",
    "decode_json",
    "dump_document",
    "dump_line",
    "iter_trace_lines",
    "parse_trace_line",
    "plain",
    "read_manifest",
    "read_marker",
    "read_summary",
    "read_trace",
    "to_plain",
]

R = TypeVar("R", bound=Record)


class RecordFormatError(TraceFormatError):
    """A record that does not fit its model; the message names the field."""


class ManifestIntegrityError(RecordFormatError):
    """The manifest's stored fingerprint does not match its own plan: it was edited."""


def plain(value: Any) -> Any:
    """orjson's ``default``: a record as the object it is written as (the keys it has)."""
    if isinstance(value, Record):
        fields_set = value.__pydantic_fields_set__
        out = {key: item for key, item in value.__dict__.items() if key in fields_set}
        extra = value.__pydantic_extra__
        if extra:
            out.update(extra)
        return out
    raise TypeError(f"{type(value).__name__} is not JSON")


def to_plain(value: Any) -> Any:
    """``value`` with every record in it turned into the object it is written as."""
    if isinstance(value, Record):
        value = plain(value)
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    return value


def dump_line(record: Record | dict[str, Any]) -> bytes:
    """One compact JSONL line (orjson). Text that is not valid Unicode (a lone surrogate a model
    server sent) is kept exactly, written as its ``\\uXXXX`` escape (:func:`schemas.json_bytes`).
    A value JSON cannot hold (an odd object of a custom adapter) is made safe and the line flagged
    ``serialization_repaired``, never fatal: one odd payload must not abort a run. A non-finite
    float is written as null."""
    try:
        return orjson.dumps(record, default=plain, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        value = to_plain(record)
    try:
        return json_bytes(value) + b"\n"
    except (TypeError, ValueError):
        safe = json_safe(value)
        if isinstance(safe, dict):
            safe.setdefault("serialization_repaired", True)
        return json_bytes(safe) + b"\n"


def dump_document(record: Record | dict[str, Any]) -> bytes:
    """A document as stored: indented UTF-8 JSON. Integers beyond 64 bits and lone surrogates
    (written as their escape) go through the standard library."""
    try:
        return orjson.dumps(record, default=plain, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        value = to_plain(record)
    text = json.dumps(value, ensure_ascii=False, indent=2, allow_nan=False) + "\n"
    return escape_lone_surrogates(text).encode("utf-8")


def decode_json(data: bytes | str) -> Any:
    """JSON text as Python values; NaN and Infinity (which some writers produce) as null."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data, parse_constant=lambda _: None)


def _check_version(where: str, value: Any, accepted: tuple[str, ...], *, kind: str, prefix: str) -> None:
    try:
        check_version(value, accepted, kind=kind, prefix=prefix)
    except RecordVersionError as exc:
        raise RecordVersionError(f"{where}: {exc}") from None


def _validate(model: type[R], value: Any, where: str) -> R:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(record)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise RecordFormatError(f"{where}: {field}: {first['msg']}{more}") from None


def read_trace(value: Any, where: str = "trace") -> EpisodeTrace:
    """A trace record from its parsed JSON object."""
    if not isinstance(value, dict):
        raise RecordFormatError(f"{where}: a trace record must be a JSON object")
    _check_version(where, value.get("schema_version"), TRACE_SCHEMA_VERSIONS, kind="trace record", prefix="shopsimrl-episode-")
    return _validate(EpisodeTrace, value, where)


def parse_trace_line(raw: bytes, where: str = "trace") -> EpisodeTrace | None:
    """One JSONL line as a trace record, or None when it is torn, garbled, foreign or does not fit
    the record (an unreadable line, counted by the caller). Raises :class:`RecordVersionError` for
    a trace of another version: what it says cannot be read here, and skipping it would run or
    score its episode wrongly. NaN in records of the earlier implementation reads as absent; an
    escaped lone surrogate reads back as the same string."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
    if not isinstance(value, dict) or not isinstance(value.get("episode_id"), str):
        return None
    try:
        return read_trace(value, where)
    except RecordFormatError:
        return None


def iter_trace_lines(path: Path) -> Iterator[tuple[int, EpisodeTrace | None]]:
    """``(byte offset, record or None for an unreadable line)`` for every non-blank line of a file."""
    if not path.exists():
        return
    with path.open("rb") as handle:
        offset = 0
        for number, raw in enumerate(handle, 1):
            start, offset = offset, offset + len(raw)
            line = raw.strip()
            if line:
                yield start, parse_trace_line(line, f"{path}:{number}")


def read_manifest(value: Any, where: str = "manifest.json") -> RunManifest:
    """A run manifest from its parsed JSON object; its fingerprint is checked against its plan as
    stored, before anything is typed."""
    if not isinstance(value, dict):
        raise RecordFormatError(f"{where}: the manifest must be a JSON object")
    _check_version(
        where, value.get("schema_version"), MANIFEST_SCHEMA_VERSIONS, kind="run manifest", prefix="shopsimrl-run-manifest-"
    )
    plan, stored = value.get("plan"), value.get("plan_fingerprint")
    if not isinstance(plan, dict) or not isinstance(stored, str):
        raise RecordFormatError(f"{where}: the manifest needs a 'plan' object and a 'plan_fingerprint' string")
    if not isinstance(plan.get("jobs"), list):
        raise RecordFormatError(f"{where}: plan.jobs must be a list")
    if fingerprint(plan) != stored:
        raise ManifestIntegrityError(f"{where}: plan_fingerprint does not match the plan it stores; the manifest was edited")
    return _validate(RunManifest, value, where)


def read_marker(value: Any, where: str = "_SUCCESS.json") -> ShardMarker:
    if not isinstance(value, dict):
        raise RecordFormatError(f"{where}: a commit marker must be a JSON object")
    _check_version(
        where, value.get("schema_version"), (MARKER_SCHEMA_VERSION,), kind="commit marker", prefix="shopsimrl-shard-commit-"
    )
    return _validate(ShardMarker, value, where)


def read_summary(value: Any, where: str = "summary.json") -> EvalSummary:
    if not isinstance(value, dict):
        raise RecordFormatError(f"{where}: a summary must be a JSON object")
    _check_version(
        where, value.get("schema_version"), SUMMARY_SCHEMA_VERSIONS, kind="run summary", prefix="shopsimrl-eval-summary-"
    )
    return _validate(EvalSummary, value, where)
