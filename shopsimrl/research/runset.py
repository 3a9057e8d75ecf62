"""Many runs read as one table: the runs under a folder or ``s3://`` prefix (found as ``shopsimrl
runs`` finds them, :func:`shopsimrl.runner.runs.list_runs`), or a list of runs, each row carrying
its run's identity columns (:data:`RUN_COLUMNS`).

A location that is itself a run is read as one run, exactly as before (no identity columns unless
asked for); any other location, a list or a :class:`RunSet` is a multi-run read. Runs are opened
one at a time, when their turn comes, so a read over many runs holds one run's reader at a time.

A run that cannot be read — it cannot be opened, its records are unreadable or of another schema
version, its folder could not be listed — is skipped with a warning naming it and the error, and
listed as skipped in the table's metadata; ``strict=True`` fails instead, naming the run. A store
that does not answer (an OSError, ``StoreUnavailableError``) always fails the read: it is
retryable, not a property of the run. A run that fails after some of its rows were already handed
out (a steps stream) fails the read whatever ``strict`` says: its rows cannot be taken back.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import pyarrow as pa  # type: ignore[import-untyped]

from shopsimrl.runner.runs import MAX_DEPTH, RunEntry, list_runs
from shopsimrl.storage.objectstore import RunLocationError
from shopsimrl.storage.reading import Run, RunReadError, open_run
from shopsimrl.storage.sharded import ShardedRunStore

__all__ = [
    "METADATA_RUNS",
    "METADATA_SKIPPED",
    "RUN_COLUMNS",
    "RunIdentity",
    "RunSet",
    "RunSkippedWarning",
    "RunsLike",
    "SkippedRun",
    "Skips",
    "open_member",
    "open_runs",
    "resolve",
    "runs_metadata",
]

T = TypeVar("T")

RUN_COLUMNS = pa.schema(
    [
        ("run_location", pa.string()),  # where the run is, credentials removed
        ("run_experiment", pa.string()),
        ("run_model", pa.string()),
        ("run_checkpoint", pa.string()),
        ("run_fingerprint", pa.string()),  # the plan fingerprint, in full
        ("run_split", pa.string()),
    ]
)
"""The identity columns every row of a multi-run table starts with: what ``shopsimrl runs`` shows
as experiment, model, checkpoint, plan and split, and the run's location."""

METADATA_RUNS = "shopsimrl.runs"
"""Schema (and Parquet file) metadata key: a JSON list, one object per run read (its identity and
``rows``, the rows it gave)."""
METADATA_SKIPPED = "shopsimrl.skipped_runs"
"""Schema (and Parquet file) metadata key: a JSON list of ``{location, name, error}``."""


class RunSkippedWarning(UserWarning):
    """A run of a multi-run read could not be read and was left out (the table's metadata lists it)."""


