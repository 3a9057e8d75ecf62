"""``shopsimrl worker``: run one shard of a frozen plan into write-once parts, then commit it.

One worker = one shard = one process (a local subprocess or a pod of an Indexed Job). It

1. plans from the config alone and creates or verifies ``manifest.json`` and ``shards.json``
   (planning is deterministic, so concurrent workers agree; another fingerprint → exit 42,
   another shard count → exit 2);
2. resumes from the shard's existing parts: an episode with a completed record is never run
   again (the reducer de-duplicates whatever a concurrent writer produced anyway);
3. runs the remaining jobs with :class:`~shopsimrl.runner.scheduler.Evaluator`, buffering traces and
   writing a new part every ``flush_episodes`` records or ``flush_seconds``, whichever comes
   first (a timer flushes a stalled buffer), so a crash loses at most that tail;
4. on SIGTERM/SIGINT stops, flushes what finished and exits 3 (resume later);
5. when every job is completed or has exhausted its attempts, writes ``_SUCCESS.json`` listing
   every part with its sha256 and record count: exit 0 if all completed, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import secrets
import signal
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from shopsimrl import eventloop
from shopsimrl.config import ConfigError, WorkerSettings, load_experiment_config
from shopsimrl.exitcodes import ExitCode
from shopsimrl.logs import LogSettings, current_settings
from shopsimrl.manifest import FingerprintMismatchError, ManifestError
from shopsimrl.records import EpisodeTrace, dump_line
from shopsimrl.schemas import EpisodeJob, fingerprint
from shopsimrl.stopping import STOP_SIGNALS
from shopsimrl.storage.objectstore import RunLocationError, StoreUnavailableError
from shopsimrl.storage.sharded import (
    PART_PATTERN,
    PROGRESS_SCHEMA_VERSION,
    RecordOutcome,
    ShardedRunStore,
    ShardMapError,
    ShardState,
    WrittenPart,
    marker_document,
    marker_part_problems,
    marker_problem,
    part_entry,
    part_order,
    record_outcome,
    scan_shard,
)

__all__ = ["PartSink", "WorkerOptions", "commit_shard", "plan_run", "run_worker"]

log = structlog.get_logger("shopsimrl.runner.worker")


class _Stop(Exception):
    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PartSink:
    """The Evaluator's trace sink: buffers encoded traces and writes them as whole parts.

    ``save_traces`` and ``flush_if_stale`` run in threads (``asyncio.to_thread``, off the event loop); one lock
    keeps buffer and part sequence consistent between the episode path and the flush timer.
    It remembers what each part it wrote holds (``written``), so the commit never reads its own
    parts back, and keeps the writer's progress object up to date: after every part and, as a
    heartbeat, every ``heartbeat_seconds`` while the flush timer runs. ``resumed``: the episodes
    the shard had completed when the worker started; ``session``: the worker's writer id, shared
    by the event-loop processes it starts (``status`` adds up the processes of one session).
    """

    def __init__(
        self,
        store: ShardedRunStore,
        shard: int,
        writer: str,
        first_seq: int,
        *,
        flush_episodes: int,
        flush_seconds: float,
        plan_fingerprint: str,
        resumed: Collection[str] = (),
        session: str | None = None,
        heartbeat_seconds: float = 30.0,
    ) -> None:
        self.store, self.shard, self.writer = store, shard, writer
        self.flush_episodes, self.flush_seconds = flush_episodes, flush_seconds
        self._seq = first_seq
        self._buffer: list[bytes] = []
        self._outcomes: list[RecordOutcome] = []
        self._oldest = 0.0
        self._lock = threading.Lock()
        self.written: list[WrittenPart] = []
        self._resumed = frozenset(resumed)
        self._completed: set[str] = set()
        self._failed_attempts = 0
        self._records = 0
        self._progress: dict[str, Any] = {
            "schema_version": PROGRESS_SCHEMA_VERSION,
            "shard": shard,
            "writer": writer,
            "plan_fingerprint": plan_fingerprint,
            "session": session or writer,
            "resumed": len(self._resumed),
            "heartbeat_seconds": heartbeat_seconds,
            "started_at": _now(),
        }
        self._progress_lock = threading.Lock()
        self._last_beat = -math.inf

    def save_traces(self, records: list[EpisodeTrace]) -> None:
        """Buffer ``records`` (the scheduler's group commit, one lock for the batch); a part is
        written once the buffer holds ``flush_episodes`` records."""
        lines = [dump_line(record) for record in records]
        outcomes = [record_outcome(record) for record in records]
        with self._lock:
            if not self._buffer:
                self._oldest = time.monotonic()
            self._buffer.extend(lines)
            self._outcomes.extend(outcomes)
            wrote = len(self._buffer) >= self.flush_episodes and self._flush_locked()
        if wrote:
            self.report_progress()

    def flush(self) -> None:
        with self._lock:
            wrote = self._flush_locked()
        if wrote:
            self.report_progress()

    def flush_if_stale(self) -> None:
        """The timer's call: flush a buffer older than ``flush_seconds``, beat the heartbeat when due."""
        with self._lock:
            wrote = bool(self._buffer) and time.monotonic() - self._oldest >= self.flush_seconds and self._flush_locked()
        if wrote or time.monotonic() - self._last_beat >= self._progress["heartbeat_seconds"]:
            self.report_progress()

    async def flush_stale_parts(self) -> None:
        """Flush a buffer older than ``flush_seconds``, until cancelled. A failed write is logged
        and tried again: the buffer stays until a part holds it (this one, or the final flush)."""
        while True:
            await asyncio.sleep(min(1.0, self.flush_seconds / 4))
            try:
                await asyncio.to_thread(self.flush_if_stale)
            except Exception as exc:
                log.warning("part_flush_failed", error=f"{type(exc).__name__}: {exc}", buffered=self.buffered)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def _flush_locked(self) -> bool:
        if not self._buffer:
            return False
        # The buffer is kept until the part is safely stored, so a failed write loses nothing
        # that a later flush (or the SIGTERM path) could still save.
        name, stored = self.store.write_part(self.shard, self._seq, self.writer, b"".join(self._buffer))
        part = WrittenPart(part_entry(name, stored, len(self._buffer)), tuple(self._outcomes))
        self._seq = int(PART_PATTERN.match(name).group(1)) + 1  # type: ignore[union-attr]
        self.written.append(part)
        self._records += len(self._outcomes)
        self._completed.update(o.episode_id for o in self._outcomes if o.completed and o.episode_id not in self._resumed)
        self._failed_attempts += sum(1 for o in self._outcomes if not o.completed)
        log.info("part_written", part=name, records=len(self._buffer), bytes=len(stored), lines_bytes=sum(map(len, self._buffer)))
        self._buffer.clear()
        self._outcomes.clear()
        return True

    def report_progress(self, state: str = "running") -> None:
        """Rewrite this writer's progress object. Advisory: one try, a failure is only logged
        (the next part or heartbeat writes it again)."""
        with self._progress_lock:
            self._last_beat = time.monotonic()
            progress = {
                **self._progress,
                "state": state,
                "completed": len(self._completed),
                "failed_attempts": self._failed_attempts,
                "parts_written": len(self.written),
                "records_written": self._records,
                "updated_at": _now(),
            }
            try:
                self.store.write_progress(self.shard, progress)
            except Exception as exc:
                log.warning("progress_not_written", error=f"{type(exc).__name__}: {exc}")


def _now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class WorkerOptions:
    run: str
    config: Path
    shard_index: int
    shards: int | None = None
    final_test: bool = False
    retry_failed: bool = True
    reroll_failed: bool = False
    settings: WorkerSettings = field(default_factory=WorkerSettings)


def _prepare(config_path: Path, settings: WorkerSettings, final_test: bool) -> Any:
    from shopsimrl.model import ModelConfigError
    from shopsimrl.planning import PlanError
    from shopsimrl.prompts import PromptError
    from shopsimrl.runner.experiment import prepare
    from shopsimrl.skills import SkillBankError
    from shopsimrl.tasks import SplitError

    try:
        config = load_experiment_config(config_path).with_overrides(settings)
        return prepare(config, final_test=final_test)
    except (ConfigError, SplitError, PlanError, SkillBankError, PromptError, ModelConfigError) as exc:
        raise _Stop(ExitCode.BAD_INPUT, str(exc)) from None


def plan_run(prepared: Any, store: ShardedRunStore, shards: int | None) -> tuple[dict[str, Any], Any]:
    """Create or verify manifest.json and shards.json; returns (manifest, shard map)."""
    from shopsimrl.planning import PlanError

    plan = prepared.plan()
    execution = {**prepared.execution(), "run": store.display_uri}
    manifest = store.initialize(plan, execution)
    if shards is None:
        shard_map = store.read_shard_map()
        if shard_map is None:
            raise ShardMapError(f"{store.display_uri} has no shards.json yet; pass --shards N (or SHOPSIMRL_SHARDS)")
        shards = shard_map.count
    try:
        shard_map = store.ensure_shard_map(prepared.jobs, shards, manifest["plan_fingerprint"])
    except PlanError as exc:
        raise ShardMapError(str(exc)) from None
    return manifest, shard_map


def _terminated(signum: int, frame: object) -> None:
    # Outside the evaluation there is nothing buffered: stop where we are, with the retryable code.
    raise _Stop(
        ExitCode.RETRYABLE, f"signal {signum} while planning or committing; finished episodes are saved, restart to resume"
    )


def run_worker(options: WorkerOptions) -> ExitCode:
    """Run one shard; every failure is mapped to an exit code and logged (never a traceback).

    The process exits with the returned code: once it is known, later signals are ignored."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _terminated)
    try:
        return _exit_code(options)
    except _Stop as stop:  # a signal that landed while an outcome was being reported
        return stop.code
    finally:
        _ignore_signals()
        structlog.contextvars.unbind_contextvars("run", "shard", "writer")


def _ignore_signals() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _exit_code(options: WorkerOptions) -> ExitCode:
    try:
        return _run_worker(options)
    except _Stop as stop:
        _ignore_signals()  # already stopping: report, then exit
        (log.warning if stop.code == ExitCode.RETRYABLE else log.error)(
            "worker_stopped", exit_code=int(stop.code), reason=str(stop)
        )
        return stop.code
    except FingerprintMismatchError as exc:
        _ignore_signals()
        log.error("fingerprint_mismatch", exit_code=42, reason=str(exc))
        return ExitCode.FINGERPRINT_MISMATCH
    except (ShardMapError, RunLocationError, ManifestError) as exc:
        _ignore_signals()
        log.error("bad_input", exit_code=2, reason=str(exc))
        return ExitCode.BAD_INPUT
    except StoreUnavailableError as exc:
        _ignore_signals()
        log.error("store_unavailable", exit_code=3, reason=str(exc))
        return ExitCode.RETRYABLE


def _run_worker(options: WorkerOptions) -> ExitCode:
    from shopsimrl.model import ModelConfigError

    settings = options.settings
    store = ShardedRunStore(options.run)
    writer = secrets.token_hex(4)
    structlog.contextvars.bind_contextvars(run=store.display_uri, shard=options.shard_index, writer=writer)
    prepared = _prepare(options.config, settings, options.final_test)
    try:
        prepared.model().check_api_key()
    except ModelConfigError as exc:
        raise _Stop(ExitCode.BAD_INPUT, str(exc)) from None
    manifest, shard_map = plan_run(prepared, store, options.shards)
    index = options.shard_index
    if not 0 <= index < shard_map.count:
        raise _Stop(ExitCode.BAD_INPUT, f"shard index {index} is outside 0…{shard_map.count - 1}")
    plan_fp = manifest["plan_fingerprint"]
    by_id = {job.episode_id: job for job in prepared.jobs}
    jobs = [by_id[eid] for eid in shard_map.episode_ids[index]]
    shard_ids = set(shard_map.episode_ids[index])

    ids_sha = fingerprint(shard_map.episode_ids[index])
    # A commit is trusted only once checked against the parts themselves.
    state = scan_shard(store, index, shard_ids)
    check = _check_markers(store, index, plan_fp, ids_sha, state)
    for name, problem in check.ignored:
        log.warning("marker_not_verified", marker=name, problem=problem)
    if check.distrusted:
        # Bytes that differ from what a commit recorded: their episodes run again.
        log.warning("parts_not_trusted", parts=sorted(check.distrusted))
        state = scan_shard(store, index, shard_ids, exclude=check.distrusted)
    if check.verified:
        committed = {
            eid for marker in check.verified for part in marker["parts"] for eid in state.part_completed.get(part["name"], ())
        }
        if committed >= shard_ids:
            log.info("shard_already_committed", completed=len(jobs))
            return ExitCode.OK
        in_markers = {part["name"] for marker in check.verified for part in marker["parts"]}
        settled = committed | set(state.final_failures())
        if not options.retry_failed or (not options.reroll_failed and settled >= shard_ids and in_markers >= set(state.parts)):
            # Nothing to run or commit: every episode not completed failed as an outcome (final).
            log.info("shard_committed_with_failures", failed=len(shard_ids - committed))
            return ExitCode.EPISODES_FAILED

    log.info(
        "shard_resumed",
        jobs=len(jobs),
        completed=len(state.completed),
        parts=len(state.parts),
        unreadable_lines=state.unreadable_lines,
    )
    config = prepared.config
    loops = settings.processes or 1
    # Each event loop of each worker running at once gets an equal share of the shop's slots.
    sharing = min(settings.parallelism or shard_map.count, shard_map.count) * loops
    final = state.final_failures()
    pending = [
        job for job in jobs if job.episode_id not in state.completed and (options.reroll_failed or job.episode_id not in final)
    ]
    if loops > 1 and len(pending) > 1:
        outcome, written = _evaluate_in_processes(options, index, pending, state, loops, sharing, writer, plan_fp)
    else:
        sink = PartSink(
            store,
            index,
            writer,
            state.next_seq,
            flush_episodes=settings.flush_episodes,
            flush_seconds=settings.flush_seconds,
            plan_fingerprint=plan_fp,
            resumed=state.completed,
            heartbeat_seconds=settings.heartbeat_seconds,
        )
        sink.report_progress()
        outcome = eventloop.run(_evaluate(prepared, jobs, state, sink, settings, options, sharing))
        if outcome == "interrupted":
            sink.report_progress("interrupted")
        written = sink.written
    if outcome == "interrupted":
        raise _Stop(ExitCode.RETRYABLE, f"interrupted; finished episodes are saved in {store.display_uri}, restart to resume")

    marker, completed = commit_shard(
        store,
        index,
        shard_map.episode_ids[index],
        plan_fp=plan_fp,
        writer=writer,
        state=state,
        exclude=check.distrusted,
        written=written,
    )
    log.info("shard_committed", marker=marker, completed=completed, failed=len(jobs) - completed, config=config.name)
    return ExitCode.OK if completed == len(jobs) else ExitCode.EPISODES_FAILED


@dataclass(frozen=True)
class _SliceSpec:
    """What one event-loop process of a worker needs: everything but the plan, which it rebuilds
    from the config (planning is deterministic) instead of receiving it."""

    options: WorkerOptions
    shard: int
    episode_ids: list[str]
    prior_attempts: dict[str, int]
    final_failures: dict[str, str | None]
    writer: str
    first_seq: int
    sharing: int
    log_settings: LogSettings
    parent: int
    session: str
    plan_fingerprint: str
    resumed: frozenset[str]


def _evaluate_in_processes(
    options: WorkerOptions,
    shard: int,
    pending: list[EpisodeJob],
    state: ShardState,
    loops: int,
    sharing: int,
    session: str,
    plan_fingerprint: str,
) -> tuple[str, list[WrittenPart]]:
    """Run ``pending`` in ``loops`` processes, job k in process k mod loops; each writes its own
    parts (its own writer id) and journals its own leases. Returns the combined outcome and the
    parts written, for the commit. SIGTERM/SIGINT are passed on once; a process that dies
    makes the outcome "interrupted" (its saved parts stay; a restart resumes the rest)."""
    context = multiprocessing.get_context("spawn")  # no fork: the parent may hold threads (s3fs)
    children: list[tuple[Any, Any]] = []
    final = state.final_failures()
    for k in range(loops):
        ids = [job.episode_id for job in pending[k::loops]]
        if not ids:
            continue
        spec = _SliceSpec(
            options=options,
            shard=shard,
            episode_ids=ids,
            prior_attempts={eid: state.attempts[eid] for eid in ids if eid in state.attempts},
            final_failures={eid: cls for eid, cls in final.items() if eid in ids},
            writer=secrets.token_hex(4),
            first_seq=state.next_seq,
            sharing=sharing,
            log_settings=current_settings(),
            parent=os.getpid(),
            session=session,
            plan_fingerprint=plan_fingerprint,
            resumed=frozenset(state.completed),
        )
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_slice_main, args=(spec, send), name=f"shard-{shard}-loop-{k}", daemon=False)
        process.start()
        send.close()
        children.append((process, receive))
    log.info("worker_processes_started", processes=len(children), jobs=len(pending))

    stopping = False

    def pass_on(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        log.warning(f"{signal.Signals(signum).name}: stopping the worker's processes")
        for process, _ in children:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    previous = {signum: signal.signal(signum, pass_on) for signum in STOP_SIGNALS}
    outcomes: list[str] = []
    written: list[WrittenPart] = []
    try:
        for process, receive in children:
            try:
                result = receive.recv()  # sent just before the process exits
            except EOFError:  # it died without reporting (kill -9, a crash)
                result = {"outcome": "interrupted", "written": []}
            process.join()
            outcomes.append(result["outcome"])
            written.extend(result["written"])
            if process.exitcode:
                log.warning("worker_process_failed", process=process.name, exit_code=process.exitcode)
                outcomes.append("interrupted")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return ("interrupted" if stopping or "interrupted" in outcomes else "done"), written


def _slice_main(spec: _SliceSpec, send: Any) -> None:
    """Entry point of one event-loop process of a worker."""
    from shopsimrl.logs import configure_logging
    from shopsimrl.stopping import die_with_parent

    die_with_parent(spec.parent)
    for signum in STOP_SIGNALS:  # until _evaluate's graceful stop takes over
        signal.signal(signum, _terminated)
    configure_logging(settings=spec.log_settings)
    options = spec.options
    store = ShardedRunStore(options.run)
    structlog.contextvars.bind_contextvars(run=store.display_uri, shard=spec.shard, writer=spec.writer)
    outcome, written = "interrupted", []
    try:
        prepared = _prepare(options.config, options.settings, options.final_test)
        by_id = {job.episode_id: job for job in prepared.jobs}
        jobs = [by_id[eid] for eid in spec.episode_ids]
        state = ShardState(attempts=dict(spec.prior_attempts))
        state.best_unfinished = {eid: RecordOutcome(eid, False, (0, ""), True, cls) for eid, cls in spec.final_failures.items()}
        settings = options.settings
        sink = PartSink(
            store,
            spec.shard,
            spec.writer,
            spec.first_seq,
            flush_episodes=settings.flush_episodes,
            flush_seconds=settings.flush_seconds,
            plan_fingerprint=spec.plan_fingerprint,
            resumed=spec.resumed,
            session=spec.session,
            heartbeat_seconds=settings.heartbeat_seconds,
        )
        sink.report_progress()
        try:
            outcome = eventloop.run(_evaluate(prepared, jobs, state, sink, settings, options, spec.sharing))
            if outcome == "interrupted":
                sink.report_progress("interrupted")
        finally:
            written = sink.written
    except _Stop as stop:
        log.warning("worker_process_stopped", reason=str(stop))
    finally:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        send.send({"outcome": outcome, "written": written})
        send.close()


def commit_shard(
    store: ShardedRunStore,
    index: int,
    episode_ids: list[str],
    *,
    plan_fp: str,
    writer: str,
    state: ShardState | None = None,
    exclude: Collection[str] = (),
    written: Sequence[WrittenPart] = (),
) -> tuple[str, int]:
    """Add a commit marker for the shard; returns its name and the completed episode count.

    The marker lists exactly the parts hashed: every part now listed (ours and any concurrent
    writer's, less ``exclude``) and every part this process wrote (``written``), by name even
    when a listing does not show it yet. Parts already in ``state`` and the ones this process
    wrote (whose bytes and sha256 it knows) are not read again; only a concurrent writer's new
    parts are. The marker is a new object, never a replacement: the reducer takes the union of
    the verified markers, whatever order they were written in.
    """
    state = scan_shard(store, index, set(episode_ids), state, exclude=exclude, written=written)
    completed = len(state.completed)
    document = marker_document(
        shard=index,
        plan_fingerprint=plan_fp,
        completed=completed,
        failed=len(episode_ids) - completed,
        episode_ids_sha256=fingerprint(episode_ids),
        parts=[state.parts[name] for name in sorted(state.parts, key=part_order)],
        writer=writer,
    )
    return store.create_marker(index, document), completed


@dataclass
class _MarkerCheck:
    verified: list[dict[str, Any]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    distrusted: set[str] = field(default_factory=set)
    """Parts whose bytes differ from the sha256 a marker recorded for them."""


def _check_markers(store: ShardedRunStore, index: int, plan_fp: str, ids_sha: str, state: ShardState) -> _MarkerCheck:
    """The shard's markers against the parts as read: the same rules as the reducer's."""
    check = _MarkerCheck()
    actual = {name: entry["sha256"] for name, entry in state.parts.items()}
    for name, marker in store.read_markers(index):
        problem = marker_problem(marker, index=index, plan_fingerprint=plan_fp, episode_ids_sha256=ids_sha)
        problems = [problem] if problem else marker_part_problems(marker, actual)
        if not problems:
            check.verified.append(marker)
            continue
        check.ignored.append((name, "; ".join(problems[:5])))
        if problem is None:
            check.distrusted |= {p["name"] for p in marker["parts"] if actual.get(p["name"]) not in (None, p["sha256"])}
    return check


async def _evaluate(
    prepared: Any,
    jobs: list[EpisodeJob],
    state: ShardState,
    sink: PartSink,
    settings: WorkerSettings,
    options: WorkerOptions,
    processes: int,
) -> str:
    """Run the shard's pending jobs; "interrupted" when a signal stopped them, else "done".

    Whatever finished is saved on every path: at the first signal the buffer is flushed at
    once (before the episodes unwind and release their leases, which may take the grace
    period), and again after the evaluation ended."""
    from shopsimrl.runner.lease_journal import LeaseJournal, shard_journal_storage, start_lease_tracking
    from shopsimrl.runner.scheduler import ConcurrencyLimitedModel, Evaluator
    from shopsimrl.stopping import GracefulStop

    config = prepared.config
    store = sink.store
    model = prepared.model()
    environment = prepared.environment()
    journal = LeaseJournal(
        shard_journal_storage(store, sink.shard), environment_url=prepared.environment_settings.base_url, writer=sink.writer
    )
    limited = ConcurrencyLimitedModel(model, config.model.max_concurrent_requests or config.experiment.concurrency)

    def on_trace(record: EpisodeTrace, will_retry: bool) -> None:
        log.info(
            "episode_finished",
            episode_id=record.episode_id,
            status=record.status,
            reward=record.final.reward if record.final is not None else None,
            failure_class=record.failure_class,
            will_retry=will_retry,
        )

    evaluation: asyncio.Task[Any] | None = None
    early_flush: list[asyncio.Future[None]] = []

    def stop_now() -> None:
        early_flush.append(asyncio.ensure_future(asyncio.to_thread(sink.flush)))
        if evaluation is not None:
            evaluation.cancel()

    grace = config.environment.cleanup_grace_seconds
    cleanup = f"saving finished episodes and releasing leases (up to {grace:g} s)"
    with GracefulStop(stop_now, cleanup=cleanup) as stop:
        timer = asyncio.ensure_future(sink.flush_stale_parts())
        try:
            await start_lease_tracking(
                environment,
                journal,
                concurrency=config.experiment.concurrency,
                processes=processes,
                configured=config.environment.max_leases,
            )
            if not stop.requested:
                evaluator = Evaluator(
                    prepared.runtime(limited, environment),
                    sink,
                    concurrency=config.experiment.concurrency,
                    max_episode_retries=config.runtime.max_episode_retries,
                    retry_failed=options.retry_failed,
                    reroll_failed=options.reroll_failed,
                    on_trace=on_trace,
                )
                evaluation = asyncio.ensure_future(
                    evaluator.run(
                        jobs,
                        completed=set(state.completed),
                        prior_attempts=dict(state.attempts),
                        final_failures=state.final_failures(),
                    )
                )
                try:
                    await evaluation
                except asyncio.CancelledError:
                    if not stop.requested:
                        raise
            if stop.requested:
                log.warning("worker_interrupted", saved_parts=len(sink.written))
                return "interrupted"
            return "done"
        finally:
            timer.cancel()
            try:
                # Finished episodes are saved before anything else can fail or time out.
                await asyncio.gather(*early_flush, return_exceptions=True)
                await asyncio.to_thread(sink.flush)
            finally:
                try:
                    await model.aclose()
                finally:
                    try:
                        await environment.aclose()
                    finally:
                        await journal.aclose()
