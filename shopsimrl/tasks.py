"""Task split files: explicit id lists or legacy ``{start, end}`` ranges, split roles, test guard.

A split file is ``{"version": …, "splits": {name: {"task_ids": [...]} | {"start": a, "end": b},
"persona": true|false|null, "role"?: "train"|"val"|"test", "task_count"?, "task_ids_sha256"?}}``.
When a split carries ``task_count`` or ``task_ids_sha256`` they are verified; a mismatch is an
error, so a hand-edited split can never pass for the frozen one.

The split identity that enters the plan fingerprint is ``{name, split_version, persona, role,
task_count, task_ids_sha256, file_name}`` — never an absolute path, so moving the checkout does not
change the plan.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SplitError", "TaskSplit", "load_task_split", "task_ids_sha256"]


class SplitError(ValueError):
    """A split file or split definition is malformed, inconsistent or missing."""


def task_ids_sha256(task_ids: list[int] | tuple[int, ...]) -> str:
    """sha256 of the compact JSON list, the digest convention of the real split files."""
    return hashlib.sha256(json.dumps(list(task_ids), separators=(",", ":")).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TaskSplit:
    name: str
    task_ids: tuple[int, ...]
    persona: bool | None
    role: str | None
    split_version: str | None
    file_name: str
    overlaps_test: bool = False
    """Some of its tasks belong to a held-out test split of the same file."""

    @property
    def is_test(self) -> bool:
        """Held out: named or marked ``test`` (any case), or sharing tasks with such a split."""
        return _is_test_spec(self.name, self.role) or self.overlaps_test

    def identity(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "split_version": self.split_version,
            "persona": self.persona,
            "role": self.role,
            "task_count": len(self.task_ids),
            "task_ids_sha256": task_ids_sha256(self.task_ids),
            "file_name": self.file_name,
        }


def _is_test_spec(name: str, role: Any) -> bool:
    return name.casefold() == "test" or (isinstance(role, str) and role.casefold() == "test")


def _overlaps_test(path: Path, name: str, ids: list[int], document: dict[str, Any]) -> bool:
    """True when a held-out test split of the same file shares a task with this split."""
    wanted = set(ids)
    for other, spec in document["splits"].items():
        if other == name or not isinstance(spec, dict) or not _is_test_spec(other, spec.get("role")):
            continue
        if "task_ids" not in spec and not ("start" in spec and "end" in spec):
            continue  # a withheld test split (digest only) cannot be compared
        try:
            held_out = _task_ids(f"{path.name}: splits.{other}", spec, document)
        except SplitError as exc:
            raise SplitError(f"{exc} (while checking split {name!r} against held-out split {other!r})") from None
        if wanted.intersection(held_out):
            return True
    return False


def _task_ids(where: str, spec: dict[str, Any], document: dict[str, Any]) -> list[int]:
    if "task_ids" in spec:
        ids = spec["task_ids"]
        if not isinstance(ids, list) or not ids:
            raise SplitError(f"{where}.task_ids must be a non-empty list of integers")
        for position, value in enumerate(ids):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SplitError(f"{where}.task_ids[{position}] must be a non-negative integer, got {value!r}")
        if len(set(ids)) != len(ids):
            seen: set[int] = set()
            duplicate = next(v for v in ids if v in seen or seen.add(v))  # type: ignore[func-returns-value]
            raise SplitError(f"{where}.task_ids contains task {duplicate} more than once")
        return ids
    if "start" in spec and "end" in spec:
        start, end = spec["start"], spec["end"]
        for key, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SplitError(f"{where}.{key} must be a non-negative integer, got {value!r}")
        if start >= end:
            raise SplitError(f"{where}: start ({start}) must be below end ({end}); the range is half-open")
        corpus = document.get("corpus_size", document.get("source_corpus_size"))
        if isinstance(corpus, int) and not isinstance(corpus, bool) and end > corpus:
            raise SplitError(f"{where}: end ({end}) exceeds corpus_size ({corpus})")
        return list(range(start, end))
    raise SplitError(f"{where} needs either 'task_ids' or both 'start' and 'end'")


def load_task_split(path: str | Path, name: str) -> TaskSplit:
    """Load and verify split ``name`` of the split file at ``path``."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SplitError(f"cannot read split file {path}: {exc.strerror or exc}") from exc
    try:
        document = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SplitError(f"split file {path} is not UTF-8: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise SplitError(f"split file {path} is not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("splits"), dict):
        raise SplitError(f"split file {path} must be an object with a 'splits' object")
    splits = document["splits"]
    if name not in splits:
        raise SplitError(f"split {name!r} not found in {path}; available: {', '.join(sorted(splits))}")
    spec = splits[name]
    where = f"{path.name}: splits.{name}"
    if not isinstance(spec, dict):
        raise SplitError(f"{where} must be an object")
    ids = _task_ids(where, spec, document)

    persona = spec.get("persona")
    if persona is not None and not isinstance(persona, bool):
        raise SplitError(f"{where}.persona must be true, false or null, got {persona!r}")
    role = spec.get("role")
    if role is not None and not isinstance(role, str):
        raise SplitError(f"{where}.role must be a string, got {role!r}")

    if "task_count" in spec and spec["task_count"] != len(ids):
        raise SplitError(f"{where}.task_count is {spec['task_count']!r} but the split lists {len(ids)} tasks")
    if "task_ids_sha256" in spec:
        actual = task_ids_sha256(ids)
        if spec["task_ids_sha256"] != actual:
            raise SplitError(
                f"{where}.task_ids_sha256 does not match its task_ids (file says {spec['task_ids_sha256']}, "
                f"ids hash to {actual}); the split was edited"
            )
    version = document.get("version", document.get("schema_version"))
    return TaskSplit(
        name=name,
        task_ids=tuple(ids),
        persona=persona,
        role=role,
        split_version=str(version) if version is not None else None,
        file_name=path.name,
        overlaps_test=_overlaps_test(path, name, ids, document),
    )
