"""A run directory on local disk: the one-shard run store of ``shopsimrl run``.

Layout: ``<output_dir>/<name>/{manifest.json, traces.jsonl, summary.json, progress.json, .lock, leases/}``
(``progress.json``: the running process's counts and heartbeat, for ``shopsimrl status``).

Durability rules of :class:`LocalRunStore`:
- each trace is one line, appended with flush + fsync as soon as its episode ends (traces that
  end while a write runs go out together in the next one, one fsync for all); a torn tail
  left by a crash is sealed with a newline before the next append, so it stays a separate,
  skipped line;
- the file is read as bytes and decoded line by line: a bad line (torn, not UTF-8, not JSON, not
  a trace) is skipped and counted, never fatal;
- each episode's winning record is picked by the one rule of :mod:`shopsimrl.records.winner` (the first
  completed record; without one, the latest attempt); every other record is a superseded attempt;
- ``manifest.json`` and ``summary.json`` are written to a temp file (its mode from the umask, as
  for the traces), fsynced, renamed, and the directory fsynced; a write that fails (full disk,
  quota, file size limit) removes its temp file, leaves the previous file as it was and raises
  :class:`RunWriteError`;
- one process at a time holds the run (``flock`` on ``.lock``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shopsimrl.manifest import FingerprintMismatchError, ManifestError, build_manifest, plan_diff, validate_manifest
from shopsimrl.records import EpisodeTrace, RunManifest, dump_line, iter_trace_lines, read_summary, to_plain
from shopsimrl.records.winner import WinnerPicker
from shopsimrl.schemas import canonical_json, escape_lone_surrogates, fingerprint

__all__ = [
    "EpisodeState",
    "LocalRunStore",
    "ResumeIndex",
    "RunLockedError",
    "RunWriteError",
    "atomic_write_json",
]


class RunLockedError(RuntimeError):
    """Another process holds the run directory."""


class RunWriteError(RuntimeError):
    """A file of the run directory could not be written. ``retryable``: the cause may pass (a full
    disk, a quota, an I/O error: exit 3); otherwise it is the location's permissions (exit 2)."""

    def __init__(self, path: Path, exc: OSError) -> None:
        self.retryable = exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS)
        hint = "free space and run the command again" if self.retryable else "the location is not writable"
        super().__init__(
            f"cannot write {path}: {exc.strerror or exc} (errno {errno.errorcode.get(exc.errno or 0, exc.errno)}); {hint}"
        )


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse directory fsync; the rename still happened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_json(path: Path, value: Any) -> None:
    """Replace ``path`` whole or not at all; raises :class:`RunWriteError` when it cannot be written."""
    # A lone surrogate (a model's text that is not valid Unicode) is written as its \uXXXX escape.
    data = escape_lone_surrogates(json.dumps(value, ensure_ascii=False, indent=2, allow_nan=False) + "\n").encode("utf-8")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # 0o666 leaves the mode to the umask, like the traces beside it (mkstemp would make it 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise RunWriteError(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise RunWriteError(path, exc) from exc
        raise
    _fsync_dir(path.parent)


@dataclass
class EpisodeState:
    """What resume needs to know about one episode, without its heavy trace."""

    completed: bool
    attempts: int
    offset: int
    """Byte offset of the winning record (for a second, streaming pass)."""
    final_failure: bool = False
    """The winning record is a failure that is an outcome of the episode (final unless re-rolled)."""
    failure_class: str | None = None


@dataclass
class ResumeIndex:
    episodes: dict[str, EpisodeState] = field(default_factory=dict)
    bad_lines: int = 0
    lines: int = 0

    def is_complete(self, episode_id: str) -> bool:
        state = self.episodes.get(episode_id)
        return bool(state and state.completed)

    def attempts(self, episode_id: str) -> int:
        state = self.episodes.get(episode_id)
        return state.attempts if state else 0

    def final_failures(self) -> dict[str, str | None]:
        """Episode → ``failure_class`` of its winning record, where that failure is an outcome."""
        return {eid: state.failure_class for eid, state in self.episodes.items() if state.final_failure}


class LocalRunStore:
    """The single-process run directory of ``shopsimrl run`` (no shards)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.manifest_path = self.run_dir / "manifest.json"
        self.traces_path = self.run_dir / "traces.jsonl"
        self.summary_path = self.run_dir / "summary.json"
        self.progress_path = self.run_dir / "progress.json"
        self.inflight_path = self.run_dir / "model_inflight.jsonl"
        """One line per invocation: the adaptive model in-flight limit's history (shopsimrl.inflight)."""
        self._lock_handle: Any = None

    @property
    def display_uri(self) -> str:
        return str(self.run_dir)

    # -- lifecycle --------------------------------------------------------------------------

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        handle = (self.run_dir / ".lock").open("a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RunLockedError(f"{self.run_dir} is being written by another shopsimrl process") from None
        self._lock_handle = handle

    def release(self) -> None:
        if self._lock_handle is not None:
            fcntl.flock(self._lock_handle.fileno(), fcntl.LOCK_UN)
            self._lock_handle.close()
            self._lock_handle = None

    def __enter__(self) -> LocalRunStore:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- manifest ---------------------------------------------------------------------------

    def read_manifest(self) -> RunManifest | None:
        if not self.manifest_path.exists():
            return None
        try:
            manifest = json.loads(self.manifest_path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{self.manifest_path} is not valid JSON: {exc}") from exc
        return validate_manifest(manifest, str(self.manifest_path))

    def freeze_plan(self, plan: dict[str, Any], execution: dict[str, Any] | None = None) -> RunManifest:
        """Create the manifest, or verify that the existing one freezes the same plan."""
        if (self.run_dir / "shards.json").exists():
            # A single process would not see the shards' parts and would run every episode again.
            raise ManifestError(
                f"{self.run_dir} holds a sharded run (shards.json); resume it with `shopsimrl run --shards N` "
                "or `shopsimrl worker`, and merge it with `shopsimrl reduce`"
            )
        existing = self.read_manifest()
        new_fingerprint = fingerprint(plan)
        if existing is not None:
            if existing.plan_fingerprint != new_fingerprint:
                raise FingerprintMismatchError(
                    str(self.run_dir), existing.plan_fingerprint, new_fingerprint, plan_diff(existing.plan.as_dict(), plan)
                )
            return existing
        manifest = build_manifest(plan, execution, plan_fingerprint=new_fingerprint)
        atomic_write_json(self.manifest_path, to_plain(manifest))
        return manifest

    # -- traces -----------------------------------------------------------------------------

    def save_traces(self, records: list[EpisodeTrace]) -> None:
        """Append ``records`` as lines with one write and one fsync (the scheduler's group commit)."""
        line = b"".join(dump_line(record) for record in records)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.traces_path.open("a+b") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":  # a crash tore the last line: seal it off
                    handle.seek(0, os.SEEK_END)
                    handle.write(b"\n")
            handle.seek(0, os.SEEK_END)
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def flush(self) -> None:
        """Nothing to do: every :meth:`save_traces` is durable when it returns."""

    def load_index(self) -> ResumeIndex:
        """One pass over traces.jsonl: per episode its attempts and its winning record
        (:class:`~shopsimrl.records.winner.WinnerPicker`, the rule the sharded reducer applies too)."""
        index = ResumeIndex()
        picker: WinnerPicker[tuple[int, bool, str | None]] = WinnerPicker()
        attempts: dict[str, int] = {}
        for offset, record in iter_trace_lines(self.traces_path):
            index.lines += 1
            if record is None:
                index.bad_lines += 1
                continue
            attempts[record.episode_id] = attempts.get(record.episode_id, 0) + 1
            picker.offer(record, (offset, record.failed_as_outcome, record.failure_class))
        for episode_id, count in attempts.items():
            winner = picker.winner(episode_id)
            assert winner is not None  # every counted episode was offered
            offset, final, failure_class = winner
            index.episodes[episode_id] = EpisodeState(
                completed=episode_id in picker.completed,
                attempts=count,
                offset=offset,
                final_failure=final,
                failure_class=failure_class,
            )
        return index

    def iter_records(self, index: ResumeIndex | None = None) -> Iterator[tuple[bool, EpisodeTrace]]:
        """Stream ``(is_winner, record)`` over every valid line; the winning record per episode is flagged."""
        index = index or self.load_index()
        for offset, record in iter_trace_lines(self.traces_path):
            if record is None:
                continue
            state = index.episodes.get(record.episode_id)
            yield (state is not None and state.offset == offset), record

    # -- model in-flight history ------------------------------------------------------------

    def append_model_inflight(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"
        try:
            with self.inflight_path.open("a", encoding="utf-8") as handle:
                handle.write(line)
        except OSError as exc:
            raise RunWriteError(self.inflight_path, exc) from exc

    def read_model_inflight(self) -> list[dict[str, Any]]:
        """The invocations' records; a torn or foreign line (a kill mid-write) is skipped."""
        try:
            text = self.inflight_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        records = []
        for line in text.splitlines():
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                records.append(value)
        return records

    # -- summary ----------------------------------------------------------------------------

    def read_summary(self) -> dict[str, Any] | None:
        """The summary.json there is, or None when there is none or it is not a JSON object."""
        try:
            value = json.loads(self.summary_path.read_bytes())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def write_summary(self, summary: dict[str, Any]) -> None:
        canonical_json(summary)  # refuse NaN before touching the file
        read_summary(summary, str(self.summary_path))  # what is written fits its schema version
        atomic_write_json(self.summary_path, summary)


# --------------------------------------------------------------------------- the run
