"""Trace records as stored: the v4 skeleton, the JSONL line codec, the completion test, and the
one rule that picks each episode's winning record among its attempts.

Both run stores (the local ``traces.jsonl`` of :mod:`shopsimrl.local_run` and the reducer of
the sharded parts, :mod:`shopsimrl.sharded.reduce`) read records in their reading order (file
order; part order, then line order) and hand them to :class:`WinnerPicker`. The rule:

1. a completed record (:func:`is_completed`) beats every unfinished one, and the first completed
   record in reading order wins; later completed records of the episode are duplicates (a
   replaced pod, a retried write), counted and never scored twice;
2. without a completed record, the unfinished attempt with the highest ``attempt`` wins, then
   the latest ``ended_at``, then the one read later. ``attempt`` is the scheduler's count over
   every invocation, so it orders attempts even where reading order does not (parts sort by
   writer id, not by time); records of the earlier implementation carry none and count as 0.

Every other record is a superseded attempt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Generic, TypeVar

import orjson

from shopsimrl.schemas import TRACE_SCHEMA_VERSION, EpisodeJob, json_bytes, json_safe

__all__ = [
    "EXCUSED_FAILURE_CLASSES",
    "FAILURE_CLASSES",
    "Offer",
    "Verdict",
    "WinnerPicker",
    "attempt_rank",
    "encode_trace_line",
    "failure_is_outcome",
    "is_completed",
    "iter_jsonl_records",
    "parse_trace_line",
    "trace_skeleton",
]

T = TypeVar("T")

FAILURE_CLASSES = ("infrastructure", "configuration_error", "environment_error", "model_error", "runtime_error")
"""``failure_class`` of a failed record (docs/runtime_eval.md §4 has the attribution table)."""
EXCUSED_FAILURE_CLASSES = frozenset({"infrastructure", "configuration_error"})
"""Failures that say nothing about the agent: outside the intent-to-treat score, and run again by
the next invocation. Every other failure (and one without a class: traces of the earlier
implementation) is an outcome of the episode: a 0 in the score, final once recorded."""


def failure_is_outcome(record: dict[str, Any]) -> bool:
    """A failed record that scores as the agent's 0 (and is not run again unless re-rolled)."""
    return not is_completed(record) and record.get("failure_class") not in EXCUSED_FAILURE_CLASSES


def trace_skeleton(job: EpisodeJob) -> dict[str, Any]:
    """Every key of a v4 record, in order, with the values of an episode that has not started."""
    return {
        "schema_version": TRACE_SCHEMA_VERSION,
        "episode_id": job.episode_id,
        "status": "failed",
        "job": job.to_dict(),
        "provenance": {},
        "started_at": None,
        "ended_at": None,
        "duration_ms": None,
        "reset": None,
        "selected_skills": [],
        "conversation": [],
        "steps": [],
        "final": None,
        "error": None,
        "failure_class": None,
    }


def is_completed(record: dict[str, Any]) -> bool:
    """The one completion predicate: v4 schema, status completed, a final with done true."""
    final = record.get("final")
    return (
        record.get("schema_version") == TRACE_SCHEMA_VERSION
        and record.get("status") == "completed"
        and isinstance(final, dict)
        and final.get("done") is True
    )


# --------------------------------------------------------------------------- line codec


def encode_trace_line(record: dict[str, Any]) -> bytes:
    """One compact JSONL line (orjson). Text that is not valid Unicode (a lone surrogate a model
    server sent) is kept exactly, written as its ``\\uXXXX`` escape (:func:`schemas.json_bytes`).
    A value JSON cannot hold (an odd object) is made safe and the record flagged
    ``serialization_repaired``, never fatal. Wire data reaches traces through
    ``schemas.parse_json``, which reads NaN as null; a non-finite float made by a custom adapter
    is written as null."""
    episode_id = record.get("episode_id")
    if not isinstance(episode_id, str) or not episode_id:
        raise ValueError("a trace needs a string episode_id")
    try:
        return json_bytes(record) + b"\n"
    except (TypeError, ValueError):
        safe = json_safe(record)
        safe.setdefault("serialization_repaired", True)
        return json_bytes(safe) + b"\n"


def parse_trace_line(raw: bytes) -> dict[str, Any] | None:
    """One JSONL line back into a trace record, or None when it is torn, garbled or foreign.
    Records of the earlier implementation may hold NaN, which is read as such; an escaped lone
    surrogate is read back as the same string (orjson refuses it, the standard library does not)."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
    return record if isinstance(record, dict) and isinstance(record.get("episode_id"), str) else None


def iter_jsonl_records(path: Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """Yield ``(byte offset, record or None for a bad line)`` for every non-blank line of a file."""
    if not path.exists():
        return
    with path.open("rb") as handle:
        offset = 0
        for raw in handle:
            start, offset = offset, offset + len(raw)
            line = raw.strip()
            if line:
                yield start, parse_trace_line(line)


# --------------------------------------------------------------------------- the winner rule


def attempt_rank(record: dict[str, Any]) -> tuple[int, str]:
    """How unfinished attempts of one episode order (higher wins): ``attempt``, then ``ended_at``."""
    attempt = record.get("attempt")
    return (attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0, str(record.get("ended_at") or ""))


class Verdict(Enum):
    COMPLETED = "completed"
    """The episode's winner: its first completed record."""
    DUPLICATE = "duplicate"
    """A further completed record of an episode that already has one."""
    UNFINISHED = "unfinished"
    """An unfinished attempt: the best so far, or a superseded one (then it is the ``loser``)."""


@dataclass(frozen=True)
class Offer(Generic[T]):
    verdict: Verdict
    loser: T | None
    """The item this record showed to be a superseded attempt (possibly its own), else None."""


@dataclass
class _Waiting(Generic[T]):
    rank: tuple[int, str]
    order: int
    item: T


class WinnerPicker(Generic[T]):
    """Applies the winner rule to records offered in reading order, one pass, holding one item
    per episode (what the caller needs of the record: its file offset, a small view)."""

    def __init__(self) -> None:
        self.completed: dict[str, T] = {}
        """Per episode with a completed record: the item of the first one."""
        self._waiting: dict[str, _Waiting[T]] = {}
        self._offered = 0

    def offer(self, record: dict[str, Any], item: T) -> Offer[T]:
        episode_id = record["episode_id"]
        self._offered += 1
        if is_completed(record):
            if episode_id in self.completed:
                return Offer(Verdict.DUPLICATE, None)
            self.completed[episode_id] = item
            waiting = self._waiting.pop(episode_id, None)
            return Offer(Verdict.COMPLETED, None if waiting is None else waiting.item)
        if episode_id in self.completed:
            return Offer(Verdict.UNFINISHED, item)
        candidate = _Waiting(attempt_rank(record), self._offered, item)
        waiting = self._waiting.get(episode_id)
        if waiting is not None and waiting.rank > candidate.rank:  # ties: the record read later wins
            return Offer(Verdict.UNFINISHED, item)
        self._waiting[episode_id] = candidate
        return Offer(Verdict.UNFINISHED, None if waiting is None else waiting.item)

    def winner(self, episode_id: str) -> T | None:
        """The item of the episode's winning record so far, None when none was offered."""
        if episode_id in self.completed:
            return self.completed[episode_id]
        waiting = self._waiting.get(episode_id)
        return None if waiting is None else waiting.item

    def unfinished(self) -> list[T]:
        """The winners of episodes without a completed record, in the reading order of those records."""
        return [waiting.item for waiting in sorted(self._waiting.values(), key=lambda w: w.order)]
