"""SIGTERM and SIGINT during a run: the first stops it gracefully, later ones are only logged.

A stopping run still has work that must not be cut short: releasing ShopSimulator leases (they
never expire) and saving finished traces. That work is bounded by its own grace periods, so a
second Ctrl-C, or the SIGTERM a Job controller sends after the terminal's SIGINT, is logged and
ignored instead of cancelling the cleanup. kill -9 stays the way to end a process at once; the
lease journal covers that case. :func:`die_with_parent` makes a child process (a shard worker
of ``run --shards``, an event-loop process of a worker) stop when its parent dies, even by kill -9.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["STOP_SIGNALS", "GracefulStop", "die_with_parent", "hold_signals"]

log = structlog.get_logger("shopsimrl.stopping")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_held: list[int] = []
"""Signals received inside an event loop before a GracefulStop took over (see hold_signals)."""
_stopped = False
"""A graceful stop happened in this process: from then on it is on its way out."""


def _hold(signum: int, frame: object) -> None:
    _held.append(signum)


class hold_signals:
    """For the life of an event loop: a signal is recorded, never raised inside the loop.

    An event loop must not see a Python signal handler raise (uvloop logs the exception and
    carries on; the stop would be lost). Inside the block, SIGTERM/SIGINT are only recorded; a
    :class:`GracefulStop` entered in the loop acts on the recorded ones at once. On exit, after a
    graceful stop the signals stay ignored; otherwise the handlers from before come back and a
    signal no GracefulStop took is passed to them (a command with no stop handling of its own
    ends as it would have)."""

    def __enter__(self) -> hold_signals:
        self._previous = {signum: signal.signal(signum, _hold) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        pending = list(_held)
        _held.clear()
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if _stopped else handler)
        if pending and not _stopped:
            handler = self._previous[signal.Signals(pending[0])]
            if callable(handler):
                handler(pending[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(pending[0])


class GracefulStop:
    """SIGTERM/SIGINT handling on the running loop for the duration of a ``with`` block.

    The handlers are plain ``signal.signal`` handlers that hand the signal to the loop, not
    ``loop.add_signal_handler``: removing one of those sets the default action before anything
    else can be put back, and a SIGTERM in that gap (an orchestrator's, right after a Ctrl-C)
    killed the process with leases still held. Here each disposition replaces the last in one
    call, so there is no moment at which a signal ends the process."""

    def __init__(self, on_stop: Callable[[], None], *, cleanup: str) -> None:
        """``on_stop`` runs once, at the first signal; ``cleanup`` says what the process still
        does before it exits (shown when a later signal arrives)."""
        self._on_stop = on_stop
        self._cleanup = cleanup
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._arrived: list[int] = []
        """Signals the handler saw that the loop has not handled yet."""

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = signum
            log.warning(f"{name}: stopping; {self._cleanup}")
            self._on_stop()
        else:
            log.warning(f"{name} again: already stopping; {self._cleanup} (kill -9 skips that)")

    def _handle_arrived(self) -> None:
        while self._arrived:
            self._handle(self._arrived.pop(0))

    def __enter__(self) -> GracefulStop:
        loop = asyncio.get_running_loop()

        def on_signal(signum: int, _frame: object) -> None:
            # Runs between two bytecodes of whatever the loop is doing: only record the signal
            # and wake the loop, which handles it as an ordinary callback.
            self._arrived.append(signum)
            loop.call_soon_threadsafe(self._handle_arrived)

        self._previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
        while _held:  # arrived in this loop before the handlers above were installed
            self._handle(_held.pop(0))
        return self

    def __exit__(self, *exc: object) -> None:
        global _stopped
        if self.requested:
            # On its way out after a stop: a late signal must not turn the exit into a traceback.
            _stopped = True
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
            return
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        # A signal that came as the work ended, not handled yet: hold_signals passes it on.
        _held.extend(self._arrived)
        self._arrived.clear()


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a child process: receive SIGTERM when the parent process dies (Linux; elsewhere a
    no-op). ``parent`` is the parent's pid as the parent saw it before starting the child."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
