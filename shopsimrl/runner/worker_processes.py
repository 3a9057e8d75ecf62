"""A worker's shard run in several event-loop processes (``SHOPSIMRL_WORKER_PROCESSES``).

Job k of the shard's pending jobs goes to process k mod N; each process plans again from the
config (planning is deterministic), writes its own parts under its own writer id and journals
its own leases; the worker commits what they all wrote.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
from dataclasses import dataclass
from typing import Any

import structlog

from shopsimrl.logs import LogSettings, current_settings
from shopsimrl.runner.driver import Resume
from shopsimrl.runner.worker import WorkerOptions, WorkerStopped, evaluate_shard, prepare_worker, stop_on_signal
from shopsimrl.schemas import EpisodeJob
from shopsimrl.stopping import STOP_SIGNALS
from shopsimrl.storage.sharded import PartWriter, ShardedRunStore, ShardState, WrittenPart

__all__ = ["evaluate_in_processes"]

log = structlog.get_logger("shopsimrl.runner.worker")


@dataclass(frozen=True)
class _SliceSpec:
    """What one event-loop process of a worker needs: everything but the plan, which it rebuilds
    from the config instead of receiving it."""

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


def evaluate_in_processes(
    options: WorkerOptions,
    shard: int,
    pending: list[EpisodeJob],
    state: ShardState,
    loops: int,
    sharing: int,
    session: str,
    plan_fingerprint: str,
) -> tuple[bool, list[WrittenPart]]:
    """Run ``pending`` in ``loops`` processes; returns whether the run was interrupted and the
    parts written, for the commit. SIGTERM/SIGINT are passed on once; a process that dies
    interrupts the run (its saved parts stay; a restart resumes the rest)."""
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
    interrupted = False
    written: list[WrittenPart] = []
    try:
        for process, receive in children:
            try:
                result = receive.recv()  # sent just before the process exits
            except EOFError:  # it died without reporting (kill -9, a crash)
                result = {"interrupted": True, "written": []}
            process.join()
            interrupted = interrupted or result["interrupted"]
            written.extend(result["written"])
            if process.exitcode:
                log.warning("worker_process_failed", process=process.name, exit_code=process.exitcode)
                interrupted = True
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return stopping or interrupted, written


def _slice_main(spec: _SliceSpec, send: Any) -> None:
    """Entry point of one event-loop process of a worker."""
    from shopsimrl.logs import configure_logging
    from shopsimrl.stopping import die_with_parent

    die_with_parent(spec.parent)
    for signum in STOP_SIGNALS:  # until the evaluation's graceful stop takes over
        signal.signal(signum, stop_on_signal)
    configure_logging(settings=spec.log_settings)
    options = spec.options
    store = ShardedRunStore(options.run)
    structlog.contextvars.bind_contextvars(run=store.display_uri, shard=spec.shard, writer=spec.writer)
    interrupted, written = True, []
    try:
        prepared = prepare_worker(options.config, options.settings, options.final_test, options.overrides)
        by_id = {job.episode_id: job for job in prepared.jobs}
        jobs = [by_id[eid] for eid in spec.episode_ids]
        settings = options.settings
        parts = PartWriter(
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
        try:
            resume = Resume(prior_attempts=dict(spec.prior_attempts), final_failures=dict(spec.final_failures))
            interrupted = evaluate_shard(prepared, jobs, resume, parts, options, spec.sharing)
        finally:
            written = parts.written
    except WorkerStopped as stop:
        log.warning("worker_process_stopped", reason=str(stop))
    finally:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        send.send({"interrupted": interrupted, "written": written})
        send.close()
