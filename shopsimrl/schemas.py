"""Persisted shapes of shopsimrl: jobs, model outputs, skills, traces, manifests, summaries.

Every persisted record carries its schema version as its first key. Readers accept the
versions listed here and reject anything newer with a clear error.

Canonical JSON (sorted keys, compact separators, UTF-8, no NaN) and its sha256
``fingerprint`` are the identity functions of the whole project: the plan fingerprint,
the prompt hash, the skill-bank hash and split digests are all computed with them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import orjson

__all__ = [
    "EPISODE_STATUS",
    "FINGERPRINT_VERSION",
    "MANIFEST_SCHEMA_VERSION",
    "MANIFEST_SCHEMA_VERSIONS",
    "PIPELINE_VERSION",
    "SUMMARY_SCHEMA_VERSION",
    "TRACE_SCHEMA_VERSION",
    "EpisodeJob",
    "ModelOutput",
    "Skill",
    "ToolCall",
    "TraceFormatError",
    "canonical_json",
    "episode_id_for",
    "escape_lone_surrogates",
    "find_lone_surrogate",
    "fingerprint",
    "join_surrogate_pairs",
    "json_bytes",
    "json_safe",
    "parse_json",
    "parse_json_exact",
    "read_json_file",
    "read_utf8_file",
    "redact_uri",
    "replace_lone_surrogates",
    "sha256_hex",
    "wire_json",
]

TRACE_SCHEMA_VERSION = "shopsimrl-episode-v4"
"""Every trace line written by this package carries this version (reference-compatible)."""

MANIFEST_SCHEMA_VERSION = "shopsimrl-run-manifest-v2"
"""v2 adds ``fingerprint_version`` and a separate, non-fingerprinted ``execution`` block."""

MANIFEST_SCHEMA_VERSIONS = ("shopsimrl-run-manifest-v1", MANIFEST_SCHEMA_VERSION)

SUMMARY_SCHEMA_VERSION = "shopsimrl-eval-summary-v3"
"""v3 = the reference's v2 keys plus intervals, latency percentiles and retry statistics."""

PIPELINE_VERSION = "shopsimrl-v0.5"
FINGERPRINT_VERSION = "semantic-plan-v2"

EPISODE_STATUS = ("completed", "failed")


class TraceFormatError(ValueError):
    """A persisted record cannot be understood (unknown or newer schema, wrong shape)."""


# --------------------------------------------------------------------------- identity


def canonical_json(value: Any) -> str:
    """Sorted keys, compact separators, non-ASCII kept, NaN/Infinity rejected."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False)


def wire_json(value: Any) -> bytes:
    """Compact UTF-8 JSON for HTTP bodies on the hot path (orjson: several times faster than the
    standard library). Callers pass finite numbers only: orjson writes NaN as null. A lone
    surrogate is sent as its ``\\uXXXX`` escape (:func:`json_bytes`)."""
    return json_bytes(value)


# A code point U+D800..U+DFFF in a Python str: half of a UTF-16 pair, or an undecodable byte kept by
# surrogateescape. JSON may spell one (``"\\ud800"``) and Python's json reads it, but UTF-8 cannot
# encode it: orjson refuses it, and so does every text file, terminal and HTTP body.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON (orjson), lossless for text that is not valid Unicode.

    orjson refuses a str holding a lone surrogate; such a value is written by the standard library
    instead, each lone surrogate as its ``\\uXXXX`` escape: valid UTF-8 and valid JSON, and every
    JSON reader (:func:`parse_json` included) gives back the same string. Raises TypeError for a
    value JSON cannot hold and ValueError for NaN or infinity on that path.
    """
    try:
        return orjson.dumps(value)
    except TypeError:
        if find_lone_surrogate(value) is None:
            raise
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # With ensure_ascii=False a surrogate can only stand inside a string literal, raw: escape it there.
    return escape_lone_surrogates(text).encode("utf-8")


