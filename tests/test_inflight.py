"""The adaptive in-flight limit per model server (issue 26, item 2): its rules driven signal by
signal, and a real run against a testbed policy server that refuses for load."""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from shopsimrl.inflight import MAX_HOLD_S, PROBE_ROUNDS, AdaptiveLimit, model_inflight_block
from shopsimrl.model import _retry_after
from tests.testbed_process import ROOT, start_testbed, write_config


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _round(limit: AdaptiveLimit, signal: str = "ok", status: int | None = None) -> None:
    """As many requests as the limit, all granted before any ends, all ending with ``signal``."""
    permits = [await limit.acquire() for _ in range(limit.limit)]
    for permit in permits:
        limit.release(permit, signal, status=status)  # type: ignore[arg-type]


def test_starts_below_the_ceiling_and_doubles_on_clean_rounds() -> None:
    async def scenario() -> list[int]:
        limit = AdaptiveLimit(200, clock=Clock())
        seen = [limit.limit]
        for _ in range(4):
            await _round(limit)
            seen.append(limit.limit)
        return seen

    assert asyncio.run(scenario()) == [32, 64, 128, 200, 200]
    assert AdaptiveLimit(8).limit == 8  # a ceiling under 32 is the start


def test_one_cut_per_round_then_a_plateau_below_the_level_that_overloaded() -> None:
    async def scenario() -> AdaptiveLimit:
        limit = AdaptiveLimit(1024, clock=Clock())
        await _round(limit)  # 64
        permits = [await limit.acquire() for _ in range(limit.limit)]
        # Every request of the round is refused: one halving, not 64.
        for permit in permits:
            limit.release(permit, "overload", status=429)
        assert (limit.limit, limit.cuts, limit.signals["429"]) == (32, 1, 64)
        for _ in range(40):
            await _round(limit)
        return limit

    limit = asyncio.run(scenario())
    # 32 -> 63 one per clean round (31 rounds), then PROBE_ROUNDS clean rounds at 63 allow 64.
    assert limit.limit == 64 and limit.highest == 64
    reasons = [change["reason"] for change in limit.changes]
    assert reasons.count("cut (429)") == 1 and reasons[-1] == "probe (clean rounds at the plateau)"
    assert PROBE_ROUNDS <= 40 - 31


def test_a_timeout_and_a_503_cut_too_and_other_failures_do_not() -> None:
    async def scenario() -> AdaptiveLimit:
        limit = AdaptiveLimit(64, clock=Clock())
        await _round(limit, "other", status=500)
        assert limit.limit == 32 and limit.cuts == 0  # no news about load: no growth, no cut
        await _round(limit, "overload", status=None)
        await _round(limit, "overload", status=503)
        return limit

    limit = asyncio.run(scenario())
    assert (limit.limit, limit.cuts, limit.signals) == (8, 2, {"429": 0, "503": 16, "timeout": 32})


def test_the_limit_holds_requests_back_until_one_ends() -> None:
    async def scenario() -> None:
        limit = AdaptiveLimit(2, clock=Clock())
        first, second = await limit.acquire(), await limit.acquire()
        waiting = asyncio.create_task(limit.acquire())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done() and limit.in_flight == 2
        limit.release(first, "ok")
        await asyncio.wait_for(waiting, 5)
        assert limit.in_flight == 2
        limit.release(second, "ok")
        limit.release(waiting.result(), "ok")

    asyncio.run(scenario())


def test_retry_after_pauses_new_requests_capped() -> None:
    async def scenario() -> AdaptiveLimit:
        limit = AdaptiveLimit(4)
        permit = await limit.acquire()
        limit.release(permit, "overload", status=429, retry_after=0.3)
        held = asyncio.create_task(limit.acquire())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not held.done()  # free places, but the server asked for a pause
        limit.release(await asyncio.wait_for(held, 5), "ok")
        return limit

    limit = asyncio.run(scenario())
    assert limit.holds == 1 and limit.held_s == 0.3
    capped = AdaptiveLimit(4, clock=Clock())

    async def long_pause() -> None:
        capped.release(await capped.acquire(), "overload", status=503, retry_after=3600)

    asyncio.run(long_pause())
    assert capped.held_s == MAX_HOLD_S


