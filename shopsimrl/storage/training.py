"""The layout of a training run on an object store (``s3://…``): immutable parts and their commits.

A training run has no plan frozen up front (the trainer hands rollouts in one at a time), so
it is not a sharded run: no manifest, no shard map. What it has instead::

    training.json                                 the run's identity (create-only): what it is, who made it
    traces/part-00003-1a2b3c4d.jsonl.zst          v4 traces, the evaluation record unchanged (zstd, as a shard's parts)
    training/part-00003-1a2b3c4d.jsonl.zst        the trainer's samples of the same rollouts, one line each, same order
    commits/part-00003-1a2b3c4d.json              the commit of the pair: both parts' sha256 and record counts,
                                                  and the (episode_id, attempt) of every rollout in them
    leases/1a2b3c4d.json                          the lease journal of the writing process (while it holds leases)

A flush writes the samples part, then the trace part, then the commit, each create-only; the
part names carry a sequence number and the writer's random id, so two writers never overwrite
each other. Only committed parts count: a reader takes the commits, checks each part they name
against its sha256 and reads nothing else, so a part left by a process killed before its commit
is ignored (and reported by :func:`committed_state`). Sequence numbers continue across processes
(a writer starts after the highest one listed), so part order is the order the rollouts were
written in, and the commits alone say which attempts a run holds: a restarting writer numbers
the next attempt of an episode from them without reading a trace.

The reader recognises a training run by ``training.json`` at the root and no ``manifest.json``
(:func:`shopsimrl.storage.reading.open_run`); evaluation runs are read as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from shopsimrl.manifest import ManifestError
from shopsimrl.records import dump_document
from shopsimrl.schemas import sha256_hex
from shopsimrl.storage.objectstore import ObjectStore
from shopsimrl.storage.sharded import PART_PATTERN, encode_part, part_name, part_order

__all__ = [
    "COMMITS",
    "IDENTITY",
    "LEASES",
    "SAMPLES",
    "TRACES",
    "TRAINING_COMMIT_SCHEMA_VERSION",
    "TRAINING_RUN_SCHEMA_VERSION",
    "CommittedState",
    "PartRef",
    "TrainingCommit",
    "TrainingObjects",
    "TrainingRunError",
    "committed_state",
]

TRAINING_RUN_SCHEMA_VERSION = "shopsimrl-training-run-v1"
TRAINING_COMMIT_SCHEMA_VERSION = "shopsimrl-training-commit-v1"
IDENTITY = "training.json"
TRACES, SAMPLES, COMMITS, LEASES = "traces", "training", "commits", "leases"
COMMIT_PATTERN = re.compile(r"^part-(\d{5,})-([0-9a-f]{8,32})\.json$")
_EVALUATION_OBJECTS = ("manifest.json", "shards.json", "traces.jsonl")


class TrainingRunError(ValueError):
    """The location holds something else than a training run, or a committed part does not
    verify (exit 2: the location or its contents must be looked at)."""


@dataclass(frozen=True)
class PartRef:
    """One part as its commit names it."""

    name: str
    sha256: str
    records: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "records": self.records}


@dataclass(frozen=True)
class TrainingCommit:
    """The commit of one flush: a trace part and the samples part beside it."""

    name: str
    """The commit object's name under ``commits/`` (the parts' name with ``.json``)."""
    seq: int
    writer: str
    traces: PartRef
    samples: PartRef
    rollouts: tuple[tuple[str, int], ...]
    """``(episode_id, attempt)`` of each rollout, in the parts' line order."""
    written_at: str

    def document(self) -> dict[str, Any]:
        return {
            "schema_version": TRAINING_COMMIT_SCHEMA_VERSION,
            "seq": self.seq,
            "writer": self.writer,
            "traces": self.traces.to_dict(),
            "samples": self.samples.to_dict(),
            "rollouts": [[episode_id, attempt] for episode_id, attempt in self.rollouts],
            "written_at": self.written_at,
        }

    @classmethod
    def parse(cls, name: str, data: bytes) -> TrainingCommit:
        """A commit object's bytes; ValueError saying which field does not fit."""
        try:
            value = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(value, dict) or value.get("schema_version") != TRAINING_COMMIT_SCHEMA_VERSION:
            version = value.get("schema_version") if isinstance(value, dict) else None
            raise ValueError(f"not a training commit of version {TRAINING_COMMIT_SCHEMA_VERSION} (schema_version {version!r})")
        match = COMMIT_PATTERN.match(name)
        if match is None or value.get("seq") != int(match.group(1)) or value.get("writer") != match.group(2):
            raise ValueError("'seq' and 'writer' do not match the commit's name")
        refs = []
        for key in ("traces", "samples"):
            ref = value.get(key)
            if (
                not isinstance(ref, dict)
                or ref.get("name") != name.removesuffix(".json") + ".jsonl.zst"
                or not isinstance(ref.get("sha256"), str)
                or not isinstance(ref.get("records"), int)
                or isinstance(ref.get("records"), bool)
            ):
                raise ValueError(f"{key!r} must name this commit's part with its 'sha256' and 'records'")
            refs.append(PartRef(ref["name"], ref["sha256"], ref["records"]))
        rollouts = value.get("rollouts")
        if not isinstance(rollouts, list) or not all(
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], int)
            and not isinstance(item[1], bool)
            for item in rollouts
        ):
            raise ValueError("'rollouts' must be a list of [episode_id, attempt]")
        if not refs[0].records == refs[1].records == len(rollouts):
            raise ValueError("the parts' record counts and 'rollouts' disagree")
        return cls(
            name,
            value["seq"],
            value["writer"],
            refs[0],
            refs[1],
            tuple((str(e), int(a)) for e, a in rollouts),
            str(value.get("written_at", "")),
        )


