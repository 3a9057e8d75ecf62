"""Lease journal: the ShopSimulator leases a run's process holds, kept with the run.

ShopSimulator leases never expire: a process killed outright (kill -9, an OOM kill, a node
lost) keeps its slots leased until someone calls ``release_all``. So every process that runs
episodes writes a journal — one small JSON object per process, replaced whenever its leases
change — and a process that starts on the same run (or shard) first releases the leases that
dead predecessors left in theirs.

Where the journals live:

- a local run: ``<run dir>/leases/<writer>.json`` (the run directory is locked to one process);
- a sharded run: ``<run>/leases/<shard>/<writer>.json`` in the run's store (local or ``s3://``),
  so a replacement pod on another node finds them.

Which journals are released: those of processes that are provably gone — on this host (same
hostname and PID namespace) when the PID is dead or belongs to a newer process; on another host
always, because Kubernetes starts a replacement pod for an index only after the old one has
terminated (``podFailurePolicy`` implies ``podReplacementPolicy: Failed``). Two workers running
one shard at once on different hosts is outside that contract.

What can still leak after kill -9 (docs/sharded_runs.md, "Leases"): resets that were in flight
when the process died — the server grants them, now or once a slot frees, to nobody. On a local
disk the journal is written before each reset is sent, so it records exactly how many; on an
object store it lags by up to ``min_interval`` plus one PUT, and leases granted in that window
can leak too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import structlog

from shopsimrl.environment import ShopEnvironmentError, ShopSimulatorEnvironment, SlotUsage, lease_budget
from shopsimrl.schemas import redact_uri

__all__ = [
    "JOURNAL_SCHEMA_VERSION",
    "DirectoryJournalStorage",
    "JournalStorage",
    "JournalSummary",
    "LeaseJournal",
    "ProcessIdentity",
    "LeasePlan",
    "RecoveryReport",
    "StoreJournalStorage",
    "read_journals",
    "shard_journal_storage",
    "start_lease_tracking",
]

JOURNAL_SCHEMA_VERSION = "shopsimrl-lease-journal-v1"

log = structlog.get_logger("shopsimrl.leases")


class JournalStorage(Protocol):
    """Where one run's (or shard's) journals are kept: whole small objects by name."""

    display: str
    write_through: bool
    """Cheap enough to write on every change, synchronously (a local disk)."""

    def names(self) -> list[str]: ...

    def read(self, name: str) -> bytes | None: ...

    def write(self, name: str, data: bytes) -> None: ...

    def delete(self, name: str) -> None: ...


class DirectoryJournalStorage:
    """Journals as files in a local directory (replaced atomically, no fsync: kill -9 of the
    process, not a power cut, is what they guard against)."""

    write_through = True

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.display = str(self.directory)

    def names(self) -> list[str]:
        try:
            return sorted(p.name for p in self.directory.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
        except FileNotFoundError:
            return []

    def read(self, name: str) -> bytes | None:
        try:
            return (self.directory / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.directory / name)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()
        with contextlib.suppress(OSError):  # only succeeds once no journal is left
            self.directory.rmdir()


class StoreJournalStorage:
    """Journals as objects under a prefix of a sharded run's store (any fsspec location)."""

    write_through = False

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.strip("/")
        self.display = f"{store.display_uri}/{self.prefix}"

    def names(self) -> list[str]:
        return [name for name in self.store.listdir(self.prefix) if name.endswith(".json")]

    def read(self, name: str) -> bytes | None:
        return self.store.read_bytes(f"{self.prefix}/{name}")

    def write(self, name: str, data: bytes) -> None:
        self.store.overwrite(f"{self.prefix}/{name}", data)

    def delete(self, name: str) -> None:
        self.store.delete(f"{self.prefix}/{name}")


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
        started = data.get("started")
        namespace = data.get("pid_namespace")
        return cls(
            data["host"],
            data["pid"],
            started if isinstance(started, int) else None,
            namespace if isinstance(namespace, str) else None,
        )

    def is_alive(self) -> bool:
        """False when provably gone; True when it runs here, or cannot be checked from here but
        may (never: another host or PID namespace is taken as gone, see the module docstring)."""
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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


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
        try:
            document = json.loads(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, ValueError):
            document = None
        if not isinstance(document, dict):
            continue
        owner = ProcessIdentity.from_dict(document.get("process"))
        leases = document.get("leases")
        in_flight = document.get("resets_in_flight")
        summaries.append(
            JournalSummary(
                name,
                len(leases) if isinstance(leases, list) else 0,
                in_flight if isinstance(in_flight, int) else 0,
                document.get("environment") if isinstance(document.get("environment"), str) else None,
                document.get("updated_at") if isinstance(document.get("updated_at"), str) else None,
                None if owner is None else owner.is_alive(),
            )
        )
    return summaries