def parse_json(data: bytes | str) -> Any:
    """JSON from the wire (orjson). ``NaN`` and ``Infinity``, which JSON does not have but some
    servers send, are read as null, so no non-finite number enters a trace. A lone surrogate
    (``"\\ud800"``, or its raw bytes) is read as the str it spells; a high and a low surrogate that
    follow each other become the one character they encode, as the escaped pair would. Raises
    ValueError for text that is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        value = json.loads(data, parse_constant=lambda _: None)
    return join_surrogate_pairs(value) if find_lone_surrogate(value) is not None else value


def parse_json_exact(data: bytes | str) -> Any:
    """JSON as :func:`json_bytes` writes it, for files this package wrote: orjson, or the standard
    library for text holding an escaped lone surrogate (orjson refuses those). NaN and Infinity
    are not JSON: ValueError, like any other text that is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data, parse_constant=_refuse_constant)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_utf8_file(path: Path, what: str, error: Callable[[str], Exception]) -> str:
    """The text of ``path``; ``error(message)`` raised naming ``what`` and the file when it cannot
    be read or is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not valid UTF-8 (byte offset {exc.start})") from None


def read_json_file(path: Path, what: str, error: Callable[[str], Exception]) -> Any:
    """The JSON document in ``path`` (NaN and Infinity refused, as :func:`parse_json_exact`);
    ``error(message)`` raised naming ``what``, the file, and the line and column of bad JSON."""
    text = read_utf8_file(path, what, error)
    try:
        return parse_json_exact(text)
    except ValueError as exc:
        at = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise error(f"{what} {path} is not valid JSON{at}: {message}") from None


def join_surrogate_pairs(value: Any) -> Any:
    """``value`` with every adjacent high+low surrogate pair in its strings made one character."""
    if isinstance(value, str):
        return _SURROGATE_PAIR.sub(lambda m: m.group().encode("utf-16", "surrogatepass").decode("utf-16"), value)
    if isinstance(value, dict):
        return {join_surrogate_pairs(k): join_surrogate_pairs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [join_surrogate_pairs(v) for v in value]
    return value


def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, int, str] | None:
    """Where a JSON-like value holds text that is not valid Unicode: ``(path, index, "U+D800")`` of
    the first lone surrogate (in a string, or in a key: then the path ends in ``(key)``), else None.
    Paths read ``choices[0].message.content``; ``index`` counts code points."""
    if isinstance(value, str):
        found = _LONE_SURROGATE.search(value)
        return None if found is None else (path, found.start(), f"U+{ord(found.group()):04X}")
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and (found := _LONE_SURROGATE.search(key)) is not None:
                return (f"{path}.(key)" if path else "(key)", found.start(), f"U+{ord(found.group()):04X}")
            inner = find_lone_surrogate(item, where)
            if inner is not None:
                return inner
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            inner = find_lone_surrogate(item, f"{path}[{index}]")
            if inner is not None:
                return inner
    return None


def escape_lone_surrogates(text: str) -> str:
    """``text`` with each lone surrogate shown as its ``\\uXXXX`` escape, as the trace file spells
    it: for a page, a terminal or a table cell, which must hold valid Unicode."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def replace_lone_surrogates(value: Any) -> Any:
    """A copy of a JSON-like value with each lone surrogate replaced by U+FFFD (keys too): text any
    encoder, terminal or page can carry. Values without one come back unchanged (the same object)."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if find_lone_surrogate(value) is None:
        return value
    if isinstance(value, dict):
        return {replace_lone_surrogates(k): replace_lone_surrogates(v) for k, v in value.items()}
    return [replace_lone_surrogates(v) for v in value]


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")  # injective: a lone surrogate hashes too
    return hashlib.sha256(data).hexdigest()


def fingerprint(value: Any) -> str:
    """sha256 of the canonical JSON of ``value``; a string is hashed JSON-encoded (with quotes)."""
    return sha256_hex(canonical_json(value))


def json_safe(value: Any) -> Any:
    """A copy of ``value`` that canonical JSON accepts: NaN/inf become None, unknown objects str().

    Used at the persistence boundary so that one odd payload never aborts a run.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return repr(value)