class TrainingObjects(ObjectStore):
    """A training run's objects (module docstring); every call retried as the store's
    :class:`~shopsimrl.storage.objectstore.RetryPolicy` allows."""

    # -- identity ---------------------------------------------------------------------------

    def read_identity(self) -> dict[str, Any] | None:
        """``training.json``, None when absent; TrainingRunError when it is not a training run's."""
        try:
            value = self.read_json(IDENTITY)
        except ManifestError as exc:
            raise TrainingRunError(str(exc)) from None
        if value is None:
            return None
        if not isinstance(value, dict) or value.get("schema_version") != TRAINING_RUN_SCHEMA_VERSION:
            version = value.get("schema_version") if isinstance(value, dict) else None
            raise TrainingRunError(
                f"{self.display_uri}/{IDENTITY} is not a training run's identity of version "
                f"{TRAINING_RUN_SCHEMA_VERSION} (schema_version {version!r})"
            )
        return value

    def claim(self, identity: dict[str, Any]) -> dict[str, Any]:
        """The run's identity: ``identity`` written when the location is new, else the one there.
        Refuses a location that holds an evaluation run (its readers would not see these parts).
        The first call that reaches the store: an unreachable one raises here."""
        existing = self.read_identity()
        if existing is not None:
            return existing
        for name in _EVALUATION_OBJECTS:
            if self.exists(name):
                raise TrainingRunError(
                    f"{self.display_uri} holds an evaluation run ({name}); give the training run another run.output_dir or run.name"
                )
        document = {"schema_version": TRAINING_RUN_SCHEMA_VERSION, **identity}
        if self.create(IDENTITY, dump_document(document)):
            return document
        found = self.read_identity()  # another process created it first
        if found is None:
            raise TrainingRunError(f"{self.display_uri}/{IDENTITY} was created and is gone again")
        return found

    def exists(self, rel: str) -> bool:
        path = self.path(rel)
        return bool(self._call(f"look for {rel} in", lambda: self.fs.exists(path)))

    # -- parts and commits ------------------------------------------------------------------

    def list_names(self, prefix: str) -> list[str]:
        """Part or commit names under ``prefix``, in write order (sequence number, then writer)."""
        pattern = COMMIT_PATTERN if prefix == COMMITS else PART_PATTERN
        return sorted((name for name in self.listdir(prefix) if pattern.match(name)), key=part_order)

    def write_flush(
        self, seq: int, writer: str, traces: bytes, samples: bytes, rollouts: Sequence[tuple[str, int]], written_at: str
    ) -> TrainingCommit:
        """One flush: the samples part, the trace part, then their commit (each create-only).
        ``seq`` moves on when a name is taken by other bytes (only a writer id shared by two
        processes gets there)."""
        stored_traces, stored_samples = encode_part(traces), encode_part(samples)
        for _ in range(100):
            name = part_name(seq, writer)
            if self.create(f"{SAMPLES}/{name}", stored_samples, read_back=False) and self.create(
                f"{TRACES}/{name}", stored_traces, read_back=False
            ):
                commit = TrainingCommit(
                    name.removesuffix(".jsonl.zst") + ".json",
                    seq,
                    writer,
                    PartRef(name, sha256_hex(stored_traces), len(rollouts)),
                    PartRef(name, sha256_hex(stored_samples), len(rollouts)),
                    tuple(rollouts),
                    written_at,
                )
                if self.create(f"{COMMITS}/{commit.name}", dump_document(commit.document())):
                    return commit
            seq += 1
        raise TrainingRunError(f"{self.display_uri}: cannot find a free part name for writer {writer}")

    def read_commits(self, names: Iterable[str] | None = None) -> tuple[list[TrainingCommit], list[str]]:
        """The commits (all listed, or ``names``) in write order, and why any object is not one."""
        names = self.list_names(COMMITS) if names is None else list(names)
        commits: list[TrainingCommit] = []
        problems: list[str] = []
        for rel, data in self.read_many(f"{COMMITS}/{name}" for name in names):
            if data is None:
                continue  # listed, then gone
            try:
                commits.append(TrainingCommit.parse(rel.rpartition("/")[2], data))
            except ValueError as exc:
                problems.append(f"{self.display_uri}/{rel}: {exc}")
        return commits, problems

    def committed_parts(self, prefix: str, commits: Sequence[TrainingCommit]) -> Iterator[tuple[TrainingCommit, bytes]]:
        """Each commit's part under ``prefix`` (``traces`` or ``training``), its bytes checked
        against the commit (fetched several at a time, yielded in the commits' order).
        TrainingRunError naming the part when one is missing or differs: committed output that
        does not verify is not read at all."""
        by_rel = {f"{prefix}/{(c.traces if prefix == TRACES else c.samples).name}": c for c in commits}
        for rel, data in self.read_many(by_rel):
            commit = by_rel[rel]
            ref = commit.traces if prefix == TRACES else commit.samples
            if data is None:
                raise TrainingRunError(f"{self.display_uri}/{rel}: committed by {COMMITS}/{commit.name} but missing")
            if sha256_hex(data) != ref.sha256:
                raise TrainingRunError(
                    f"{self.display_uri}/{rel}: its sha256 differs from {COMMITS}/{commit.name}; the part was changed"
                )
            yield commit, data


