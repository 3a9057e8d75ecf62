"""Live progress of a run on the terminal: a rich bar with the running reward mean and failures.

The bar counts the whole plan: ``73 + 327 / 400`` means 73 episodes were settled by earlier
invocations and 327 by this one. Rate and ETA come from this invocation's episodes only. While
the bar is shown, log lines are printed through its console (:func:`shopsimrl.logs.live_console`).

Failed episodes, requeues and model retries are counted in the bar; each is logged as one info
line (hidden by ``-q``). Model calls refused for load (HTTP 429/503: more requests in flight
than the server takes) add one warning, then at most one a minute with the count since.

:class:`RunProgress` is fed persisted traces (a single-process run); :class:`ShardedRunProgress`
is fed the JSON log records of shard workers (a local sharded run, see :mod:`shopsimrl.runner.local_job`).
:class:`ProgressFile` keeps a local run's counts in its ``progress.json`` for ``shopsimrl status``
in another terminal.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

import structlog
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress_bar import ProgressBar
from rich.text import Text

from shopsimrl.logs import live_console, tap
from shopsimrl.records import EpisodeTrace
from shopsimrl.runner.lease_journal import ProcessIdentity

__all__ = ["LOCAL_PROGRESS_SCHEMA", "ProgressFile", "RunProgress", "ShardedRunProgress", "read_progress_file"]

log = structlog.get_logger("shopsimrl.runner.progress")


class _WholePlanBar(BarColumn):
    """The bar over the whole plan; the rich task itself counts only this invocation's episodes."""

    def render(self, task: Task) -> ProgressBar:
        return ProgressBar(
            total=max(0, task.fields["overall"]),
            completed=max(0, task.fields["before"] + task.completed),
            width=None if self.bar_width is None else max(1, self.bar_width),
            pulse=not task.started,
            animation_time=task.get_time(),
            style=self.style,
            complete_style=self.complete_style,
            finished_style=self.finished_style,
            pulse_style=self.pulse_style,
        )


class _CountColumn(ProgressColumn):
    """``done/total``, or ``before + done / total`` when earlier invocations settled some."""

    def render(self, task: Task) -> Text:
        done, before, overall = int(task.completed), task.fields["before"], task.fields["overall"]
        return Text(f"{before} + {done} / {overall}" if before else f"{done}/{overall}", style="progress.download")


OVERLOAD_STATUSES = frozenset({429, 503})
"""Model answers that say the server is oversubscribed (rate limited, overloaded)."""


