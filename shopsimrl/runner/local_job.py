"""Local emulation of an Indexed Job for `run --shards N`: N ``shopsimrl worker`` processes, then ``reduce``.

It behaves like the Kubernetes Indexed Job controller on one machine, so a local sharded run
exercises exactly the code path of the pods: each index runs ``shopsimrl worker`` with
``JOB_COMPLETION_INDEX`` set; an index whose process exits with anything but 0, 2 or 42 is
restarted after a short backoff, up to ``backoff_limit_per_index`` times — exit 1 (some
episodes failed) included, so a restart gives those episodes fresh attempts, as the Job's
per-index retries do; 2 (bad input) and 42 (fingerprint mismatch) fail the index at once, as
the chart's ``podFailurePolicy`` ``FailIndex`` rule does. When every index has finished, the
run is reduced.

Stopping: SIGTERM/SIGINT are passed on to every worker as SIGTERM, and the coordinator waits for
them to save their traces and release their leases (each bounds that by its own grace period).
On Linux each worker also gets SIGTERM if the coordinator itself dies (even by kill -9), so no
worker outlives it holding leases. Workers start with SIGTERM and SIGINT blocked until
``shopsimrl``'s entry point has its handler (a worker command must be ``python -m shopsimrl …``
or the ``shopsimrl`` script, which unblock them).

Workers' output: each worker logs JSON lines (``SHOPSIMRL_LOG_FORMAT=json``) to a pipe that the
coordinator's loop drains. Every record is handed to ``on_event`` (the progress bar
learns from ``shard_resumed`` and ``episode_finished``) and logged again by the coordinator at the
record's level, so it reaches the user through the coordinator's own log set-up (console or JSON,
``-q``/``-v``, the progress bar's console); the per-episode records are relayed at debug level.
Anything a worker writes that is not a JSON record (a traceback, an ``error:`` line) is passed
on as it is, prefixed with the shard. The slot sizing warning, which every worker gives word for
word about the whole run (processes × concurrency against the shop's slots), is relayed once,
the repeats at debug. Workers log at info
(debug when the coordinator does), so progress is learned whatever level the user chose. Each worker also gets a copy of the
coordinator's stderr (``SHOPSIMRL_LOG_FALLBACK_FD``): if the coordinator dies and the pipe closes, the
worker writes there from then on, so its last lines (stopping, releasing leases) still show.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from shopsimrl import logs
from shopsimrl.exitcodes import ExitCode
from shopsimrl.stopping import die_with_parent

__all__ = ["IndexOutcome", "ShardedRunResult", "run_indexed"]

log = structlog.get_logger("shopsimrl.runner.local_job")

_FINAL_CODES = {int(ExitCode.OK), int(ExitCode.BAD_INPUT), int(ExitCode.FINGERPRINT_MISMATCH)}
_REPORTED_CODES = _FINAL_CODES | {int(ExitCode.EPISODES_FAILED)}

# One line per episode attempt or per part: the progress bar stands for them at the default level.
_RELAYED_AT_DEBUG = {"episode_finished", "part_written"}
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
# How long a finished worker's last lines may take to arrive before its outcome is logged.
_DRAIN_S = 5.0

WorkerEventListener = Callable[[int, dict[str, Any]], None]


@dataclass
class IndexOutcome:
    index: int
    exit_code: int | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)


@dataclass
class ShardedRunResult:
    indexes: list[IndexOutcome]
    interrupted: bool = False

    @property
    def exit_code(self) -> ExitCode:
        """The most severe outcome: 42, then 2, then 3 (crashed past the limit or interrupted), then 1."""
        codes = {o.exit_code for o in self.indexes}
        if int(ExitCode.FINGERPRINT_MISMATCH) in codes:
            return ExitCode.FINGERPRINT_MISMATCH
        if int(ExitCode.BAD_INPUT) in codes:
            return ExitCode.BAD_INPUT
        if self.interrupted or any(code not in _REPORTED_CODES for code in codes):
            return ExitCode.RETRYABLE
        if int(ExitCode.EPISODES_FAILED) in codes:
            return ExitCode.EPISODES_FAILED
        return ExitCode.OK


def _worker_command(
    run: str,
    config: Path,
    shards: int,
    final_test: bool,
    retry_failed: bool,
    reroll_failed: bool = False,
    settings: Sequence[str] = (),
) -> list[str]:
    command = [sys.executable, "-m", "shopsimrl", "worker", "--run", run, "--config", str(config), "--shards", str(shards)]
    for setting in settings:
        command += ["--set", setting]
    if final_test:
        command.append("--final-test")
    if not retry_failed:
        command.append("--no-retry-failed")
    if reroll_failed:
        command.append("--reroll-failed")
    return command


def _worker_preexec() -> Callable[[], None]:
    """A ``preexec_fn`` for the workers: SIGTERM and SIGINT blocked, and (Linux) SIGTERM when
    this process dies (see ``stopping.die_with_parent``).

    Blocked, not ignored: a Ctrl-C reaches every process of the terminal's group, a worker
    still starting its interpreter included, where Python would raise KeyboardInterrupt from
    the middle of an import and print its traceback. Blocked, the signal waits until
    ``shopsimrl``'s entry point has its handler and unblocks them; the worker then exits 3."""
    parent = os.getpid()

    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        if sys.platform.startswith("linux"):
            die_with_parent(parent)

    return preexec


