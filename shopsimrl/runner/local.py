"""A run on one machine: ``shopsimrl run`` without ``--shards``.

The twin of :mod:`shopsimrl.runner.worker` for a single process: :func:`run_local` takes the
run directory's lock, creates or verifies the manifest, resumes from ``traces.jsonl``, runs the
pending episodes with :class:`~shopsimrl.runner.scheduler.Evaluator` (SIGTERM/SIGINT stop it through
:class:`~shopsimrl.stopping.GracefulStop`: every lease is released, finished episodes are
saved, exit 3), then writes ``summary.json``. A failure is raised as :class:`RunStopped` with
its exit code; the CLI prints it.
Its run directory is a :class:`~shopsimrl.storage.local.LocalRunStore`.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from shopsimrl import eventloop
from shopsimrl.cost import unapplied_prices
from shopsimrl.exitcodes import ExitCode
from shopsimrl.inflight import AdaptiveLimit, model_inflight_block
from shopsimrl.manifest import FingerprintMismatchError, ManifestError, run_identity
from shopsimrl.metrics import SummaryAccumulator
from shopsimrl.records import RecordVersionError, RunManifest
from shopsimrl.runner.driver import Evaluation, EvaluationHooks, Resume, evaluate_together, evaluation
from shopsimrl.runner.lease_journal import DirectoryJournalStorage
from shopsimrl.runner.progress import ProgressFile, RunProgress
from shopsimrl.storage.local import LocalRunStore, RunLockedError, RunWriteError

if TYPE_CHECKING:
    from shopsimrl.runner.experiment import PreparedExperiment
    from shopsimrl.runner.scheduler import EpisodeSlot, Evaluator
    from shopsimrl.runner.slots import SlotPool

__all__ = ["LocalRun", "RunStopped", "run_local", "run_local_together", "summarize_local"]

log = structlog.get_logger("shopsimrl.runner.local")

T = TypeVar("T")


class RunStopped(Exception):
    """The run ended before its summary, with this exit code (the CLI prints the message)."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def run_local(
    prepared: PreparedExperiment,
    *,
    max_episode_retries: int | None = None,
    retry_failed: bool = True,
    reroll_failed: bool = False,
    show_progress: bool = True,
    announce: Callable[[str], None] = lambda line: None,
) -> tuple[LocalRunStore, dict[str, Any]]:
    """Run (or resume) every episode of ``prepared`` in this process; returns the store and the
    written summary. Raises :class:`RunStopped`.

    ``announce`` receives the one line that says what is to run; ``show_progress``: a live bar
    when stderr is a terminal."""
    run = LocalRun(prepared, retry_failed=retry_failed, reroll_failed=reroll_failed)
    try:
        run.open(announce)
        if _drive(prepared, [run.evaluation(max_episode_retries=max_episode_retries, show_progress=show_progress)]):
            raise RunStopped(ExitCode.RETRYABLE, "interrupted; finished episodes are saved, rerun the same command to resume")
        return run.store, run.summarize()
    finally:
        run.close()


def _drive(prepared: PreparedExperiment, evaluations: list[Evaluation]) -> bool:
    """Drive ``evaluations`` on one event loop; True when a signal stopped them."""
    try:
        return eventloop.run(evaluate_together(evaluations))
    except KeyboardInterrupt:  # Ctrl-C before the run's own handlers were installed
        return True
    except OSError as exc:
        where = f" in {prepared.config.run_dir}" if len(evaluations) == 1 else ""
        raise RunStopped(ExitCode.RETRYABLE, f"cannot persist traces{where}: {exc}") from None


