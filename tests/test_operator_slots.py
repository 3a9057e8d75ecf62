"""The operator's view of ShopSimulator slots (issue: leases): `env slots`, `env release-all`,
`wait-ready` and `plan --check` with no free slot, and `status --env-url`, run as users run them
against the testbed shop process with 2 slots, both held by another client."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.testbed_process import ROOT, LocalTestbed, start_testbed, write_config

pytestmark = pytest.mark.slow

SLOTS = 2


@pytest.fixture(scope="module")
def bed() -> Iterator[LocalTestbed]:
    with start_testbed(SHOPSIM_ENV_SLOTS=str(SLOTS)) as testbed:
        yield testbed


@pytest.fixture
def full(bed: LocalTestbed) -> Iterator[LocalTestbed]:
    """Every slot leased by a client that is not shopsimrl (as another team's run would)."""
    for idx in range(SLOTS):
        answer = httpx.post(f"{bed.shop_url}/api/shop_agent", json={"action": "reset", "idx": idx + 1}, timeout=10)
        assert "env_idx" in answer.json()["result"], answer.text
    assert bed.healthz()["free_slots"] == 0
    yield bed
    bed.release_all()


def shopsimrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )


def test_env_slots_shows_the_pool(full: LocalTestbed) -> None:
    result = shopsimrl("env", "slots", "--url", full.shop_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{full.shop_url}: 0/{SLOTS} slots free, {SLOTS} leased"


def test_release_all_refuses_without_yes_and_frees_every_slot_with_it(full: LocalTestbed) -> None:
    refused = shopsimrl("env", "release-all", "--url", full.shop_url)
    assert refused.returncode == 2 and "EVERY client" in refused.stderr and "--yes" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert full.healthz()["free_slots"] == 0  # nothing was released
    done = shopsimrl("env", "release-all", "--url", full.shop_url, "--yes")
    assert done.returncode == 0, done.stderr
    assert full.healthz()["free_slots"] == SLOTS


def test_wait_ready_treats_no_free_slot_as_not_ready_unless_told(full: LocalTestbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, name="ready", sample_size=2, concurrency=1)
    waited = shopsimrl("wait-ready", "--config", str(config), "--timeout", "2", env=full.env())
    assert waited.returncode == 3, waited.stderr
    assert "0/2 slots free" in waited.stderr and "shopsimrl env slots --url" in waited.stderr
    shard_pod = shopsimrl("wait-ready", "--config", str(config), "--timeout", "2", "--no-require-free-slot", env=full.env())
    assert shard_pod.returncode == 0, shard_pod.stderr
    assert "(0/2 slots free)" in shard_pod.stdout + shard_pod.stderr


def test_plan_check_reports_the_pool_and_the_oversized_plan(full: LocalTestbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, name="check", sample_size=4, concurrency=4)
    checked = shopsimrl("plan", str(config), "--check", "--json", "--shards", "3", "--run", str(tmp_path / "run"), env=full.env())
    assert checked.returncode == 3, checked.stderr
    services = json.loads(checked.stdout)["services"]
    assert services["ready"] is False and services["reason"] == "environment_no_free_slot"
    assert services["environment_slots"] == SLOTS and services["free_slots"] == 0
    assert "3 process(es) × concurrency 4 = 12 episodes in flight, but ShopSimulator has 2 slots" in checked.stderr


def test_status_shows_the_shops_slots_beside_the_shards(full: LocalTestbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, name="status", sample_size=4, concurrency=2)
    run = str(tmp_path / "run")
    planned = shopsimrl("plan", str(config), "--shards", "2", "--run", run, env=full.env())
    assert planned.returncode == 0, planned.stderr
    shown = shopsimrl("status", run, "--env-url", full.shop_url, env=full.env())
    assert shown.returncode == 0, shown.stderr
    assert f"shop {full.shop_url}: 0/{SLOTS} slots free" in shown.stdout
    report = json.loads(shopsimrl("status", run, "--env-url", full.shop_url, "--json", env=full.env()).stdout)
    assert report["environment"]["environment_slots"] == SLOTS and report["environment"]["free_slots"] == 0
