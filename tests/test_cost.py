"""Cost (issue 26, item 6): tokens of every attempt, active wall time, accelerator hours and money
in the summary, priced from the manifest's ``execution.cost``; prices are no part of the plan."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.config import ConfigError, load_experiment_config
from shopsimrl.cost import ActiveTime, cost_block, read_pricing, unapplied_prices
from shopsimrl.metrics import SummaryAccumulator, format_summary_table, unfinished_view
from shopsimrl.records import read_summary, read_trace
from shopsimrl.runner.experiment import prepare
from shopsimrl.schemas import TRACE_SCHEMA_VERSION, fingerprint

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ROOT / "configs" / "splits" / "persona_splits.v1.json"
PRICES = {
    "currency": "EUR",
    "prompt_per_million": 2.0,
    "completion_per_million": 10.0,
    "accelerators": 2,
    "server_share": 0.5,
    "accelerator_per_hour": 3.0,
}


def _record(
    episode_id: str,
    *,
    start: str,
    end: str,
    status: str = "completed",
    usage: tuple[int, int] = (1000, 100),
    attempt: int = 1,
    failure_class: str | None = None,
) -> dict[str, Any]:
    prompt, completion = usage
    step = {
        "step_index": 0,
        "model": {"usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}},
    }
    record: dict[str, Any] = {
        "schema_version": TRACE_SCHEMA_VERSION,
        "episode_id": episode_id,
        "status": status,
        "attempt": attempt,
        "job": {"task_id": int(episode_id[1:]), "sample_id": 0, "seed": 1, "split": "val"},
        "started_at": f"2026-01-01T{start}+00:00",
        "ended_at": f"2026-01-01T{end}+00:00",
        "steps": [step],
    }
    if status == "completed":
        record["final"] = {"done": True, "reward": 1.0, "reward_detail": {"r_success": 1.0}}
    else:
        record.update(failure_class=failure_class or "policy", error={"type": "PolicyError"})
    return record


# --------------------------------------------------------------------------- active time


def test_active_time_is_the_union_of_spans_with_short_pauses_bridged() -> None:
    active = ActiveTime(bridge_s=60)
    # Two shards' episodes overlapping: counted once, not summed.
    active.add(0, 100)
    active.add(50, 150)
    # A 30 s pause (bridged) and a 10-minute pause between invocations (not counted).
    active.add(180, 200)
    active.add(800, 900)
    active.add(10, 20)  # inside an earlier span: nothing new
    assert active.spans == 2
    assert active.seconds() == pytest.approx(200 + 100)
    assert active.bridged_over_limit_s == 0


def test_active_time_joins_its_closest_spans_past_its_limit_and_says_how_much_it_added() -> None:
    active = ActiveTime(bridge_s=1, max_spans=3)
    for start, end in ((0, 1), (10, 11), (30, 31), (35, 36)):  # gaps 9, 19, 4
        active.add(start, end)
    assert active.spans == 3
    assert active.bridged_over_limit_s == pytest.approx(4)  # the closest pair was joined
    assert active.seconds() == pytest.approx(1 + 1 + 6)


def test_active_time_ignores_records_without_both_times_or_with_naive_ones() -> None:
    active = ActiveTime()
    active.add_times("2026-01-01T00:00:00+00:00", None)
    active.add_times("2026-01-01T00:00:00", "2026-01-01T00:01:00")  # no zone: which hour is unknown
    active.add_times("2026-01-01T00:01:00+00:00", "2026-01-01T00:00:00+00:00")  # ends before it starts
    assert active.seconds() is None


# --------------------------------------------------------------------------- the summary


def _accumulate(records: list[tuple[str, dict[str, Any]]], execution: dict[str, Any] | None) -> dict[str, Any]:
    accumulator = SummaryAccumulator(requested_episode_ids={"e1", "e2", "e3"}, execution=execution)
    for how, record in records:
        trace = read_trace(record)
        {"add": accumulator.add, "superseded": accumulator.note_superseded_attempt, "duplicate": accumulator.note_duplicate}[how](
            trace
        )
    return accumulator.result(created_at="2026-01-02T00:00:00+00:00")


RECORDS = [
    # e1: an infrastructure failure, then a completed retry.
    ("superseded", _record("e1", start="00:00:00", end="00:10:00", status="failed", failure_class="infrastructure")),
    ("add", _record("e1", start="00:00:30", end="00:20:00", attempt=2)),
    # e2: completed, and run again by a replaced pod (a duplicate).
    ("add", _record("e2", start="00:05:00", end="00:25:00")),
    ("duplicate", _record("e2", start="00:06:00", end="00:26:00")),
    # e3: failed as an outcome, in a second invocation two hours later.
    ("add", _record("e3", start="02:00:00", end="02:30:00", status="failed", usage=(500, 50))),
]


def test_the_summary_prices_every_attempt_and_the_active_time_of_the_run() -> None:
    summary = _accumulate(RECORDS, {"concurrency": 4, "cost": PRICES})
    cost = summary["cost"]
    # The reference key keeps its meaning: completed episodes only.
    assert cost["tokens"] == {"prompt_tokens": 2000, "completion_tokens": 200, "total_tokens": 2200}
    # Spent: the failed attempt, the duplicate and the failed outcome too.
    assert cost["tokens_all_attempts"] == {"prompt_tokens": 4500, "completion_tokens": 450, "total_tokens": 4950}
    # Active: 00:00–00:26 and 02:00–02:30 (the two-hour pause between invocations is not counted).
    active = 26 * 60 + 30 * 60
    assert summary["throughput"]["active_seconds"] == pytest.approx(active)
    assert summary["throughput"]["span_seconds"] == pytest.approx(2.5 * 3600)
    hours = active / 3600 * 2 * 0.5
    assert cost["accelerator_hours"] == pytest.approx(hours)
    money = cost["money"]
    assert money["currency"] == "EUR"
    assert money["prompt_tokens"] == pytest.approx(4500 / 1e6 * 2.0)
    assert money["completion_tokens"] == pytest.approx(450 / 1e6 * 10.0)
    assert money["accelerator"] == pytest.approx(hours * 3.0)
    assert money["total"] == pytest.approx(4500 / 1e6 * 2.0 + 450 / 1e6 * 10.0 + hours * 3.0)
    assert cost["pricing"] == {**PRICES, "accelerators": 2.0}
    assert cost["notes"] == []
    read_summary(summary)  # fits the summary's schema
    table = format_summary_table(summary)
    assert "accelerator hours 0.9333" in table and "money 2.81 EUR (prompt 0.0090, completion 0.0045, accelerator 2.80)" in table


def test_without_prices_the_summary_keeps_tokens_and_times_and_no_money() -> None:
    summary = _accumulate(RECORDS, {"concurrency": 4})
    assert summary["cost"]["tokens_all_attempts"]["total_tokens"] == 4950
    assert summary["cost"]["pricing"] is None and summary["cost"]["money"] is None
    assert summary["cost"]["accelerator_hours"] is None
    assert summary["throughput"]["active_seconds"] == pytest.approx(56 * 60)
    assert "money –" in format_summary_table(summary)


def test_a_priced_item_without_its_counts_makes_the_total_unknown_and_says_why() -> None:
    no_usage = copy.deepcopy(RECORDS[1][1])
    no_usage["steps"] = []
    summary = _accumulate([("add", no_usage)], {"cost": {"prompt_per_million": 1.0}})
    assert summary["cost"]["money"] == {"currency": "USD", "prompt_tokens": None, "total": None}
    assert summary["cost"]["notes"] == ["prompt_tokens priced, but the model server reported none: the total is unknown"]
    assert "money unknown USD (prompt unknown)" in format_summary_table(summary)


def test_prices_that_cannot_be_read_from_a_manifest_give_a_note_not_a_failure() -> None:
    pricing, note = read_pricing({"cost": {"prompt_per_million": -1}})
    assert pricing is None and note is not None and "prompt_per_million" in note
    summary = _accumulate(RECORDS, {"cost": {"prompt_per_million": "cheap"}})
    assert summary["cost"]["money"] is None
    assert "execution.cost is not a valid cost block" in summary["cost"]["notes"][0]


def test_an_unfinished_view_keeps_the_tokens_its_attempt_spent() -> None:
    """The reducer holds unfinished attempts as views: their tokens must still be counted."""
    failed = RECORDS[0][1]
    whole, viewed = SummaryAccumulator(), SummaryAccumulator()
    whole.add(read_trace(failed))
    viewed.add(unfinished_view(read_trace(failed)))
    assert viewed.result(created_at="x") == whole.result(created_at="x")
    assert whole.result(created_at="x")["cost"]["tokens_all_attempts"]["total_tokens"] == 1100


def test_a_summary_written_before_cost_still_reads_and_prints() -> None:
    old = _accumulate(RECORDS, None)
    for key in ("tokens_all_attempts", "pricing", "accelerator_hours", "money", "notes"):
        del old["cost"][key]
    del old["throughput"]["active_seconds"], old["throughput"]["span_seconds"]
    model = read_summary(old)
    assert model.cost.money is None and model.cost.tokens_all_attempts == {} and model.cost.notes == []
    assert "money –" in format_summary_table(old)


def test_cost_block_totals_only_what_is_priced() -> None:
    pricing, _ = read_pricing({"cost": {"accelerators": 1, "accelerator_per_hour": 4.0}})
    block = cost_block({"total_tokens": 5}, 1800.0, pricing)
    assert block["accelerator_hours"] == pytest.approx(0.5)
    assert block["money"] == {"currency": "USD", "accelerator": pytest.approx(2.0), "total": pytest.approx(2.0)}


# --------------------------------------------------------------------------- the config


def _config(tmp_path: Path, cost: str = "") -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"tasks: {{split_file: {SPLITS}, split: val, sample_size: 5}}\n"
        "environment: {persona: true}\n"
        "model: {name: m, base_url: http://127.0.0.1:1/v1}\n" + cost,
        encoding="utf-8",
    )
    return path


def test_prices_are_execution_settings_not_part_of_the_plan(tmp_path: Path) -> None:
    bare = prepare(load_experiment_config(_config(tmp_path)))
    priced = prepare(
        load_experiment_config(
            _config(tmp_path, "cost: {prompt_per_million: 0.5, accelerators: 1, accelerator_per_hour: 2, server_share: 0.25}\n")
        )
    )
    assert fingerprint(priced.plan()) == fingerprint(bare.plan())
    assert "cost" not in bare.execution()
    assert priced.execution()["cost"] == {
        "currency": "USD",
        "prompt_per_million": 0.5,
        "completion_per_million": None,
        "accelerators": 1.0,
        "server_share": 0.25,
        "accelerator_per_hour": 2.0,
    }
    warning = unapplied_prices(bare.execution(), priced.execution())
    assert warning is not None and "prompt_per_million 0.5" in warning and "(none, the manifest's" in warning
    assert unapplied_prices(priced.execution(), dict(priced.execution())) is None


@pytest.mark.parametrize(
    ("block", "named"),
    [
        ("cost: {accelerator_per_hour: 2.5}", "cost.accelerator_per_hour needs cost.accelerators"),
        ("cost: {prompt_per_million: -1}", "cost.prompt_per_million"),
        ("cost: {server_share: 1.5}", "cost.server_share"),
        ("cost: {accelerators: 0}", "cost.accelerators"),
        ("cost: {completion_per_million: .nan}", "cost.completion_per_million"),
        ("cost: {prompt_per_milion: 1}", "cost.prompt_per_milion: unknown key"),
    ],
)
def test_bad_prices_are_refused_naming_the_key(tmp_path: Path, block: str, named: str) -> None:
    with pytest.raises(ConfigError, match=r"exp\.yaml") as caught:
        load_experiment_config(_config(tmp_path, block + "\n"))
    assert named in str(caught.value)


def test_plan_shows_the_prices_apart_from_the_plan(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from shopsimrl.cli import app

    config = _config(tmp_path, "cost: {prompt_per_million: 0.5, accelerators: 1, accelerator_per_hour: 2}\n")
    shown = CliRunner().invoke(app, ["plan", str(config), "--json"], prog_name="shopsimrl")
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    assert report["cost"] == {
        "currency": "USD",
        "prompt_per_million": 0.5,
        "accelerators": 1.0,
        "server_share": 1.0,
        "accelerator_per_hour": 2.0,
    }
    (tmp_path / "bare").mkdir()
    bare_config = _config(tmp_path / "bare")
    bare = json.loads(CliRunner().invoke(app, ["plan", str(bare_config), "--json"], prog_name="shopsimrl").stdout)
    assert "cost" not in bare and bare["plan_fingerprint"] == report["plan_fingerprint"]
    table = CliRunner().invoke(app, ["plan", str(config)], prog_name="shopsimrl").output
    assert "\ncost\n" in table and "prompt_per_million" in table, table