def run_local_together(
    runs: Sequence[LocalRun],
    *,
    concurrency: int,
    show_progress: bool = True,
    announce: Callable[[str], None] = lambda line: None,
) -> list[dict[str, Any]]:
    """Run (or resume) several local runs on one event loop, sharing ``concurrency`` slots: a
    freed slot goes to the earliest run with an episode waiting (``shopsimrl evalset``). One
    Ctrl-C stops them all, each saving its finished episodes. Returns each run's summary;
    raises :class:`RunStopped` (naming the run, by its folder, where one run failed)."""
    from shopsimrl.runner.slots import MemberSlot, SharedSlots

    shared = SharedSlots(member_slot_pool(runs, concurrency))
    limits = shared_model_limits(runs)
    try:
        for run in runs:
            _named(run, run.open, announce)
        evaluations = []
        for position, run in enumerate(runs):
            urls = run.prepared.environment_settings.base_url, run.prepared.model_settings.base_url
            evaluations.append(
                run.evaluation(
                    show_progress=show_progress and position == 0,  # one live bar fits a terminal: the first member's
                    slot=MemberSlot(shared, shared.add(*urls)),
                    limit=limits.get(urls[1]) if run.prepared.config.model.adaptive_concurrency else None,
                )
            )
        if _drive(runs[0].prepared, evaluations):
            raise RunStopped(
                ExitCode.RETRYABLE, "interrupted; every member's finished episodes are saved, rerun the same command to resume"
            )
        return [_named(run, run.summarize) for run in runs]
    finally:
        for run in runs:
            run.close()


def member_slot_pool(runs: Sequence[LocalRun], concurrency: int) -> SlotPool:
    """The set's slots: ``concurrency`` in all, and per shop URL the smallest
    ``environment.max_leases``, per model URL the smallest ``model.max_concurrent_requests`` its
    members configure (a URL none bounds: the total only)."""
    from shopsimrl.runner.slots import SlotPool

    shop_budget: dict[str, int] = {}
    model_budget: dict[str, int] = {}
    for run in runs:
        config = run.prepared.config
        for budget, url, cap in (
            (shop_budget, run.prepared.environment_settings.base_url, config.environment.max_leases),
            (model_budget, run.prepared.model_settings.base_url, config.model.max_concurrent_requests),
        ):
            if cap is not None:
                budget[url] = min(cap, budget.get(url, cap))
    return SlotPool(concurrency, shop_budget, model_budget)


def shared_model_limits(runs: Sequence[LocalRun]) -> dict[str, AdaptiveLimit]:
    """One adaptive in-flight limit per model URL that two or more adaptive members call: the
    server's overload is one signal, so its members back off together (a member alone on its
    server builds its own). Its ceiling is the largest of theirs; each member's own stays in
    force through its concurrency bound."""
    ceilings: dict[str, list[int]] = {}
    for run in runs:
        config = run.prepared.config
        if config.model.adaptive_concurrency:
            ceiling = config.model.max_concurrent_requests or config.experiment.concurrency
            ceilings.setdefault(run.prepared.model_settings.base_url, []).append(ceiling)
    return {url: AdaptiveLimit(max(each)) for url, each in ceilings.items() if len(each) > 1}


def _named(run: LocalRun, step: Callable[..., T], *args: Any) -> T:
    try:
        return step(*args)
    except RunStopped as exc:
        raise RunStopped(exc.code, f"{run.name}: {exc}") from None


