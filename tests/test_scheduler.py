"""The scheduler: resume, per-invocation retries of infrastructure failures, bad episodes (E3–E5)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from shopsimrl.records import EpisodeTrace, read_trace
from shopsimrl.runner.scheduler import Evaluator
from shopsimrl.schemas import EpisodeJob
from shopsimrl.storage.local import LocalRunStore

JOBS = [EpisodeJob(task_id=t, sample_id=0, seed=t, split="val") for t in (1, 2, 3)]


def trace(job: EpisodeJob, status: str, failure_class: str | None = None, reward: float = 1.0) -> EpisodeTrace:
    return read_trace(
        {
            "schema_version": "shopsimrl-episode-v4",
            "episode_id": job.episode_id,
            "status": status,
            "job": job.to_dict(),
            "final": {"done": True, "reward": reward} if status == "completed" else None,
            "steps": [],
            "error": None if status == "completed" else {"type": "X"},
            "failure_class": failure_class,
        }
    )


class ScriptedRuntime:
    """Returns scripted outcomes per episode; records every call."""

    def __init__(self, script: dict[int, list[str | Exception]]) -> None:
        self.script = script
        self.calls: list[int] = []

    async def run(self, job: EpisodeJob) -> EpisodeTrace:
        self.calls.append(job.task_id)
        outcomes = self.script.get(job.task_id, ["ok"])
        outcome = outcomes[min(self.calls.count(job.task_id) - 1, len(outcomes) - 1)]
        if isinstance(outcome, Exception):
            raise outcome
        if outcome == "ok":
            return trace(job, "completed")
        if outcome == "nan":
            return trace(job, "completed", reward=math.nan)
        return trace(job, "failed", outcome)


async def run(store: LocalRunStore, runtime: ScriptedRuntime, **kwargs) -> object:
    index = store.load_index()
    evaluator = Evaluator(runtime, store, concurrency=2, retry_backoff_seconds=0.0, **kwargs)
    return await evaluator.run(
        JOBS,
        completed={e for e, s in index.episodes.items() if s.completed},
        prior_attempts={e: s.attempts for e, s in index.episodes.items()},
        final_failures=index.final_failures(),
    )


async def test_e3_resume_never_reruns_completed(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    runtime = ScriptedRuntime({})
    await run(store, runtime)
    await run(store, runtime)
    assert sorted(runtime.calls) == [1, 2, 3]
    assert store.traces_path.read_text().count("\n") == 3


async def test_e4_infrastructure_failures_are_retried_within_the_invocation(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    runtime = ScriptedRuntime({2: ["infrastructure", "infrastructure", "ok"]})
    outcome = await run(store, runtime)
    assert runtime.calls.count(2) == 3 and outcome.completed == 3 and outcome.failed == 0 and outcome.retried == 2
    index = store.load_index()
    assert index.is_complete(JOBS[1].episode_id) and index.attempts(JOBS[1].episode_id) == 3
    attempts = [r.attempt for _, r in store.iter_records(index) if r.episode_id == JOBS[1].episode_id]
    assert attempts == [1, 2, 3]


async def test_e5_attempt_cap_is_per_invocation(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    runtime = ScriptedRuntime({3: ["infrastructure"]})
    outcome = await run(store, runtime)
    assert runtime.calls.count(3) == 3 and outcome.failed == 1
    # A later invocation gives the episode a fresh budget (the earlier cap was cumulative forever).
    outcome = await run(store, runtime)
    assert runtime.calls.count(3) == 6 and outcome.scheduled == 1
    # ...unless asked to leave earlier failures alone.
    outcome = await run(store, runtime, retry_failed=False)
    assert runtime.calls.count(3) == 6 and outcome.skipped_failed == 1


async def test_non_infrastructure_failures_are_not_retried(tmp_path: Path) -> None:
    runtime = ScriptedRuntime({1: ["environment_error"], 2: ["configuration_error"]})
    outcome = await run(LocalRunStore(tmp_path), runtime)
    assert runtime.calls.count(1) == 1 and runtime.calls.count(2) == 1 and outcome.failed == 2


@pytest.mark.parametrize("failure_class", ["environment_error", "model_error", "runtime_error", None])
async def test_an_outcome_failure_is_final_across_invocations_unless_rerolled(tmp_path: Path, failure_class: str | None) -> None:
    store = LocalRunStore(tmp_path)
    runtime = ScriptedRuntime({1: [failure_class or "unclassified-legacy", "ok"]})
    if failure_class is None:  # a record of the earlier implementation: no class, counted as an outcome
        runtime.script[1] = [RuntimeError("x"), "ok"]
    await run(store, runtime)
    if failure_class is None:
        lines = store.traces_path.read_text().splitlines()
        store.traces_path.write_text(
            "\n".join(line.replace('"failure_class":"runtime_error"', '"failure_class":null') for line in lines) + "\n"
        )
    for _ in range(2):  # reruns leave the recorded outcome alone
        outcome = await run(store, runtime)
        assert outcome.scheduled == 0 and outcome.skipped_final == 1 and outcome.skipped_completed == 2
    assert runtime.calls.count(1) == 1
    outcome = await run(store, runtime, reroll_failed=True)  # the explicit choice: run it again, marked
    assert runtime.calls.count(1) == 2 and outcome.rerolled == 1 and outcome.completed == 1
    records = [r for _, r in store.iter_records() if r.episode_id == JOBS[0].episode_id]
    assert [r.rerolled_from for r in records] == [None, failure_class or "unclassified"]
    from shopsimrl.runner.local import summarize_local

    summary = summarize_local(store, None, [job.episode_id for job in JOBS])
    assert summary["intent_to_treat"]["rerolled"] == 1 and summary["counts"]["completed"] == 3
    # A re-roll happens once: the re-rolled episode is completed now, so nothing runs again.
    assert (await run(store, runtime, reroll_failed=True)).scheduled == 0


async def test_configuration_failures_run_again_in_the_next_invocation(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    runtime = ScriptedRuntime({2: ["configuration_error", "ok"]})
    outcome = await run(store, runtime)
    assert runtime.calls.count(2) == 1 and outcome.failed == 1 and outcome.retried == 0
    from shopsimrl.runner.local import summarize_local

    summary = summarize_local(store, None, [job.episode_id for job in JOBS])
    itt = summary["intent_to_treat"]
    assert itt["episodes"] == 2 and itt["failed_configuration_excluded"] == 1 and itt["failed_counted_as_zero"] == 0
    outcome = await run(store, runtime)  # the settings were fixed: the episode runs, and it is no re-roll
    assert runtime.calls.count(2) == 2 and outcome.completed == 1 and outcome.rerolled == 0
    assert summarize_local(store, None, [job.episode_id for job in JOBS])["intent_to_treat"]["rerolled"] == 0


async def test_one_bad_episode_never_aborts_the_run(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    runtime = ScriptedRuntime({1: [RuntimeError("bug in a custom runtime")], 2: ["nan"]})
    outcome = await run(store, runtime)
    assert outcome.attempts == 3
    records = {r.episode_id: r for _, r in store.iter_records()}
    assert records[JOBS[0].episode_id].error.stage == "evaluator_boundary"
    assert records[JOBS[1].episode_id].final.get("reward", "absent") is None  # NaN made safe, not fatal
    assert records[JOBS[2].episode_id].status == "completed"


async def test_a_failing_store_stops_the_run(tmp_path: Path) -> None:
    class FullDisk:
        def save_traces(self, records: list[dict]) -> None:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        await Evaluator(ScriptedRuntime({}), FullDisk(), concurrency=2).run(JOBS)


async def test_a_failing_progress_callback_never_stalls_the_run(tmp_path: Path) -> None:
    def broken(record: dict, will_retry: bool) -> None:
        raise RuntimeError("display went away")

    evaluator = Evaluator(ScriptedRuntime({}), LocalRunStore(tmp_path), concurrency=2, on_trace=broken)
    outcome = await asyncio.wait_for(evaluator.run(JOBS), timeout=30)
    assert outcome.completed == 3


class BlockingSink:
    """A trace sink whose save blocks (in its worker thread) until the test lets it go."""

    def __init__(self) -> None:
        import threading

        self.entered = threading.Event()
        self.release = threading.Event()
        self.saved: list[str] = []
        self.batches: list[list[str]] = []

    def save_traces(self, records: list[dict]) -> None:
        self.entered.set()
        assert self.release.wait(30), "the test never let the save finish"
        self.saved.extend(record.episode_id for record in records)
        self.batches.append([record.episode_id for record in records])


@pytest.mark.slow
async def test_a_save_in_progress_when_the_run_is_stopped_is_finished_before_run_returns() -> None:
    """The final flush of a stopping worker runs after Evaluator.run returns: a record whose save
    was in flight at the stop must be in the sink by then (it used to land after, and be lost)."""
    sink = BlockingSink()
    evaluator = Evaluator(ScriptedRuntime({}), sink, concurrency=1, retry_backoff_seconds=0.0)
    running = asyncio.ensure_future(evaluator.run(JOBS[:1]))
    await asyncio.to_thread(sink.entered.wait, 30)  # the episode ended; its save is in the thread
    running.cancel()  # the stop arrives while the save is in flight
    seen_at_return: list[list[str]] = []
    running.add_done_callback(lambda _: seen_at_return.append(list(sink.saved)))
    await asyncio.wait({running}, timeout=0.5)  # give a run() that does not wait the time to return
    sink.release.set()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert seen_at_return == [[JOBS[0].episode_id]]  # the record was saved before run() returned


class GatedRuntime(ScriptedRuntime):
    """Task 1's episode ends at once; the others only once the test opens the gate."""

    def __init__(self) -> None:
        super().__init__({})
        self.gate = asyncio.Event()
        self.all_ended = asyncio.Event()

    async def run(self, job: EpisodeJob) -> EpisodeTrace:
        if job.task_id != 1:
            await self.gate.wait()
        try:
            return await super().run(job)
        finally:
            if len(self.calls) == 3:
                self.all_ended.set()


