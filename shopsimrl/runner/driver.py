"""The one evaluation driver: a batch of work under SIGTERM/SIGINT, its output saved on every path.

:func:`drive` is the life cycle every long stage shares (``run``, ``worker`` and its processes, the
judge, and what runs rollouts for them): run the work; at the first signal save what is finished
at once and cancel the rest (the work's own clean-up, e.g. lease releases, runs as it unwinds);
on every path save what is finished again, then close each resource in order, each whether or
not the one before it closed.

:func:`evaluation` builds the work of :func:`drive` for episodes: the adapters of a prepared
experiment, its lease journal, the scheduler over the jobs still to run, and the hooks by which a
local run shows its progress bar and a shard worker its log lines and flush timer;
:func:`evaluate_together` drives one or several (an eval set's members) on one loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import structlog

from shopsimrl.inflight import AdaptiveLimit
from shopsimrl.schemas import EpisodeJob, redact_uri
from shopsimrl.stopping import GracefulStop
from shopsimrl.storage.base import TraceWriter

if TYPE_CHECKING:
    from shopsimrl.runner.experiment import PreparedExperiment
    from shopsimrl.runner.lease_journal import JournalStorage
    from shopsimrl.runner.scheduler import EpisodeSlot, Evaluator

_log = structlog.get_logger("shopsimrl.runner")

__all__ = [
    "AsyncClosable",
    "Driven",
    "Evaluation",
    "EvaluationHooks",
    "Resume",
    "drive",
    "evaluate_together",
    "evaluation",
]

T = TypeVar("T")


class AsyncClosable(Protocol):
    async def aclose(self) -> None: ...


@dataclass
class Driven(Generic[T]):
    """How a driven batch ended: ``result`` when it finished, ``interrupted`` when a signal stopped it."""

    interrupted: bool
    result: T | None = None


async def drive(
    work: Coroutine[Any, Any, T],
    *,
    cleanup: str,
    save: Callable[[], None] = lambda: None,
    closing: Sequence[AsyncClosable] = (),
    background: Sequence[Callable[[], Awaitable[None]]] = (),
) -> Driven[T]:
    """Run ``work`` until it ends or a SIGTERM/SIGINT stops it.

    ``save`` persists what is finished (it runs in a thread: at the first signal, and after the
    work ended whichever way); ``closing`` are closed in order afterwards; ``background`` tasks
    (a flush timer, a heartbeat) run beside the work and are cancelled when it ends. ``cleanup``
    says what the process still does once stopped (shown at a second signal)."""
    task: asyncio.Task[T] = asyncio.ensure_future(work)
    early: list[asyncio.Future[None]] = []

    def stop() -> None:
        early.append(asyncio.ensure_future(asyncio.to_thread(save)))  # before the work unwinds, which can take long
        task.cancel()

    helpers = [asyncio.ensure_future(start()) for start in background]
    try:
        with GracefulStop(stop, cleanup=cleanup) as signals:
            try:
                return Driven(False, await task)
            except asyncio.CancelledError:
                if not signals.requested:
                    raise
                return Driven(True)
    finally:
        for helper in helpers:
            helper.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        try:
            # Finished work is saved before anything else can fail or time out.
            await asyncio.gather(*early, return_exceptions=True)
            await asyncio.to_thread(save)
        finally:
            await _close_in_order(list(closing))


async def _close_in_order(resources: list[AsyncClosable]) -> None:
    if not resources:
        return
    try:
        await resources[0].aclose()
    finally:
        await _close_in_order(resources[1:])


@dataclass(frozen=True)
class Resume:
    """What the store says of the jobs before this invocation."""

    completed: set[str] = field(default_factory=set)
    prior_attempts: dict[str, int] = field(default_factory=dict)
    final_failures: dict[str, str | None] = field(default_factory=dict)
    """Episode → ``failure_class`` of a recorded failure that is the agent's (final unless re-rolled)."""


class EvaluationHooks:
    """What a caller adds around the evaluation; the defaults add nothing."""

    def started(self, evaluator: Evaluator, pending: int) -> None:
        """The scheduler is ready with ``pending`` episodes to run (set ``evaluator.on_trace`` here)."""

    def background(self) -> Sequence[Callable[[], Awaitable[None]]]:
        """Tasks that run beside the evaluation (a progress heartbeat, a flush timer)."""
        return ()

    def ended(self, state: str) -> None:
        """The evaluation ended: ``finished``, ``interrupted`` or ``stopped`` (it raised)."""

    def model_inflight(self, record: dict[str, Any]) -> None:
        """The adaptive in-flight limit's history of this invocation (``shopsimrl.inflight``)."""
        _log.info("model_inflight", **record)


