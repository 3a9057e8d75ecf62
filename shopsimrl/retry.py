"""The one retry loop of every remote call: model adapter, environment adapter, object store.

A call is a function of its :class:`Attempt` (the attempt number, when it started), run until
it returns, raises an error that ``retryable`` refuses (raised as it is), or runs out of
attempts or of the wall-clock budget: then the last error is raised as it is, or translated by
``exhausted`` (the model adapter's ``ModelRequestError``, the store's ``StoreUnavailableError``).
Between attempts ``on_retry`` sees the failed attempt with its error and the delay about to be
slept (the model adapter records ``backoff_ms`` in the trace's per-attempt records there, and
each caller logs its own line). Only an :class:`Exception` is ever retried: a cancellation
(``asyncio.CancelledError``), ``KeyboardInterrupt`` or ``SystemExit`` leaves the loop at once,
during a call or a wait, without ``retryable``, ``on_retry`` or ``exhausted`` seeing it.

The delay before attempt *n + 1* is ``base_delay_s · 2^(n - 1)``, capped at ``max_delay_s``,
with the :class:`Backoff`'s jitter; a ``retry_after`` the server asked for replaces it (capped).
Neither is asked for after the last attempt, nor after a refused error (no jitter is drawn).
The budget counts from the first attempt, calls and waits included; a retry whose wait would
end past it is not begun (its wait is not slept), and the last error is raised then.

The loop itself is tenacity's (``Retrying``, ``AsyncRetrying``): from the first failure on it
runs the attempts, the waits and the hooks. The first attempt is made before it is set up:
setting it up costs 12 µs of CPU (sync) to 22 µs (async) per call, where an attempt that
succeeds costs 0.4 µs, and the runner makes about 2.4 calls per episode step, nearly all
succeeding at once (``bench/retry_overhead.py``, docs/benchmarks.md). The project's rules are
its strategies, written here because tenacity's own differ from ours in ways callers would see:

- the wait: tenacity's ``wait_exponential`` has no "the server's Retry-After replaces it" and
  its jitter modes are not ours (``additive`` is the earlier implementation's model client's,
  kept so that the backoffs recorded in traces stay comparable);
- the budget: tenacity's ``stop_before_delay`` stops when the wait would end *at or* past the
  budget, ours only past it, and tenacity's clock starts when it is set up, ours at the first
  attempt;
- giving up: ``exhausted``'s error is raised with only the cause it names (the last error's
  text may hold what the caller redacts), where tenacity would raise its ``RetryError`` or
  re-raise the last error;
- attempts are numbered here and handed to the call as an :class:`Attempt`, which tenacity's
  ``__call__`` does not do.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, NoReturn, TypeVar

from tenacity import AsyncRetrying, RetryCallState, Retrying

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


class _Rules:
    """One retried call's state and the project's rules, as tenacity's strategies and hooks.

    tenacity takes over at the first failure: its first "attempt" re-raises that failure (the
    ``replay``), so that it decides the first wait as it decides the others. (With no failure
    and ``first`` numbered 0, tenacity makes every attempt: ``bench/retry_overhead.py``.)"""

    __slots__ = ("attempt", "backoff", "exhausted", "on_retry", "replay", "retry_after", "retryable", "started")

    def __init__(
        self,
        started: float,
        first: Attempt,
        failure: Exception | None,
        backoff: Backoff,
        retryable: Retryable,
        retry_after: RetryAfter | None,
        on_retry: OnRetry | None,
        exhausted: Exhausted | None,
    ) -> None:
        self.started = started
        self.attempt = first
        self.replay: Exception | None = failure
        self.backoff = backoff
        self.retryable = retryable
        self.retry_after = retry_after
        self.on_retry = on_retry
        self.exhausted = exhausted

    def next_attempt(self) -> Attempt:
        """The attempt to make now; raises the first failure again if tenacity has not seen it."""
        if self.replay is not None:
            failure, self.replay = self.replay, None
            raise failure
        self.attempt = Attempt(self.attempt.number + 1, time.perf_counter())
        return self.attempt

    def elapsed(self, state: RetryCallState) -> float:
        """Seconds from the first attempt's start to this outcome (tenacity's clock starts later)."""
        assert state.outcome_timestamp is not None
        return state.outcome_timestamp - self.started

    def retry(self, state: RetryCallState) -> bool:
        """Whether the outcome asks for another attempt (tenacity's ``retry``; a result does not)."""
        assert state.outcome is not None
        error = state.outcome.exception()
        if not isinstance(error, Exception):
            return False  # a result, or a cancellation or interrupt: tenacity re-raises the latter
        self.attempt.error = error
        return self.retryable(error)

    def wait(self, state: RetryCallState) -> float:
        if self.attempt.number >= self.backoff.attempts:
            return 0.0  # no retry follows: the server's wish is not asked, no jitter is drawn
        wish = None
        if self.retry_after is not None:
            assert self.attempt.error is not None
            wish = self.retry_after(self.attempt.error)
        return self.backoff.delay(self.attempt.number, wish)

    def stop(self, state: RetryCallState) -> bool:
        if self.attempt.number >= self.backoff.attempts:
            return True
        return self.elapsed(state) + state.upcoming_sleep > self.backoff.budget_s

    def before_sleep(self, state: RetryCallState) -> None:
        self.attempt.delay_s = state.upcoming_sleep
        if self.on_retry is not None:
            self.on_retry(self.attempt)

    def give_up(self, state: RetryCallState) -> NoReturn:
        """Raise the last error, or its translation with only the cause the translation set
        (``__cause__``, none by default): the last error's text may hold what the caller redacts
        (a model server's echo of a key)."""
        error = self.attempt.error
        assert error is not None
        if self.exhausted is not None:
            translated = self.exhausted(self.attempt, self.elapsed(state))
            raise translated from translated.__cause__
        raise error


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
    first = Attempt(1, time.perf_counter())
    try:
        return await call(first)  # nearly every call: no retry loop to set up (module docstring)
    except Exception as error:
        failure = error
    rules = _Rules(started, first, failure, backoff, retryable, retry_after, on_retry, exhausted)

    async def attempt() -> T:
        return await call(rules.next_attempt())

    async def wait(seconds: float) -> None:
        await sleep(float(seconds))  # tenacity hands a float subclass; callers get a float

    controller = AsyncRetrying(
        sleep=wait,
        stop=rules.stop,
        wait=rules.wait,
        retry=rules.retry,
        before_sleep=rules.before_sleep,
        retry_error_callback=rules.give_up,
    )
    result: T = await controller(attempt)
    return result


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
    first = Attempt(1, time.perf_counter())
    try:
        return call(first)
    except Exception as error:
        failure = error
    rules = _Rules(started, first, failure, backoff, retryable, retry_after, on_retry, exhausted)

    def wait(seconds: float) -> None:
        sleep(float(seconds))

    controller = Retrying(
        sleep=wait,
        stop=rules.stop,
        wait=rules.wait,
        retry=rules.retry,
        before_sleep=rules.before_sleep,
        retry_error_callback=rules.give_up,
    )
    return controller(lambda: call(rules.next_attempt()))