async def test_traces_that_end_during_a_write_go_out_together_in_the_next_one() -> None:
    """Group commit: while episode 1's trace is being written, episodes 2 and 3 end; both are
    written by the next call, in the order they ended, and none is left out."""
    sink = BlockingSink()
    runtime = GatedRuntime()
    running = asyncio.ensure_future(Evaluator(runtime, sink, concurrency=3).run(JOBS))
    await asyncio.to_thread(sink.entered.wait, 30)  # episode 1's trace is in the sink's thread
    runtime.gate.set()
    await asyncio.wait_for(runtime.all_ended.wait(), timeout=30)
    for _ in range(5):  # episodes 2 and 3 return and queue their saves
        await asyncio.sleep(0)
    sink.release.set()
    outcome = await asyncio.wait_for(running, timeout=30)
    assert outcome.completed == 3
    assert sink.batches == [[JOBS[0].episode_id], [JOBS[1].episode_id, JOBS[2].episode_id]]


class FullDiskStore:
    """The real LocalRunStore writing its traces to /dev/full, the kernel's always-full device
    (every write fails with ENOSPC), each save held at a barrier until the test lets it go."""

    def __init__(self, directory: Path) -> None:
        import threading

        self.store = LocalRunStore(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.store.traces_path.symlink_to("/dev/full")
        self.entered = [threading.Event(), threading.Event()]
        self.release = [threading.Event(), threading.Event()]
        self.failed: list[tuple[list[str], OSError]] = []

    def save_traces(self, records: list[dict]) -> None:
        call = len(self.failed)
        self.entered[call].set()
        assert self.release[call].wait(30), "the test never let the save go"
        try:
            self.store.save_traces(records)
        except OSError as exc:
            self.failed.append(([record.episode_id for record in records], exc))
            raise


class CleanupAfterCancel(ScriptedRuntime):
    """Task 1's episode ends at once, task 2's when the gate opens; task 3's runs until it is
    cancelled, and then its clean-up (an episode releasing its lease) lets the second write go
    and lasts until that write has failed."""

    def __init__(self, sink: FullDiskStore) -> None:
        super().__init__({})
        self.sink = sink
        self.gate = asyncio.Event()
        self.cancelled_before_second_write_failed = False

    async def run(self, job: EpisodeJob) -> EpisodeTrace:
        if job.task_id == 2:
            await self.gate.wait()
        elif job.task_id == 3:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled_before_second_write_failed = len(self.sink.failed) == 1
                self.sink.release[1].set()
                while len(self.sink.failed) < 2:  # noqa: ASYNC110 - the write runs in a thread
                    await asyncio.sleep(0.01)
                for _ in range(10):  # the failed write reaches its save task
                    await asyncio.sleep(0)
                raise
        return await super().run(job)


async def test_a_full_disk_leaves_no_save_failure_unretrieved(tmp_path: Path) -> None:
    """Issue 22: a full disk mid-run exited 3 but printed "Task exception was never retrieved".
    The first failed write stops the run; a write queued behind it failed while the runners were
    being cancelled, after its runner had stopped waiting for it and before the clean-up looked
    at the saves still running, so nobody retrieved its error."""
    import gc

    sink = FullDiskStore(tmp_path / "run")
    runtime = CleanupAfterCancel(sink)
    loop = asyncio.get_running_loop()
    unretrieved: list[str] = []

    def record(_: object, context: dict[str, object]) -> None:
        # Only this run's write errors: gc.collect() below may also finalise what earlier tests
        # in the process left behind, which is not this test's subject.
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno == 28:
            unretrieved.append(str(context["message"]))

    previous = loop.get_exception_handler()
    loop.set_exception_handler(record)
    try:
        running = asyncio.ensure_future(Evaluator(runtime, sink, concurrency=3).run(JOBS))
        await asyncio.to_thread(sink.entered[0].wait, 30)  # episode 1's trace is being written
        runtime.gate.set()  # episode 2 ends; its trace waits for the next write
        while 2 not in runtime.calls:  # noqa: ASYNC110 - set by the episode's task
            await asyncio.sleep(0.01)
        for _ in range(10):
            await asyncio.sleep(0)
        sink.release[0].set()  # the disk is full: the first write fails and stops the run
        with pytest.raises(OSError) as raised:
            await asyncio.wait_for(running, timeout=30)
        assert raised.value.errno == 28
        # The fault happened as described: both writes hit ENOSPC, the second one after the
        # runners were cancelled (episode 3's clean-up let it go).
        assert [ids for ids, _ in sink.failed] == [[JOBS[0].episode_id], [JOBS[1].episode_id]]
        assert all(exc.errno == 28 for _, exc in sink.failed)
        assert runtime.cancelled_before_second_write_failed
        # The errors' tracebacks keep the save tasks alive; once they go, a task whose error
        # nobody retrieved reports it from its finaliser.
        del running, raised
        sink.failed.clear()
        gc.collect()
        for _ in range(3):
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert unretrieved == []