class _OverloadNotice:
    """One warning when the model server starts refusing requests for load, then at most one
    every ``interval_s`` with the refusals since the last; at the end, those not yet reported."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.total = 0
        self._pending: Counter[int] = Counter()
        self._since: float | None = None

    def note(self, status: int) -> None:
        self.total += 1
        self._pending[status] += 1
        now = self.clock()
        if self._since is None or now - self._since >= self.interval_s:
            # The retry that triggers it belongs to one episode; the warning is about all of them.
            contextvars.copy_context().run(self._report, now)

    def flush(self) -> None:
        if self._pending:
            contextvars.copy_context().run(self._report, self.clock())

    def _report(self, now: float) -> None:
        structlog.contextvars.unbind_contextvars("episode_id")
        since = self._since
        statuses = ", ".join(f"HTTP {status} ×{count}" for status, count in sorted(self._pending.items()))
        fields = {"refused": sum(self._pending.values()), "statuses": statuses, "refused_total": self.total}
        if since is None:
            log.warning(
                "the model server refuses requests for load; they are retried (lower model.max_concurrent_requests "
                "or experiment.concurrency if it persists)",
                **fields,
            )
        else:
            log.warning("the model server still refuses requests for load", window_s=round(now - since, 1), **fields)
        self._pending.clear()
        self._since = now


class RunProgress:
    """Feed it every persisted trace; it shows settled/failed counts and the reward mean so far.

    ``total`` is the plan's episode count, ``before`` those an earlier invocation settled (they are
    not run again), so ``total - before`` episodes are expected from this invocation."""

    counts_own_model_calls = True
    """Count this process's model retries (its log lines, :func:`shopsimrl.logs.tap`)."""

    def __init__(
        self,
        total: int,
        *,
        before: int = 0,
        description: str = "episodes",
        enabled: bool = True,
        console: Console | None = None,
        auto_refresh: bool = True,
        overload_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``auto_refresh=False``: no redraw thread; the owner calls :meth:`tick` instead.

        Counting (and the overload warning) works with the bar hidden too (``enabled=False``)."""
        self.total = total
        self.before = before
        self.completed = 0
        self.failed = 0
        self.retries = 0
        self.model_retries = 0
        self._overload = _OverloadNotice(overload_interval_s, clock)
        self._reward_sum = 0.0
        self._scored = 0
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            _WholePlanBar(),
            _CountColumn(),
            TextColumn(
                "reward {task.fields[reward]}  failed {task.fields[failed]}  retried {task.fields[retries]}"
                "  model retries {task.fields[model_retries]}"
            ),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            disable=not enabled,
            auto_refresh=auto_refresh,
        )
        self._task = self._progress.add_task(
            description,
            total=max(0, total - before),
            overall=total,
            before=before,
            reward="-",
            failed=0,
            retries=0,
            model_retries=0,
        )
        self._stack = ExitStack()

    def __enter__(self) -> Self:
        if self.counts_own_model_calls:
            self._stack.enter_context(tap("model_request_retry", self.on_model_retry))
        if self.enabled:
            self._progress.start()
            self._stack.enter_context(live_console(self._progress.console))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._overload.flush()  # above the bar's last frame, like every other line
        finally:
            self._stack.close()
            self._progress.stop()

    def on_model_retry(self, fields: dict[str, Any]) -> None:
        """Count one model call retried (the adapter's ``model_request_retry`` line)."""
        self.model_retries += 1
        status = fields.get("status")
        if isinstance(status, int) and status in OVERLOAD_STATUSES:
            self._overload.note(status)
        self._progress.update(self._task, model_retries=self.model_retries)

    def tick(self) -> None:
        """Redraw (the clock columns move even when no episode finishes)."""
        self._progress.refresh()

    def on_trace(self, record: EpisodeTrace, will_retry: bool = False) -> None:
        """Count a persisted attempt; at debug level also log it (the line a shard worker logs)."""
        reward = record.final.reward if record.final is not None else None
        log.debug(
            "episode_finished",
            episode_id=record.episode_id,
            status=record.status,
            reward=reward,
            failure_class=record.failure_class,
            will_retry=will_retry,
        )
        if record.status == "completed":
            self.completed += 1
            if reward is not None:
                self._reward_sum += reward
                self._scored += 1
            advance = 1
        elif will_retry:
            self.retries += 1
            advance = 0
        else:
            self.failed += 1
            advance = 1
        self._progress.update(self._task, advance=advance, reward=self._mean(), failed=self.failed, retries=self.retries)

    def reward_mean(self) -> float | None:
        """The mean reward of this invocation's scored episodes so far."""
        return self._reward_sum / self._scored if self._scored else None

    def _mean(self) -> str:
        mean = self.reward_mean()
        return "-" if mean is None else f"{mean:.3f}"


@dataclass
class _ShardState:
    """One shard as its workers' log lines describe it (a restarted worker starts a new process view)."""

    jobs: int
    before: int | None = None
    """Episodes settled when the first worker of this invocation started; None until it says."""
    settled_at_start: int = 0
    """Episodes settled when the current worker process started."""
    completed: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    def start(self, settled: int) -> None:
        if self.before is None:
            self.before = settled
        self.settled_at_start = settled
        # What the previous process finished is in ``settled`` if it was saved; if not, it runs again.
        self.completed.clear()
        self.failed.clear()

    @property
    def done(self) -> int:
        """Episodes settled by this invocation so far."""
        if self.before is None:
            return len(self.completed) + len(self.failed)
        return max(0, self.settled_at_start - self.before + len(self.completed) + len(self.failed))


class ShardedRunProgress(RunProgress):
    """The aggregated bar of a local sharded run, fed the workers' JSON log records.

    A worker says how far its shard already is when it starts (``shard_resumed`` with
    ``completed``, ``shard_already_committed``, ``shard_committed_with_failures``) and logs
    ``episode_finished`` (status, reward, will_retry) for every attempt it saves, and
    ``model_request_retry`` for every model call it retries."""

    # The workers' retries arrive as their records; relayed, they are this process's lines too.
    counts_own_model_calls = False

    def __init__(self, jobs_per_shard: list[int], *, enabled: bool = True, console: Console | None = None) -> None:
        # Redrawn by the coordinator's loop (tick), not by a thread of its own: see sharded.local_job._WorkerOutput.
        super().__init__(sum(jobs_per_shard), enabled=enabled, console=console, auto_refresh=False)
        self._shards = [_ShardState(jobs) for jobs in jobs_per_shard]
        self._rewards: dict[str, float] = {}

    def on_worker_event(self, shard: int, record: dict[str, Any]) -> None:
        if not 0 <= shard < len(self._shards):
            return
        state = self._shards[shard]
        event = record.get("event")
        if event == "shard_resumed" and isinstance(record.get("completed"), int):
            state.start(record["completed"])
        elif event == "shard_already_committed":
            state.start(state.jobs)
        elif event == "shard_committed_with_failures":
            state.start(state.jobs)  # its failures are final: --no-retry-failed
        elif event == "episode_finished":
            self._on_episode(state, record)
        elif event == "model_request_retry":
            self.on_model_retry(record)
            return
        else:
            return
        self._refresh()

    def _on_episode(self, state: _ShardState, record: dict[str, Any]) -> None:
        episode_id = str(record.get("episode_id"))
        if record.get("status") == "completed":
            state.completed.add(episode_id)
            state.failed.discard(episode_id)
            reward = record.get("reward")
            if isinstance(reward, (int, float)) and not isinstance(reward, bool):
                self._rewards[episode_id] = float(reward)
        elif record.get("will_retry"):
            self.retries += 1
        else:
            state.failed.add(episode_id)

    def _refresh(self) -> None:
        self.before = sum(state.before or 0 for state in self._shards)
        self.completed = sum(len(state.completed) for state in self._shards)
        self.failed = sum(len(state.failed) for state in self._shards)
        done = sum(state.done for state in self._shards)
        mean = f"{sum(self._rewards.values()) / len(self._rewards):.3f}" if self._rewards else "-"
        self._progress.update(
            self._task,
            total=max(0, self.total - self.before),
            completed=done,
            before=self.before,
            reward=mean,
            failed=self.failed,
            retries=self.retries,
        )


LOCAL_PROGRESS_SCHEMA = "shopsimrl-local-progress-v1"


def _now() -> str:
    return datetime.now(UTC).isoformat()


class ProgressFile:
    """A local run's ``progress.json``: the counts of :class:`RunProgress`, the process and a
    heartbeat, for ``shopsimrl status`` in another terminal (it takes no lock and reads no trace).

    Rewritten whole (a temporary file renamed over it) when the run starts, every
    ``heartbeat_seconds`` while it runs and once more with its final state (``finished``,
    ``interrupted``, ``stopped``). Advisory: no fsync, and a write that fails is logged once and
    tried again at the next beat; the run goes on."""

    def __init__(
        self,
        path: Path,
        bar: RunProgress,
        *,
        plan_fingerprint: str,
        completed_before: int,
        heartbeat_seconds: float = 2.0,
    ) -> None:
        self.path = Path(path)
        self.bar = bar
        self.heartbeat_seconds = heartbeat_seconds
        self._fixed = {
            "schema_version": LOCAL_PROGRESS_SCHEMA,
            "plan_fingerprint": plan_fingerprint,
            "process": ProcessIdentity.current().to_dict(),
            "started_at": _now(),
            "heartbeat_seconds": heartbeat_seconds,
            "jobs": bar.total,
            "settled_before": bar.before,
            "completed_before": completed_before,
        }
        self._warned = False
        self._final: str | None = None
        """The final state once written: no beat says ``running`` after it (an eval set's member
        that finished while the others still run keeps its heartbeat task until the set ends)."""

    def document(self, state: str) -> dict[str, Any]:
        bar = self.bar
        return {
            **self._fixed,
            "state": state,
            "updated_at": _now(),
            "completed": bar.completed,
            "failed": bar.failed,
            "requeued": bar.retries,
            "model_retries": bar.model_retries,
            "reward_mean": bar.reward_mean(),
        }

    def write(self, state: str = "running") -> None:
        if state == "running" and self._final is not None:
            return
        if state != "running":
            self._final = state
        data = (json.dumps(self.document(state), ensure_ascii=False, indent=2) + "\n").encode("utf-8")
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if not self._warned:
                self._warned = True
                log.warning("progress_not_written", path=str(self.path), error=f"{type(exc).__name__}: {exc}")

    async def beat(self) -> None:
        """Rewrite the file every ``heartbeat_seconds``, until cancelled or the final state is written."""
        while self._final is None:
            await asyncio.sleep(self.heartbeat_seconds)
            await asyncio.to_thread(self.write)


def read_progress_file(path: Path) -> dict[str, Any] | None:
    """A ``progress.json`` as :class:`ProgressFile` writes it; None when absent or unreadable."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict) or value.get("schema_version") != LOCAL_PROGRESS_SCHEMA:
        return None
    return value
