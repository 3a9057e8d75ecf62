"""CPU the retry loop costs per call: the hand-written loop it replaced against tenacity's.

    .venv/bin/python bench/retry_overhead.py [--calls 200000] [--repeat 5]

Every remote call (model, environment, object store) goes through shopsimrl.retry; an episode
step makes about 2.4 of them, nearly all succeeding at once. This times, in one process and
without I/O, a call that returns at once (and one that fails once, then succeeds, its wait a
no-op) through:

- ``hand-written``: the loop as it was before tenacity (commit 39aa2bd), reproduced below;
- ``tenacity, all``: tenacity's ``Retrying`` / ``AsyncRetrying`` with shopsimrl.retry's rules
  making every attempt, the first included;
- ``shopsimrl``: shopsimrl.retry as it is: the first attempt made at once, tenacity set up
  only after it failed.

Both get the callbacks the model adapter passes (retryable, retry_after, on_retry, exhausted,
sleep). The async loops run on uvloop, as the runner does. Prints the process's CPU time per
call (best of ``--repeat``), and the ratio; nothing is asserted. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import uvloop
from tenacity import AsyncRetrying, Retrying

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.retry import (
    Attempt,
    Backoff,
    Exhausted,
    OnRetry,
    Retryable,
    RetryAfter,
    _Rules,
    retry_async,
    retry_sync,
)

T = TypeVar("T")


# --- the hand-written loop (shopsimrl/retry.py at 39aa2bd), for comparison only ---------------


def _next_delay(
    backoff: Backoff, attempt: Attempt, exc: BaseException, retryable: Retryable, retry_after: RetryAfter | None, elapsed: float
) -> float | None:
    attempt.error = exc
    if not retryable(exc) or attempt.number >= backoff.attempts:
        return None
    delay = backoff.delay(attempt.number, retry_after(exc) if retry_after is not None else None)
    return None if elapsed + delay > backoff.budget_s else delay


def _give_up(attempt: Attempt, exc: BaseException, retryable: Retryable, exhausted: Exhausted | None, elapsed: float) -> None:
    if exhausted is not None and retryable(exc):
        error = exhausted(attempt, elapsed)
        raise error from error.__cause__


async def hand_written_async(
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


def hand_written_sync(
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


# --- tenacity making every attempt, with shopsimrl.retry's rules ------------------------------


async def tenacity_all_async(
    call: Callable[[Attempt], Awaitable[T]],
    backoff: Backoff,
    *,
    retryable: Retryable,
    retry_after: RetryAfter | None = None,
    on_retry: OnRetry | None = None,
    exhausted: Exhausted | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> T:
    rules = _Rules(time.monotonic(), Attempt(0, 0.0), None, backoff, retryable, retry_after, on_retry, exhausted)

    async def attempt() -> T:
        return await call(rules.next_attempt())

    async def wait(seconds: float) -> None:
        await sleep(float(seconds))

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


def tenacity_all_sync(
    call: Callable[[Attempt], T],
    backoff: Backoff,
    *,
    retryable: Retryable,
    retry_after: RetryAfter | None = None,
    on_retry: OnRetry | None = None,
    exhausted: Exhausted | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    rules = _Rules(time.monotonic(), Attempt(0, 0.0), None, backoff, retryable, retry_after, on_retry, exhausted)

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


# --- the measurement ------------------------------------------------------------------------


class Busy(Exception):
    retry_after: float | None = None


BACKOFF = Backoff(attempts=5, base_delay_s=1.0, max_delay_s=30.0, jitter="additive")  # the model adapter's kind


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, Busy)


def _retry_after(exc: BaseException) -> float | None:
    return exc.retry_after if isinstance(exc, Busy) else None


def _on_retry(failed: Attempt) -> None:
    pass


def _exhausted(last: Attempt, elapsed_s: float) -> RuntimeError:
    return RuntimeError(f"failed after {last.number} attempts")


def _sync_sleep(seconds: float) -> None:
    pass


async def _async_sleep(seconds: float) -> None:
    pass


def _sync_call(fails: int) -> Callable[[Attempt], int]:
    def call(attempt: Attempt) -> int:
        if attempt.number <= fails:
            raise Busy("busy")
        return attempt.number

    return call


def _async_call(fails: int) -> Callable[[Attempt], Awaitable[int]]:
    async def call(attempt: Attempt) -> int:
        if attempt.number <= fails:
            raise Busy("busy")
        return attempt.number

    return call


def time_sync(loop: Callable[..., int], fails: int, calls: int) -> float:
    call = _sync_call(fails)
    started = time.process_time()
    for _ in range(calls):
        loop(
            call,
            BACKOFF,
            retryable=_retryable,
            retry_after=_retry_after,
            on_retry=_on_retry,
            exhausted=_exhausted,
            sleep=_sync_sleep,
        )
    return (time.process_time() - started) / calls * 1e6


def time_async(loop: Callable[..., Awaitable[int]], fails: int, calls: int) -> float:
    call = _async_call(fails)

    async def main() -> float:
        started = time.process_time()
        for _ in range(calls):
            await loop(
                call,
                BACKOFF,
                retryable=_retryable,
                retry_after=_retry_after,
                on_retry=_on_retry,
                exhausted=_exhausted,
                sleep=_async_sleep,
            )
        return (time.process_time() - started) / calls * 1e6

    return uvloop.run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=200_000, help="calls per timing (default 200,000)")
    parser.add_argument("--repeat", type=int, default=5, help="timings per row; the best is shown (default 5)")
    args = parser.parse_args()
    rows = [
        ("sync", "succeeds at once", 0, time_sync, (hand_written_sync, tenacity_all_sync, retry_sync)),
        ("async", "succeeds at once", 0, time_async, (hand_written_async, tenacity_all_async, retry_async)),
        ("sync", "fails once, then succeeds", 1, time_sync, (hand_written_sync, tenacity_all_sync, retry_sync)),
        ("async", "fails once, then succeeds", 1, time_async, (hand_written_async, tenacity_all_async, retry_async)),
    ]
    print(f"CPU µs per call, best of {args.repeat} × {args.calls:,} calls (python {sys.version.split()[0]})")
    print(f"{'loop':<6} {'call':<26} {'hand-written':>13} {'tenacity, all':>14} {'shopsimrl':>10} {'ratio':>6} {'added':>6}")
    for kind, what, fails, timer, loops in rows:
        calls = args.calls if fails == 0 else args.calls // 4
        old, every, new = (min(timer(loop, fails, calls) for _ in range(args.repeat)) for loop in loops)
        print(f"{kind:<6} {what:<26} {old:>13.2f} {every:>14.2f} {new:>10.2f} {new / old:>5.2f}× {new - old:>6.2f}")
    print("ratio, added: shopsimrl's loop against the hand-written one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
