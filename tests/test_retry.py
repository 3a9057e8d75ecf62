"""The one retry loop (shopsimrl.retry): attempts, delays, what is retried, what is raised.

The adapters' own tests (test_model, test_environment, tests/sharded/test_shardstore) check it
against real servers; these pin the loop itself with a recorded sleep and no clock games."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

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


# --- Behaviours the callers and the traces depend on, run through both loops -----------------


def run_loop(loop: str, call: Callable[[Attempt], str], backoff: Backoff, **options: Any) -> str:
    """``call`` through ``retry_sync`` or ``retry_async`` (``sleep``, if given, is a plain function)."""
    if loop == "sync":
        return retry_sync(call, backoff, **options)

    async def call_async(attempt: Attempt) -> str:
        return call(attempt)

    plain_sleep = options.pop("sleep", None)
    if plain_sleep is not None:

        async def sleep(seconds: float) -> None:
            plain_sleep(seconds)

        options["sleep"] = sleep

    async def main() -> tuple[str | None, BaseException | None]:
        # The error is carried out of the loop rather than through asyncio.run, which would
        # treat a KeyboardInterrupt or a CancelledError of its main task in its own way.
        try:
            return await retry_async(call_async, backoff, **options), None
        except BaseException as exc:
            return None, exc

    result, error = asyncio.run(main())
    if error is not None:
        raise error
    assert result is not None
    return result


LOOPS = pytest.mark.parametrize("loop", ["sync", "async"])


@LOOPS
@pytest.mark.parametrize("cancel", [KeyboardInterrupt, asyncio.CancelledError])
@pytest.mark.parametrize("at", [1, 2])
def test_cancellation_is_never_retried_nor_translated(loop: str, cancel: type[BaseException], at: int) -> None:
    calls: list[int] = []
    consulted: list[BaseException] = []
    seen: list[str] = []

    def call(attempt: Attempt) -> str:
        calls.append(attempt.number)
        if attempt.number < at:
            raise Flaky("down")
        raise cancel()

    def retryable(exc: BaseException) -> bool:
        consulted.append(exc)
        return True

    with pytest.raises(cancel):
        run_loop(
            loop,
            call,
            Backoff(attempts=5, base_delay_s=0),
            retryable=retryable,
            retry_after=lambda exc: seen.append("retry_after") or 0.0,
            on_retry=lambda a: seen.append("on_retry"),
            exhausted=lambda a, s: RuntimeError("translated"),
            sleep=lambda s: seen.append("sleep"),
        )
    # Only the Flaky failures before it were seen by the loop's callbacks.
    assert calls == list(range(1, at + 1)) and all(isinstance(exc, Flaky) for exc in consulted)
    assert len(consulted) == at - 1 and seen == ["retry_after", "on_retry", "sleep"] * (at - 1)


@LOOPS
def test_an_interrupt_during_the_wait_ends_the_loop(loop: str) -> None:
    calls: list[int] = []
    slept: list[float] = []

    def call(attempt: Attempt) -> str:
        calls.append(attempt.number)
        raise Flaky("down")

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_loop(loop, call, Backoff(attempts=5), retryable=lambda exc: True, sleep=sleep)
    assert calls == [1] and slept == [1.0]


def test_a_task_cancelled_while_it_waits_to_retry_makes_no_further_attempt() -> None:
    calls: list[int] = []
    slept: list[float] = []

    async def main() -> bool:
        waiting = asyncio.Event()

        async def call(attempt: Attempt) -> str:
            calls.append(attempt.number)
            raise Flaky("down")

        async def sleep(seconds: float) -> None:
            slept.append(seconds)
            waiting.set()
            await asyncio.sleep(seconds)

        task = asyncio.create_task(
            retry_async(call, Backoff(attempts=5, base_delay_s=3600.0), retryable=lambda exc: True, sleep=sleep)
        )
        await waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    # The cancellation met the loop in its hour-long wait (the sleep had begun), and ended it.
    assert asyncio.run(main()) and calls == [1] and slept == [3600.0]


@LOOPS
def test_on_retry_sees_the_attempt_the_call_got_with_its_error_and_delay_before_the_wait(loop: str) -> None:
    events: list[tuple[str, object]] = []
    given: list[Attempt] = []
    raised: list[Flaky] = []

    def call(attempt: Attempt) -> str:
        given.append(attempt)
        events.append(("call", attempt.number))
        if attempt.number < 3:
            raised.append(Flaky(str(attempt.number)))
            raise raised[-1]
        return "done"

    def on_retry(failed: Attempt) -> None:
        assert failed is given[-1] and failed.error is raised[-1]
        events.append(("on_retry", (failed.number, failed.delay_s)))

    result = run_loop(
        loop,
        call,
        Backoff(attempts=5, base_delay_s=0.5),
        retryable=lambda exc: True,
        on_retry=on_retry,
        sleep=lambda s: events.append(("sleep", s)),
    )
    assert result == "done"
    assert events == [
        ("call", 1),
        ("on_retry", (1, 0.5)),
        ("sleep", 0.5),
        ("call", 2),
        ("on_retry", (2, 1.0)),
        ("sleep", 1.0),
        ("call", 3),
    ]
    assert [a.number for a in given] == [1, 2, 3] and given[0].started <= given[1].started <= given[2].started
    assert given[2].error is None and given[2].delay_s == 0.0  # the attempt that succeeded


@LOOPS
def test_the_last_error_is_raised_itself_and_a_refused_one_at_once(loop: str) -> None:
    raised: list[Exception] = []

    def call(attempt: Attempt) -> str:
        raised.append(Flaky(f"failure {attempt.number}") if attempt.number < 2 else Fatal("fatal"))
        raise raised[-1]

    with pytest.raises(Fatal) as refused:
        run_loop(loop, call, Backoff(attempts=5, base_delay_s=0), retryable=lambda exc: isinstance(exc, Flaky))
    assert refused.value is raised[-1] and len(raised) == 2

    raised.clear()
    with pytest.raises(Fatal) as last:
        run_loop(loop, call, Backoff(attempts=2, base_delay_s=0), retryable=lambda exc: True)
    assert last.value is raised[-1] and len(raised) == 2


@LOOPS
def test_a_translation_sees_the_last_attempt_and_keeps_the_cause_it_names(loop: str) -> None:
    raised: list[Flaky] = []
    seen: list[tuple[int, float, float]] = []

    def call(attempt: Attempt) -> str:
        raised.append(Flaky(f"failure {attempt.number}"))
        raise raised[-1]

    def translate(last: Attempt, elapsed_s: float) -> RuntimeError:
        assert last.error is raised[-1]
        seen.append((last.number, last.delay_s, elapsed_s))
        error = RuntimeError("store still failing")
        error.__cause__ = last.error  # as the object store's StoreUnavailableError
        return error

    with pytest.raises(RuntimeError, match="store still failing") as info:
        run_loop(loop, call, Backoff(attempts=3, base_delay_s=0), retryable=lambda exc: True, exhausted=translate)
    assert info.value.__cause__ is raised[-1] and len(raised) == 3
    [(number, delay, elapsed)] = seen
    assert number == 3 and delay == 0.0 and elapsed >= 0.0  # the last attempt is followed by no wait

    raised.clear()
    seen.clear()
    with pytest.raises(RuntimeError):  # a single attempt is still translated once it fails retryably
        run_loop(loop, call, Backoff(attempts=1), retryable=lambda exc: True, exhausted=translate)
    assert len(raised) == 1 and seen[0][0] == 1


@LOOPS
def test_a_zero_budget_allows_no_retry(loop: str) -> None:
    calls, call = failing(10)
    slept: list[float] = []
    with pytest.raises(RuntimeError, match="after 1"):
        run_loop(
            loop,
            call,  # type: ignore[arg-type]
            Backoff(attempts=8, base_delay_s=0.2, budget_s=0.0),
            retryable=lambda exc: True,
            exhausted=lambda last, s: RuntimeError(f"after {last.number}"),
            sleep=slept.append,
        )
    assert calls == [1] and slept == []


@LOOPS
def test_the_budget_counts_the_seconds_really_spent_waiting(loop: str) -> None:
    calls, call = failing(10)
    spent: list[float] = []

    def exhausted(last: Attempt, elapsed_s: float) -> RuntimeError:
        spent.append(elapsed_s)
        return RuntimeError(f"after {last.number}")

    # The first wait (0.4 s, really slept) fits the 0.7 s budget; the second would end at 0.8 s at
    # the earliest, past it, so it is not begun: two attempts, the time slept counted.
    with pytest.raises(RuntimeError, match="after 2"):
        run_loop(
            loop,
            call,  # type: ignore[arg-type]
            Backoff(attempts=8, base_delay_s=5.0, budget_s=0.7),
            retryable=lambda exc: True,
            retry_after=lambda exc: 0.4,
            exhausted=exhausted,
            sleep=time.sleep,
        )
    assert calls == [1, 2] and spent[0] >= 0.4


@LOOPS
def test_the_budget_counts_the_first_attempts_own_time(loop: str) -> None:
    calls: list[int] = []

    def call(attempt: Attempt) -> str:
        calls.append(attempt.number)
        time.sleep(0.3)  # a slow first answer: 0.3 s of the 0.5 s budget gone
        raise Flaky("slow, then failed")

    # A 0.3 s wait after it would end at 0.6 s at the earliest: not begun.
    with pytest.raises(RuntimeError, match="after 1"):
        run_loop(
            loop,
            call,
            Backoff(attempts=8, budget_s=0.5),
            retryable=lambda exc: True,
            retry_after=lambda exc: 0.3,
            exhausted=lambda last, s: RuntimeError(f"after {last.number}"),
            sleep=lambda s: None,
        )
    assert calls == [1]


@LOOPS
def test_the_servers_wait_and_the_jitter_are_asked_only_for_a_retry(loop: str) -> None:
    calls, call = failing(10)
    asked: list[str] = []
    random.seed(11)
    with pytest.raises(Flaky):
        run_loop(
            loop,
            call,  # type: ignore[arg-type]
            Backoff(attempts=3, base_delay_s=0, jitter="additive"),
            retryable=lambda exc: True,
            retry_after=lambda exc: asked.append(str(exc)) or None,
            sleep=lambda s: None,
        )
    after_loop = random.random()
    random.seed(11)
    random.random(), random.random()  # one draw per retry made: two
    assert calls == [1, 2, 3] and asked == ["failure 1", "failure 2"] and after_loop == random.random()

    _, call = failing(1, Fatal)
    asked.clear()
    with pytest.raises(Fatal):
        run_loop(
            loop,
            call,  # type: ignore[arg-type]
            Backoff(attempts=3),
            retryable=lambda exc: isinstance(exc, Flaky),
            retry_after=lambda exc: asked.append(str(exc)) or None,
        )
    assert asked == []