def _parse_record(line: str) -> dict[str, Any] | None:
    """A worker's JSON log record, or None for any other line."""
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("event"), str) else None


_SHARD_FIELDS = frozenset({"shard", "writer", "pid", "run"})
"""What tells one worker's record from another's; the rest is what a warning says."""


_ABOUT_THE_WHOLE_RUN = ("episodes in flight, but ShopSimulator has",)
"""Warnings a worker gives about every process of the run (``SlotUsage.sizing_warning``): the
same from each shard. Others, identical or not (``SIGTERM: stopping``), are each worker's own."""


class _WarnedOnce:
    """The run-wide warnings relayed so far, by what they say, and the shard that said it first."""

    def __init__(self) -> None:
        self._first: dict[str, int] = {}

    def repeats(self, index: int, event: str, record: dict[str, Any]) -> bool:
        if not any(marker in event for marker in _ABOUT_THE_WHOLE_RUN):
            return False
        said = json.dumps([event, {k: v for k, v in record.items() if k not in _SHARD_FIELDS}], sort_keys=True, default=str)
        return self._first.setdefault(said, index) != index


def _relay(index: int, line: str, on_event: WorkerEventListener | None, warned: _WarnedOnce | None = None) -> None:
    record = _parse_record(line)
    if record is None:
        if logs.log_format() == "json":
            log.warning("worker_output", shard=index, line=line)
        else:
            logs.print_line(f"shard {index} | {line}")
        return
    if on_event is not None:
        on_event(index, dict(record))
    event = record.pop("event")
    name = str(record.pop("level", "info")).lower()
    record.pop("timestamp", None)  # the relayed line is stamped again, a pipe's latency later
    level = logging.DEBUG if event in _RELAYED_AT_DEBUG else _LEVELS.get(name, logging.INFO)
    if level == logging.WARNING and warned is not None and warned.repeats(index, event, record):
        level = logging.DEBUG
    record.setdefault("shard", index)
    log.log(level, event, **record)


