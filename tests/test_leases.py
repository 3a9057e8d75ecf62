"""Leases against the real testbed shop (uvicorn in a thread): cancellation, timeouts, the lease
budget, visible waits, the lease journal and its recovery.

The shop runs with ``keep_orphan_resets=True`` where it matters: like the real (threaded) server,
it then grants a queued reset whose client has gone, so a client that abandons a reset leaks a
slot — and these tests fail if the adapter ever does.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from shopsimrl.environment import (
    EnvironmentUnavailableError,
    ShopSimulatorEnvironment,
    ShopSimulatorSettings,
    SlotUsage,
    lease_budget,
)
from shopsimrl.httpclient import HttpService
from shopsimrl.runner.lease_journal import (
    DirectoryJournalStorage,
    LeaseJournal,
    ProcessIdentity,
    parse_journal,
    start_lease_tracking,
)
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings, create_app
from tests.testbed.conftest import SMALL_CATALOG

TASK = 0  # a task id of the small fixture catalog


@contextmanager
def shop(slots: int, **settings: Any) -> Iterator[tuple[str, Any]]:
    """A testbed shop on a loopback port; yields (url, its lease pool)."""
    app = create_app(ShopSettings(slots=slots, **settings), catalog_path=SMALL_CATALOG)
    with running_server(app) as url:
        yield url, app.state.shop.pool


def health(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/healthz", timeout=10).json()


def raw_reset(url: str) -> dict[str, Any]:
    """Take a slot as another client would."""
    return httpx.post(f"{url}/api/shop_agent", json={"action": "reset", "idx": TASK}, timeout=10).json()["result"]


def raw_release(url: str, lease: dict[str, Any]) -> int:
    body = {"action": "release_one", "env_idx": lease["env_idx"], "lease_id": lease["lease_id"]}
    return httpx.post(f"{url}/api/shop_agent", json=body, timeout=10).status_code


@asynccontextmanager
async def environment(url: str, **settings: Any) -> AsyncIterator[ShopSimulatorEnvironment]:
    settings.setdefault("cleanup_grace_seconds", 20.0)
    env = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=url, **settings))
    try:
        yield env
    finally:
        await env.aclose()


async def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``condition`` (a deterministic event, never a duration) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- never abandoned


async def test_a_cancelled_reset_queued_at_the_shop_is_released_once_granted() -> None:
    with shop(1, keep_orphan_resets=True) as (url, pool):
        holder = raw_reset(url)
        async with environment(url) as env:
            task = asyncio.ensure_future(env.open_episode().reset(TASK))
            await until(lambda: pool._waiting == 1, "the reset is queued at the shop")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert raw_release(url, holder) == 200  # the shop now grants the orphaned reset
        # aclose() waited for the abandoned request and released what it got
        assert health(url)["free_slots"] == 1
        assert env.unreleased_leases == {}


@pytest.mark.slow
async def test_reset_timeout_gives_up_waiting_but_the_request_stays_and_its_lease_is_released() -> None:
    with shop(1, keep_orphan_resets=True) as (url, pool):
        holder = raw_reset(url)
        async with environment(url, reset_timeout=0.3) as env:
            with pytest.raises(EnvironmentUnavailableError, match=r"reset_timeout=0\.3s; the request stays queued"):
                await env.open_episode().reset(TASK)
            assert pool._waiting == 1  # still queued at the shop: the connection was not dropped
            assert raw_release(url, holder) == 200
            await until(lambda: not env._background, "the abandoned reset is granted and released")
            assert health(url)["free_slots"] == 1


async def test_a_reset_cancelled_before_it_was_sent_never_reaches_the_shop() -> None:
    with shop(2, keep_orphan_resets=True) as (url, _pool):
        async with environment(url, max_leases=1) as env:
            first = env.open_episode()
            await first.reset(TASK)  # takes the only permit
            waiting = asyncio.ensure_future(env.open_episode().reset(TASK))
            await until(lambda: len(env._waiting) == 1, "the second reset waits for a permit")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await first.close()
            assert env._background == set()  # nothing was abandoned at the shop
            assert health(url)["free_slots"] == 2


async def test_a_cancelled_close_still_releases_its_lease() -> None:
    with shop(2) as (url, _):
        # No keep-alive: every request opens a connection, so a close() cancelled at its first
        # suspension has provably not sent its release yet.
        env = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=url), http=HttpService(keep_alive=False))
        episode = env.open_episode()
        await episode.reset(TASK)
        closing = asyncio.ensure_future(episode.close())
        await asyncio.sleep(0)  # close() runs up to its first suspension ...
        closing.cancel()  # ... and is cancelled there (a second signal during cleanup)
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert episode.lease_id is None  # the episode handed the lease to the environment
        await env.aclose()  # which finishes the release
        assert health(url)["free_slots"] == 2


async def test_a_release_that_fails_keeps_the_lease_for_the_journal() -> None:
    with shop(1) as (url, _):
        async with environment(url, max_retries=0) as env:
            episode = env.open_episode()
            await episode.reset(TASK)
            lease = (episode.env_idx, episode.lease_id)
            # Point the adapter at a closed port for the release: unconfirmed, so still unreleased.
            env._agent_url = "http://127.0.0.1:1/api/shop_agent"
            with pytest.raises(EnvironmentUnavailableError):
                await episode.close()
            assert env.unreleased_leases == {lease[0]: lease[1]}
            env._agent_url = f"{url}/api/shop_agent"
            assert await env.release_lease(*lease) is True
            assert await env.release_lease(*lease) is False  # already gone: 409, harmless


# --------------------------------------------------------------------------- budget and visibility


def test_lease_budget() -> None:
    assert lease_budget(concurrency=8, processes=1, environment_slots=2, configured=None) == 2
    assert lease_budget(concurrency=8, processes=3, environment_slots=20, configured=None) == 6
    assert lease_budget(concurrency=4, processes=3, environment_slots=20, configured=None) == 4
    assert lease_budget(concurrency=8, processes=3, environment_slots=2, configured=None) == 1  # at least one
    assert lease_budget(concurrency=8, processes=1, environment_slots=None, configured=None) == 8
    assert lease_budget(concurrency=8, processes=1, environment_slots=2, configured=5) == 5
    usage = SlotUsage(environment_slots=20, free_slots=20)
    assert usage.sizing_warning(concurrency=8, processes=2, lease_limit=8) is None
    warning = usage.sizing_warning(concurrency=32, processes=16, lease_limit=1)
    assert warning and "16 process(es) × concurrency 32 = 512 episodes in flight" in warning and "20 slots" in warning


async def test_the_lease_budget_bounds_leases_held_or_requested() -> None:
    with shop(8, keep_orphan_resets=True) as (url, pool):
        async with environment(url, max_leases=2) as env:
            episodes = [env.open_episode() for _ in range(6)]
            resets = [asyncio.ensure_future(e.reset(TASK)) for e in episodes]
            await until(lambda: sum(r.done() for r in resets) == 2 and len(env._waiting) == 4, "2 granted, 4 waiting")
            assert health(url)["free_slots"] == 6 and pool._waiting == 0  # the others wait here, not at the shop
            granted = [episode for episode, reset in zip(episodes, resets, strict=True) if reset.done()]
            for episode in granted:
                await episode.close()
            await until(lambda: sum(r.done() for r in resets) == 4, "the next two are granted")
            assert health(url)["free_slots"] == 6 and len(env._waiting) == 2
            for reset in resets:
                reset.cancel()
            await asyncio.gather(*resets, return_exceptions=True)
            for episode in episodes:
                await episode.close()
        assert health(url)["free_slots"] == 8


@pytest.mark.slow
async def test_waiting_for_a_slot_is_logged_with_the_pool_state() -> None:
    with shop(1, keep_orphan_resets=True) as (url, _pool):
        holder = raw_reset(url)
        async with environment(url, slot_wait_log_seconds=0.5) as env:
            with structlog.testing.capture_logs() as logs:
                task = asyncio.ensure_future(env.open_episode().reset(TASK))
                await until(lambda: any("waiting for a ShopSimulator slot" in e["event"] for e in logs), "the wait is logged")
            raw_release(url, holder)
            episode_lease = await task
            await env._release(episode_lease["env_idx"], episode_lease["lease_id"])
        line = next(e for e in logs if "waiting for a ShopSimulator slot" in e["event"])
        assert line["event"] == "waiting for a ShopSimulator slot (0/1 slots free, 1 queued)"
        assert line["queued_at_shop"] == 1 and line["log_level"] == "warning"


@pytest.mark.slow
async def test_aclose_gives_up_after_the_grace_period_and_says_what_may_leak() -> None:
    with shop(1, keep_orphan_resets=True) as (url, pool):
        holder = raw_reset(url)  # never released while the environment waits: the reset can't finish
        env = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=url, cleanup_grace_seconds=0.3))
        task = asyncio.ensure_future(env.open_episode().reset(TASK))
        await until(lambda: pool._waiting == 1, "the reset is queued")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        with structlog.testing.capture_logs() as logs:
            await env.aclose()
        warning = next(e for e in logs if e["event"] == "lease cleanup incomplete")
        assert warning["resets_still_queued"] == 1 and "release-all" in warning["consequence"]
        raw_release(url, holder)


# --------------------------------------------------------------------------- the journal


def journal_state(path: Path) -> Any:
    return parse_journal(path.name, path.read_bytes())


async def test_the_journal_is_written_before_the_reset_is_sent_and_removed_when_nothing_is_held(tmp_path: Path) -> None:
    with shop(1, keep_orphan_resets=True) as (url, pool):
        journal = LeaseJournal(DirectoryJournalStorage(tmp_path / "leases"), environment_url=url)
        path = tmp_path / "leases" / journal.name
        holder = raw_reset(url)
        async with environment(url) as env:
            await start_lease_tracking(env, journal, concurrency=1, processes=1, configured=None)
            episode = env.open_episode()
            task = asyncio.ensure_future(episode.reset(TASK))
            await until(lambda: pool._waiting == 1, "the reset is queued")
            state = journal_state(path)
            assert state.resets_in_flight == 1 and state.held == {}
            raw_release(url, holder)
            await task
            state = journal_state(path)
            assert state.resets_in_flight == 0 and state.held == {episode.env_idx: episode.lease_id}
            assert state.process == ProcessIdentity.current() and state.environment == url
            await episode.close()
            assert journal_state(path).held == {}
        await journal.aclose()
        assert not (tmp_path / "leases").exists()  # nothing held at the end: no journal left


async def test_a_long_local_journal_is_compacted_and_still_exact(tmp_path: Path) -> None:
    with shop(4) as (url, _):
        journal = LeaseJournal(DirectoryJournalStorage(tmp_path / "leases"), environment_url=url)
        journal._COMPACT_AFTER = 8
        path = tmp_path / "leases" / journal.name
        async with environment(url) as env:
            await start_lease_tracking(env, journal, concurrency=4, processes=1, configured=None)
            kept = env.open_episode()
            await kept.reset(TASK)
            for _ in range(20):
                episode = env.open_episode()
                await episode.reset(TASK)
                await episode.close()
                assert len(path.read_bytes().splitlines()) <= 1 + 8 + 4 + 3  # header + bounded events
            assert journal_state(path).held == {kept.env_idx: kept.lease_id}
            await kept.close()
        await journal.aclose()


def test_a_ramp_up_of_many_resets_in_flight_compacts_the_local_journal_rarely(tmp_path: Path) -> None:
    """1,000 resets sent before any answer (1,000 episodes starting at once): each compaction
    writes every reset in flight, so a bound on held leases alone compacted on every event."""
    storage = DirectoryJournalStorage(tmp_path / "leases")
    journal = LeaseJournal(storage, environment_url="http://shop.invalid")
    rewrites = []
    write = storage.write
    storage.write = lambda name, data: (rewrites.append(len(data.splitlines())), write(name, data))[1]  # type: ignore[method-assign]
    for _ in range(1000):
        journal.reset_sent()
    for n in range(1000):
        journal.reset_answered((n, f"lease-{n}"))
    assert journal_state(tmp_path / "leases" / journal.name).held == {n: f"lease-{n}" for n in range(1000)}
    assert len(rewrites) <= 3, rewrites[:10]  # the first event, then at most once per ~512 + 4·state lines


def dead_process_identity() -> ProcessIdentity:
    """The identity of a process of this host that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        alive = ProcessIdentity(ProcessIdentity.current().host, child.pid, None, ProcessIdentity.current().pid_namespace)
        started = __import__("shopsimrl.runner.lease_journal", fromlist=["x"])._process_start_ticks(child.pid)
        alive = ProcessIdentity(alive.host, alive.pid, started, alive.pid_namespace)
        assert alive.is_alive()
    finally:
        child.kill()
        child.wait()
    assert not alive.is_alive()
    return alive


