"""An adaptive limit on the requests one process has in flight at one model server.

A configured concurrency C is a ceiling, not a target: a server that cannot take C requests at
once answers 429/503 or stops answering within the read timeout, and every such request is sent
again later. :class:`AdaptiveLimit` starts below C and moves like TCP's congestion window:

- **start** at ``min(32, C)``;
- **grow** after a clean round (as many successful requests as the limit, none overloaded):
  double until the first overload, then one more per clean round;
- **cut** to half (never below 1) on an overload signal (HTTP 429, 503, a read or write
  timeout), at most once per round: a signal from a request sent before the last cut says
  nothing about the new limit;
- **plateau**: after a cut, growth stops one below the level that overloaded; after
  :data:`PROBE_ROUNDS` clean rounds there it may try that level again;
- **Retry-After**: a server that asks for a pause gets it (new requests wait, at most
  :data:`MAX_HOLD_S`), on top of the retry's own wait.

Every change is kept (bounded) for the run's summary (``model_inflight``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "MAX_CHANGES",
    "MAX_HOLD_S",
    "MAX_INVOCATIONS",
    "PROBE_ROUNDS",
    "START_LIMIT",
    "AdaptiveLimit",
    "Permit",
    "model_inflight_block",
]

START_LIMIT: Final = 32
MAX_HOLD_S: Final = 30.0
"""The longest pause a Retry-After imposes on new requests."""
PROBE_ROUNDS: Final = 8
"""Clean rounds at the plateau before the limit tries the level that overloaded again."""
MAX_CHANGES: Final = 200
"""Changes kept for the summary; past it the oldest are dropped (and counted)."""

Signal = Literal["ok", "overload", "other"]


@dataclass(frozen=True)
class Permit:
    """One request's place in flight; ``generation`` is the number of cuts when it was granted."""

    generation: int


class AdaptiveLimit:
    """Requests in flight at one model server, the limit adapting to overload (module docstring)."""

    def __init__(
        self,
        maximum: int,
        *,
        start: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_hold_s: float = MAX_HOLD_S,
    ) -> None:
        if maximum < 1:
            raise ValueError(f"maximum must be at least 1, got {maximum}")
        self.maximum = maximum
        self.start = min(maximum, start if start is not None else START_LIMIT)
        self.limit = self.start
        self._clock = clock
        self._began = clock()
        self._max_hold_s = max_hold_s
        self._in_flight = 0
        self._generation = 0
        self._clean = 0
        self._ceiling: int | None = None
        self._plateau_rounds = 0
        self._hold_until = 0.0
        self._changed = asyncio.Event()
        self.lowest = self.start
        self.highest = self.start
        self.cuts = 0
        self.signals = {"429": 0, "503": 0, "timeout": 0}
        self.held_s = 0.0
        self.holds = 0
        self.requests = 0
        self.changes: list[dict[str, Any]] = []
        self.dropped_changes = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def acquire(self) -> Permit:
        """Wait for a place under the limit and past any Retry-After pause."""
        while True:
            now = self._clock()
            if now < self._hold_until:
                await asyncio.sleep(self._hold_until - now)
                continue
            if self._in_flight < self.limit:
                self._in_flight += 1
                self.requests += 1
                return Permit(self._generation)
            self._changed.clear()
            await self._changed.wait()

    def release(self, permit: Permit, signal: Signal, *, status: int | None = None, retry_after: float | None = None) -> None:
        """The request of ``permit`` ended: ``ok`` (an answer), ``overload`` (429, 503, a timeout;
        ``status`` None for a timeout) or ``other`` (any other failure: no news about load)."""
        self._in_flight -= 1
        if signal == "overload":
            key = "timeout" if status is None else str(status)
            self.signals[key] = self.signals.get(key, 0) + 1
            if retry_after is not None and retry_after > 0:
                hold = min(retry_after, self._max_hold_s)
                until = self._clock() + hold
                if until > self._hold_until:
                    self._hold_until = until
                    self.holds += 1
                    self.held_s += hold
            if permit.generation == self._generation:
                self._cut("429" if status == 429 else "503" if status == 503 else "timeout")
        elif signal == "ok":
            self._clean += 1
            if self._clean >= self.limit:
                self._clean = 0
                self._grow()
        self._changed.set()

    def _cut(self, reason: str) -> None:
        self._ceiling = self.limit
        self._plateau_rounds = 0
        self._generation += 1
        self._clean = 0
        self.cuts += 1
        self._set(max(1, self.limit // 2), f"cut ({reason})")

    def _grow(self) -> None:
        if self.limit >= self.maximum:
            return
        if self._ceiling is None:
            self._set(min(self.maximum, self.limit * 2), "grow (clean round)")
        elif self.limit + 1 < self._ceiling:
            self._set(self.limit + 1, "grow (clean round)")
        else:
            self._plateau_rounds += 1
            if self._plateau_rounds >= PROBE_ROUNDS:
                self._plateau_rounds = 0
                self._ceiling = min(self.maximum, self._ceiling) + 1
                self._set(min(self.maximum, self.limit + 1), "probe (clean rounds at the plateau)")

    def _set(self, limit: int, reason: str) -> None:
        if limit == self.limit:
            return
        self.limit = limit
        self.lowest = min(self.lowest, limit)
        self.highest = max(self.highest, limit)
        self.changes.append({"t_s": round(self._clock() - self._began, 3), "limit": limit, "reason": reason})
        if len(self.changes) > MAX_CHANGES:
            del self.changes[0]
            self.dropped_changes += 1

    def snapshot(self) -> dict[str, Any]:
        """The summary's record of this limit."""
        return {
            "requests": self.requests,
            "configured": self.maximum,
            "start": self.start,
            "final": self.limit,
            "lowest": self.lowest,
            "highest": self.highest,
            "cuts": self.cuts,
            "signals": dict(self.signals),
            "retry_after_holds": self.holds,
            "retry_after_held_s": round(self.held_s, 3),
            "changes": list(self.changes),
            "changes_dropped": self.dropped_changes,
        }


MAX_INVOCATIONS: Final = 20
"""Invocations whose full history the summary keeps (the newest); the totals cover all."""


def model_inflight_block(invocations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The summary's ``model_inflight``: totals over the run's invocations and the newest ones'
    records as :meth:`AdaptiveLimit.snapshot` wrote them; None for a run without any."""
    if not invocations:
        return None
    signals: dict[str, int] = {}
    for record in invocations:
        for key, count in (record.get("signals") or {}).items():
            if isinstance(count, int):
                signals[key] = signals.get(key, 0) + count

    def numbers(key: str) -> list[int]:
        return [r[key] for r in invocations if isinstance(r.get(key), int) and not isinstance(r.get(key), bool)]

    last = invocations[-1]
    return {
        "invocations": len(invocations),
        "configured": last.get("configured"),
        "final": last.get("final"),
        "lowest": min(numbers("lowest"), default=None),
        "highest": max(numbers("highest"), default=None),
        "cuts": sum(numbers("cuts")),
        "signals": signals,
        "history": invocations[-MAX_INVOCATIONS:],
    }
