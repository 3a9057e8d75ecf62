"""Episodes and steps as tables (``shopsimrl.research.analysis``) and ``shopsimrl export table``: the rows
against the trace records, Parquet and CSV read back equal, steps written batch by batch."""

from __future__ import annotations

import math
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shopsimrl.records import EpisodeTrace, to_plain
from shopsimrl.research import analysis, tables
from shopsimrl.research.episodes import CORE_COLUMNS, episode_row
from shopsimrl.storage.reading import open_run
from tests.sharded.conftest import cli

from .conftest import RUN_KINDS, ResearchRuns, run_location


def _records(runs: ResearchRuns, kind: str, s3_env: dict[str, str]) -> list[EpisodeTrace]:
    return list(open_run(run_location(runs, kind)[0]).records())


def test_every_row_column_has_a_type() -> None:
    assert tuple(tables.EPISODE_TYPES) == CORE_COLUMNS


@pytest.mark.slow
@pytest.mark.parametrize("kind", RUN_KINDS)
def test_the_episode_table_is_episode_row_typed(research_runs: ResearchRuns, s3_env: dict[str, str], kind: str) -> None:
    records = _records(research_runs, kind, s3_env)
    table = analysis.episodes_table(run_location(research_runs, kind)[0])
    rows = [episode_row(record) for record in records]
    components = sorted({key for row in rows for key in row if key.startswith("r_")})
    assert table.column_names == [*CORE_COLUMNS, *components]
    assert table.num_rows == len(records)
    for got, row in zip(table.to_pylist(), rows, strict=True):
        for name in CORE_COLUMNS:
            expected = row[name]
            if name in ("started_at", "ended_at") and expected is not None:
                expected = datetime.fromisoformat(expected)
            assert got[name] == expected, (row["episode_id"], name)
        assert {key: got[key] for key in components if got[key] is not None} == {
            key: row[key] for key in components if key in row
        }


@pytest.mark.slow
def test_steps_read_the_trace_of_each_call(research_runs: ResearchRuns) -> None:
    """The v4 traces hold a repair turn, a cut-off reply and an invalid action."""
    steps = {(row["episode_id"], row["step_index"]): row for row in analysis.steps_table(research_runs.legacy).to_pylist()}
    records = list(open_run(research_runs.legacy).records())
    assert len(steps) == sum(len(record.steps) for record in records)

    repair = steps[("task-000006__sample-000", 1)]
    assert repair["protocol_error"] == "tool_call_count" and repair["tool_calls"] == 0 and repair["action"] is None
    assert repair["page_type"] == "search_home" and repair["content_chars"] == len("Action: search[台灯]")
    retry_on_same_page = steps[("task-000006__sample-000", 2)]
    assert retry_on_same_page["page_type"] == "search_home" and retry_on_same_page["tool_name"] == "search"
    assert retry_on_same_page["arguments_json"] == '{"query": "台灯"}' and retry_on_same_page["action"] == "search[台灯]"
    assert steps[("task-000006__sample-000", 3)]["page_type"] == "search_results"

    cut_off = steps[("task-000005__sample-001", 2)]
    assert cut_off["policy_failure"] == "generation_length" and cut_off["finish_reason"] == "length"
    assert cut_off["reasoning_tokens"] == 4000 and cut_off["completion_tokens"] == 4096 and cut_off["latency_ms"] == 30500.0
    assert cut_off["feedback_valid"] is None and cut_off["step_reward"] is None

    invalid = steps[("task-000004__sample-000", 3)]
    assert invalid["feedback_valid"] is False and invalid["feedback_reason"] == "incomplete_options"
    assert invalid["tools_offered"] == "click" and invalid["http_attempts"] is None  # v4 records no HTTP attempts

    bought = steps[("task-000003__sample-000", 3)]
    assert bought["done"] is True and bought["step_reward"] == 1.0 and bought["feedback_message"] == "购买已执行"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "sharded"])
def test_steps_of_testbed_runs(research_runs: ResearchRuns, s3_env: dict[str, str], kind: str) -> None:
    records = _records(research_runs, kind, s3_env)
    table = analysis.steps_table(run_location(research_runs, kind)[0])
    assert table.schema == tables.STEP_SCHEMA
    rows = table.to_pylist()
    assert len(rows) == sum(len(record.steps) for record in records)
    by_key = {(row["episode_id"], row["step_index"]): row for row in rows}
    for record in map(to_plain, records):
        for step in record["steps"]:
            row = by_key[(record["episode_id"], step["step_index"])]
            model = step["model"]
            assert row["tool_name"] == model["tool_calls"][0]["name"] and row["action"] == step["action"]
            assert row["latency_ms"] == model["latency_ms"] and row["prompt_tokens"] == model["usage"]["prompt_tokens"]
            assert row["http_attempts"] == len(model["attempts"]) and row["retries"] == len(model["attempts"]) - 1
            assert row["feedback_valid"] == step["environment"]["action_feedback"]["valid"]
            assert row["observation_chars"] == len(step["observation"])


