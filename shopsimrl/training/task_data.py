"""slime's prompt data for a split: one JSONL line per frozen task id.

slime reads the file with ``--prompt-data FILE --input-key prompt --metadata-key metadata``; each
sample it hands the custom-generate function then carries the line's ``prompt`` (the task id as a
string) and ``metadata`` (where :func:`shopsimrl.training.slime_adapter.task_id_of` finds the task
id). Every task id of the split appears once, in the split file's order::

    {"prompt":"4","metadata":{"schema_version":"shopsimrl-slime-tasks-v1","task_id":4,"split":"train"}}

The bytes are those the earlier implementation wrote (compact JSON, one line each, ``\\n`` after
every line), so its files and these are interchangeable. :func:`check_task_data` is the
preflight's reading of such a file against the split.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from shopsimrl.schemas import parse_json_exact, read_utf8_file
from shopsimrl.storage.local import RunWriteError
from shopsimrl.tasks import TaskSplit, load_task_split

__all__ = [
    "TASK_DATA_SCHEMA_VERSION",
    "TaskDataError",
    "TaskDataSummary",
    "check_task_data",
    "task_data_bytes",
    "write_task_data",
]

TASK_DATA_SCHEMA_VERSION: Final = "shopsimrl-slime-tasks-v1"
_LINE_KEYS: Final = frozenset({"prompt", "metadata"})
_METADATA_KEYS: Final = frozenset({"schema_version", "task_id", "split"})


class TaskDataError(ValueError):
    """Task data that cannot be written or does not match its split; the message names the file and line."""


@dataclass(frozen=True)
class TaskDataSummary:
    path: Path
    split: TaskSplit
    records: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": TASK_DATA_SCHEMA_VERSION,
            "path": str(self.path),
            "split": self.split.identity(),
            "records": self.records,
            "sha256": self.sha256,
        }


def task_data_bytes(split: TaskSplit) -> bytes:
    """The file's content for ``split`` (module docstring)."""
    lines = [
        json.dumps(
            {
                "prompt": str(task_id),
                "metadata": {"schema_version": TASK_DATA_SCHEMA_VERSION, "task_id": task_id, "split": split.name},
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )
        for task_id in split.task_ids
    ]
    return ("\n".join(lines) + "\n").encode("utf-8")


def write_task_data(split_file: str | Path, split_name: str, out: str | Path) -> TaskDataSummary:
    """Write the split's prompt data to ``out``, replacing it whole or not at all. A held-out test
    split is refused (training never runs it), as is a split without tasks."""
    split = load_task_split(split_file, split_name)
    if split.is_test:
        raise TaskDataError(
            f"split {split.name!r} of {split_file} is (or overlaps) the held-out test split; training never runs it"
        )
    if not split.task_ids:
        raise TaskDataError(f"split {split.name!r} of {split_file} has no task ids")
    data = task_data_bytes(split)
    path = Path(out)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise RunWriteError(path, exc) from exc
    return TaskDataSummary(path=path.resolve(), split=split, records=len(split.task_ids), sha256=hashlib.sha256(data).hexdigest())


def check_task_data(path: str | Path, split: TaskSplit) -> TaskDataSummary:
    """The file holds every task id of ``split`` exactly once, each line in the schema of the
    module docstring; :class:`TaskDataError` naming the file, the line and the field otherwise."""
    path = Path(path)
    text = read_utf8_file(path, "task data", TaskDataError)
    wanted = set(split.task_ids)
    seen: dict[int, int] = {}
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline after the last line
    for number, line in enumerate(lines, start=1):
        where = f"task data {path} line {number}"
        try:
            record = parse_json_exact(line)
        except ValueError as exc:
            problem = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise TaskDataError(f"{where}: not a JSON object ({problem})") from None
        if not isinstance(record, dict) or set(record) != _LINE_KEYS:
            raise TaskDataError(f"{where}: must be an object with exactly the keys {sorted(_LINE_KEYS)}")
        metadata = record["metadata"]
        if not isinstance(metadata, dict) or set(metadata) != _METADATA_KEYS:
            raise TaskDataError(f"{where}: metadata must be an object with exactly the keys {sorted(_METADATA_KEYS)}")
        if metadata["schema_version"] != TASK_DATA_SCHEMA_VERSION:
            raise TaskDataError(
                f"{where}: metadata.schema_version is {metadata['schema_version']!r}, expected {TASK_DATA_SCHEMA_VERSION!r}"
            )
        task_id = metadata["task_id"]
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise TaskDataError(f"{where}: metadata.task_id must be an integer, got {task_id!r}")
        if record["prompt"] != str(task_id):
            raise TaskDataError(f"{where}: prompt is {record['prompt']!r}, expected the task id {str(task_id)!r}")
        if metadata["split"] != split.name:
            raise TaskDataError(f"{where}: metadata.split is {metadata['split']!r}, the config trains on {split.name!r}")
        if task_id not in wanted:
            raise TaskDataError(f"{where}: task {task_id} is not in split {split.name!r} of {split.file_name}")
        if task_id in seen:
            raise TaskDataError(f"{where}: task {task_id} appears a second time (first on line {seen[task_id]})")
        seen[task_id] = number
    missing = [task_id for task_id in split.task_ids if task_id not in seen]
    if missing:
        shown = ", ".join(str(task_id) for task_id in missing[:5]) + (", …" if len(missing) > 5 else "")
        raise TaskDataError(
            f"task data {path} lacks {len(missing)} of the {len(wanted)} tasks of split {split.name!r} ({shown}); "
            f"write it again with `shopsimrl training prepare-data`"
        )
    return TaskDataSummary(
        path=path.resolve(), split=split, records=len(seen), sha256=hashlib.sha256(text.encode("utf-8")).hexdigest()
    )