@dataclass
class CommittedState:
    """What a training run's commits say (no part is read)."""

    commits: list[TrainingCommit] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    """Per episode: the highest attempt committed (the next one is numbered after it)."""
    next_seq: int = 0
    """After every sequence number listed, committed or not."""
    uncommitted: list[str] = field(default_factory=list)
    """Parts without a commit: a writer killed between writing them and its commit."""
    problems: list[str] = field(default_factory=list)
    """Objects under ``commits/`` that are not a training commit."""

    def rollouts(self) -> Iterator[tuple[str, int]]:
        for commit in self.commits:
            yield from commit.rollouts


def committed_state(store: TrainingObjects) -> CommittedState:
    """The run's commits, the attempts they hold, the next sequence number, the stray parts."""
    state = CommittedState()
    state.commits, state.problems = store.read_commits()
    for commit in state.commits:
        for episode_id, attempt in commit.rollouts:
            state.attempts[episode_id] = max(attempt, state.attempts.get(episode_id, 0))
    committed = {commit.traces.name for commit in state.commits}
    seqs = [commit.seq for commit in state.commits]
    for prefix in (TRACES, SAMPLES):
        for name in store.list_names(prefix):
            seqs.append(part_order(name)[0])
            if name not in committed and f"{prefix}/{name}" not in state.uncommitted:
                state.uncommitted.append(f"{prefix}/{name}")
    state.next_seq = max(seqs, default=-1) + 1
    return state
