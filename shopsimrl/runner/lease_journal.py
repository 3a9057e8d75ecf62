"""Lease journal: the ShopSimulator leases a run's process holds, kept with the run.

ShopSimulator leases never expire: a process killed outright (kill -9, an OOM kill, a node
lost) keeps its slots leased until someone calls ``release_all``. So every process that runs
episodes keeps a journal, and a process that starts on the same run (or shard) first releases
the leases that dead predecessors left in theirs.

Where and how the journals are kept:

- on a local disk (a local run: ``<run dir>/leases/``; a sharded run in a directory:
  ``<run>/leases/<shard>/``), ``<writer>.jsonl`` is an append-only event log — a header line,
  then one short line per event (reset sent, reset answered with or without a lease, lease
  released), written with one ``write()`` before the adapter goes on: a reset is journaled as in
  flight before it is sent. It is compacted when it grows, and deleted when nothing is held;
- on an object store (``s3://…/leases/<shard>/``), ``<writer>.json`` is a snapshot of the state,
  replaced by a writer task at most every ``min_interval`` seconds (0.2 s; every PUT is billed),
  so bursts of changes coalesce. A reset waits (:meth:`LeaseJournal.recorded`) until a snapshot
  that counts it as in flight is stored: the resets that wait meanwhile go out together after
  the next write (a group commit; at most ``min_interval`` plus one PUT of start latency).

Which journals are released: those of processes that are provably gone — on this host (same
hostname and PID namespace) when the PID is dead or belongs to a newer process; on another host
always, because Kubernetes starts a replacement pod for an index only after the old one has
terminated (``podFailurePolicy`` implies ``podReplacementPolicy: Failed``). Two workers running
one shard at once on different hosts is outside that contract.

What can still leak after kill -9 (docs/sharded_runs.md, "Leases"): resets that were in flight
when the process died — the server grants them, now or once a slot frees, to nobody — and, on an
object store, leases granted since the last snapshot, whose resets that snapshot counts as in
flight. Either way at most the ``resets_in_flight`` the stored journal names (the successor
logs the sum as ``resets_in_flight_at_stop``). Only while the journal cannot be written at all
(the store down past its retries; logged) do resets go out unrecorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import orjson
import structlog

from shopsimrl.environment import ShopEnvironmentError, ShopSimulatorEnvironment, SlotUsage, lease_budget
from shopsimrl.schemas import redact_uri

__all__ = [
    "JOURNAL_SCHEMA_VERSION",
    "DirectoryJournalStorage",
    "JournalState",
    "JournalStorage",
    "LeaseJournal",
    "LeasePlan",
    "ProcessIdentity",
    "RecoveryReport",
    "StoreJournalStorage",
    "parse_journal",
    "read_journals",
    "shard_journal_storage",
    "start_lease_tracking",
]

JOURNAL_SCHEMA_VERSION = "shopsimrl-lease-journal-v1"
_LOG_SUFFIX, _SNAPSHOT_SUFFIX = ".jsonl", ".json"

log = structlog.get_logger("shopsimrl.leases")


def _now() -> str:
    return datetime.now(UTC).isoformat()


# --------------------------------------------------------------------------- process identity


def _process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), to tell a reused PID apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """Enough to decide later, from another process, whether this one is still alive."""

    host: str
    pid: int
    started: int | None
    pid_namespace: str | None

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _process_start_ticks(pid), _pid_namespace())

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "pid": self.pid, "started": self.started, "pid_namespace": self.pid_namespace}

    @classmethod
    def from_dict(cls, data: Any) -> ProcessIdentity | None:
        if not isinstance(data, dict) or not isinstance(data.get("host"), str) or not isinstance(data.get("pid"), int):
            return None
        started, namespace = data.get("started"), data.get("pid_namespace")
        return cls(
            data["host"],
            data["pid"],
            started if isinstance(started, int) else None,
            namespace if isinstance(namespace, str) else None,
        )

    def is_alive(self) -> bool:
        """False when provably gone, or when it ran on another host or in another PID namespace
        (taken as gone: see the module docstring); True when it runs here."""
        here = ProcessIdentity.current()
        if self.host != here.host or self.pid_namespace != here.pid_namespace:
            return False
        if self.pid == here.pid:
            return self.started == here.started
        if self.started is not None:
            return _process_start_ticks(self.pid) == self.started
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# --------------------------------------------------------------------------- journal contents


@dataclass
class JournalState:
    """What one journal says: whose it is and what that process held."""

    writer: str
    process: ProcessIdentity | None
    environment: str | None
    held: dict[int, str] = field(default_factory=dict)
    resets_in_flight: int = 0
    updated_at: str | None = None

    def header(self) -> dict[str, Any]:
        return {
            "schema_version": JOURNAL_SCHEMA_VERSION,
            "writer": self.writer,
            "process": self.process.to_dict() if self.process else None,
            "environment": self.environment,
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            **self.header(),
            "updated_at": _now(),
            "resets_in_flight": self.resets_in_flight,
            "leases": [{"env_idx": env_idx, "lease_id": lease_id} for env_idx, lease_id in sorted(self.held.items())],
        }

    def apply(self, event: dict[str, Any]) -> None:
        """One event line of a local journal."""
        if "sent" in event:
            self.resets_in_flight += 1
        elif "answered" in event:
            self.resets_in_flight = max(0, self.resets_in_flight - 1)
            lease = event["answered"]
            if lease is not None:
                self.held[int(lease[0])] = str(lease[1])
        elif "released" in event:
            env_idx, lease_id = int(event["released"][0]), str(event["released"][1])
            if self.held.get(env_idx) == lease_id:
                del self.held[env_idx]
        if isinstance(event.get("at"), str):
            self.updated_at = event["at"]


def parse_journal(name: str, raw: bytes) -> JournalState:
    """Read a journal: an event log (``.jsonl``) or a snapshot (``.json``). Raises ValueError."""
    lines = [line for line in raw.split(b"\n") if line.strip()]
    if not lines:
        raise ValueError("empty journal")
    head = json.loads(lines[0])
    if not isinstance(head, dict) or head.get("schema_version") != JOURNAL_SCHEMA_VERSION:
        raise ValueError(f"not a lease journal of version {JOURNAL_SCHEMA_VERSION}")
    environment = head.get("environment")
    state = JournalState(
        str(head.get("writer", "")),
        ProcessIdentity.from_dict(head.get("process")),
        environment if isinstance(environment, str) else None,
    )
    if name.endswith(_LOG_SUFFIX):
        for line in lines[1:]:
            try:
                event = json.loads(line)
                if isinstance(event, dict):
                    state.apply(event)
            except (ValueError, TypeError, IndexError, KeyError):
                continue  # a torn last line (kill -9 in the middle of a write)
        return state
    state.held = {int(e["env_idx"]): str(e["lease_id"]) for e in head.get("leases", [])}
    in_flight = head.get("resets_in_flight")
    state.resets_in_flight = in_flight if isinstance(in_flight, int) and in_flight > 0 else 0
    state.updated_at = head.get("updated_at") if isinstance(head.get("updated_at"), str) else None
    return state


# --------------------------------------------------------------------------- storage


class JournalStorage(Protocol):
    """Where one run's (or shard's) journals are kept."""

    display: str
    appends: bool
    """True: a local directory, journals are event logs appended line by line."""

    def names(self) -> list[str]: ...

    def read(self, name: str) -> bytes | None: ...

    def write(self, name: str, data: bytes) -> None: ...

    def delete(self, name: str) -> None: ...


class DirectoryJournalStorage:
    """Journals as files in a local directory. No fsync: kill -9 of the process, not a power
    cut, is what they guard against, and the page cache survives the process."""

    appends = True

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.display = str(self.directory)
        self._fds: dict[str, int] = {}

    def names(self) -> list[str]:
        try:
            return sorted(
                p.name
                for p in self.directory.iterdir()
                if p.suffix in (_LOG_SUFFIX, _SNAPSHOT_SUFFIX) and not p.name.startswith(".")
            )
        except FileNotFoundError:
            return []

    def read(self, name: str) -> bytes | None:
        try:
            return (self.directory / name).read_bytes()
        except FileNotFoundError:
            return None

    def append(self, name: str, line: bytes) -> None:
        fd = self._fds.get(name)
        if fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = self._fds[name] = os.open(self.directory / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, line)

    def write(self, name: str, data: bytes) -> None:
        """Replace the whole file atomically (compaction)."""
        self._close(name)
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.directory / name)

    def delete(self, name: str) -> None:
        self._close(name)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()
        with contextlib.suppress(OSError):  # only succeeds once no journal is left
            self.directory.rmdir()

    def _close(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)


class RunObjects(Protocol):
    """What the journals use of a sharded run's store (``sharded.objectstore.ObjectStore``), which lives a layer up."""

    display_uri: str
    local: bool

    def path(self, *parts: str) -> str: ...

    def listdir(self, rel: str) -> list[str]: ...

    def read_bytes(self, rel: str) -> bytes | None: ...

    def overwrite(self, rel: str, data: bytes) -> None: ...

    def delete(self, rel: str) -> None: ...


