"""Where training rollouts are kept: a run the research tools read, plus the trainer's fields beside it.

Two layouts, chosen by ``run.output_dir`` (:attr:`~shopsimrl.training.config.TrainingConfig.run_location`).

A local directory (:class:`TrainingRunStore`) is an evaluation run directory
(:class:`~shopsimrl.storage.local.LocalRunStore`) with one more file::

    <run dir>/
      traces.jsonl              the v4 trace of every rollout (the evaluation record, unchanged)
      training/samples.jsonl    per rollout: the trainer's samples (tokens, loss mask, log-probs...)
      leases/                   the lease journal of the process that runs the rollouts
      .lock                     one process at a time

Each rollout is written as its trace line, then its samples line, each appended with one write
and an fsync. A crash between the two leaves a trace without samples (the reader reports it:
:attr:`TrainingSamples.missing`), never samples without the trace they belong to.

An object store location (``s3://…``; :class:`ObjectTrainingRunStore`) holds immutable parts
and their commits (:mod:`shopsimrl.storage.training`): the rollouts are buffered and written
together, a trace part, the samples part beside it and the commit naming both, every
``run.flush_rollouts`` rollouts, when ``run.flush_seconds`` have passed since the oldest one
finished, when no other rollout is being played, and at close. A rollout's call returns once its
commit is stored, so a sample reaches the trainer only when its trace and samples are durable; a
process killed outright loses the rollouts not yet committed, none of which the trainer received,
and its successor numbers attempts from the commits.

Either way ``shopsimrl show``/``view``/``labels``/``export`` read the rollouts as they read an
evaluation (:func:`shopsimrl.storage.reading.open_run`; a training run has no manifest: its jobs
are handed in one by one by the trainer, not frozen up front). Token ids, masks and log-probs
never enter a trace: they live in the samples lines (schema :data:`SAMPLES_SCHEMA_VERSION`),
keyed by the trace's ``episode_id`` and ``attempt``; :func:`read_training_samples` reads them
from either layout.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import structlog

from shopsimrl.records import dump_line
from shopsimrl.runner.lease_journal import DirectoryJournalStorage, JournalStorage, StoreJournalStorage
from shopsimrl.storage.local import LocalRunStore
from shopsimrl.storage.objectstore import RetryPolicy, StoreUnavailableError
from shopsimrl.storage.sharded import part_lines
from shopsimrl.storage.training import (
    IDENTITY,
    LEASES,
    SAMPLES,
    CommittedState,
    TrainingObjects,
    TrainingRunError,
    committed_state,
)
from shopsimrl.training.rollout import EpisodeRollout

__all__ = [
    "SAMPLES_FILE",
    "SAMPLES_SCHEMA_VERSION",
    "ObjectTrainingRunStore",
    "RolloutStore",
    "TrainingRunStore",
    "TrainingSamples",
    "read_training_samples",
]

SAMPLES_SCHEMA_VERSION = "shopsimrl-training-samples-v1"
SAMPLES_FILE = Path("training") / "samples.jsonl"

log = structlog.get_logger("shopsimrl.training.store")


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


def _samples_line(rollout: EpisodeRollout) -> bytes:
    record = samples_record(rollout)
    return (json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")


class RolloutStore(Protocol):
    """What the rollout process (:class:`~shopsimrl.training.worker.TrainingWorker`) writes through."""

    location: str
    """Where the run is, credentials removed."""

    def acquire(self) -> None:
        """Take the run (blocking I/O: called off the event loop); learn the attempts there."""

    def journal_storage(self) -> JournalStorage:
        """Where the process's lease journal lives."""

    def started(self) -> None:
        """A rollout began (its record may join the next write)."""

    def abandoned(self) -> None:
        """A rollout begun ended without a record (cancelled)."""

    async def commit(self, rollout: EpisodeRollout) -> None:
        """Number the rollout's attempt and store its trace and samples; durable when this returns."""

    async def aclose(self) -> None:
        """Write what is buffered and let go of the run."""