class LocalRun:
    """One local run in steps, so that several can share an event loop: :meth:`open` takes the
    lock and freezes or checks the plan, :meth:`evaluation` is what the loop drives,
    :meth:`summarize` writes ``summary.json``, :meth:`close` releases the lock."""

    def __init__(
        self, prepared: PreparedExperiment, *, name: str = "", retry_failed: bool = True, reroll_failed: bool = False
    ) -> None:
        self.prepared = prepared
        self.name = name or prepared.config.name
        self.retry_failed, self.reroll_failed = retry_failed, reroll_failed
        self.store = LocalRunStore(prepared.config.run_dir)
        self._locked = False
        self.manifest: RunManifest | None = None
        self.resume = Resume()

    def open(self, announce: Callable[[str], None]) -> None:
        config = self.prepared.config
        store = self.store
        try:
            store.acquire()
        except RunLockedError as exc:
            raise RunStopped(ExitCode.RETRYABLE, str(exc)) from None
        except OSError as exc:  # the directory cannot exist there (a file in the way, no permission) or the disk failed
            unusable = isinstance(exc, (PermissionError, FileExistsError, FileNotFoundError, NotADirectoryError))
            raise RunStopped(
                ExitCode.BAD_INPUT if unusable else ExitCode.RETRYABLE,
                f"experiment.output_dir: cannot create the run directory {config.run_dir}: {exc.strerror or exc}",
            ) from None
        self._locked = True
        try:
            if not config.experiment.resume and store.read_manifest() is not None:
                raise RunStopped(ExitCode.BAD_INPUT, f"{config.run_dir} already holds a run and experiment.resume is false")
            self.manifest = store.freeze_plan(self.prepared.plan(), self.prepared.execution())
            if (unapplied := unapplied_prices(self.manifest.execution, self.prepared.execution())) is not None:
                log.warning("prices_not_applied", detail=unapplied)
        except FingerprintMismatchError as exc:
            raise RunStopped(ExitCode.FINGERPRINT_MISMATCH, str(exc)) from None
        except ManifestError as exc:
            raise RunStopped(ExitCode.BAD_INPUT, str(exc)) from None
        except RunWriteError as exc:
            raise RunStopped(ExitCode.RETRYABLE if exc.retryable else ExitCode.BAD_INPUT, str(exc)) from None
        try:
            index = store.load_index()
        except RecordVersionError as exc:
            raise RunStopped(ExitCode.BAD_INPUT, str(exc)) from None
        completed = {eid for eid, state in index.episodes.items() if state.completed}
        prior = {eid: state.attempts for eid, state in index.episodes.items()}
        final = {eid: cls for eid, cls in index.final_failures().items() if eid not in completed}
        announce(
            _plan_line(
                config.name, self.prepared.jobs, completed, prior, final, self.retry_failed, self.reroll_failed, config.run_dir
            )
        )
        self.resume = Resume(completed, prior, final)

    def evaluation(
        self,
        *,
        max_episode_retries: int | None = None,
        show_progress: bool = True,
        slot: EpisodeSlot | None = None,
        limit: AdaptiveLimit | None = None,
    ) -> Evaluation:
        assert self.manifest is not None, "open() first"
        config = self.prepared.config
        retries = config.runtime.max_episode_retries if max_episode_retries is None else max_episode_retries
        hooks = _LocalHooks(self.store, len(self.prepared.jobs), self.resume, self.manifest.plan_fingerprint, show_progress)
        return evaluation(
            self.prepared,
            self.prepared.jobs,
            self.resume,
            self.store,
            DirectoryJournalStorage(config.run_dir / "leases"),
            max_episode_retries=retries,
            retry_failed=self.retry_failed,
            reroll_failed=self.reroll_failed,
            hooks=hooks,
            slot=slot,
            limit=limit,
        )

    def summarize(self) -> dict[str, Any]:
        try:
            return summarize_local(self.store, self.manifest, [job.episode_id for job in self.prepared.jobs])
        except RunWriteError as exc:  # the traces are safe; only the derived summary is missing
            raise RunStopped(
                ExitCode.RETRYABLE if exc.retryable else ExitCode.BAD_INPUT,
                f"{exc}; the traces are saved, `shopsimrl summarize {self.store.run_dir}` rewrites it",
            ) from None

    def close(self) -> None:
        if self._locked:
            self._locked = False
            self.store.release()