class _WorkerOutput:
    """One worker's stderr pipe, read without blocking by the coordinator's own loop.

    No reader threads: on Linux a child's parent-death signal (``die_with_parent``) is sent
    each time the thread that started it, or a thread it was handed to, exits. With threads a
    kill -9 of the coordinator would signal the workers while the pipe is still open, and the
    line a worker logs on stopping would be lost in it."""

    def __init__(
        self, index: int, stream: IO[bytes], on_event: WorkerEventListener | None, warned: _WarnedOnce | None = None
    ) -> None:
        self.index = index
        self.stream = stream
        self.on_event = on_event
        self.warned = warned
        self.open = True
        self._partial = b""
        os.set_blocking(stream.fileno(), False)

    def fileno(self) -> int:
        return self.stream.fileno()

    def pump(self) -> None:
        """Relay every whole line there is now; at the end of the stream also the last partial one."""
        while self.open:
            try:
                data = os.read(self.stream.fileno(), 65536)
            except BlockingIOError:
                return
            if not data:
                self.open = False
                self.stream.close()
                data, self._partial = self._partial + b"\n", b""
            *lines, self._partial = (self._partial + data).split(b"\n")
            for raw in lines:
                self._relay(raw.decode("utf-8", errors="replace").rstrip("\r"))

    def _relay(self, line: str) -> None:
        if not line:
            return
        try:
            _relay(self.index, line, self.on_event, self.warned)
        except Exception as exc:  # one bad record must not stop the relay: the pipe would fill
            log.error("worker_output_unreadable", shard=self.index, error=f"{type(exc).__name__}: {exc}", line=line[:300])


def _pump(outputs: list[_WorkerOutput], timeout: float) -> None:
    """Wait up to ``timeout`` for worker output and relay it."""
    live = [output for output in outputs if output.open]
    if not live:
        time.sleep(timeout)
        return
    ready, _, _ = select.select(live, [], [], timeout)
    for output in ready:
        output.pump()


def _drain(output: _WorkerOutput, timeout: float) -> None:
    """Relay a finished worker's last lines (a traceback) until its pipe closes or ``timeout``."""
    deadline = time.monotonic() + timeout
    while output.open and time.monotonic() < deadline:
        _pump([output], max(0.0, deadline - time.monotonic()))
    if output.open:  # a process the worker left behind holds the pipe: stop reading it
        output.open = False
        output.stream.close()