def write_journal(
    directory: Path, name: str, process: ProcessIdentity, leases: list[dict[str, Any]], url: str, in_flight: int = 0
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(
        json.dumps(
            {
                "schema_version": "shopsimrl-lease-journal-v1",
                "writer": name[:-5],
                "process": process.to_dict(),
                "environment": url,
                "updated_at": "2026-11-30T00:00:00+00:00",
                "resets_in_flight": in_flight,
                "leases": leases,
            }
        )
    )


@pytest.mark.slow
async def test_recovery_releases_a_dead_processs_leases_before_new_ones_are_taken(tmp_path: Path) -> None:
    with shop(3) as (url, _):
        leaked = [raw_reset(url), raw_reset(url)]  # what a killed process left behind
        stale = raw_reset(url)
        raw_release(url, stale)  # a lease the journal still names but the shop already freed
        directory = tmp_path / "leases"
        entries = [{"env_idx": lease["env_idx"], "lease_id": lease["lease_id"]} for lease in (*leaked, stale)]
        write_journal(directory, "deadbeef.json", dead_process_identity(), entries, url, in_flight=1)
        elsewhere = ProcessIdentity("another-pod", 1, 12345, "pid:[1]")
        other = raw_reset(url)
        write_journal(directory, "0ther0ne.json", elsewhere, [{"env_idx": other["env_idx"], "lease_id": other["lease_id"]}], url)
        assert health(url)["free_slots"] == 0
        journal = LeaseJournal(DirectoryJournalStorage(directory), environment_url=url)
        async with environment(url) as env:
            plan = await start_lease_tracking(env, journal, concurrency=3, processes=1, configured=None)
            await journal.aclose()
        report = plan.recovery
        assert (report.released, report.already_gone, report.failed) == (3, 1, 0)
        assert report.resets_in_flight_at_stop == 1
        assert plan.usage == SlotUsage(environment_slots=3, free_slots=3)  # measured after recovery
        assert sorted(report.journals) == ["0ther0ne.json", "deadbeef.json"] and not directory.exists()


async def test_recovery_leaves_a_live_processs_journal_alone(tmp_path: Path) -> None:
    with shop(2) as (url, _):
        live = raw_reset(url)
        directory = tmp_path / "leases"
        parent = ProcessIdentity.current()
        write_journal(directory, "11ve0000.json", parent, [{"env_idx": live["env_idx"], "lease_id": live["lease_id"]}], url)
        journal = LeaseJournal(DirectoryJournalStorage(directory), environment_url=url)
        async with environment(url) as env:
            report = await journal.recover(env)
        assert report.skipped_live == ["11ve0000.json"] and report.released == 0
        assert (directory / "11ve0000.json").exists() and health(url)["free_slots"] == 1


def test_process_identity_tells_gone_from_alive() -> None:
    me = ProcessIdentity.current()
    assert me.is_alive()
    assert not ProcessIdentity(me.host, me.pid, (me.started or 0) + 1, me.pid_namespace).is_alive()  # a reused PID
    assert not ProcessIdentity("some-other-host", me.pid, me.started, me.pid_namespace).is_alive()
    assert not ProcessIdentity(me.host, me.pid, me.started, "pid:[0]").is_alive()  # another container
    assert ProcessIdentity.from_dict({"host": "h"}) is None
