"""episode_row agrees with summary.json: the research tools and the summary count the same things."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shopsimrl.metrics import summarize_traces
from shopsimrl.records import read_trace
from shopsimrl.research.episodes import CORE_COLUMNS, episode_row
from shopsimrl.storage.reading import open_run

from .conftest import ResearchRuns


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["local", "legacy"])
def test_rows_add_up_to_the_summary(research_runs: ResearchRuns, which: str) -> None:
    records = list(open_run(getattr(research_runs, which)).records())
    rows = [episode_row(record) for record in records]
    summary = summarize_traces(records)
    assert [list(row)[: len(CORE_COLUMNS)] for row in rows] == [list(CORE_COLUMNS)] * len(rows)
    done = [row for row in rows if row["completed"]]
    assert _mean([row["reward"] for row in done]) == pytest.approx(summary["primary"]["reward_mean"])
    assert _mean([row["success"] for row in done]) == pytest.approx(summary["primary"]["success_rate"])
    itt = [row["reward_itt"] for row in rows if row["reward_itt"] is not None]
    assert _mean(itt) == pytest.approx(summary["intent_to_treat"]["reward_mean"])
    for component, mean in summary["reward_components"].items():
        assert _mean([row[component] for row in done if component in row]) == pytest.approx(mean)
    behavior = summary["behavior"]  # counted over completed episodes
    assert sum(row["actions"] for row in done) == behavior["total_actions"]
    assert sum(row["invalid_actions"] for row in done) == behavior["invalid_actions"]
    assert sum(row["protocol_errors"] for row in done) == behavior["protocol_errors"]
    for key, total in summary["cost"]["tokens"].items():
        assert sum(row[key] or 0 for row in done) == total
    reasons = {}
    for row in done:
        reasons[row["termination_reason"]] = reasons.get(row["termination_reason"], 0) + 1
    assert reasons == behavior["termination_reasons"]


def test_failed_episodes_count_zero_unless_infrastructure() -> None:
    failed = {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": "task-000007__sample-001",
        "status": "failed",
        "job": {"task_id": 7, "sample_id": 1, "seed": 7, "split": "val"},
        "final": None,
    }
    row = episode_row(read_trace({**failed, "failure_class": "policy"}))
    assert row["reward"] is None and row["reward_itt"] == 0.0 and row["success_itt"] == 0.0 and row["task_id"] == 7
    assert episode_row(read_trace({**failed, "failure_class": "infrastructure"}))["reward_itt"] is None
    json.dumps(row)  # every value is plain JSON


def test_a_fixture_row(tmp_path: Path) -> None:
    line = (
        (Path(__file__).resolve().parents[1] / "fixtures" / "legacy_v4_traces.jsonl").read_text(encoding="utf-8").splitlines()[0]
    )
    row = episode_row(read_trace(json.loads(line)))
    assert row["episode_id"] == "task-000003__sample-000" and row["task_id"] == 3 and row["split"] == "val"
