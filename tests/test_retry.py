"""The one retry loop (shopsimrl.retry): attempts, delays, what is retried, what is raised.

The adapters' own tests (test_model, test_environment, tests/sharded/test_shardstore) check it
against real servers; these pin the loop itself with a recorded sleep and no clock games."""

from __future__ import annotations

import asyncio
import random

import pytest

from shopsimrl.retry import Attempt, Backoff, retry_async, retry_sync


class Flaky(Exception):
    pass


class Fatal(Exception):
    pass


def failing(times: int, error: type[Exception] = Flaky) -> tuple[list[int], object]:
    calls: list[int] = []

    def call(attempt: Attempt) -> str:
        calls.append(attempt.number)
        if len(calls) <= times:
            raise error(f"failure {len(calls)}")
        return "done"

    return calls, call


def test_retries_until_success_with_doubling_delays_and_reports_each_retry() -> None:
    calls, call = failing(2)
    sleeps: list[float] = []
    retried: list[tuple[int, str, float]] = []
    result = retry_sync(
        call,
        Backoff(attempts=5, base_delay_s=0.5),
        retryable=lambda exc: isinstance(exc, Flaky),
        on_retry=lambda a: retried.append((a.number, str(a.error), a.delay_s)),
        sleep=sleeps.append,
    )
    assert result == "done" and calls == [1, 2, 3]
    assert sleeps == [0.5, 1.0] and retried == [(1, "failure 1", 0.5), (2, "failure 2", 1.0)]


def test_an_error_that_is_not_retryable_is_raised_at_once_even_with_a_translation() -> None:
    calls, call = failing(1, Fatal)
    sleeps: list[float] = []
    with pytest.raises(Fatal, match="failure 1"):
        retry_sync(
            call,
            Backoff(attempts=5),
            retryable=lambda exc: isinstance(exc, Flaky),
            exhausted=lambda a, s: RuntimeError("never"),
            sleep=sleeps.append,
        )
    assert calls == [1] and sleeps == []


def test_exhausted_attempts_raise_the_last_error_or_its_translation() -> None:
    calls, call = failing(10)
    with pytest.raises(Flaky, match="failure 3"):
        retry_sync(call, Backoff(attempts=3, base_delay_s=0), retryable=lambda exc: True, sleep=lambda s: None)
    assert calls == [1, 2, 3]

    calls, call = failing(10)

    def translate(last: Attempt, elapsed_s: float) -> RuntimeError:
        return RuntimeError(f"gave up after {last.number}: {last.error}")

    with pytest.raises(RuntimeError, match="gave up after 2: failure 2") as info:
        retry_sync(
            call, Backoff(attempts=2, base_delay_s=0), retryable=lambda exc: True, exhausted=translate, sleep=lambda s: None
        )
    # No cause unless the translation names one: the last error's text may hold a secret.
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_the_budget_stops_a_retry_that_would_end_past_it() -> None:
    calls, call = failing(10)
    sleeps: list[float] = []
    with pytest.raises(Flaky):
        retry_sync(
            call, Backoff(attempts=100, base_delay_s=100.0, budget_s=250.0), retryable=lambda exc: True, sleep=sleeps.append
        )
    # The sleeps are recorded, not slept: the budget sees only the real seconds of the calls
    # (far below the 50 s of margin), so 100 and 200 s fit and 400 s would end past 250 s.
    assert sleeps == [100.0, 200.0] and calls == [1, 2, 3]


def test_retry_after_replaces_the_backoff_and_is_capped() -> None:
    sleeps: list[float] = []

    class Busy(Exception):
        def __init__(self, after: float | None) -> None:
            self.after = after

    answers = iter([Busy(7.0), Busy(90.0), Busy(None)])

    def call(attempt: Attempt) -> str:
        answer = next(answers, None)
        if answer is not None:
            raise answer
        return "ok"

    assert (
        retry_sync(
            call,
            Backoff(attempts=5, base_delay_s=1.0, max_delay_s=30.0),
            retryable=lambda exc: True,
            retry_after=lambda exc: exc.after,
            sleep=sleeps.append,
        )
        == "ok"
    )  # type: ignore[attr-defined]
    assert sleeps == [7.0, 30.0, 4.0]  # the third falls back to base · 2^2


@pytest.mark.parametrize(("jitter", "low", "high"), [("none", 2.0, 2.0), ("additive", 2.0, 3.0), ("proportional", 1.0, 2.0)])
def test_jitter_stays_in_its_range(jitter: str, low: float, high: float) -> None:
    backoff = Backoff(base_delay_s=1.0, jitter=jitter)  # type: ignore[arg-type]
    random.seed(7)
    delays = [backoff.delay(2) for _ in range(500)]
    assert all(low <= d <= high for d in delays)
    assert jitter == "none" or max(delays) - min(delays) > (high - low) / 2  # it does vary


def test_the_async_loop_behaves_like_the_sync_one() -> None:
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    calls: list[int] = []

    async def call(attempt: Attempt) -> str:
        calls.append(attempt.number)
        if attempt.number < 3:
            raise Flaky(str(attempt.number))
        return "done"

    result = asyncio.run(retry_async(call, Backoff(attempts=3, base_delay_s=0.25), retryable=lambda exc: True, sleep=sleep))
    assert result == "done" and calls == [1, 2, 3] and sleeps == [0.25, 0.5]