_SECRET_QUERY_KEY = re.compile(
    r"(^|[_.-])(api|access)?[_-]?(key|token|secret|password|passwd|sig|signature|credential|auth)s?($|[_.-])", re.I
)


def redact_uri(uri: str) -> str:
    """The URI without a ``user:password@`` part and with credential-like query values masked.

    Every URL that reaches a trace, a manifest or a log line goes through here, so a gateway URL
    that carries a token never persists it. Host, port and the rest of the query stay verbatim.
    """
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc.rpartition("@")[2]
    query = parts.query
    if query:
        pieces = []
        for piece in query.split("&"):
            key, sep, _value = piece.partition("=")
            pieces.append(f"{key}=REDACTED" if sep and _SECRET_QUERY_KEY.search(key) else piece)
        query = "&".join(pieces)
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# --------------------------------------------------------------------------- jobs


def episode_id_for(task_id: int, sample_id: int) -> str:
    return f"task-{task_id:06d}__sample-{sample_id:03d}"


@dataclass(frozen=True, slots=True)
class EpisodeJob:
    """One frozen unit of work: a task, the index of its independent sample, and its seed."""

    task_id: int
    sample_id: int
    seed: int
    split: str

    @property
    def episode_id(self) -> str:
        return episode_id_for(self.task_id, self.sample_id)

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "sample_id": self.sample_id, "seed": self.seed, "split": self.split}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeJob:
        try:
            job = cls(task_id=data["task_id"], sample_id=data["sample_id"], seed=data["seed"], split=data["split"])
        except (KeyError, TypeError) as exc:
            raise TraceFormatError(f"job record needs task_id, sample_id, seed, split: {data!r}") from exc
        for name in ("task_id", "sample_id", "seed"):
            value = getattr(job, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TraceFormatError(f"job field {name!r} must be a non-negative integer, got {value!r}")
        if not isinstance(job.split, str) or not job.split:
            raise TraceFormatError(f"job field 'split' must be a non-empty string, got {job.split!r}")
        return job


# --------------------------------------------------------------------------- model output


@dataclass(slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: dict[str, Any] | None
    """Parsed JSON object, or None when the raw argument string was not a JSON object."""
    raw_arguments: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.arguments,
            "raw_arguments": self.raw_arguments,
        }


@dataclass(slots=True)
class ModelOutput:
    """What one model call returned, after the adapter's protocol checks.

    ``protocol_error`` / ``policy_failure`` are ``{"code", "message"}`` objects or None.
    ``raw_response`` is kept only for rejected outputs. ``latency_ms`` is the latency of the
    successful attempt; ``attempts`` lists every attempt (latency, status or error).
    """

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    response_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    latency_ms: float | None = None
    protocol_error: dict[str, str] | None = None
    policy_failure: dict[str, str] | None = None
    raw_response: Any = None
    attempt_count: int = 1
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "reasoning": self.reasoning,
            "tool_calls": [call.to_dict() for call in self.tool_calls],
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "response_id": self.response_id,
            "metadata": dict(self.metadata),
            "latency_ms": self.latency_ms,
            "protocol_error": self.protocol_error,
            "policy_failure": self.policy_failure,
            "raw_response": self.raw_response,
            "attempt_count": self.attempt_count,
            "attempts": list(self.attempts),
        }


# --------------------------------------------------------------------------- skills


@dataclass(frozen=True, slots=True)
class Skill:
    skill_id: str
    content: str
    version: str = "1"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def content_sha256(self) -> str:
        return fingerprint(self.content)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["metadata"] = dict(self.metadata)
        data["content_sha256"] = self.content_sha256
        return data


# --------------------------------------------------------------------------- trace helpers

TraceStatus = Literal["completed", "failed"]
