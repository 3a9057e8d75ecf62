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
from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from shopsimrl.records._base import Record, RecordVersionError, check_version
from shopsimrl.records.manifest import MANIFEST_SCHEMA_VERSIONS, RunManifest
from shopsimrl.records.marker import MARKER_SCHEMA_VERSION, ShardMarker
from shopsimrl.records.summary import SUMMARY_SCHEMA_VERSIONS, EvalSummary
from shopsimrl.records.trace import TRACE_SCHEMA_VERSIONS, EpisodeTrace
from shopsimrl.schemas import TraceFormatError, fingerprint, json_safe

__all__ = [
    "ManifestIntegrityError",
    "RecordFormatError",
    "RecordVersionError",
    "decode_json",
    "dump_document",
    "dump_line",
    "plain",
    "read_manifest",
    "read_marker",
    "read_summary",
    "read_trace",
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


def dump_line(record: Record | dict[str, Any]) -> bytes:
    """One compact JSONL line. A value JSON cannot hold is made safe and the line flagged
    ``serialization_repaired``, never fatal: one odd payload must not abort a run."""
    try:
        return orjson.dumps(record, default=plain, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        safe = json_safe(orjson.loads(orjson.dumps(record, default=_lenient)) if isinstance(record, Record) else record)
        if isinstance(safe, dict):
            safe.setdefault("serialization_repaired", True)
        return orjson.dumps(safe, option=orjson.OPT_APPEND_NEWLINE)


def _lenient(value: Any) -> Any:
    try:
        return plain(value)
    except TypeError:
        return repr(value)


def dump_document(record: Record | dict[str, Any]) -> bytes:
    """A document as stored: indented UTF-8 JSON, NaN refused."""
    try:
        return orjson.dumps(record, default=plain, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # integers beyond 64 bits: the standard library writes them
        value = orjson.loads(orjson.dumps(record, default=plain)) if isinstance(record, Record) else record
        return (json.dumps(value, ensure_ascii=False, indent=2, allow_nan=False) + "\n").encode("utf-8")


def decode_json(data: bytes | str) -> Any:
    """JSON text as Python values; NaN and Infinity (which some writers produce) as null."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data, parse_constant=lambda _: None)


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
    check_version(value.get("schema_version"), TRACE_SCHEMA_VERSIONS, kind="trace record", prefix="shopsimrl-episode-")
    return _validate(EpisodeTrace, value, where)


def read_manifest(value: Any, where: str = "manifest.json") -> RunManifest:
    """A run manifest from its parsed JSON object; its fingerprint is checked against its plan as
    stored, before anything is typed."""
    if not isinstance(value, dict):
        raise RecordFormatError(f"{where}: the manifest must be a JSON object")
    check_version(value.get("schema_version"), MANIFEST_SCHEMA_VERSIONS, kind="run manifest", prefix="shopsimrl-run-manifest-")
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
    check_version(value.get("schema_version"), (MARKER_SCHEMA_VERSION,), kind="commit marker", prefix="shopsimrl-shard-commit-")
    return _validate(ShardMarker, value, where)


def read_summary(value: Any, where: str = "summary.json") -> EvalSummary:
    if not isinstance(value, dict):
        raise RecordFormatError(f"{where}: a summary must be a JSON object")
    check_version(value.get("schema_version"), SUMMARY_SCHEMA_VERSIONS, kind="run summary", prefix="shopsimrl-eval-summary-")
    return _validate(EvalSummary, value, where)
