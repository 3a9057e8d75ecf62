"""Async scheduler for a list of episodes (a whole local run, or one shard).

It only schedules: bounded concurrency, separate limits for model calls, retries of
infrastructure failures, persistence of every attempt as it ends. It never takes an agent
decision and never reruns a completed episode.

Retry semantics (documented in docs/runtime_eval.md §4): the scored population is a property
of the plan, not of how many times ``run`` was invoked.
- within one invocation, an episode whose attempt failed with ``failure_class == "infrastructure"``
  is requeued after a short backoff, up to ``1 + max_episode_retries`` attempts; other failures
  are recorded once;
- a later invocation runs again, with a fresh budget, every episode whose failure says nothing
  about the agent (``infrastructure``, ``configuration_error``: ``retry_failed=True``, the
  default); a failure that is an outcome of the episode (``environment_error``, ``model_error``,
  ``runtime_error``, unclassified) is final once recorded. ``reroll_failed=True`` runs those
  again too, and marks each such attempt with ``rerolled_from`` (the class it replaces);
  ``retry_failed=False`` runs only never-attempted episodes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from shopsimrl.episode import AgentRuntime, failed_trace
from shopsimrl.model import ChatModel
from shopsimrl.records import EpisodeTrace
from shopsimrl.schemas import EpisodeJob, ModelOutput

__all__ = ["ConcurrencyLimitedModel", "EpisodeSlot", "EvaluationOutcome", "Evaluator", "TraceSink"]

log = structlog.get_logger("shopsimrl.runner.scheduler")

MAX_REQUEUE_DELAY_S = 30.0
"""The backoff before an episode runs again doubles per attempt up to this (then jittered)."""


class TraceSink(Protocol):
    def save_traces(self, records: list[EpisodeTrace]) -> None:
        """Persist ``records`` in order; durable (as the sink defines it) when it returns."""
        ...


class EpisodeSlot(Protocol):
    """A slot shared with other evaluations on the same loop (the members of an eval set)."""

    async def acquire(self) -> None:
        """Wait until this evaluation may start one more episode."""
        ...

    def release(self) -> None:
        """An episode of this evaluation ended; its slot goes back."""
        ...


class ConcurrencyLimitedModel:
    """A ChatModel that lets at most ``limit`` calls be in flight (the model server's budget)."""

    def __init__(self, model: ChatModel, limit: int) -> None:
        self._model = model
        self._semaphore = asyncio.Semaphore(limit)

    def identity(self) -> dict[str, Any]:
        return self._model.identity()

    async def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], seed: int | None = None) -> ModelOutput:
        async with self._semaphore:
            return await self._model.generate(messages, tools, seed=seed)

    async def aclose(self) -> None:
        await self._model.aclose()


@dataclass
class EvaluationOutcome:
    scheduled: int = 0
    attempts: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    skipped_completed: int = 0
    skipped_failed: int = 0
    skipped_final: int = 0
    """Episodes whose recorded failure is an outcome (final unless re-rolled)."""
    rerolled: int = 0