class LeaseJournal:
    """One process's journal (a :class:`~shopsimrl.environment.LeaseObserver`).

    On a local disk (``storage.write_through``) every change is written before the adapter's
    next step, so a reset is journaled as in flight before it is sent: after kill -9, exactly the
    resets in flight can have leaked. On an object store a writer task replaces the journal
    with the latest state, at most every ``min_interval`` seconds (every PUT is billed): bursts
    coalesce, and kill -9 can lose up to that much more.
    """

    def __init__(
        self, storage: JournalStorage, *, environment_url: str, writer: str | None = None, min_interval: float = 1.0
    ) -> None:
        self.storage = storage
        self.min_interval = min_interval
        self.writer = writer or secrets.token_hex(4)
        self.name = f"{self.writer}.json"
        self.environment_url = redact_uri(environment_url)
        self.identity = ProcessIdentity.current()
        self._held: dict[int, str] = {}
        self._in_flight = 0
        self._dirty: asyncio.Event | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._exists = False
        self._failures = 0

    # -- LeaseObserver

    def leases_changed(self, held: Mapping[int, str], resets_in_flight: int) -> None:
        self._held = dict(held)
        self._in_flight = resets_in_flight
        if self.storage.write_through:
            try:
                self._apply()
            except OSError as exc:  # the run goes on; only a later kill -9 would lose more
                self._write_failed(exc)
        elif self._dirty is not None:
            self._dirty.set()

    # -- lifecycle

    async def start(self) -> None:
        if not self.storage.write_through:
            self._dirty = asyncio.Event()
            self._task = asyncio.ensure_future(self._write_changes())

    async def aclose(self, timeout: float = 30.0) -> None:
        """Write the final state: no journal when nothing is held, else one kept for the next
        start (leases whose release could not be confirmed)."""
        self._closing = True
        try:
            if self._task is None:
                await asyncio.wait_for(asyncio.to_thread(self._apply), timeout)
                return
            assert self._dirty is not None
            self._dirty.set()
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except Exception as exc:  # a late or failed journal never fails the run
            log.warning(
                "lease journal not finalised", journal=f"{self.storage.display}/{self.name}", error=f"{type(exc).__name__}: {exc}"
            )

    def document(self) -> dict[str, Any]:
        return {
            "schema_version": JOURNAL_SCHEMA_VERSION,
            "writer": self.writer,
            "process": self.identity.to_dict(),
            "environment": self.environment_url,
            "updated_at": _now(),
            "resets_in_flight": self._in_flight,
            "leases": [{"env_idx": env_idx, "lease_id": lease_id} for env_idx, lease_id in sorted(self._held.items())],
        }

    def _apply(self) -> None:
        """Make the stored journal match the state: present while anything is held or in flight."""
        if self._held or self._in_flight:
            data = (json.dumps(self.document(), ensure_ascii=False, indent=1) + "\n").encode("utf-8")
            self.storage.write(self.name, data)
            self._exists = True
        elif self._exists:
            self.storage.delete(self.name)
            self._exists = False
        self._failures = 0

    def _write_failed(self, exc: BaseException) -> None:
        self._failures += 1
        if self._failures == 1 or self._failures % 10 == 0:
            log.warning(
                "lease journal write failed", journal=f"{self.storage.display}/{self.name}", error=f"{type(exc).__name__}: {exc}"
            )

    async def _write_changes(self) -> None:
        assert self._dirty is not None
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            final = self._closing
            try:
                await asyncio.to_thread(self._apply)
            except Exception as exc:  # keep running: the next change, or this retry, writes again
                self._write_failed(exc)
                if final:
                    raise
                self._dirty.set()
                await asyncio.sleep(min(5.0, 0.2 * 2**self._failures))
                continue
            if final and not self._dirty.is_set():
                return
            if self.min_interval and not self._closing:
                await asyncio.sleep(self.min_interval)

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
                document = json.loads(raw.decode("utf-8"))
                if document.get("schema_version") != JOURNAL_SCHEMA_VERSION:
                    raise ValueError(f"schema_version {document.get('schema_version')!r}")
                leases = [(int(e["env_idx"]), str(e["lease_id"])) for e in document.get("leases", [])]
            except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as exc:
                log.warning("unreadable lease journal left as it is", journal=where, error=str(exc))
                continue
            owner = ProcessIdentity.from_dict(document.get("process"))
            if owner is not None and owner.is_alive():
                report.skipped_live.append(name)
                log.info("lease journal of a live process left alone", journal=where, pid=owner.pid)
                continue
            if document.get("environment") not in (None, self.environment_url):
                log.warning(
                    "lease journal names another ShopSimulator; releasing through this run's",
                    journal=where, journal_environment=document.get("environment"), environment=self.environment_url,
                )
            failed = 0
            for env_idx, lease_id in leases:
                try:
                    if await environment.release_lease(env_idx, lease_id):
                        report.released += 1
                    else:
                        report.already_gone += 1
                except ShopEnvironmentError as exc:
                    failed += 1
                    log.warning("could not release a journaled lease", journal=where, env_idx=env_idx, error=str(exc))
            in_flight = document.get("resets_in_flight")
            report.resets_in_flight_at_stop += in_flight if isinstance(in_flight, int) and in_flight > 0 else 0
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


def shard_journal_storage(store: Any, shard: int) -> JournalStorage:
    """Where the journals of one shard live: a plain directory when the run is on a local disk
    (written through), else objects in the run's store."""
    prefix = f"leases/{shard:05d}"
    if store.local:
        return DirectoryJournalStorage(Path(store.path(prefix)))
    return StoreJournalStorage(store, prefix)