class TrainingRunStore:
    """A training run directory (module docstring). :meth:`save` is thread-safe: rollouts that
    end at once on the trainer's event loop are written one after the other, off the loop."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.location = str(self.run_dir)
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

    def journal_storage(self) -> JournalStorage:
        return DirectoryJournalStorage(self.leases_dir)

    def started(self) -> None:
        """Nothing to count: every rollout is written on its own."""

    def abandoned(self) -> None:
        """Nothing to count: every rollout is written on its own."""

    def save(self, rollout: EpisodeRollout) -> None:
        """The rollout's trace (its ``attempt`` numbered here), then its samples line; each durable
        when this returns."""
        with self._write:
            episode_id = rollout.trace.episode_id
            self._attempts[episode_id] = self._attempts.get(episode_id, 0) + 1
            rollout.trace.attempt = self._attempts[episode_id]
            line = _samples_line(rollout)
            self.runs.save_traces([rollout.trace])
            _append_line(self.samples_path, line)

    async def commit(self, rollout: EpisodeRollout) -> None:
        # Shielded: a cancelled caller must not leave the trace written without its samples line.
        await asyncio.shield(asyncio.to_thread(self.save, rollout))

    async def aclose(self) -> None:
        self.release()


@dataclass
class _Buffered:
    trace: bytes
    samples: bytes
    key: tuple[str, int]
    done: asyncio.Future[None]


class ObjectTrainingRunStore:
    """A training run on an object store (module docstring; layout :mod:`shopsimrl.storage.training`).

    Runs on one event loop: :meth:`commit` buffers on the loop, the writes go out in a thread,
    one flush at a time. Not locked against a second process: two processes on one location
    never overwrite each other's objects (each part and commit name carries its writer's id), but
    one rollout played by both would be numbered the same attempt twice; give each rollout
    process its own ``run.name``.
    """

    def __init__(
        self,
        location: str,
        *,
        identity: dict[str, Any],
        flush_rollouts: int,
        flush_seconds: float,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.objects = TrainingObjects(location, retry=retry)
        self.location = self.objects.display_uri
        self.identity = identity
        self.flush_rollouts = flush_rollouts
        self.flush_seconds = flush_seconds
        self.writer = secrets.token_hex(4)
        self.found = CommittedState()
        """What the commits said when the run was taken (:meth:`acquire`)."""
        self.commits = 0
        """Commits this process wrote."""
        self._attempts: dict[str, int] = {}
        self._seq = 0
        self._buffer: list[_Buffered] = []
        self._oldest = 0.0
        self._playing = 0
        self._flushing: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._failed = False
        self._closing = False

    def acquire(self) -> None:
        """Write (or find) ``training.json`` and read the commits: the attempts committed so far
        and the next part number. The first call that reaches the store: one that stays
        unreachable past the retries raises :class:`StoreUnavailableError` naming the location."""
        try:
            self.objects.claim({**self.identity, "created_at": datetime.now(UTC).isoformat(), "writer": self.writer})
            self.found = committed_state(self.objects)
        except StoreUnavailableError as exc:
            raise StoreUnavailableError(f"the training run's object store at {self.location} cannot be reached: {exc}") from exc
        for problem in self.found.problems:
            log.warning("not a training commit, ignored", problem=problem)
        if self.found.uncommitted:
            log.warning(
                "parts without a commit (a writer stopped before its commit), ignored",
                run=self.location,
                parts=len(self.found.uncommitted),
                sample=self.found.uncommitted[:5],
            )
        self._attempts = dict(self.found.attempts)
        self._seq = self.found.next_seq

    def journal_storage(self) -> JournalStorage:
        return StoreJournalStorage(self.objects, LEASES)

    @property
    def buffered(self) -> list[tuple[str, int]]:
        """``(episode_id, attempt)`` of the rollouts not yet handed to a flush."""
        return [entry.key for entry in self._buffer]

    def started(self) -> None:
        self._playing += 1

    def abandoned(self) -> None:
        self._playing -= 1
        self._maybe_flush()

    async def commit(self, rollout: EpisodeRollout) -> None:
        """Buffer the rollout; return once the commit holding it is stored. A cancelled caller
        leaves it in the buffer: it is written, though the trainer never received it."""
        self._playing -= 1
        episode_id = rollout.trace.episode_id
        self._attempts[episode_id] = self._attempts.get(episode_id, 0) + 1
        rollout.trace.attempt = self._attempts[episode_id]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A failure nobody waits for any more (a cancelled caller) is logged by the flush, not by asyncio.
        done.add_done_callback(lambda future: future.cancelled() or future.exception())
        if not self._buffer:
            self._oldest = time.monotonic()
        self._buffer.append(
            _Buffered(dump_line(rollout.trace), _samples_line(rollout), (episode_id, rollout.trace.attempt), done)
        )
        self._maybe_flush()
        await asyncio.shield(done)

    def _maybe_flush(self) -> None:
        """Start a flush of the whole buffer when one is due (module docstring), none is running
        and the last one did not fail (then only the timer, or the close, tries again)."""
        if self._flushing is not None or not self._buffer:
            return
        age = time.monotonic() - self._oldest
        due = age >= self.flush_seconds or self._closing
        if not due and (self._failed or (len(self._buffer) < self.flush_rollouts and self._playing > 0)):
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.flush_seconds - age, self._timer_fired)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._buffer = self._buffer, []
        self._flushing = asyncio.get_running_loop().create_task(self._flush(batch))

    def _timer_fired(self) -> None:
        self._timer = None
        self._maybe_flush()

    async def _flush(self, batch: list[_Buffered]) -> None:
        try:
            await asyncio.to_thread(self._write, batch)
        except Exception as exc:
            # Kept, in front: written by a later flush (the timer's or the close's) if the store
            # comes back; the callers waiting for these rollouts get the error now.
            self._buffer[:0] = batch
            self._oldest = time.monotonic()
            self._failed = True
            log.error(
                "training rollouts not written; kept for the next flush",
                run=self.location,
                rollouts=len(batch),
                error=f"{type(exc).__name__}: {exc}",
            )
            for entry in batch:
                if not entry.done.done():
                    entry.done.set_exception(exc)
        else:
            self._failed = False
            for entry in batch:
                if not entry.done.done():
                    entry.done.set_result(None)
        finally:
            self._flushing = None
            if not self._closing:  # at close, aclose decides what is tried next
                self._maybe_flush()

    def _write(self, batch: list[_Buffered]) -> None:
        commit = self.objects.write_flush(
            self._seq,
            self.writer,
            b"".join(entry.trace for entry in batch),
            b"".join(entry.samples for entry in batch),
            [entry.key for entry in batch],
            datetime.now(UTC).isoformat(),
        )
        self._seq = commit.seq + 1
        self.commits += 1
        log.info("training part written", part=commit.traces.name, rollouts=len(batch))

    async def aclose(self) -> None:
        """Write what is buffered and wait for it: a flush that fails at close is not tried
        again. Raises :class:`StoreUnavailableError` saying how many rollouts were not written."""
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._flushing is not None or self._buffer:
            ours = self._flushing is None
            if ours:
                self._failed = False
                self._maybe_flush()
            flushing = self._flushing
            assert flushing is not None
            await asyncio.shield(flushing)
            if self._failed and ours:
                break
        if self._buffer:
            raise StoreUnavailableError(
                f"{len(self._buffer)} training rollouts could not be written to {self.location}; "
                "the trainer did not receive their samples"
            )


@dataclass
class TrainingSamples:
    """What :func:`read_training_samples` found."""

    records: dict[tuple[str, int | None], dict[str, Any]] = field(default_factory=dict)
    """``(episode_id, attempt)`` → the rollout's training line."""
    bad_lines: list[int] = field(default_factory=list)
    """Local layout: line numbers (1-based) that are not a training line of this schema (a torn tail, say)."""
    missing: list[tuple[str, int | None]] = field(default_factory=list)
    """Traces of the run without a training line (the process stopped between the two writes)."""
    problems: list[str] = field(default_factory=list)
    """Object store layout: committed lines that are not the training line their commit names."""
    uncommitted: list[str] = field(default_factory=list)
    """Object store layout: parts without a commit (a process stopped before its commit), not read."""


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    if not path.exists():
        return
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if raw.strip():
                yield number, raw


