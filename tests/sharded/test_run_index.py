"""``shopsimrl runs`` over an ``s3://`` prefix (moto and SeaweedFS), what it reads there counted on
the wire, and a leaderboard of real testbed runs with their cost (issue 26, items 3 and 6)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.runner.runs import HEAD_BYTES, list_runs
from shopsimrl.storage.sharded import ShardedRunStore
from tests.run_index_fixtures import plan, sharded_run

from .conftest import S3_TEST_ENV, S3Server, Testbed, _make_bucket, cli, write_config
from .faultproxy import FaultPlan, FaultProxy

pytestmark = pytest.mark.slow


def _prefix_of_runs(base: str) -> None:
    sharded_run(f"{base}/ckpt-1", plan("sweep", "ckpt-1"), [1.0, 0.0, 0.0, 0.0])
    # Enough jobs that the whole manifest is several times the head that is read of it.
    sharded_run(f"{base}/ckpt-2", plan("sweep", "ckpt-2", repeats=600), [1.0, 1.0] * 1200, shards=3)
    sharded_run(f"{base}/later/ckpt-3", plan("sweep", "ckpt-3"), [1.0] * 4, commit=1, reduce=False)
    ShardedRunStore(f"{base}/broken").overwrite("manifest.json", b'{"schema_version": "shopsimrl-run-manifest-v2", "pl')


@pytest.mark.s3
def test_runs_lists_the_sharded_runs_under_an_s3_prefix(s3_server: S3Server) -> None:
    base = f"s3://{s3_server.bucket}/team/runs"
    _prefix_of_runs(base)
    entries = {entry.name: entry for entry in list_runs(base)}
    assert set(entries) == {"ckpt-1", "ckpt-2", "later/ckpt-3", "broken"}
    one, two = entries["ckpt-1"], entries["ckpt-2"]
    assert (one.kind, one.state, one.checkpoint, one.location) == ("sharded", "finished", "ckpt-1", f"{base}/ckpt-1")
    assert one.score == pytest.approx(25.0) and one.cost is not None and one.tokens == 4 * 1050
    assert (two.state, two.requested, two.completed, two.score) == ("finished", 2400, 2400, pytest.approx(100.0))
    assert two.job_list != one.job_list  # 600 repeats: another job list
    later = entries["later/ckpt-3"]
    assert (later.state, later.completed, later.requested, later.detail) == (
        "in progress",
        2,
        4,
        "1/2 shards committed, no summary yet",
    )
    assert later.job_list == one.job_list
    broken = entries["broken"]
    assert broken.state == "unreadable" and "manifest.json is not valid JSON" in (broken.error or "")

    result = CliRunner().invoke(app, ["runs", base, "--json"], prog_name="shopsimrl")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["location"] == base and [run["name"] for run in document["runs"]][:2] == ["ckpt-2", "ckpt-1"]
    assert S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"] not in result.output


@pytest.mark.s3
def test_on_s3_runs_reads_heads_summaries_and_markers_never_a_part(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request goes through a counting proxy in front of moto."""
    for name, value in {**S3_TEST_ENV, "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(name, value)
    bucket = _make_bucket(moto_endpoint, S3_TEST_ENV["AWS_ACCESS_KEY_ID"], S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    base = f"s3://{bucket}/runs"
    _prefix_of_runs(base)
    manifest_size = len(ShardedRunStore(f"{base}/ckpt-2").read_bytes("manifest.json") or b"")
    assert manifest_size > 3 * HEAD_BYTES
    proxy = FaultProxy(moto_endpoint, FaultPlan())
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    try:
        entries = list_runs(base)
    finally:
        proxy.stop()
    assert len(entries) == 4
    gets = {key: count for (method, key), count in proxy.requests.items() if method == "GET" and not key.endswith("?list")}
    assert gets, proxy.requests
    assert not [key for key in gets if "/part-" in key or key.endswith("jobs.jsonl")], gets
    # A finished run: one read of its manifest's head (not the whole manifest) and one of its summary.
    finished = {key.split("/runs/ckpt-2/", 1)[1]: count for key, count in gets.items() if "/runs/ckpt-2/" in key}
    assert finished == {"manifest.json": 1, "summary.json": 1}, finished
    assert proxy.transferred[("GET", f"{bucket}/runs/ckpt-2/manifest.json")] == HEAD_BYTES < manifest_size
    # A run in progress: what status reads (the plan, markers), nothing of its part.
    progress = {key.split("/runs/later/ckpt-3/", 1)[1] for key in gets if "/runs/later/ckpt-3/" in key}
    assert progress == {"manifest.json", "shards.json", "shards/00000/_SUCCESS.json"}, progress
    listings = sum(count for (method, key), count in proxy.requests.items() if method == "GET" and key.endswith("?list"))
    print(f"\n[runs on s3] 4 runs: {sum(gets.values())} object reads, {listings} listings")


# --------------------------------------------------------------------------- real runs, with prices


def _priced(config: Path, checkpoint: str, accelerator_per_hour: float) -> Path:
    text = config.read_text(encoding="utf-8").replace("  temperature:", f"  checkpoint_id: {checkpoint}\n  temperature:")
    text += (
        "cost:\n  currency: EUR\n  prompt_per_million: 0.2\n  completion_per_million: 0.8\n"
        f"  accelerators: 2\n  server_share: 0.5\n  accelerator_per_hour: {accelerator_per_hour}\n"
    )
    config.write_text(text, encoding="utf-8")
    return config


def test_a_leaderboard_of_testbed_runs_with_their_cost(testbed: Testbed, tmp_path: Path) -> None:
    """Two checkpoints (two temperatures) run locally and one sharded: `runs` ranks them in one
    group with the summaries' numbers, and `report` shows the same money."""
    runs_dir = tmp_path / "local-runs"
    greedy = _priced(write_config(tmp_path, testbed, episodes=8, name="greedy", temperature=0.0), "ckpt-greedy", 2.0)
    warm = _priced(write_config(tmp_path, testbed, episodes=8, name="warm", temperature=0.7), "ckpt-warm", 2.0)
    env = testbed.env(SHOPSIMRL_LOG_FORMAT="json")
    for config in (greedy, warm):
        done = cli("run", str(config), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    sharded = cli("run", str(greedy), "--shards", "2", "--run", str(runs_dir / "greedy-sharded"), env=env)
    assert sharded.returncode == 0, sharded.stderr[-3000:]

    listed = cli("runs", str(runs_dir), "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    document = json.loads(listed.stdout)
    assert len(document["groups"]) == 1 and len(document["runs"]) == 3  # one job list: one leaderboard
    for run in document["runs"]:
        summary = json.loads((Path(run["location"]) / "summary.json").read_text(encoding="utf-8"))
        assert run["state"] == "finished"
        assert run["score"] == summary["intent_to_treat"]["score"]
        assert run["cost"] == summary["cost"]["money"]["total"] > 0 and run["currency"] == "EUR"
        assert run["tokens"] == summary["cost"]["tokens_all_attempts"]["total_tokens"] > 0
        hours = summary["throughput"]["active_seconds"] / 3600 * 2 * 0.5
        assert summary["cost"]["accelerator_hours"] == pytest.approx(hours)
    scores = [run["score"] for run in document["runs"]]
    assert scores == sorted(scores, reverse=True)
    local, copy = (
        {run["kind"]: run for run in document["runs"] if run["checkpoint"] == "ckpt-greedy"}[kind]
        for kind in ("local", "sharded")
    )
    assert copy["fingerprint"] == local["fingerprint"] and copy["score"] == local["score"] and copy["tokens"] == local["tokens"]

    table = cli("runs", str(runs_dir), env=env)
    assert table.returncode == 0 and "ckpt-warm" in table.stdout and " EUR" in table.stdout, table.stderr

    # Other prices in the config do not reprice the run: it keeps those it was created with, and says so.
    _priced(greedy, "ckpt-greedy", 99.0)
    again = cli("run", str(greedy), env=env)
    assert again.returncode == 0 and "prices_not_applied" in again.stderr
    after = json.loads((runs_dir / "greedy" / "summary.json").read_text(encoding="utf-8"))
    assert after["cost"]["pricing"]["accelerator_per_hour"] == 2.0

    report = tmp_path / "report.html"
    made = cli("report", str(runs_dir / "greedy"), str(runs_dir / "warm"), "-o", str(report), env=env)
    assert made.returncode == 0, made.stderr[-2000:]
    page = report.read_text(encoding="utf-8")
    assert "<h3>Cost and time</h3>" in page
    money = after["cost"]["money"]["total"]
    shown = f"{money:.2f}" if money >= 1 else f"{money:.4f}"
    assert re.search(rf"<td>{re.escape(shown)} EUR \(prompt ", page), page[page.index("Cost and time") :][:3000]