class Evaluator:
    def __init__(
        self,
        runtime: AgentRuntime,
        sink: TraceSink,
        *,
        concurrency: int = 1,
        max_episode_retries: int = 2,
        retry_failed: bool = True,
        reroll_failed: bool = False,
        retry_backoff_seconds: float = 1.0,
        on_trace: Callable[[EpisodeTrace, bool], None] | None = None,
        slot: EpisodeSlot | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if reroll_failed and not retry_failed:
            raise ValueError("reroll_failed needs retry_failed")
        self.runtime = runtime
        self.sink = sink
        self.concurrency = concurrency
        self.max_attempts = 1 + max_episode_retries
        self.retry_failed = retry_failed
        self.reroll_failed = reroll_failed
        self.retry_backoff_seconds = retry_backoff_seconds
        self.on_trace = on_trace
        self.slot = slot
        self._save_lock = asyncio.Lock()

    def pending(
        self,
        jobs: Sequence[EpisodeJob],
        completed: Collection[str],
        prior_attempts: Mapping[str, int],
        outcome: EvaluationOutcome,
        final_failures: Mapping[str, str | None] | None = None,
    ) -> list[EpisodeJob]:
        """The jobs this invocation runs. ``final_failures``: episode → ``failure_class`` of its
        winning record, for episodes whose recorded failure is an outcome."""
        final_failures = final_failures or {}
        pending = []
        for job in jobs:
            if job.episode_id in completed:
                outcome.skipped_completed += 1
            elif job.episode_id in final_failures and not self.reroll_failed:
                outcome.skipped_final += 1
            elif not self.retry_failed and prior_attempts.get(job.episode_id, 0) > 0:
                outcome.skipped_failed += 1
            else:
                outcome.rerolled += job.episode_id in final_failures
                pending.append(job)
        return pending

    async def run(
        self,
        jobs: Sequence[EpisodeJob],
        *,
        completed: Collection[str] | None = None,
        prior_attempts: Mapping[str, int] | None = None,
        final_failures: Mapping[str, str | None] | None = None,
    ) -> EvaluationOutcome:
        outcome = EvaluationOutcome()
        prior_attempts = prior_attempts or {}
        final_failures = final_failures or {}
        pending = self.pending(jobs, completed or set(), prior_attempts, outcome, final_failures)
        outcome.scheduled = len(pending)
        if not pending:
            return outcome

        queue: asyncio.Queue[tuple[EpisodeJob, int]] = asyncio.Queue()
        for job in pending:
            queue.put_nowait((job, 1))
        remaining = len(pending)
        all_done = asyncio.Event()
        loop = asyncio.get_running_loop()
        fatal: list[BaseException] = []

        def settle(trace: EpisodeTrace, job: EpisodeJob, attempt: int) -> bool:
            """Count one persisted attempt; True when the episode is finished for this invocation."""
            outcome.attempts += 1
            will_retry = trace.status != "completed" and trace.failure_class == "infrastructure" and attempt < self.max_attempts
            if self.on_trace is not None:
                try:
                    self.on_trace(trace, will_retry)
                except Exception as exc:  # a broken progress display must not stall the run
                    log.warning("on_trace_failed", error=type(exc).__name__, message=str(exc)[:300])
            if trace.status == "completed":
                outcome.completed += 1
            elif will_retry:
                outcome.retried += 1
                delay = min(self.retry_backoff_seconds * 2 ** (attempt - 1), MAX_REQUEUE_DELAY_S) * (1 + random.random() * 0.5)
                log.info("episode_requeued", episode_id=job.episode_id, attempt=attempt, delay_s=round(delay, 2))
                loop.call_later(delay, queue.put_nowait, (job, attempt + 1))
                return False
            else:
                outcome.failed += 1
            return True

        saves: set[asyncio.Task[None]] = set()
        waiting: list[tuple[EpisodeTrace, asyncio.Future[None]]] = []
        writer: asyncio.Task[None] | None = None

        async def write_waiting() -> None:
            # Group commit: the traces that finished while the previous write ran go out in one
            # call (one fsync for a local run), off the event loop, one write at a time.
            while waiting:
                batch = waiting[:]
                waiting.clear()
                try:
                    async with self._save_lock:
                        await asyncio.to_thread(self.sink.save_traces, [trace for trace, _ in batch])
                except Exception as exc:
                    for _, done in batch:
                        if not done.done():  # its save was cancelled (the loop shutting down)
                            done.set_exception(exc)
                except BaseException:
                    for _, done in batch:
                        done.cancel()
                    raise
                else:
                    for _, done in batch:
                        if not done.done():
                            done.set_result(None)

        async def save(trace: EpisodeTrace) -> None:
            nonlocal writer
            done: asyncio.Future[None] = loop.create_future()
            waiting.append((trace, done))
            if writer is None or writer.done():
                writer = asyncio.ensure_future(write_waiting())
            await done

        def saved(task: asyncio.Task[None]) -> None:
            # Every failed save is seen here. A runner cancelled while it waited no longer awaits
            # its save (asyncio.shield drops the link), and a save that fails after that but
            # before the clean-up below looks at ``saves`` would otherwise end as "Task exception
            # was never retrieved" (a full disk: the first failed write stops the run, the writes
            # queued behind it fail while the runners are being cancelled).
            saves.discard(task)
            if not task.cancelled() and (exc := task.exception()) is not None and not fatal:
                fatal.append(exc)

        async def run_episodes() -> None:
            """One of ``concurrency`` tasks: take a queued attempt, run it, save its trace."""
            while True:
                job, attempt = await queue.get()
                if not await run_one(job, attempt):
                    return

        async def run_in_slot(slot: EpisodeSlot) -> None:
            """``run_episodes`` in a slot shared with other evaluations: a runner keeps its slot
            while this evaluation has episodes queued and gives it back when none is, so the
            earliest member keeps its slots until it drains and a later one fills them then."""
            holding = False
            try:
                while True:
                    try:
                        job, attempt = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        if holding:
                            holding = False
                            slot.release()
                        job, attempt = await queue.get()
                    if not holding:
                        await slot.acquire()
                        holding = True
                    if not await run_one(job, attempt):
                        return
            finally:
                if holding:
                    slot.release()

        async def run_one(job: EpisodeJob, attempt: int) -> bool:
            """Run one attempt and save its trace; False when nothing more can be saved."""
            nonlocal remaining
            trace = await self._attempt(job)
            trace.attempt = prior_attempts.get(job.episode_id, 0) + attempt
            if job.episode_id in final_failures:
                # A re-roll replaces an outcome: the record says which, so the summary counts it.
                trace.rerolled_from = final_failures[job.episode_id] or "unclassified"
            # A finished episode is saved even if the run is cancelled meanwhile: the save
            # runs as its own task, which run() waits for before it returns.
            saving = asyncio.ensure_future(save(trace))
            saves.add(saving)
            saving.add_done_callback(saved)
            try:
                await asyncio.shield(saving)
            except Exception as exc:  # the store failed: nothing more can be persisted
                fatal.append(exc)
                all_done.set()
                return False
            if settle(trace, job, attempt):
                remaining -= 1
                if remaining == 0:
                    all_done.set()
            return True

        def runner_ended(task: asyncio.Task[None]) -> None:
            # A runner ends only by cancellation; anything else is a bug that would leave run()
            # waiting for episodes nobody runs: stop the run with it instead.
            if not task.cancelled() and task.exception() is not None:
                fatal.append(task.exception())  # type: ignore[arg-type]
                all_done.set()

        runners = [
            asyncio.create_task(run_episodes() if self.slot is None else run_in_slot(self.slot), name=f"episode-runner-{i}")
            for i in range(min(self.concurrency, len(pending)))
        ]
        for task in runners:
            task.add_done_callback(runner_ended)
        try:
            await all_done.wait()
        finally:
            for task in runners:
                task.cancel()
            await asyncio.gather(*runners, return_exceptions=True)
            if saves:
                done, _ = await asyncio.wait(set(saves))
                for task in done:
                    if not task.cancelled() and task.exception() is not None and not fatal:
                        fatal.append(task.exception())  # type: ignore[arg-type]
        if fatal:
            raise fatal[0]
        return outcome

    async def _attempt(self, job: EpisodeJob) -> EpisodeTrace:
        # Every log line of the episode (runtime, adapters, retries) carries its episode_id.
        try:
            with structlog.contextvars.bound_contextvars(episode_id=job.episode_id):
                return await self.runtime.run(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a runtime bug must cost one episode, never the run
            log.error("runtime_raised", episode_id=job.episode_id, error=type(exc).__name__, message=str(exc)[:300])
            return failed_trace(job, exc)