def _training_line(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("schema_version") != SAMPLES_SCHEMA_VERSION:
        return None
    return value


def read_training_samples(location: str | Path) -> TrainingSamples:
    """The training lines of a run, local directory or object store location, checked against
    its traces (``missing``)."""
    text = str(location)
    if "://" in text or (Path(text) / IDENTITY).is_file():
        return _read_object_samples(text)
    run_dir = Path(text)
    found = TrainingSamples()
    for number, raw in _lines(run_dir / SAMPLES_FILE):
        value = _training_line(raw)
        if value is None:
            found.bad_lines.append(number)
            continue
        found.records[(str(value.get("episode_id")), value.get("attempt"))] = value
    for _, record in LocalRunStore(run_dir).iter_records():
        key = (record.episode_id, record.attempt)
        if key not in found.records:
            found.missing.append(key)
    return found


def _read_object_samples(location: str) -> TrainingSamples:
    """The committed samples parts, each line checked against the rollout its commit names there."""
    objects = TrainingObjects(location)
    if objects.read_identity() is None:
        raise TrainingRunError(f"{objects.display_uri} holds no {IDENTITY}: not a training run")
    state = committed_state(objects)
    found = TrainingSamples(problems=list(state.problems), uncommitted=list(state.uncommitted))
    for commit, data in objects.committed_parts(SAMPLES, state.commits):
        where = f"{objects.display_uri}/{SAMPLES}/{commit.samples.name}"
        lines, whole = part_lines(commit.samples.name, data)
        rows = [raw for raw in lines.split(b"\n") if raw.strip()]
        if not whole:
            found.problems.append(f"{where}: not a whole zstd frame")
        for number, (raw, key) in enumerate(zip(rows, commit.rollouts, strict=False), start=1):
            value = _training_line(raw)
            if value is None:
                found.problems.append(f"{where} line {number}: not a training line of {SAMPLES_SCHEMA_VERSION}")
            elif (value.get("episode_id"), value.get("attempt")) != key:
                found.problems.append(
                    f"{where} line {number}: holds {value.get('episode_id')} attempt {value.get('attempt')}, its commit {key[0]} attempt {key[1]}"
                )
            else:
                found.records[key] = value
        if len(rows) != len(commit.rollouts):
            found.problems.append(f"{where}: {len(rows)} lines, its commit names {len(commit.rollouts)} rollouts")
    found.missing = [key for key in state.rollouts() if key not in found.records]
    return found