@dataclass
class Evaluation:
    """One prepared evaluation not yet driven (:func:`evaluate_together` drives it, alone or with
    the other members of an eval set)."""

    work: Callable[[], Coroutine[Any, Any, None]]
    save: Callable[[], None]
    closing: list[AsyncClosable]
    background: Sequence[Callable[[], Awaitable[None]]]
    grace: float


def evaluation(
    prepared: PreparedExperiment,
    jobs: Sequence[EpisodeJob],
    resume: Resume,
    writer: TraceWriter,
    journal_storage: JournalStorage,
    *,
    journal_writer: str | None = None,
    processes: int = 1,
    max_episode_retries: int,
    retry_failed: bool = True,
    reroll_failed: bool = False,
    hooks: EvaluationHooks | None = None,
    slot: EpisodeSlot | None = None,
    limit: AdaptiveLimit | None = None,
) -> Evaluation:
    """The episodes of ``jobs`` that ``resume`` leaves to run, each attempt saved through ``writer``.

    ``processes``: how many event loops (of all workers running at once) share the shop's slots;
    ``slot``: a slot shared with other evaluations, taken before each episode starts (none: only
    ``experiment.concurrency`` bounds it); ``limit``: an adaptive in-flight limit shared with
    other evaluations calling the same model server (none: its own, when the config adapts)."""
    from shopsimrl.runner.lease_journal import LeaseJournal, start_lease_tracking
    from shopsimrl.runner.scheduler import ConcurrencyLimitedModel, EvaluationOutcome, Evaluator

    hooks = hooks or EvaluationHooks()
    config = prepared.config
    ceiling = config.model.max_concurrent_requests or config.experiment.concurrency
    shared = limit is not None
    if limit is None and config.model.adaptive_concurrency:
        limit = AdaptiveLimit(ceiling)
    model = prepared.model(limit)
    environment = prepared.environment()
    journal = LeaseJournal(journal_storage, environment_url=prepared.environment_settings.base_url, writer=journal_writer)
    limited = ConcurrencyLimitedModel(model, ceiling)
    began = datetime.now(UTC).isoformat()

    async def run() -> None:
        await start_lease_tracking(
            environment,
            journal,
            concurrency=config.experiment.concurrency,
            processes=processes,
            configured=config.environment.max_leases,
        )
        evaluator = Evaluator(
            prepared.runtime(limited, environment),
            writer,
            concurrency=config.experiment.concurrency,
            max_episode_retries=max_episode_retries,
            retry_failed=retry_failed,
            reroll_failed=reroll_failed,
            slot=slot,
        )
        pending = evaluator.pending(
            list(jobs), resume.completed, resume.prior_attempts, EvaluationOutcome(), resume.final_failures
        )
        hooks.started(evaluator, len(pending))
        state = "stopped"
        try:
            await evaluator.run(
                list(jobs),
                completed=resume.completed,
                prior_attempts=resume.prior_attempts,
                final_failures=resume.final_failures,
            )
            state = "finished"
        except asyncio.CancelledError:
            state = "interrupted"
            raise
        finally:
            hooks.ended(state)
            if limit is not None and limit.requests:  # a resume with nothing to run changes nothing
                hooks.model_inflight(
                    {
                        "started_at": began,
                        "ended_at": datetime.now(UTC).isoformat(),
                        "state": state,
                        "model_base_url": redact_uri(prepared.model_settings.base_url),
                        **limit.snapshot(),
                        **({"shared": True} if shared else {}),
                    }
                )

    return Evaluation(
        run, writer.flush, [model, environment, journal], hooks.background(), config.environment.cleanup_grace_seconds
    )


async def evaluate_together(evaluations: Sequence[Evaluation]) -> bool:
    """Drive ``evaluations`` on this loop at once, under one SIGTERM/SIGINT handler: a signal
    stops them all, each saving what finished and releasing its leases. True when a signal
    stopped them."""

    async def work() -> None:
        tasks = [asyncio.ensure_future(each.work()) for each in evaluations]
        try:
            await asyncio.gather(*tasks)
        finally:  # one that raised stops the others; each unwinds (releases its leases)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def save() -> None:
        errors = []
        for each in evaluations:
            try:
                each.save()
            except Exception as exc:  # the other members' finished episodes are still saved
                errors.append(exc)
        if errors:
            raise errors[0]

    grace = max(each.grace for each in evaluations)
    driven = await drive(
        evaluations[0].work() if len(evaluations) == 1 else work(),
        cleanup=f"saving finished episodes and releasing leases (up to {grace:g} s)",
        save=save,
        closing=[resource for each in evaluations for resource in each.closing],
        background=[start for each in evaluations for start in each.background],
    )
    return driven.interrupted