@pytest.mark.parametrize(
    ("header", "expected"),
    [(None, None), ("", None), ("7", 7.0), (" 1.5 ", 1.5), ("-3", 0.0), ("inf", None), ("nan", None), ("soon", None)],
)
def test_retry_after_header_in_seconds(header: str | None, expected: float | None) -> None:
    assert _retry_after(header) == expected


def test_retry_after_header_as_an_http_date() -> None:
    """A date is relative to now: one in the past means no wait, one ahead means the time left."""
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    ahead = email.utils.format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)
    waited = _retry_after(ahead)
    assert waited is not None and 3000 < waited <= 3600


def test_the_summary_block_sums_invocations() -> None:
    first = {"requests": 10, "configured": 64, "final": 16, "lowest": 8, "highest": 32, "cuts": 2, "signals": {"429": 5}}
    second = {
        "requests": 4,
        "configured": 64,
        "final": 32,
        "lowest": 16,
        "highest": 64,
        "cuts": 1,
        "signals": {"429": 1, "timeout": 2},
    }
    block = model_inflight_block([first, second])
    assert block is not None
    assert (block["invocations"], block["final"], block["lowest"], block["highest"], block["cuts"]) == (2, 32, 8, 64, 3)
    assert block["signals"] == {"429": 6, "timeout": 2}
    assert model_inflight_block([]) is None


@pytest.mark.slow
def test_a_run_against_a_server_that_refuses_for_load_loses_nothing(tmp_path: Path) -> None:
    """C = 32 against a policy server answering at most 4 at once: the limit comes down, every
    episode completes with the scores of an unhurried run, and the summary keeps the history."""

    def run(config: Path, bed_model: str, bed_shop: str) -> dict:
        env = {**os.environ, "SHOPSIMRL_MODEL_BASE_URL": bed_model, "SHOPSIMRL_ENV_BASE_URL": bed_shop}
        proc = subprocess.run(
            [sys.executable, "-m", "shopsimrl", "run", str(config), "--no-progress"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((config.parent / "runs" / config.stem / "summary.json").read_text(encoding="utf-8"))

    def rewards(run_dir: Path) -> dict[str, float]:
        lines = (run_dir / "traces.jsonl").read_text(encoding="utf-8").splitlines()
        return {r["episode_id"]: r["final"]["reward"] for r in map(json.loads, lines) if r["status"] == "completed"}

    with start_testbed(SHOPSIM_POLICY_MAX_INFLIGHT="4", SHOPSIM_POLICY_LATENCY_MS="40", SHOPSIM_ENV_SLOTS="64") as bed:
        loaded = run(write_config(tmp_path, name="loaded", sample_size=32, concurrency=32), bed.model_url, bed.shop_url)
    with start_testbed() as bed:
        calm = run(write_config(tmp_path, name="calm", sample_size=32, concurrency=4), bed.model_url, bed.shop_url)

    assert loaded["counts"]["completed"] == calm["counts"]["completed"] == 32
    assert rewards(tmp_path / "runs" / "loaded") == rewards(tmp_path / "runs" / "calm")
    inflight = loaded["model_inflight"]
    assert inflight["invocations"] == 1 and inflight["configured"] == 32
    assert inflight["signals"]["429"] >= 1 and inflight["cuts"] >= 1 and inflight["lowest"] < 32
    history = inflight["history"][0]
    assert history["changes"] and history["requests"] > 0 and history["model_base_url"].startswith("http://127.0.0.1")
    assert calm["model_inflight"]["signals"] == {"429": 0, "503": 0, "timeout": 0}


def test_plan_shows_the_in_flight_policy(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from shopsimrl.cli import app

    config = write_config(tmp_path, name="planned", sample_size=3, concurrency=256)

    def shown(*sets: str) -> dict:
        args = ["plan", str(config), "--json", *(a for s in sets for a in ("--set", s))]
        result = CliRunner().invoke(app, args, prog_name="shopsimrl")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    adaptive, fixed = shown(), shown("model.adaptive_concurrency=false")
    assert adaptive["model_in_flight"] == "adaptive: from 32 up to 256 per process"
    assert shown("model.max_concurrent_requests=16")["model_in_flight"] == "adaptive: from 16 up to 16 per process"
    assert fixed["model_in_flight"] == "fixed at 256 per process"
    assert fixed["plan_fingerprint"] == adaptive["plan_fingerprint"]  # scheduling, not the plan