@dataclass(frozen=True)
class RunIdentity:
    """Which run a row belongs to: the identity ``shopsimrl runs`` shows (``RunEntry``'s fields)."""

    location: str
    """Where the run is, credentials removed."""
    name: str
    """Its path under the location that was read (as ``runs`` shows it); a run given by itself: its location."""
    kind: str
    experiment: str | None = None
    model: str | None = None
    model_id: str | None = None
    checkpoint: str | None = None
    fingerprint: str | None = None
    split: str | None = None
    created: str | None = None

    @classmethod
    def of_entry(cls, entry: RunEntry) -> RunIdentity:
        return cls(
            location=entry.location,
            name=entry.name,
            kind=entry.kind,
            experiment=entry.experiment,
            model=entry.model,
            model_id=entry.model_id,
            checkpoint=entry.checkpoint,
            fingerprint=entry.fingerprint,
            split=entry.split,
            created=entry.created,
        )

    @classmethod
    def of_run(cls, run: Run) -> RunIdentity:
        """From an opened run: its manifest (a training run: its ``training.json``), the
        summary's ``run`` block as :attr:`Run.identity` builds it."""
        identity = run.identity
        split = identity.get("split")
        return cls(
            location=run.location,
            name=run.location,
            kind=run.kind,
            experiment=_text(identity.get("experiment")),
            model=_text(identity.get("model_name")),
            model_id=_text(identity.get("model_id")),
            checkpoint=_text(identity.get("checkpoint_id")),
            fingerprint=_text(identity.get("plan_fingerprint")),
            split=_text(split.get("name")) if isinstance(split, dict) else None,
            created=run.manifest.created_at if run.manifest is not None else None,
        )

    def columns(self) -> dict[str, str | None]:
        """The values of :data:`RUN_COLUMNS` for this run."""
        return {
            "run_location": self.location,
            "run_experiment": self.experiment,
            "run_model": self.model,
            "run_checkpoint": self.checkpoint,
            "run_fingerprint": self.fingerprint,
            "run_split": self.split,
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class SkippedRun:
    """A run left out of a multi-run read, and why."""

    location: str
    name: str
    error: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Member:
    identity: RunIdentity
    source: Run | str | None
    """An opened run, the URI to open it at (credentials kept), or None: it could not be listed."""
    error: str | None = None


@dataclass
class RunSet:
    """Several runs to read as one table (:func:`open_runs`). Nothing of a run but its identity is
    read until a table is asked for; each read opens the runs anew, one at a time."""

    members: list[_Member] = field(default_factory=list)

    @property
    def identities(self) -> list[RunIdentity]:
        """The runs, in the order they are read (each location's runs by name)."""
        return [member.identity for member in self.members]

    def __len__(self) -> int:
        return len(self.members)

    def each(self, read: Callable[[Run], T], skips: Skips) -> Iterator[tuple[RunIdentity, T]]:
        """``read(run)`` of every run, opened one at a time; a run whose opening or reading raises
        a ValueError (not a run, unreadable records, another schema version) is skipped or, strict,
        fails the read (:meth:`Skips.refuse`)."""
        for member in self.members:
            try:
                result = read(open_member(member))
            except ValueError as exc:
                skips.refuse(member, exc)
                continue
            yield member.identity, result


def open_member(member: _Member) -> Run:
    """The member's run, opened (a RunReadError when its folder could not be listed)."""
    if member.source is None:
        raise RunReadError(member.error or f"{member.identity.location} could not be listed")
    return member.source if isinstance(member.source, Run) else open_run(member.source)


@dataclass
class Skips:
    """What one multi-run read does with a run it cannot read, and the runs it left out."""

    strict: bool = False
    on_skip: Callable[[SkippedRun], None] | None = None
    """Told of each run left out; by default a :class:`RunSkippedWarning`."""
    skipped: list[SkippedRun] = field(default_factory=list)

    def refuse(self, member: _Member, exc: BaseException) -> None:
        """Skip ``member`` for ``exc`` or, strict, raise a RunReadError naming it."""
        location = member.identity.location
        message = str(exc) or type(exc).__name__
        named = message if location in message else f"{location}: {message}"
        if self.strict:
            raise RunReadError(named) from exc
        skipped = SkippedRun(location, member.identity.name, named)
        self.skipped.append(skipped)
        if self.on_skip is None:
            warnings.warn(f"skipped a run that cannot be read: {named}", RunSkippedWarning, stacklevel=2)
        else:
            self.on_skip(skipped)

    def none_read(self, runs: int) -> RunReadError:
        """The error of a read in which no run could be read."""
        reasons = "; ".join(item.error for item in self.skipped)
        return RunReadError(f"none of the {runs} runs could be read: {reasons}")


RunsLike = Run | str | os.PathLike[str] | RunSet | Sequence[Run | str | os.PathLike[str]]
"""What every reader of :mod:`shopsimrl.research.tables` takes: one run (opened, or its location),
a location holding several runs, a list of runs or locations, or a :class:`RunSet`."""


def _member(entry: RunEntry, uri: str) -> _Member:
    identity = RunIdentity.of_entry(entry)
    if entry.name == ".":  # the location given is the run: named by it, not "."
        identity = replace(identity, name=entry.location)
    if entry.kind == "unknown":  # the listing of its folder failed: there may be runs in it
        return _Member(identity, None, entry.error or "could not be listed")
    if uri.startswith("file://") and entry.kind in ("local", "legacy"):
        uri = uri[len("file://") :]  # a local run directory is opened by its path
    return _Member(identity, uri)


def _below(location: str, max_depth: int) -> tuple[list[_Member], bool]:
    """The runs at or under ``location``, by name (``runs``' discovery and identity), and whether
    ``location`` is itself a run (then the only one: the search does not go below a run)."""
    root = ShardedRunStore(location)
    entries = sorted(list_runs(location, max_depth=max_depth), key=lambda entry: entry.name)
    members = [_member(entry, root.uri if entry.name == "." else root.beneath(entry.name).uri) for entry in entries]
    return members, any(entry.name == "." for entry in entries)


def open_runs(runs: str | os.PathLike[str] | Iterable[Run | str | os.PathLike[str]], *, max_depth: int = MAX_DEPTH) -> RunSet:
    """The runs under a location, or those of a list (each item an opened run, a run's location,
    or a location holding runs, expanded in place), for a multi-run read. Reads what ``shopsimrl
    runs`` reads (listings, manifests' heads, summaries), no record. Raises RunReadError when a
    location holds no run at all, or one run is given twice."""
    items: list[Run | str | os.PathLike[str]] = [runs] if isinstance(runs, str | os.PathLike) else list(runs)
    members: list[_Member] = []
    for item in items:
        if isinstance(item, Run):
            members.append(_Member(RunIdentity.of_run(item), item))
            continue
        found, _ = _below(str(item), max_depth)
        if not found:
            raise RunReadError(f"{_shown(item)}: no run there (a folder or prefix holding runs, or a run)")
        members.extend(found)
    seen: set[str] = set()
    for member in members:
        if member.identity.location in seen:
            raise RunReadError(f"the run {member.identity.location} is given twice")
        seen.add(member.identity.location)
    if not members:
        raise RunReadError("no runs given")
    return RunSet(members)


def _shown(item: str | os.PathLike[str]) -> str:
    return ShardedRunStore(str(item)).display_uri if "://" in str(item) else str(item)


def resolve(runs: RunsLike, *, max_depth: int = MAX_DEPTH) -> Run | RunSet:
    """One run or several: an opened run, or a location that is itself a run, is one run (opened
    as :func:`open_run` opens it, its errors unchanged); any other location is the runs under it;
    a list or a RunSet is several."""
    if isinstance(runs, Run | RunSet):
        return runs
    if isinstance(runs, str | os.PathLike):
        try:
            return open_run(os.fspath(runs))
        except RunReadError as not_a_run:
            try:
                found, itself = _below(str(runs), max_depth)
            except RunLocationError:
                raise not_a_run from None
            if itself or not found:
                raise not_a_run from None  # a broken run, or no run below it: the one-run error, as before
            return RunSet(found)
    return open_runs(runs, max_depth=max_depth)


# --------------------------------------------------------------------------- metadata


def metadata(read: Sequence[tuple[RunIdentity, int]], skipped: Sequence[SkippedRun]) -> dict[str, str]:
    """The key/value metadata of a table of ``read`` runs (identity and rows each)."""
    runs = [{**identity.as_dict(), "rows": rows} for identity, rows in read]
    return {
        METADATA_RUNS: json.dumps(runs, ensure_ascii=False),
        METADATA_SKIPPED: json.dumps([item.as_dict() for item in skipped], ensure_ascii=False),
    }


def runs_metadata(source: pa.Table | pa.Schema | str | os.PathLike[str]) -> dict[str, list[dict[str, Any]]]:
    """``{"runs": [...], "skipped_runs": [...]}`` of a table of this module, or of a Parquet file
    ``export table`` wrote (read from its footer only); both lists empty when there is none."""
    if isinstance(source, str | os.PathLike):
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        raw = pq.read_metadata(source).metadata or {}
    else:
        raw = (source if isinstance(source, pa.Schema) else source.schema).metadata or {}
    found = {key.decode() if isinstance(key, bytes) else key: value for key, value in raw.items()}
    return {
        "runs": json.loads(found[METADATA_RUNS]) if METADATA_RUNS in found else [],
        "skipped_runs": json.loads(found[METADATA_SKIPPED]) if METADATA_SKIPPED in found else [],
    }