def _ignore_stop_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def run_indexed(
    run: str,
    config: Path,
    shards: int,
    *,
    parallelism: int | None = None,
    backoff_limit_per_index: int = 2,
    restart_backoff_s: float = 1.0,
    final_test: bool = False,
    retry_failed: bool = True,
    reroll_failed: bool = False,
    env: dict[str, str] | None = None,
    poll_interval_s: float = 0.1,
    stop_timeout_s: float = 120.0,
    on_event: WorkerEventListener | None = None,
    on_tick: Callable[[], None] | None = None,
    command: list[str] | None = None,
    settings: Sequence[str] = (),
) -> ShardedRunResult:
    """Run indexes 0…shards-1 as worker processes, at most ``parallelism`` at once.

    ``command``: another worker command line (the judge stage's workers); default ``shopsimrl
    worker`` for ``run`` and ``config``, each with a ``--set`` for every ``KEY=VALUE`` of ``settings``
    (the coordinator's command-line overrides: the workers must plan what it froze).

    ``on_event(index, record)`` receives every JSON log record of the workers; ``on_tick()`` is
    called about every ``poll_interval_s`` (a progress bar redraws its clock)."""
    parallelism = max(1, min(parallelism or shards, shards))
    worker_level = "debug" if logs.level() == "debug" else "info"
    # Where a worker logs if this process dies and its pipe closes: this process's own stderr.
    fallback_fd = os.dup(2)
    base_env = {
        **os.environ,
        **(env or {}),
        "SHOPSIMRL_LOG_FORMAT": "json",
        "SHOPSIMRL_LOG_LEVEL": worker_level,
        "SHOPSIMRL_LOG_FALLBACK_FD": str(fallback_fd),
    }
    outcomes = [IndexOutcome(i) for i in range(shards)]
    waiting = list(range(shards))  # indexes not yet started (or due for a restart)
    not_before: dict[int, float] = {}
    running: dict[int, subprocess.Popen[bytes]] = {}
    outputs: dict[int, _WorkerOutput] = {}
    warned = _WarnedOnce()
    interrupted = False

    def wait(timeout: float) -> None:
        _pump(list(outputs.values()), timeout)
        if on_tick is not None:
            on_tick()

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal interrupted
        if interrupted:  # the workers are stopping already; they ignore further signals too
            log.warning("already_stopping", signal=signal.Signals(signum).name)
            return
        interrupted = True
        for process in running.values():  # every worker flushes its parts and exits 3
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    preexec = _worker_preexec()
    try:
        while waiting or running:
            now = time.monotonic()
            while not interrupted and len(running) < parallelism:
                ready = [i for i in waiting if not_before.get(i, 0.0) <= now]
                if not ready:
                    break
                index = ready[0]
                waiting.remove(index)
                running[index] = process = subprocess.Popen(
                    # A re-roll is asked for once: a restarted index must not re-roll its re-rolls.
                    command
                    or _worker_command(
                        run,
                        config,
                        shards,
                        final_test,
                        retry_failed,
                        reroll_failed and not outcomes[index].restarts,
                        settings,
                    ),
                    env={**base_env, "JOB_COMPLETION_INDEX": str(index), "SHOPSIMRL_PARALLELISM": str(parallelism)},
                    stdin=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    pass_fds=(fallback_fd,),
                    preexec_fn=preexec,
                )
                assert process.stderr is not None
                outputs[index] = _WorkerOutput(index, process.stderr, on_event, warned)
                # The signal came while Popen ran: on_signal did not see this one. (mypy keeps
                # `interrupted` narrowed to False by the loop's test; on_signal sets it meanwhile.)
                if interrupted:
                    process.send_signal(signal.SIGTERM)  # type: ignore[unreachable]
                log.info("index_started", index=index, pid=process.pid, restarts=outcomes[index].restarts)
            if interrupted and not running:
                break
            for index, process in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                del running[index]
                _drain(outputs.pop(index), _DRAIN_S)  # its last lines (a traceback) before its outcome
                outcome = outcomes[index]
                outcome.exit_codes.append(code)
                outcome.exit_code = code
                # Without --retry-failed a restart would find the same failures and exit 1 again.
                if code in _FINAL_CODES or interrupted or (code == int(ExitCode.EPISODES_FAILED) and not retry_failed):
                    log.info("index_finished", index=index, exit_code=code)
                elif outcome.restarts < backoff_limit_per_index:
                    outcome.restarts += 1
                    not_before[index] = time.monotonic() + restart_backoff_s * 2 ** (outcome.restarts - 1)
                    waiting.append(index)
                    log.warning("index_restarting", index=index, exit_code=code, restart=outcome.restarts)
                else:
                    log.error("index_failed", index=index, exit_code=code, restarts=outcome.restarts)
            wait(poll_interval_s)
    finally:
        # Once stopping, later signals stay logged and ignored until the process exits: restoring
        # the default action here would let a second SIGTERM kill the coordinator (exit -15)
        # while it reports the interruption.
        if not interrupted:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        for process in running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + stop_timeout_s
        while any(process.poll() is None for process in running.values()) and time.monotonic() < deadline:
            wait(min(poll_interval_s, max(0.0, deadline - time.monotonic())))  # relaying what they log while they stop
        for process in running.values():
            if process.poll() is None:
                log.error("worker_killed", pid=process.pid, after_s=stop_timeout_s)
                process.kill()
                process.wait()
        for output in outputs.values():
            _drain(output, _DRAIN_S)
        os.close(fallback_fd)
        if interrupted:
            # Python resets handlers written in Python to the default action while it shuts down,
            # so a second SIGTERM in that window would still kill the coordinator (exit -15). Until
            # then on_signal logs it; from the exit on it is ignored (an ignored signal stays so).
            atexit.register(_ignore_stop_signals)
    return ShardedRunResult(outcomes, interrupted)
