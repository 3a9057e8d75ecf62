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

import secrets
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from shopsimrl import eventloop
from shopsimrl.config import ConfigError, ConfigOverride, WorkerSettings, load_experiment_config
from shopsimrl.cost import unapplied_prices
from shopsimrl.exitcodes import ExitCode
from shopsimrl.manifest import FingerprintMismatchError, ManifestError
from shopsimrl.records import EpisodeTrace, RunManifest
from shopsimrl.runner.driver import EvaluationHooks, Resume, evaluate_together, evaluation
from shopsimrl.schemas import EpisodeJob, fingerprint
from shopsimrl.stopping import STOP_SIGNALS
from shopsimrl.storage.objectstore import RunLocationError, StoreUnavailableError
from shopsimrl.storage.sharded import (
    PartWriter,
    ShardedRunStore,
    ShardMap,
    ShardMapError,
    check_markers,
    commit_shard,
    scan_shard,
)

if TYPE_CHECKING:
    from shopsimrl.runner.experiment import PreparedExperiment
    from shopsimrl.runner.scheduler import Evaluator

__all__ = ["WorkerOptions", "WorkerStopped", "evaluate_shard", "plan_run", "prepare_worker", "run_worker", "stop_on_signal"]

log = structlog.get_logger("shopsimrl.runner.worker")


class WorkerStopped(Exception):
    """The worker ends before its commit, with this exit code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


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
    overrides: Sequence[ConfigOverride] = ()
    """``--set`` of the worker command: the same as the run's plan was frozen with."""


def prepare_worker(
    config_path: Path, settings: WorkerSettings, final_test: bool, overrides: Sequence[ConfigOverride] = ()
) -> PreparedExperiment:
    from shopsimrl.model import ModelConfigError
    from shopsimrl.planning import PlanError
    from shopsimrl.prompts import PromptError
    from shopsimrl.runner.experiment import prepare
    from shopsimrl.skills import SkillBankError
    from shopsimrl.tasks import SplitError

    try:
        config = load_experiment_config(config_path, overrides=overrides).with_overrides(settings)
        return prepare(config, final_test=final_test)
    except (ConfigError, SplitError, PlanError, SkillBankError, PromptError, ModelConfigError) as exc:
        raise WorkerStopped(ExitCode.BAD_INPUT, str(exc)) from None


def plan_run(prepared: Any, store: ShardedRunStore, shards: int | None) -> tuple[RunManifest, ShardMap]:
    """Create or verify manifest.json and shards.json; returns (manifest, shard map)."""
    from shopsimrl.planning import PlanError

    plan = prepared.plan()
    execution = {**prepared.execution(), "run": store.display_uri}
    manifest = store.freeze_plan(plan, execution)
    if (unapplied := unapplied_prices(manifest.execution, execution)) is not None:
        log.warning("prices_not_applied", detail=unapplied)
    if shards is None:
        shard_map = store.read_shard_map()
        if shard_map is None:
            raise ShardMapError(f"{store.display_uri} has no shards.json yet; pass --shards N (or SHOPSIMRL_SHARDS)")
        shards = shard_map.count
    try:
        shard_map = store.ensure_shard_map(prepared.jobs, shards, manifest.plan_fingerprint)
    except PlanError as exc:
        raise ShardMapError(str(exc)) from None
    return manifest, shard_map


def stop_on_signal(signum: int, frame: object) -> None:
    """The signal handler outside the evaluation: nothing is buffered there, so the worker stops
    where it is, with the retryable code."""
    raise WorkerStopped(
        ExitCode.RETRYABLE, f"signal {signum} while planning or committing; finished episodes are saved, restart to resume"
    )


