"""Members of an eval set share slots on one event loop (shopsimrl.runner.slots.SharedSlots and
the scheduler's slot hook): at most the set's slots run, the earliest member first, and the next
member starts in the slots a draining member frees."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shopsimrl.records import EpisodeTrace
from shopsimrl.runner.scheduler import Evaluator
from shopsimrl.runner.slots import MemberSlot, SharedSlots, SlotPool
from shopsimrl.schemas import EpisodeJob
from shopsimrl.storage.local import LocalRunStore
from tests.test_scheduler import trace


class Member:
    """A runtime that logs each episode's start and end in the shared ``log``; an episode whose
    task is in ``hold`` waits for that event before it ends."""

    def __init__(self, name: str, log: list[tuple[str, str, int]], hold: dict[int, asyncio.Event] | None = None) -> None:
        self.name, self.log, self.hold = name, log, hold or {}
        self.running = 0

    async def run(self, job: EpisodeJob) -> EpisodeTrace:
        self.log.append(("start", self.name, job.task_id))
        await asyncio.sleep(0)
        if job.task_id in self.hold:
            await self.hold[job.task_id].wait()
        await asyncio.sleep(0)
        self.log.append(("end", self.name, job.task_id))
        return trace(job, "completed")


def jobs(count: int) -> list[EpisodeJob]:
    return [EpisodeJob(task_id=t, sample_id=0, seed=t, split="val") for t in range(count)]


def in_flight_peak(log: list[tuple[str, str, int]]) -> int:
    running = peak = 0
    for event, _, _ in log:
        running += 1 if event == "start" else -1
        peak = max(peak, running)
    return peak


async def run_set(tmp_path: Path, slots: int, members: list[tuple[Member, int]]) -> None:
    shared = SharedSlots(SlotPool(slots))
    evaluations = [
        Evaluator(member, LocalRunStore(tmp_path / member.name), concurrency=slots, slot=MemberSlot(shared, shared.add())).run(
            jobs(count)
        )
        for member, count in members
    ]
    # The timeout only turns a hang (members run one after another) into a failure.
    outcomes = await asyncio.wait_for(asyncio.gather(*evaluations), timeout=60)
    assert [outcome.completed for outcome in outcomes] == [count for _, count in members]
    assert shared.pool.busy == 0


async def test_the_earliest_member_gets_the_slots_and_the_next_fills_what_it_frees(tmp_path: Path) -> None:
    log: list[tuple[str, str, int]] = []
    second_started = asyncio.Event()

    class Second(Member):
        async def run(self, job: EpisodeJob) -> EpisodeTrace:
            second_started.set()
            return await super().run(job)

    # Member 1's last episode ends only once member 2 has started one: members run one after
    # another would never get there.
    first = Member("first", log, hold={3: second_started})
    await run_set(tmp_path, 2, [(first, 4), (Second("second", log), 4)])
    starts = [name for event, name, _ in log if event == "start"]
    assert starts == ["first"] * 4 + ["second"] * 4  # priority: the first member never waits for the second
    assert in_flight_peak(log) == 2
    last_end_of_first = max(i for i, (event, name, _) in enumerate(log) if (event, name) == ("end", "first"))
    first_start_of_second = log.index(("start", "second", 0))
    assert first_start_of_second < last_end_of_first


async def test_a_member_with_fewer_episodes_than_slots_leaves_the_rest_to_the_next(tmp_path: Path) -> None:
    log: list[tuple[str, str, int]] = []
    release = asyncio.Event()

    class Second(Member):
        async def run(self, job: EpisodeJob) -> EpisodeTrace:
            if sum(1 for event, name, _ in log if (event, name) == ("start", "second")) == 2:
                release.set()  # member 2 holds 2 of the 3 slots while member 1 still runs
            return await super().run(job)

    await run_set(tmp_path, 3, [(Member("first", log, hold={0: release}), 1), (Second("second", log), 5)])
    assert in_flight_peak(log) == 3
    assert log.index(("end", "first", 0)) > log.index(("start", "second", 1))


async def test_a_cancelled_waiter_gives_its_turn_back() -> None:
    shared = SharedSlots(SlotPool(1))
    first, second = shared.add(), shared.add()
    await shared.acquire(first)
    waiter = asyncio.ensure_future(shared.acquire(first))
    other = asyncio.ensure_future(shared.acquire(second))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    shared.release(first)
    await asyncio.wait_for(other, timeout=10)  # the slot went to the member still waiting
    assert shared.pool.busy == 1


async def test_a_waiter_cancelled_just_before_a_release_is_skipped() -> None:
    shared = SharedSlots(SlotPool(1))
    first, second = shared.add(), shared.add()
    await shared.acquire(first)
    waiter = asyncio.ensure_future(shared.acquire(first))
    other = asyncio.ensure_future(shared.acquire(second))
    await asyncio.sleep(0)
    waiter.cancel()  # its future is cancelled now; its task unwinds only on the next turn
    shared.release(first)
    await asyncio.wait_for(other, timeout=10)
    await asyncio.gather(waiter, return_exceptions=True)
    assert shared.pool.busy == 1 and shared.pool.done(first)


def test_a_member_that_finished_first_keeps_its_final_progress_state(tmp_path: Path) -> None:
    """Its heartbeat task lives until the whole set ends; it must not write `running` again."""
    from shopsimrl.runner.progress import ProgressFile, RunProgress, read_progress_file

    async def scenario() -> None:
        bar = RunProgress(3, before=0, enabled=False)
        progress = ProgressFile(tmp_path / "progress.json", bar, plan_fingerprint="f", completed_before=0, heartbeat_seconds=0.01)
        beat = asyncio.create_task(progress.beat())
        progress.write()
        progress.write("finished")
        await asyncio.wait_for(beat, 5)  # the beat ends by itself once the final state is written
        progress.write()
        assert (read_progress_file(tmp_path / "progress.json") or {})["state"] == "finished"

    asyncio.run(scenario())