def _plan_line(
    name: str,
    jobs: list[Any],
    completed: set[str],
    prior: dict[str, int],
    final: dict[str, str | None],
    retry_failed: bool,
    reroll_failed: bool,
    run_dir: Path,
) -> str:
    """What this invocation will run, in one line."""
    planned = [job.episode_id for job in jobs]
    done = sum(1 for eid in planned if eid in completed)
    kept = sum(1 for eid in planned if eid in final)
    failed_before = sum(1 for eid in planned if eid not in completed and prior.get(eid, 0) > 0)
    if reroll_failed:
        todo = len(planned) - done
    elif retry_failed:
        todo = len(planned) - done - kept
    else:
        todo = len(planned) - done - failed_before
    parts = [f"run {name}: {len(planned)} episodes", f"{done} already completed"]
    if kept:
        parts.append(f"{kept} failed as outcomes ({'re-rolled now' if reroll_failed else 'final; --reroll-failed reruns them'})")
    return ", ".join(parts) + f", {todo} to run → {run_dir}"


class _LocalHooks(EvaluationHooks):
    """A local run's view of its evaluation: the live bar over the whole plan and
    ``progress.json`` (counts and a heartbeat, for ``shopsimrl status`` in another terminal)."""

    def __init__(self, store: LocalRunStore, planned: int, resume: Resume, plan_fingerprint: str, show: bool) -> None:
        self.store, self.planned, self.resume = store, planned, resume
        self.plan_fingerprint, self.show = plan_fingerprint, show
        self.bar: RunProgress | None = None
        self.progress: ProgressFile | None = None

    def started(self, evaluator: Evaluator, pending: int) -> None:
        self.bar = RunProgress(self.planned, before=self.planned - pending, enabled=self.show and sys.stderr.isatty())
        self.bar.__enter__()
        evaluator.on_trace = self.bar.on_trace
        self.progress = ProgressFile(
            self.store.progress_path,
            self.bar,
            plan_fingerprint=self.plan_fingerprint,
            completed_before=len(self.resume.completed),
        )
        self.progress.write()

    def background(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return (self._beat,)

    async def _beat(self) -> None:
        while self.progress is None:  # noqa: ASYNC110 - set by started(), on this loop
            await asyncio.sleep(0.05)
        await self.progress.beat()

    def model_inflight(self, record: dict[str, Any]) -> None:
        try:
            self.store.append_model_inflight(record)
        except RunWriteError as exc:  # a history line lost costs no episode
            log.warning("model_inflight_not_saved", error=str(exc))

    def ended(self, state: str) -> None:
        if self.progress is not None:
            self.progress.write(state)
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def summarize_local(
    store: LocalRunStore, manifest: RunManifest | None, requested_ids: list[str] | None, requested: int | None = None
) -> dict[str, Any]:
    """The summary of the run directory's winning records, written to summary.json (raises
    :class:`RunWriteError` when it cannot be written)."""
    accumulator = SummaryAccumulator(
        requested_episode_ids=set(requested_ids) if requested_ids is not None else None,
        requested=requested,
        execution=manifest.execution if manifest is not None else None,
    )
    index = store.load_index()
    for is_winner, record in store.iter_records(index):
        if is_winner:
            accumulator.add(record)
        else:
            accumulator.note_superseded_attempt(record)
    summary = accumulator.result()
    summary.setdefault("counts", {})["unreadable_lines"] = index.bad_lines
    summary["run"] = run_identity(manifest, uri=str(store.run_dir.resolve()))
    inflight = model_inflight_block(store.read_model_inflight())
    if inflight is not None:
        summary["model_inflight"] = inflight
    previous = store.read_summary()
    if previous is not None and _same_but_created_at(summary, previous):
        return previous  # nothing changed (a resume with nothing to run): the file and its created_at stay
    store.write_summary(summary)
    return summary


def _same_but_created_at(summary: dict[str, Any], previous: dict[str, Any]) -> bool:
    # Compared as JSON reads them back (tuples are lists there).
    fresh = json.loads(json.dumps({**summary, "created_at": previous.get("created_at")}, ensure_ascii=False))
    return bool(fresh == previous)