@pytest.mark.slow
def test_dataframes_keep_missing_values_missing(research_runs: ResearchRuns) -> None:
    episodes = analysis.episodes(research_runs.legacy)
    assert str(episodes["task_id"].dtype) == "Int64" and str(episodes["completed"].dtype) == "boolean"
    failed = episodes.set_index("episode_id").loc["task-000011__sample-000"]
    assert math.isnan(failed["reward"]) and failed["steps"] == 0 and failed["reward_itt"] == 0.0
    steps = analysis.steps(research_runs.local)
    assert str(steps["reasoning_tokens"].dtype) == "Int64" and steps["reasoning_tokens"].isna().all()
    assert (steps["prompt_tokens"] > 0).all()


# --------------------------------------------------------------------------- export table


@pytest.mark.slow
@pytest.mark.parametrize("kind", RUN_KINDS)
@pytest.mark.parametrize("level", ["episodes", "steps"])
def test_export_reads_back_equal(
    research_runs: ResearchRuns, s3_env: dict[str, str], tmp_path: Path, kind: str, level: str
) -> None:
    location, env = run_location(research_runs, kind)
    expected = analysis.episodes_table(location) if level == "episodes" else analysis.steps_table(location)
    for to in ("parquet", "csv"):
        path = tmp_path / f"{level}.{to}"
        done = cli("export", "table", location, "--to", to, "--level", level, "-o", str(path), env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"wrote {expected.num_rows} {level[:-1]} rows to {path}"
        back = pq.read_table(path) if to == "parquet" else tables.read_csv_table(path, expected.schema)
        assert back.schema == expected.schema
        assert back.equals(expected), (kind, level, to)
    assert sorted(item.name for item in tmp_path.iterdir()) == [f"{level}.csv", f"{level}.parquet"]  # no partial file left


def test_csv_keeps_empty_strings_apart_from_missing(tmp_path: Path) -> None:
    schema = pa.schema([("text", pa.string()), ("count", pa.int64())])
    table = pa.table({"text": ["", None, 'a,b "c"'], "count": [1, None, 3]}, schema=schema)
    path = tmp_path / "t.csv"
    pa.csv.write_csv(table, path)
    assert tables.read_csv_table(path, schema).equals(table)


@pytest.mark.slow
def test_steps_are_written_while_the_run_is_still_being_read(
    research_runs: ResearchRuns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded memory: every batch is written before the next records are read."""
    run = open_run(research_runs.local)
    streamed = run.records
    read = 0

    def counting() -> Any:
        nonlocal read
        for record in streamed():
            read += 1
            yield record

    monkeypatch.setattr(run, "records", counting)
    read_at_writes: list[int] = []

    class Watched(pq.ParquetWriter):  # type: ignore[misc]
        def write_batch(self, batch: pa.RecordBatch, *args: Any, **kwargs: Any) -> None:
            read_at_writes.append(read)
            super().write_batch(batch, *args, **kwargs)

    monkeypatch.setattr(tables.pq, "ParquetWriter", Watched)
    path = tmp_path / "steps.parquet"
    rows = tables.export_table(run, path, to="parquet", level="steps", batch_rows=10)
    assert rows == sum(len(record.steps) for record in open_run(research_runs.local).records())
    assert len(read_at_writes) == math.ceil(rows / 10)
    assert read_at_writes[0] < research_runs.episodes / 2 and read_at_writes == sorted(read_at_writes)
    metadata = pq.ParquetFile(path).metadata
    assert metadata.num_row_groups == len(read_at_writes)
    assert all(metadata.row_group(group).num_rows <= 10 for group in range(metadata.num_row_groups))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "xlsx", "-o", "{tmp}/t.x"], "'xlsx' is not one of"),
        (["--to", "csv", "--level", "tasks", "-o", "{tmp}/t.csv"], "'tasks' is not one of"),
        (["--to", "csv", "-o", "{tmp}"], "-o/--output: {tmp} is a directory"),
    ],
)
def test_bad_export_arguments_exit_2(research_runs: ResearchRuns, tmp_path: Path, args: list[str], message: str) -> None:
    done = cli("export", "table", str(research_runs.local), *(arg.format(tmp=tmp_path) for arg in args))
    assert done.returncode == 2 and message.format(tmp=tmp_path) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_missing_run_exits_2_and_an_unreachable_store_3(tmp_path: Path) -> None:
    done = cli("export", "table", str(tmp_path / "nope"), "--to", "csv", "-o", str(tmp_path / "t.csv"))
    assert done.returncode == 2 and done.stderr.strip() == f"error: {tmp_path / 'nope'} does not exist"
    closed = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "SHOPSIMRL_STORE_RETRY_BUDGET_S": "1",
    }
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")} | closed
    done = cli("export", "table", "s3://bucket/runs/x", "--to", "csv", "-o", str(tmp_path / "t.csv"), env=env)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []
