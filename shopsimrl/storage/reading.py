"""One reader for every kind of run: a local run directory (``traces.jsonl``), a sharded run at
any location (``s3://…``, any fsspec URL, or a local directory with ``shards.json``), a training
run on an object store (``training.json``, no manifest: :mod:`~shopsimrl.storage.training`), and
run directories of the earlier implementation (v4 traces, with or without a manifest).

A sharded run is read from its committed shards (the parts a verified commit marker lists),
as the reducer reads it: no merged file is needed. A training run is read from the trace parts
its commits name, each checked against its sha256, as one shard whose episodes are the ones
the commits list. Each episode is represented by its winning
record (:mod:`shopsimrl.records.winner`' rule, the one both stores and the reducer apply).

    run = open_run("s3://bucket/runs/ckpt-1200")
    for record in run.records():      # streams: one shard's parts in memory at a time
        ...
    run.record("task-000003__sample-000")   # one episode, through an index built once
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from shopsimrl.manifest import ManifestError, run_identity
from shopsimrl.records import EpisodeTrace, RunManifest, iter_trace_lines, parse_trace_line
from shopsimrl.records.winner import WinnerPicker
from shopsimrl.schemas import EpisodeJob, TraceFormatError, redact_uri
from shopsimrl.storage.local import LocalRunStore
from shopsimrl.storage.objectstore import RunLocationError
from shopsimrl.storage.sharded import (
    RunNotPlannedError,
    ShardedRunStore,
    ShardMapError,
    iter_part_records,
    load_frozen_plan,
    part_lines,
    read_shard_parts,
)
from shopsimrl.storage.training import IDENTITY, TRACES, TrainingCommit, TrainingObjects, TrainingRunError

__all__ = ["EpisodeSource", "Run", "RunReadError", "open_run"]

T = TypeVar("T")
P = TypeVar("P", int, tuple[int, int])
"""A record's position: byte offset in traces.jsonl, or (part, line) in a shard."""


class RunReadError(ValueError):
    """The location is not a readable run, or an episode is not in it (exit 2)."""


@dataclass(frozen=True)
class EpisodeSource:
    """Where an episode's winning record lies: a file or part of the run, and its position there
    (byte offset in ``traces.jsonl``; line number among a part's records)."""

    name: str
    position: int
    shard: int | None = None
    attempts: int = 1


@dataclass
class Run:
    """An opened run. ``kind`` is ``local``, ``sharded`` or ``training`` (a training run on an
    object store); ``manifest`` is None for traces of the earlier implementation written without
    one, and for training runs (local or not)."""

    location: str
    """Where it was opened, credentials removed."""
    kind: Literal["local", "sharded", "training"]
    manifest: RunManifest | None
    include_uncommitted: bool = False
    shard_states: dict[int, str] = field(default_factory=dict)
    """Sharded runs: per shard ``committed``, ``uncommitted`` or ``corrupt`` (filled by a read)."""
    unreadable_lines: int = 0
    training: dict[str, Any] | None = None
    """A training run on an object store: its ``training.json``."""
    _local: LocalRunStore | None = None
    _store: ShardedRunStore | None = None
    _training: TrainingObjects | None = None
    _commits: list[TrainingCommit] | None = None
    _index: dict[str, EpisodeSource] | None = None
    _part_cache: tuple[tuple[int, str], list[EpisodeTrace | None]] | None = None

    # -- identity and plan ------------------------------------------------------------------

    @property
    def plan(self) -> dict[str, Any] | None:
        """The frozen plan as stored (what its fingerprint hashes), None without a manifest."""
        return None if self.manifest is None else self.manifest.plan.as_dict()

    @property
    def identity(self) -> dict[str, Any]:
        """The summary's ``run`` block: experiment, model, checkpoint, fingerprint, split (a
        training run: its name, model and split from ``training.json``; no plan, no fingerprint)."""
        identity = run_identity(self.manifest, uri=self.location)
        if self.training is not None:
            model, tasks = self.training.get("model"), self.training.get("tasks")
            identity["experiment"] = self.training.get("name")
            if isinstance(model, dict):
                identity["model_name"] = model.get("name")
            if isinstance(tasks, dict):
                identity["split"] = {**identity["split"], "name": tasks.get("split"), "task_count": tasks.get("task_count")}
        return identity

    @property
    def jobs(self) -> list[EpisodeJob] | None:
        """The frozen job list (task, sample, seed, split; ``episode_id`` derived), None without a
        manifest."""
        jobs = (self.plan or {}).get("jobs")
        if not isinstance(jobs, list):
            return None
        try:
            return [EpisodeJob.from_dict(job) for job in jobs]
        except TraceFormatError as exc:
            raise RunReadError(f"{self.location}/manifest.json: {exc}") from None

    # -- records ----------------------------------------------------------------------------

    def records(self) -> Iterator[EpisodeTrace]:
        """The winning record of every episode that has one, streamed. Sharded runs: shard by
        shard, committed shards only unless the run was opened with ``include_uncommitted``."""
        if self._local is not None:
            yield from self._local_records()
        else:
            for _, record in self._sharded_records(winners_only=True):
                yield record

    def all_records(self) -> Iterator[tuple[bool, EpisodeTrace]]:
        """Every readable record, superseded attempts and duplicates included, as ``(is_winner,
        record)`` in reading order (file order; shard, part and line order). For readers that check
        more than the winners: a skill gate refuses an episode with two completed records."""
        if self._local is not None:
            resume = self._local.load_index()
            self.unreadable_lines = resume.bad_lines
            yield from self._local.iter_records(resume)
            self._refuse_unreadable(len(resume.episodes))
        else:
            yield from self._sharded_records(winners_only=False)

    def winner_views(self, view: Callable[[EpisodeTrace], T]) -> list[T]:
        """``view(record)`` of every episode's winning record, in the order of :meth:`records`,
        from one pass over the run: each record's view is taken as it is read and only the
        winner's is kept (one view per episode in memory). Half the reading of
        :meth:`records`, which reads every record twice to hold one part at a time, when a small
        view of each episode (a table row) is all that is needed. Builds :meth:`index` too."""
        found = self._scan_local(view) if self._local is not None else self._scan_sharded(view)
        return [item for _, item in found]

    def index(self) -> dict[str, EpisodeSource]:
        """``episode_id`` → where its winning record lies (one pass over the run, kept)."""
        if self._index is None:
            self.winner_views(lambda record: None)
        assert self._index is not None
        return self._index

    def record(self, episode_id: str) -> EpisodeTrace:
        """One episode's winning record (reads one line, or one part of a sharded run)."""
        source = self.index().get(episode_id)
        if source is None:
            raise RunReadError(f"{self.location} has no episode {episode_id!r}")
        if self._local is not None:
            with self._local.traces_path.open("rb") as handle:
                handle.seek(source.position)
                record = parse_trace_line(handle.readline().strip())
        else:
            record = self._part_records(source)[source.position]
        if record is None or record.episode_id != episode_id:
            raise RunReadError(f"{self.location}: the record of {episode_id} changed since the run was indexed; open it again")
        return record

    def find(self, episode_id: str) -> tuple[EpisodeTrace, EpisodeSource]:
        """One episode's winning record and where it lies, without reading the whole run: only
        the lines that contain the episode id are parsed, in traces.jsonl or, for a sharded run,
        in the parts of the episode's own shard (the shard map says which). For one look-up
        (``shopsimrl show``); :meth:`record` serves many through the index."""
        if self._index is not None:
            return self.record(episode_id), self._index[episode_id]
        needle = _needle(episode_id)
        picker: WinnerPicker[tuple[EpisodeSource, EpisodeTrace]] = WinnerPicker()
        attempts = 0
        for source, line in self._lines_of(episode_id):
            if needle is not None and needle not in line:
                continue
            record = parse_trace_line(line)
            if record is not None and record.episode_id == episode_id:
                attempts += 1
                picker.offer(record, (source, record))
        winner = picker.winner(episode_id)
        if winner is None:
            raise RunReadError(f"{self.location} has no episode {episode_id!r}")
        source, record = winner
        return record, replace(source, attempts=attempts)

    def _lines_of(self, episode_id: str) -> Iterator[tuple[EpisodeSource, bytes]]:
        """Every non-blank line that may hold ``episode_id``'s records, with its position."""
        if self._local is not None:
            name = self._local.traces_path.name
            for offset, line in _jsonl_lines(self._local.traces_path):
                yield EpisodeSource(name, offset), line
            return
        if self._training is not None:
            # The commits list each part's episodes: only the parts that hold this one are read.
            commits = [c for c in self._training_commits() if any(eid == episode_id for eid, _ in c.rollouts)]
            for commit, data in self._committed_traces(commits):
                lines, _ = part_lines(commit.traces.name, data)
                for line_no, line in enumerate(line for line in (raw.strip() for raw in lines.split(b"\n")) if line):
                    yield EpisodeSource(commit.traces.name, line_no, shard=0), line
            return
        assert self._store is not None
        frozen = load_frozen_plan(self._store)
        shard = next((index for index, ids in enumerate(frozen.shard_map.episode_ids) if episode_id in ids), None)
        if shard is None:
            raise RunReadError(f"{self.location} has no episode {episode_id!r}")
        parts = read_shard_parts(
            self._store, shard, frozen.shard_map, frozen.fingerprint, include_uncommitted=self.include_uncommitted
        )
        self.shard_states[shard] = parts.result.state
        for name, data in parts.parts:
            lines, _ = part_lines(_held_name(name), data)
            # Numbered as iter_part_records yields them (non-blank lines), which record() indexes.
            for line_no, line in enumerate(line for line in (raw.strip() for raw in lines.split(b"\n")) if line):
                yield EpisodeSource(name, line_no, shard=shard), line

    # -- a run that holds no record -----------------------------------------------------------

    def _refuse_unreadable(self, episodes: int) -> None:
        """A run whose lines are all unreadable (garbage, torn, foreign) holds no run's traces:
        every reader refuses it (exit 2), naming the first bad line, instead of showing an empty
        run. Unreadable lines beside readable records (a torn last line after a crash) are
        skipped and counted, as the run stores do."""
        if episodes or not self.unreadable_lines:
            return
        raise RunReadError(
            f"{self._first_unreadable()}: not a trace record; {self.location} holds no readable episode record "
            f"({self.unreadable_lines} unreadable line{'s' if self.unreadable_lines != 1 else ''})"
        )

    def _first_unreadable(self) -> str:
        """Where the first unreadable line is (read again: only a refused run gets here)."""
        if self._local is not None:
            path = self._local.traces_path
            with path.open("rb") as handle:
                for number, raw in enumerate(handle, start=1):
                    if raw.strip() and parse_trace_line(raw.strip()) is None:
                        return f"{path} line {number}"
            return str(path)
        for shard, parts, _ in self._shard_parts():
            for name, data in parts:
                for number, record in enumerate(_held_part_records(name, data), start=1):
                    if record is None:
                        return f"{self.location} shard {shard}, part {name}, line {number}"
        return self.location

    # -- local run directories --------------------------------------------------------------

    def _local_records(self) -> Iterator[EpisodeTrace]:
        assert self._local is not None
        resume = self._local.load_index()
        self.unreadable_lines = resume.bad_lines
        index: dict[str, EpisodeSource] = {}
        name = self._local.traces_path.name
        for is_winner, record in self._local.iter_records(resume):
            if is_winner:
                state = resume.episodes[record.episode_id]
                index[record.episode_id] = EpisodeSource(name, state.offset, attempts=state.attempts)
                yield record
        self._refuse_unreadable(len(index))
        self._index = index

    def _scan_local(self, view: Callable[[EpisodeTrace], T]) -> list[tuple[str, T]]:
        """The pass of ``LocalRunStore.load_index`` (the winner rule over byte offsets), carrying
        each record's view."""
        assert self._local is not None
        picker: WinnerPicker[tuple[int, T]] = WinnerPicker()
        attempts: dict[str, int] = {}
        unreadable = 0
        for offset, record in iter_trace_lines(self._local.traces_path):
            if record is None:
                unreadable += 1
                continue
            attempts[record.episode_id] = attempts.get(record.episode_id, 0) + 1
            picker.offer(record, (offset, view(record)))
        winners = _winners(picker, attempts)
        name = self._local.traces_path.name
        self._index = {
            episode_id: EpisodeSource(name, offset, attempts=attempts[episode_id]) for episode_id, offset, _ in winners
        }
        self.unreadable_lines = unreadable
        self._refuse_unreadable(len(winners))
        return [(episode_id, item) for episode_id, _, item in winners]

    # -- sharded runs -----------------------------------------------------------------------

    def _shard_parts(self) -> Iterator[tuple[int, list[tuple[str, bytes]], set[str]]]:
        """Per shard its parts that count (held compressed) and its planned episode ids (a
        training run: one shard, its committed parts and the episodes they list)."""
        if self._training is not None:
            commits = self._training_commits()
            held = [(commit.traces.name, data) for commit, data in self._committed_traces(commits)]
            yield 0, held, {episode_id for commit in commits for episode_id, _ in commit.rollouts}
            return
        assert self._store is not None
        frozen = load_frozen_plan(self._store)
        for shard in range(frozen.shard_map.count):
            parts = read_shard_parts(
                self._store, shard, frozen.shard_map, frozen.fingerprint, include_uncommitted=self.include_uncommitted
            )
            self.shard_states[shard] = parts.result.state
            yield shard, parts.parts, set(frozen.shard_map.episode_ids[shard])

    def _pick(
        self, parts: list[tuple[str, bytes]], shard_ids: set[str], view: Callable[[EpisodeTrace], T]
    ) -> tuple[list[tuple[str, tuple[int, int], T]], dict[str, int], int]:
        """One pass over a shard's parts, one part decoded at a time: per episode its winning
        line ``(part, line)`` and view, in part order; the attempts per episode; unreadable lines."""
        picker: WinnerPicker[tuple[tuple[int, int], T]] = WinnerPicker()
        attempts: dict[str, int] = {}
        unreadable = 0
        for part_no, (name, data) in enumerate(parts):
            for line_no, record in enumerate(_held_part_records(name, data)):
                if record is None:
                    unreadable += 1
                elif record.episode_id in shard_ids:
                    picker.offer(record, ((part_no, line_no), view(record)))
                    attempts[record.episode_id] = attempts.get(record.episode_id, 0) + 1
        return _winners(picker, attempts), attempts, unreadable

    def _sharded_records(self, winners_only: bool) -> Iterator[tuple[bool, EpisodeTrace]]:
        """``(is_winner, record)`` in reading order; with ``winners_only``, the winners alone."""
        index: dict[str, EpisodeSource] = {}
        unreadable = 0
        for shard, parts, shard_ids in self._shard_parts():
            # Two passes over the shard's parts, one part decoded at a time: the first finds each
            # episode's winning line, the second yields those records. Decoding twice keeps memory
            # at one part's records, not a whole shard's (10,000 episodes of 50 KB each are
            # gigabytes as Python objects).
            winners, attempts, bad = self._pick(parts, shard_ids, lambda record: None)
            unreadable += bad
            at = {position: episode_id for episode_id, position, _ in winners}
            for part_no, (name, data) in enumerate(parts):
                for line_no, record in enumerate(_held_part_records(name, data)):
                    episode_id = at.get((part_no, line_no))
                    if episode_id is not None and record is not None:
                        index[episode_id] = EpisodeSource(name, line_no, shard=shard, attempts=attempts[episode_id])
                        yield True, record
                    elif not winners_only and record is not None and record.episode_id in shard_ids:
                        yield False, record
        self.unreadable_lines = unreadable
        self._refuse_unreadable(len(index))
        self._index = index

    def _scan_sharded(self, view: Callable[[EpisodeTrace], T]) -> list[tuple[str, T]]:
        index: dict[str, EpisodeSource] = {}
        found: list[tuple[str, T]] = []
        unreadable = 0
        for shard, parts, shard_ids in self._shard_parts():
            winners, attempts, bad = self._pick(parts, shard_ids, view)
            unreadable += bad
            for episode_id, (part_no, line_no), item in winners:
                index[episode_id] = EpisodeSource(parts[part_no][0], line_no, shard=shard, attempts=attempts[episode_id])
                found.append((episode_id, item))
        self.unreadable_lines = unreadable
        self._refuse_unreadable(len(found))
        self._index = index
        return found

    def _part_records(self, source: EpisodeSource) -> list[EpisodeTrace | None]:
        """A part's records, the last part read kept (a viewer opens neighbouring episodes).
        Safe from several threads: each call works on its own reference to the cache entry."""
        assert source.shard is not None
        key = (source.shard, source.name)
        cached = self._part_cache
        if cached is None or cached[0] != key:
            data = self._read_part(source)
            if data is None:
                raise RunReadError(f"{self.location}: part {source.name} of shard {source.shard} is gone; open the run again")
            cached = (key, list(iter_part_records(source.name, data)))
            self._part_cache = cached
        return cached[1]

    def _read_part(self, source: EpisodeSource) -> bytes | None:
        if self._training is None:
            assert self._store is not None and source.shard is not None
            return self._store.read_part(source.shard, source.name)
        commits = [commit for commit in self._training_commits() if commit.traces.name == source.name]
        return next((data for _, data in self._committed_traces(commits)), None)

    def _committed_traces(self, commits: list[TrainingCommit]) -> Iterator[tuple[TrainingCommit, bytes]]:
        """The commits' trace parts, verified; a part that does not verify is a RunReadError."""
        assert self._training is not None
        try:
            yield from self._training.committed_parts(TRACES, commits)
        except TrainingRunError as exc:
            raise RunReadError(str(exc)) from None

    def _training_commits(self) -> list[TrainingCommit]:
        """The training run's commits, read once (a run opened again sees later ones)."""
        assert self._training is not None
        if self._commits is None:
            self._commits, problems = self._training.read_commits()
            if problems:
                raise RunReadError(problems[0])
        return self._commits


