"""Where training rollouts are kept: a run directory the research tools read, plus a training file.

A training run directory is an evaluation run directory (:class:`~shopsimrl.storage.local.
LocalRunStore`) with one more file::

    <run dir>/
      traces.jsonl              the v4 trace of every rollout (the evaluation record, unchanged)
      training/samples.jsonl    per rollout: the trainer's samples (tokens, loss mask, log-probs...)
      leases/                   the lease journal of the process that runs the rollouts
      .lock                     one process at a time

so ``shopsimrl show``/``view``/``labels``/``export`` read the rollouts exactly as they read an
evaluation (:func:`shopsimrl.storage.reading.open_run`; a training run has no manifest: its jobs
are handed in one by one by the trainer, not frozen up front). Token ids, masks and log-probs
never enter ``traces.jsonl``: they live in ``training/samples.jsonl``, one line per rollout
(schema :data:`SAMPLES_SCHEMA_VERSION`), keyed by the trace's ``episode_id`` and ``attempt``.

Each rollout is written as its trace line, then its samples line, each appended with one write
and an fsync. A crash between the two leaves a trace without samples (the reader reports it:
:attr:`TrainingSamples.missing`), never samples without the trace they belong to.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shopsimrl.storage.local import LocalRunStore
from shopsimrl.training.rollout import EpisodeRollout

__all__ = [
    "SAMPLES_FILE",
    "SAMPLES_SCHEMA_VERSION",
    "TrainingRunStore",
    "TrainingSamples",
    "read_training_samples",
]

SAMPLES_SCHEMA_VERSION = "shopsimrl-training-samples-v1"
SAMPLES_FILE = Path("training") / "samples.jsonl"


def _append_line(path: Path, line: bytes) -> None:
    """One line appended with one write and an fsync; a torn tail left by a crash is sealed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as handle:
        handle.seek(0, os.SEEK_END)
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.seek(0, os.SEEK_END)
                handle.write(b"\n")
        handle.seek(0, os.SEEK_END)
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def samples_record(rollout: EpisodeRollout) -> dict[str, Any]:
    """The training line of one rollout (JSON-safe)."""
    trace = rollout.trace
    first = rollout.samples[0] if rollout.samples else None
    trajectory = rollout.trajectory
    return {
        "schema_version": SAMPLES_SCHEMA_VERSION,
        "episode_id": trace.episode_id,
        "attempt": trace.attempt,
        "group_index": first.group_index if first else None,
        "index": first.index if first else None,
        "rollout_id": first.rollout_id if first else None,
        "scored": rollout.scored,
        "forks": trajectory.forks if trajectory is not None else 0,
        "prompt_tokens": list(trajectory.prompt_tokens) if trajectory is not None else [],
        "reused_prefix_tokens": list(trajectory.reused_prefix_tokens) if trajectory is not None else [],
        "samples": [sample.to_dict() for sample in rollout.samples],
    }


class TrainingRunStore:
    """A training run directory (module docstring). :meth:`save` is thread-safe: rollouts that
    end at once on the trainer's event loop are written one after the other, off the loop."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.runs = LocalRunStore(self.run_dir)
        self.samples_path = self.run_dir / SAMPLES_FILE
        self.leases_dir = self.run_dir / "leases"
        self._write = threading.Lock()
        self._attempts: dict[str, int] = {}

    def acquire(self) -> None:
        """Hold the run (``flock``): a second process on the same directory is refused. Counts the
        attempts already there, so a rollout played again after a restart is the next attempt."""
        self.runs.acquire()
        self._attempts = {eid: state.attempts for eid, state in self.runs.load_index().episodes.items()}

    def release(self) -> None:
        self.runs.release()

    def __enter__(self) -> TrainingRunStore:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def save(self, rollout: EpisodeRollout) -> None:
        """The rollout's trace (its ``attempt`` numbered here), then its samples line; each durable
        when this returns."""
        with self._write:
            episode_id = rollout.trace.episode_id
            self._attempts[episode_id] = self._attempts.get(episode_id, 0) + 1
            rollout.trace.attempt = self._attempts[episode_id]
            record = samples_record(rollout)
            line = json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n"
            self.runs.save_traces([rollout.trace])
            _append_line(self.samples_path, line.encode("utf-8"))


@dataclass
class TrainingSamples:
    """What :func:`read_training_samples` found."""

    records: dict[tuple[str, int | None], dict[str, Any]] = field(default_factory=dict)
    """``(episode_id, attempt)`` → the rollout's training line."""
    bad_lines: list[int] = field(default_factory=list)
    """Line numbers (1-based) that are not a training line of this schema (a torn tail, say)."""
    missing: list[tuple[str, int | None]] = field(default_factory=list)
    """Traces of the run without a training line (the process stopped between the two writes)."""


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    if not path.exists():
        return
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if raw.strip():
                yield number, raw


def read_training_samples(run_dir: str | Path) -> TrainingSamples:
    """The training lines of a run directory, checked against its traces (``missing``)."""
    run_dir = Path(run_dir)
    found = TrainingSamples()
    for number, raw in _lines(run_dir / SAMPLES_FILE):
        try:
            value = json.loads(raw)
        except ValueError:
            found.bad_lines.append(number)
            continue
        if not isinstance(value, dict) or value.get("schema_version") != SAMPLES_SCHEMA_VERSION:
            found.bad_lines.append(number)
            continue
        found.records[(str(value.get("episode_id")), value.get("attempt"))] = value
    for _, record in LocalRunStore(run_dir).iter_records():
        key = (record.episode_id, record.attempt)
        if key not in found.records:
            found.missing.append(key)
    return found
