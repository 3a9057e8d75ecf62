"""The one retry loop of every remote call: model adapter, environment adapter, object store.

A call is a function of its :class:`Attempt` (the attempt number, when it started), run until
it returns, raises an error that ``retryable`` refuses (raised as it is), or runs out of
attempts or of the wall-clock budget: then the last error is raised as it is, or translated by
``exhausted`` (the model adapter's ``ModelRequestError``, the store's ``StoreUnavailableError``).
Between attempts ``on_retry`` sees the failed attempt with its error and the delay about to be
slept (the model adapter records ``backoff_ms`` in the trace's per-attempt records there, and
each caller logs its own line).

The delay before attempt *n + 1* is ``base_delay_s · 2^(n - 1)``, capped at ``max_delay_s``,
with the :class:`Backoff`'s jitter; a ``retry_after`` the server asked for replaces it (capped).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

__all__ = ["Attempt", "Backoff", "Jitter", "retry_async", "retry_sync"]

T = TypeVar("T")

Jitter = Literal["none", "additive", "proportional"]


@dataclass(frozen=True)
class Backoff:
    """How often and how patiently to retry."""

    attempts: int = 3
    """Total attempts, the first included."""
    base_delay_s: float = 1.0
    max_delay_s: float = math.inf
    budget_s: float = math.inf
    """Seconds one call may take, sleeps included: a retry that would end past it is not made."""
    jitter: Jitter = "none"
    """``additive``: plus U(0, min(step, 1 s)), as the earlier implementation's model client;
    ``proportional``: times U(0.5, 1), so that writers hitting one store spread out."""

    def delay(self, failures: int, retry_after: float | None = None) -> float:
        """Seconds to wait after ``failures`` failed attempts (``retry_after``: the server's wish)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_delay_s)
        step = self.base_delay_s * 2.0 ** (failures - 1)
        if self.jitter == "additive":
            return min(step, self.max_delay_s) + random.random() * min(step, 1.0)
        if self.jitter == "proportional":
            return min(step, self.max_delay_s) * (0.5 + random.random() / 2)
        return min(step, self.max_delay_s)


@dataclass
class Attempt:
    number: int
    """1 for the first attempt."""
    started: float
    """``time.perf_counter()`` when it started."""
    error: BaseException | None = None
    """Why it failed (set before ``on_retry`` and ``exhausted`` see it)."""
    delay_s: float = 0.0
    """The wait after it, before the next attempt (0 for the last)."""


Retryable = Callable[[BaseException], bool]
RetryAfter = Callable[[BaseException], "float | None"]
OnRetry = Callable[[Attempt], None]
Exhausted = Callable[[Attempt, float], BaseException]
"""(the last attempt, seconds spent) → the error to raise instead of the last one."""


def _next_delay(
    backoff: Backoff, attempt: Attempt, exc: BaseException, retryable: Retryable, retry_after: RetryAfter | None, elapsed: float
) -> float | None:
    """The delay before another attempt, or None when the error is to be raised."""
    attempt.error = exc
    if not retryable(exc):
        return None
    if attempt.number >= backoff.attempts:
        return None
    delay = backoff.delay(attempt.number, retry_after(exc) if retry_after is not None else None)
    if elapsed + delay > backoff.budget_s:
        return None
    return delay


def _give_up(attempt: Attempt, exc: BaseException, retryable: Retryable, exhausted: Exhausted | None, elapsed: float) -> None:
    """Raise the translated error when retries ran out; return to let the caller re-raise ``exc``.

    The translated error shows only the cause its callback set (``__cause__``), none by default:
    the last error's text may hold what the caller redacts (a model server's echo of a key)."""
    if exhausted is not None and retryable(exc):
        error = exhausted(attempt, elapsed)
        raise error from error.__cause__


async def retry_async(
    call: Callable[[Attempt], Awaitable[T]],
    backoff: Backoff,
    *,
    retryable: Retryable,
    retry_after: RetryAfter | None = None,
    on_retry: OnRetry | None = None,
    exhausted: Exhausted | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> T:
    started = time.monotonic()
    number = 0
    while True:
        number += 1
        attempt = Attempt(number, time.perf_counter())
        try:
            return await call(attempt)
        except Exception as exc:
            elapsed = time.monotonic() - started
            delay = _next_delay(backoff, attempt, exc, retryable, retry_after, elapsed)
            if delay is None:
                _give_up(attempt, exc, retryable, exhausted, elapsed)
                raise
        attempt.delay_s = delay
        if on_retry is not None:
            on_retry(attempt)
        await sleep(delay)


def retry_sync(
    call: Callable[[Attempt], T],
    backoff: Backoff,
    *,
    retryable: Retryable,
    retry_after: RetryAfter | None = None,
    on_retry: OnRetry | None = None,
    exhausted: Exhausted | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    started = time.monotonic()
    number = 0
    while True:
        number += 1
        attempt = Attempt(number, time.perf_counter())
        try:
            return call(attempt)
        except Exception as exc:
            elapsed = time.monotonic() - started
            delay = _next_delay(backoff, attempt, exc, retryable, retry_after, elapsed)
            if delay is None:
                _give_up(attempt, exc, retryable, exhausted, elapsed)
                raise
        attempt.delay_s = delay
        if on_retry is not None:
            on_retry(attempt)
        sleep(delay)