class StoreJournalStorage:
    """Journal snapshots as objects under a prefix of a sharded run's store (``s3://…``)."""

    appends = False

    def __init__(self, store: RunObjects, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.strip("/")
        self.display = f"{store.display_uri}/{self.prefix}"

    def names(self) -> list[str]:
        return [n for n in self.store.listdir(self.prefix) if n.endswith((_LOG_SUFFIX, _SNAPSHOT_SUFFIX))]

    def read(self, name: str) -> bytes | None:
        return self.store.read_bytes(f"{self.prefix}/{name}")

    def write(self, name: str, data: bytes) -> None:
        self.store.overwrite(f"{self.prefix}/{name}", data)

    def delete(self, name: str) -> None:
        self.store.delete(f"{self.prefix}/{name}")


def shard_journal_storage(store: RunObjects, shard: int) -> JournalStorage:
    """Where the journals of one shard live: a plain directory when the run is on a local disk,
    else objects in the run's store."""
    prefix = f"leases/{shard:05d}"
    if store.local:
        return DirectoryJournalStorage(Path(store.path(prefix)))
    return StoreJournalStorage(store, prefix)


# --------------------------------------------------------------------------- the journal


def _line(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_APPEND_NEWLINE)


class LeaseJournal:
    """One process's journal: a :class:`~shopsimrl.environment.LeaseObserver`."""

    _COMPACT_AFTER = 512
    """Event lines before a local log is rewritten as its current state (and per lease held)."""

    def __init__(
        self, storage: JournalStorage, *, environment_url: str, writer: str | None = None, min_interval: float = 0.2
    ) -> None:
        self.storage = storage
        self.min_interval = min_interval
        self.writer = writer or secrets.token_hex(4)
        self.name = self.writer + (_LOG_SUFFIX if storage.appends else _SNAPSHOT_SUFFIX)
        self.state = JournalState(self.writer, ProcessIdentity.current(), redact_uri(environment_url))
        self._lines = 0
        self._exists = False
        self._dirty: asyncio.Event | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._version = 0
        """Events seen so far (the state's version)."""
        self._stored = 0
        """The version the stored snapshot holds."""
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        """(version, future): resets waiting for a snapshot that holds their event."""

    # -- LeaseObserver

    def reset_sent(self) -> None:
        self._event({"sent": 1})

    def reset_answered(self, lease: tuple[int, str] | None) -> None:
        self._event({"answered": list(lease) if lease else None})

    def lease_released(self, env_idx: int, lease_id: str) -> None:
        self._event({"released": [env_idx, lease_id]})

    async def recorded(self) -> None:
        """Return once every event seen so far is stored (a reset calls it before it is sent).

        At once for a local journal (each event was appended before the adapter went on), and
        before the writer task started; else after the next snapshot write, or once that write
        failed past the store's retries (the run goes on, unjournaled; the failure is logged)."""
        if self.storage.appends or self._task is None or self._task.done() or self._stored >= self._version:
            return
        assert self._dirty is not None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((self._version, waiter))
        self._dirty.set()
        await waiter

    def _wake(self, version: int | None) -> None:
        """Resolve the waiters whose events ``version`` holds (None: every waiter)."""
        still = []
        for wanted, waiter in self._waiters:
            if version is None or wanted <= version:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                still.append((wanted, waiter))
        self._waiters = still

    def _event(self, event: dict[str, Any]) -> None:
        self.state.apply(event)
        self._version += 1
        if not self.storage.appends:
            if self._dirty is not None:
                self._dirty.set()
            return
        try:
            assert isinstance(self.storage, DirectoryJournalStorage)
            # Measured against everything a compaction writes (leases and resets in flight), so
            # the log right after one is always under the bound: a ramp-up of 1,000 resets in
            # flight must not compact on every event.
            if not self._exists or self._lines >= self._COMPACT_AFTER + 4 * (len(self.state.held) + self.state.resets_in_flight):
                self._compact()
            else:
                self.storage.append(self.name, _line(event))
                self._lines += 1
        except OSError as exc:  # the run goes on; only a later kill -9 would lose more
            self._write_failed(exc)

    def _compact(self) -> None:
        """Rewrite the log as header + the current state (one event per lease and per reset)."""
        events: list[dict[str, object]] = [{"answered": [env_idx, lease_id]} for env_idx, lease_id in self.state.held.items()]
        events += [{"sent": 1}] * self.state.resets_in_flight
        self.storage.write(self.name, b"".join(_line(e) for e in [{**self.state.header(), "at": _now()}, *events]))
        self._exists, self._lines = True, len(events)

    # -- lifecycle

    async def start(self) -> None:
        if not self.storage.appends:
            self._dirty = asyncio.Event()
            self._task = asyncio.ensure_future(self._write_snapshots())

    async def aclose(self, timeout: float = 30.0) -> None:
        """The final state: no journal when nothing is held, else one kept for the next start
        (leases whose release could not be confirmed)."""
        self._closing = True
        try:
            if self._task is None:
                await asyncio.to_thread(self._finish_local)
                return
            assert self._dirty is not None
            self._dirty.set()
            done, _ = await asyncio.wait({self._task}, timeout=timeout)
            if not done:
                # Its error, if it fails later, is retrieved there: no "never retrieved" at exit.
                self._task.add_done_callback(lambda task: task.cancelled() or task.exception())
                raise TimeoutError(f"the last snapshot took longer than {timeout:g} s")
            self._task.result()
        except Exception as exc:  # a late or failed journal never fails the run
            log.warning(
                "lease journal not finalised", journal=f"{self.storage.display}/{self.name}", error=f"{type(exc).__name__}: {exc}"
            )

    def _finish_local(self) -> None:
        if self.state.held or self.state.resets_in_flight:
            self._compact()
        elif self._exists:
            self.storage.delete(self.name)
            self._exists = False

    def _write_failed(self, exc: BaseException) -> None:
        self._failures += 1
        if self._failures == 1 or self._failures % 10 == 0:
            log.warning(
                "lease journal write failed", journal=f"{self.storage.display}/{self.name}", error=f"{type(exc).__name__}: {exc}"
            )

    def _sync_snapshot(self, snapshot: bytes | None) -> None:
        """Make the stored snapshot ``snapshot`` (None: no journal, nothing held or in flight)."""
        if snapshot is not None:
            self.storage.write(self.name, snapshot)
            self._exists = True
        elif self._exists:
            self.storage.delete(self.name)
            self._exists = False
        self._failures = 0

    async def _write_snapshots(self) -> None:
        assert self._dirty is not None
        try:
            while True:
                await self._dirty.wait()
                self._dirty.clear()
                final = self._closing
                # Taken on the loop, where the state changes: the thread writes these bytes.
                version = self._version
                snapshot = _line(self.state.snapshot()) if self.state.held or self.state.resets_in_flight else None
                try:
                    await asyncio.to_thread(self._sync_snapshot, snapshot)
                except Exception as exc:  # keep running: the next change, or this retry, writes again
                    self._write_failed(exc)
                    self._wake(None)  # a journal that cannot be written must not stop the episodes
                    if final:
                        raise
                    self._dirty.set()
                    await asyncio.sleep(min(5.0, 0.2 * 2**self._failures))
                    continue
                self._stored = version
                self._wake(version)
                if final and not self._dirty.is_set():
                    return
                if self.min_interval and not self._closing:
                    await asyncio.sleep(self.min_interval)
        finally:
            self._wake(None)

    # -- recovery

    async def recover(self, environment: ShopSimulatorEnvironment) -> RecoveryReport:
        """Release the leases that stopped processes left in this run's journals.

        Run it before the first reset: the slots come back before new leases are taken."""
        report = RecoveryReport()
        for name in await asyncio.to_thread(self.storage.names):
            if name == self.name:
                continue
            where = f"{self.storage.display}/{name}"
            raw = await asyncio.to_thread(self.storage.read, name)
            if raw is None:
                continue
            try:
                state = parse_journal(name, raw)
            except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as exc:
                log.warning("unreadable lease journal left as it is", journal=where, error=str(exc))
                continue
            if state.process is not None and state.process.is_alive():
                report.skipped_live.append(name)
                log.info("lease journal of a live process left alone", journal=where, pid=state.process.pid)
                continue
            if state.environment not in (None, self.state.environment):
                log.warning(
                    "lease journal names another ShopSimulator; releasing through this run's",
                    journal=where,
                    journal_environment=state.environment,
                    environment=self.state.environment,
                )
            failed = 0
            for env_idx, lease_id in state.held.items():
                try:
                    if await environment.release_lease(env_idx, lease_id):
                        report.released += 1
                    else:
                        report.already_gone += 1
                except ShopEnvironmentError as exc:
                    failed += 1
                    log.warning("could not release a journaled lease", journal=where, env_idx=env_idx, error=str(exc))
            report.resets_in_flight_at_stop += state.resets_in_flight
            report.failed += failed
            report.journals.append(name)
            if not failed:
                await asyncio.to_thread(self.storage.delete, name)
        if report.journals:
            log.warning(
                "released the leases of stopped processes",
                released=report.released,
                already_gone=report.already_gone,
                failed=report.failed,
                journals=len(report.journals),
                resets_in_flight_at_stop=report.resets_in_flight_at_stop,
            )
        return report


@dataclass
class RecoveryReport:
    released: int = 0
    """Leases a stopped process held that are now free again."""
    already_gone: int = 0
    """Leases the server no longer knew (released earlier, reassigned, server restarted)."""
    failed: int = 0
    """Leases that could not be released now; their journal is kept for the next start."""
    journals: list[str] = field(default_factory=list)
    skipped_live: list[str] = field(default_factory=list)
    resets_in_flight_at_stop: int = 0
    """Resets the stopped processes had sent without an answer: if the server granted them, those
    slots are leaked for good (``shopsimrl env release-all``)."""


@dataclass
class JournalSummary:
    """One journal as ``status`` shows it."""

    name: str
    leases: int
    resets_in_flight: int
    environment: str | None
    updated_at: str | None
    alive: bool | None
    """False: its process is provably gone (its leases are released when the shard restarts)."""


def read_journals(storage: JournalStorage) -> list[JournalSummary]:
    summaries = []
    for name in storage.names():
        raw = storage.read(name)
        if raw is None:
            continue
        try:
            state = parse_journal(name, raw)
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            continue
        summaries.append(
            JournalSummary(
                name,
                len(state.held),
                state.resets_in_flight,
                state.environment,
                state.updated_at,
                None if state.process is None else state.process.is_alive(),
            )
        )
    return summaries


# --------------------------------------------------------------------------- start of a run


@dataclass
class LeasePlan:
    """What a process learned and decided about ShopSimulator slots before its first reset."""

    usage: SlotUsage | None
    """The pool after recovery (None: /healthz could not be read)."""
    lease_limit: int
    recovery: RecoveryReport
    warnings: list[str] = field(default_factory=list)


async def start_lease_tracking(
    environment: ShopSimulatorEnvironment,
    journal: LeaseJournal,
    *,
    concurrency: int,
    processes: int,
    configured: int | None,
) -> LeasePlan:
    """Before the first reset: release what dead predecessors left, size the lease budget from
    the shop's pool, and start journaling this process's leases."""
    recovery = await journal.recover(environment)
    try:
        usage: SlotUsage | None = await environment.slot_usage()
    except ShopEnvironmentError as exc:
        log.warning("cannot read the shop's slot count; leases are bounded by the concurrency", error=str(exc))
        usage = None
    slots = usage.environment_slots if usage else None
    limit = lease_budget(concurrency=concurrency, processes=processes, environment_slots=slots, configured=configured)
    environment.limit_leases(limit)
    environment.lease_observer = journal
    await journal.start()
    plan = LeasePlan(usage, limit, recovery)
    sizing = usage.sizing_warning(concurrency=concurrency, processes=processes, lease_limit=limit) if usage else None
    if sizing:
        plan.warnings.append(sizing)
    if usage is not None and usage.free_slots == 0:
        plan.warnings.append(
            f"the shop has 0/{slots} slots free: another run holds them, or leaked them; episodes wait for a slot "
            "(see `shopsimrl env slots --url URL`; `shopsimrl env release-all --url URL --yes` frees all)"
        )
    for warning in plan.warnings:
        log.warning(warning)
    log.info(
        "lease budget",
        lease_limit=limit,
        environment_slots=slots,
        free_slots=usage.free_slots if usage else None,
        released_from_journals=recovery.released,
    )
    return plan