def run_worker(options: WorkerOptions) -> ExitCode:
    """Run one shard; every failure is mapped to an exit code and logged (never a traceback).

    The process exits with the returned code: once it is known, later signals are ignored."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop_on_signal)
    try:
        return _exit_code(options)
    except WorkerStopped as stop:  # a signal that landed while an outcome was being reported
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
    except WorkerStopped as stop:
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
    prepared = prepare_worker(options.config, settings, options.final_test, options.overrides)
    try:
        prepared.model().check_api_key()
    except ModelConfigError as exc:
        raise WorkerStopped(ExitCode.BAD_INPUT, str(exc)) from None
    manifest, shard_map = plan_run(prepared, store, options.shards)
    index = options.shard_index
    if not 0 <= index < shard_map.count:
        raise WorkerStopped(ExitCode.BAD_INPUT, f"shard index {index} is outside 0…{shard_map.count - 1}")
    plan_fp = manifest.plan_fingerprint
    by_id = {job.episode_id: job for job in prepared.jobs}
    jobs = [by_id[eid] for eid in shard_map.episode_ids[index]]
    shard_ids = set(shard_map.episode_ids[index])

    ids_sha = fingerprint(shard_map.episode_ids[index])
    # A commit is trusted only once checked against the parts themselves.
    state = scan_shard(store, index, shard_ids)
    check = check_markers(store, index, plan_fp, ids_sha, state)
    for name, problem in check.ignored:
        log.warning("marker_not_verified", marker=name, problem=problem)
    if check.distrusted:
        # Bytes that differ from what a commit recorded: their episodes run again.
        log.warning("parts_not_trusted", parts=sorted(check.distrusted))
        state = scan_shard(store, index, shard_ids, exclude=check.distrusted)
    if check.verified:
        committed = {eid for marker in check.verified for part in marker.parts for eid in state.part_completed.get(part.name, ())}
        if committed >= shard_ids:
            log.info("shard_already_committed", completed=len(jobs))
            return ExitCode.OK
        in_markers = {part.name for marker in check.verified for part in marker.parts}
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
        from shopsimrl.runner.worker_processes import evaluate_in_processes

        interrupted, written = evaluate_in_processes(options, index, pending, state, loops, sharing, writer, plan_fp)
    else:
        parts = PartWriter(
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
        resume = Resume(set(state.completed), dict(state.attempts), state.final_failures())
        interrupted = evaluate_shard(prepared, jobs, resume, parts, options, sharing)
        written = parts.written
    if interrupted:
        raise WorkerStopped(
            ExitCode.RETRYABLE, f"interrupted; finished episodes are saved in {store.display_uri}, restart to resume"
        )

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


class _ShardHooks(EvaluationHooks):
    """A shard worker's view of its evaluation: a log line per attempt, the part writer's timer
    (a stalled buffer is flushed; a heartbeat keeps ``status`` current)."""

    def __init__(self, parts: PartWriter) -> None:
        self.parts = parts

    def started(self, evaluator: Evaluator, pending: int) -> None:
        evaluator.on_trace = _log_attempt

    def background(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return (self.parts.flush_stale_parts,)


def _log_attempt(record: EpisodeTrace, will_retry: bool) -> None:
    log.info(
        "episode_finished",
        episode_id=record.episode_id,
        status=record.status,
        reward=record.final.reward if record.final is not None else None,
        failure_class=record.failure_class,
        will_retry=will_retry,
    )


def evaluate_shard(
    prepared: PreparedExperiment,
    jobs: list[EpisodeJob],
    resume: Resume,
    parts: PartWriter,
    options: WorkerOptions,
    processes: int,
) -> bool:
    """Run a shard's pending ``jobs`` in this process into ``parts``; True when a signal stopped
    them. Its progress object says ``running`` from the start and ``interrupted`` at a stop."""
    from shopsimrl.runner.lease_journal import shard_journal_storage

    parts.report_progress()
    one = evaluation(
        prepared,
        jobs,
        resume,
        parts,
        shard_journal_storage(parts.store, parts.shard),
        journal_writer=parts.writer,
        processes=processes,
        max_episode_retries=prepared.config.runtime.max_episode_retries,
        retry_failed=options.retry_failed,
        reroll_failed=options.reroll_failed,
        hooks=_ShardHooks(parts),
    )
    interrupted = eventloop.run(evaluate_together([one]))
    if interrupted:
        log.warning("worker_interrupted", saved_parts=len(parts.written))
        parts.report_progress("interrupted")
    return interrupted