def _winners(picker: WinnerPicker[tuple[P, T]], attempts: dict[str, int]) -> list[tuple[str, P, T]]:
    """Each offered episode's winner ``(episode_id, position, view)``, in reading order."""
    winners: list[tuple[str, P, T]] = []
    for episode_id in attempts:
        winner = picker.winner(episode_id)
        assert winner is not None  # every counted episode was offered
        winners.append((episode_id, winner[0], winner[1]))
    winners.sort(key=lambda item: item[1])
    return winners


def _held_name(name: str) -> str:
    """How a part as :func:`read_shard_parts` holds it is decoded: always compressed (a plain
    ``.jsonl`` part of an earlier version too), so as zstd whatever its name."""
    return name if name.endswith(".zst") else f"{name}.zst"


def _held_part_records(name: str, data: bytes) -> Iterator[EpisodeTrace | None]:
    return iter_part_records(_held_name(name), data)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line)`` of every non-blank line, stripped, unparsed (the offsets of
    :func:`~shopsimrl.records.iter_trace_lines`)."""
    with path.open("rb") as handle:
        offset = 0
        for raw in handle:
            start, offset = offset, offset + len(raw)
            line = raw.strip()
            if line:
                yield start, line


def _needle(episode_id: str) -> bytes | None:
    """Bytes every line holding the episode's records contains: its id, when JSON writes it one
    way only (printable ASCII without quote, backslash or slash); None otherwise (parse every line)."""
    if episode_id.isascii() and episode_id.isprintable() and not any(char in episode_id for char in '"\\/'):
        return episode_id.encode("ascii")
    return None


def open_run(location: str | Path, *, include_uncommitted: bool = False) -> Run:
    """Open a run for reading. Raises :class:`RunReadError` naming the location when it holds no
    run, or its manifest or shard map is unreadable."""
    text = str(location)
    shown = redact_uri(text) if "://" in text else text
    try:
        if "://" not in text and not (Path(text) / "shards.json").exists() and not (Path(text) / IDENTITY).is_file():
            return _open_local(Path(text), shown)
        store = ShardedRunStore(text)
        manifest = store.read_manifest()
        if manifest is None and (training := _open_training(text)) is not None:
            return training
        load_frozen_plan(store)  # the worker's and the reducer's checks of manifest and shard map
    except RunNotPlannedError as exc:
        raise RunReadError(str(exc)) from None
    except (ManifestError, ShardMapError, TraceFormatError, RunLocationError, TrainingRunError) as exc:
        raise RunReadError(f"{shown}: {exc}") from None
    return Run(shown, "sharded", manifest, include_uncommitted=include_uncommitted, _store=store)


def _open_training(location: str) -> Run | None:
    """The training run at ``location`` (``training.json`` there), None when there is none."""
    objects = TrainingObjects(location)
    identity = objects.read_identity()
    if identity is None:
        return None
    return Run(objects.display_uri, "training", None, training=identity, _training=objects)


def _open_local(path: Path, shown: str) -> Run:
    if path.is_file():
        raise RunReadError(f"{shown} is a file; give the run directory that holds traces.jsonl (and manifest.json)")
    store = LocalRunStore(path)
    if not store.traces_path.exists():
        if not path.exists():
            raise RunReadError(f"{shown} does not exist")
        raise RunReadError(f"{shown} holds no traces.jsonl and no shards.json: not a run directory")
    try:
        manifest = store.read_manifest()
    except ManifestError as exc:
        raise RunReadError(str(exc)) from None
    return Run(shown, "local", manifest, _local=store)
