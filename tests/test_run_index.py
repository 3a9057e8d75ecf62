"""``shopsimrl runs`` (issue 26, item 3) on a local folder: every kind of run found and listed with
its identity and headline, grouped by job list, sorted; runs without a summary by what their
progress file or markers say; unreadable ones with their error; and never a trace read."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.runner.lease_journal import ProcessIdentity
from shopsimrl.runner.progress import LOCAL_PROGRESS_SCHEMA
from shopsimrl.runner.runs import RunEntry, group_runs, list_runs, sort_runs
from shopsimrl.schemas import fingerprint

from .run_index_fixtures import legacy_run, local_run, plan, sharded_run

# --------------------------------------------------------------------------- what is opened

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # a PEP 578 hook cannot be removed: it records only inside opened_files()


@contextmanager
def opened_files() -> Iterator[list[str]]:
    """Every file this process opens inside the block."""
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


# --------------------------------------------------------------------------- a folder of runs


@pytest.fixture(scope="module")
def runs_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Written once for the module (half a second); no test changes it."""
    root = tmp_path_factory.mktemp("index") / "runs"
    # One job list (split val, seed 7): three checkpoints, one local run a sharded copy of another.
    local_run(root / "ckpt-100", plan("sweep", "ckpt-100"), [0.5, 0.5, 0.0, None])
    local_run(root / "ckpt-200", plan("sweep", "ckpt-200"), [1.0, 1.0, 0.5, 0.5])
    sharded_run(str(root / "cluster" / "ckpt-200"), plan("sweep", "ckpt-200"), [1.0, 1.0, 0.5, 0.5])
    # Another job list (seed 8): grouped apart.
    local_run(root / "other-seed", plan("sweep", "ckpt-200", seed=8), [1.0, 1.0, 1.0, 1.0], length=3)  # the dearest
    # In progress: a sharded run with one of two shards committed, a local run whose process runs now.
    sharded_run(str(root / "cluster" / "ckpt-300"), plan("sweep", "ckpt-300"), [1.0] * 4, commit=1, reduce=False)
    _with_progress(local_run(root / "ckpt-400", plan("sweep", "ckpt-400"), [1.0, 0.0], summarize=False), "running", 2, 1)
    # Finished, but its summary was never written (a full disk at the very end).
    _with_progress(local_run(root / "lost-summary", plan("sweep", "ckpt-700"), [1.0] * 4, summarize=False), "finished", 4, 0)
    # Traces of the earlier implementation, without a manifest.
    legacy_run(root / "earlier" / "v4-run", [1.0, 0.0])
    # Unreadable: a torn manifest; a summary of another plan.
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text('{"schema_version": "shopsimrl-run-manifest-v2", "plan', encoding="utf-8")
    local_run(root / "mixed-up", plan("sweep", "ckpt-500"), [1.0] * 4)
    other = local_run(root / "donor", plan("sweep", "ckpt-600"), [0.0] * 2)  # two episodes: the cheapest
    (root / "mixed-up" / "summary.json").write_bytes(other.summary_path.read_bytes())
    # Not runs: a hidden folder and an empty one.
    local_run(root / ".trash" / "old", plan("sweep", "ckpt-0"), [1.0] * 4)
    (root / "empty").mkdir()
    return root


def _with_progress(run: Any, state: str, completed: int, failed: int) -> None:
    """The ``progress.json`` a local run's process writes, this process as that process (alive)."""
    manifest = run.read_manifest()
    assert manifest is not None
    now = datetime.now(UTC).isoformat()
    run.progress_path.write_text(
        json.dumps(
            {
                "schema_version": LOCAL_PROGRESS_SCHEMA,
                "plan_fingerprint": manifest.plan_fingerprint,
                "process": ProcessIdentity.current().to_dict(),
                "started_at": now,
                "updated_at": now,
                "heartbeat_seconds": 2.0,
                "jobs": 4,
                "settled_before": 0,
                "completed_before": 0,
                "state": state,
                "completed": completed,
                "failed": failed,
            }
        ),
        encoding="utf-8",
    )


def _by_name(entries: list[RunEntry]) -> dict[str, RunEntry]:
    return {entry.name: entry for entry in entries}


def test_every_run_is_listed_with_its_identity_headline_and_state(runs_folder: Path) -> None:
    entries = _by_name(list_runs(str(runs_folder)))
    assert set(entries) == {
        "ckpt-100",
        "ckpt-200",
        "cluster/ckpt-200",
        "other-seed",
        "cluster/ckpt-300",
        "ckpt-400",
        "earlier/v4-run",
        "broken",
        "mixed-up",
        "donor",
        "lost-summary",
    }
    best = entries["ckpt-200"]
    assert (best.kind, best.state, best.experiment, best.model, best.checkpoint, best.split) == (
        "local",
        "finished",
        "sweep",
        "org/policy-4b",
        "ckpt-200",
        "val",
    )
    assert best.fingerprint == fingerprint(plan("sweep", "ckpt-200"))
    assert best.created is not None and best.created.startswith(datetime.now(UTC).strftime("%Y-%m-%d"))
    assert best.score == pytest.approx(75.0) and best.score_ci95 is not None
    assert best.score_ci95[0] < 75.0 < best.score_ci95[1]
    assert (best.requested, best.completed, best.failed, best.coverage) == (4, 4, 0, 1.0)
    assert best.tokens == 4 * 1050 and best.tokens_scope == "all attempts"
    # 4 × 1000 prompt tokens at 1 per million, 4 × 50 completion at 2, 4 minutes of one accelerator at 3 per hour.
    assert best.cost == pytest.approx(4000 / 1e6 + 200 * 2 / 1e6 + 4 / 60 * 3.0)
    assert best.accelerator_hours == pytest.approx(4 / 60) and best.currency == "USD"
    # The sharded copy of the same plan: the same numbers, from its reduced summary.
    copy = entries["cluster/ckpt-200"]
    assert (copy.kind, copy.state, copy.fingerprint, copy.score, copy.cost) == (
        "sharded",
        "finished",
        best.fingerprint,
        best.score,
        best.cost,
    )
    # A failure counts 0 in the intent-to-treat score and is counted.
    assert entries["ckpt-100"].score == pytest.approx(25.0) and entries["ckpt-100"].failed == 1

    in_progress = entries["cluster/ckpt-300"]
    assert (in_progress.state, in_progress.requested, in_progress.completed, in_progress.score) == ("in progress", 4, 2, None)
    assert in_progress.detail == "1/2 shards committed, no summary yet"
    running = entries["ckpt-400"]
    assert (running.state, running.completed, running.failed, running.requested) == ("running", 2, 1, 4)
    assert running.detail is not None and f"pid {os.getpid()}" in running.detail
    lost = entries["lost-summary"]
    assert (lost.state, lost.completed, lost.score) == ("finished", 4, None)
    assert lost.detail == "no summary.json: `shopsimrl summarize` writes it"

    legacy = entries["earlier/v4-run"]
    assert (legacy.kind, legacy.state, legacy.fingerprint, legacy.job_list) == ("legacy", "finished", None, None)
    assert legacy.score == pytest.approx(50.0)

    broken = entries["broken"]
    assert broken.state == "unreadable" and broken.error is not None and "manifest.json is not valid JSON" in broken.error
    mixed = entries["mixed-up"]
    assert mixed.state == "unreadable" and mixed.error is not None and "summary.json belongs to plan" in mixed.error
    assert mixed.experiment == "sweep" and mixed.checkpoint == "ckpt-500"  # the identity is still shown


def test_runs_of_one_job_list_form_one_leaderboard(runs_folder: Path) -> None:
    entries = sort_runs(list_runs(str(runs_folder)), "score")
    groups = group_runs(entries)
    by_key = {key: [entry.name for entry in members] for key, _, members in groups}
    seed_7 = next(key for key, label, _ in groups if label is not None and "seed 7" in label)
    # Best score first, then runs without a score (in progress, unreadable) by name.
    assert by_key[seed_7] == [
        "ckpt-200",
        "cluster/ckpt-200",
        "ckpt-100",
        "donor",
        "ckpt-400",
        "cluster/ckpt-300",
        "lost-summary",
        "mixed-up",
    ]
    seed_8 = next(key for key, label, _ in groups if label is not None and "seed 8" in label)
    assert by_key[seed_8] == ["other-seed"]
    # No readable plan, no job list: one group, last.
    assert groups[-1][0] is None and sorted(by_key[None]) == ["broken", "earlier/v4-run"]
    label = next(label for key, label, _ in groups if key == seed_7)
    assert label == "split val · 4 of 400 tasks · seed 7 · repeats 1"


@pytest.mark.parametrize(
    ("column", "descending", "first"),
    [("cost", None, "donor"), ("cost", True, "other-seed"), ("checkpoint", None, "ckpt-100"), ("coverage", None, "ckpt-200")],
)
def test_any_column_sorts_and_runs_without_a_value_come_last(
    runs_folder: Path, column: str, descending: bool | None, first: str
) -> None:
    ordered = sort_runs(list_runs(str(runs_folder)), column, descending=descending)
    assert ordered[0].name == first
    values = [getattr(entry, column) for entry in ordered]
    present = [value for value in values if value is not None]
    assert values[: len(present)] == present  # every missing value after every present one
    reverse = descending if descending is not None else column == "coverage"
    assert present == sorted(present, reverse=reverse)


def test_listing_reads_no_trace_and_no_part(runs_folder: Path) -> None:
    with opened_files() as seen:
        entries = list_runs(str(runs_folder))
    assert len(entries) == 11
    opened = [path for path in seen if Path(path).is_relative_to(runs_folder)]  # not /proc (is a pid alive?)
    assert opened, "the audit hook saw no file of the runs opened"
    names = {Path(path).name for path in opened}
    assert "traces.jsonl" not in names and not any(name.startswith("part-") for name in names), sorted(opened)
    assert "jobs.jsonl" not in names
    # What was read: manifests (finished runs: their head only), summaries, progress, markers, shard maps.
    assert names <= {"manifest.json", "summary.json", "progress.json", "shards.json", "_SUCCESS.json"}, names
    # A finished run costs two reads: its manifest head and its summary.
    finished = [path for path in opened if Path(path).parent.name == "ckpt-200" and "cluster" not in path]
    assert sorted(Path(path).name for path in finished) == ["manifest.json", "summary.json"]


def test_the_location_may_be_one_run_and_a_folder_without_runs_lists_none(runs_folder: Path) -> None:
    (one,) = list_runs(str(runs_folder / "ckpt-200"))
    assert (one.name, one.state) == (".", "finished")
    assert list_runs(str(runs_folder / "empty")) == []


def test_depth_bounds_the_search(runs_folder: Path) -> None:
    assert {entry.name for entry in list_runs(str(runs_folder), max_depth=0)} == set()
    shallow = {entry.name for entry in list_runs(str(runs_folder), max_depth=1)}
    assert "ckpt-200" in shallow and "cluster/ckpt-200" not in shallow


def test_a_folder_that_cannot_be_listed_is_listed_with_its_error(runs_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shopsimrl.storage.objectstore import ObjectStore

    real = ObjectStore.list_entries

    def refuse_cluster(self: ObjectStore, rel: str = "") -> tuple[list[str], list[str]]:
        if rel == "cluster":
            raise PermissionError(13, "Permission denied", str(runs_folder / "cluster"))
        return real(self, rel)

    monkeypatch.setattr(ObjectStore, "list_entries", refuse_cluster)
    entries = _by_name(list_runs(str(runs_folder)))
    assert entries["cluster"].state == "unreadable" and "Permission denied" in (entries["cluster"].error or "")
    assert entries["ckpt-200"].state == "finished"  # the rest is listed


# --------------------------------------------------------------------------- the command


def _runs(*args: str) -> Any:
    return CliRunner().invoke(app, ["runs", *args], prog_name="shopsimrl")


def test_the_command_prints_a_leaderboard_per_job_list(runs_folder: Path) -> None:
    result = _runs(str(runs_folder))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # Groups in the order of their best runs: seed 8's only run scores 100.
    assert lines[0].startswith("job list ") and lines[0].endswith("split val · 4 of 400 tasks · seed 8 · repeats 1 · 1 run")
    at = next(i for i, line in enumerate(lines) if line.endswith("split val · 4 of 400 tasks · seed 7 · repeats 1 · 8 runs"))
    assert lines[at + 1].split()[:4] == ["#", "run", "experiment", "model"]
    first = lines[at + 2].split()
    assert first[:5] == ["1", "ckpt-200", "sweep", "org/policy-4b", "ckpt-200"] and "75.00" in first and "USD" in first
    text = result.output
    assert "1/2 shards committed, no summary yet" in text and f"pid {os.getpid()}" in text
    assert "error: " in text and "no job list (no readable manifest) · 2 runs" in text


def test_the_command_prints_json_with_every_field(runs_folder: Path) -> None:
    result = _runs(str(runs_folder), "--json", "--sort", "cost", "--descending")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["sort"] == "cost" and document["location"] == str(runs_folder)
    costs = [run["cost"] for run in document["runs"] if run["cost"] is not None]
    assert costs == sorted(costs, reverse=True) and len(costs) == 5
    assert set(document["runs"][0]) == set(RunEntry("", "", "").as_dict())
    assert {group["job_list"] for group in document["groups"]} == {run["job_list"] for run in document["runs"]}
    flat = json.loads(_runs(str(runs_folder), "--json", "--no-group").output)
    assert flat["groups"] == [] and len(flat["runs"]) == 11


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sort", "reward"], "--sort: unknown column 'reward'; one of name, experiment"),
        (["--depth", "-1"], "--depth"),
    ],
)
def test_bad_options_exit_2_naming_the_option(runs_folder: Path, args: list[str], message: str) -> None:
    result = _runs(str(runs_folder), *args)
    assert result.exit_code == 2 and message in result.output


def test_a_location_that_is_no_folder_exits_2(tmp_path: Path) -> None:
    missing = _runs(str(tmp_path / "nowhere"))
    assert missing.exit_code == 2 and "does not exist" in missing.output
    (tmp_path / "file").write_text("x", encoding="utf-8")
    a_file = _runs(str(tmp_path / "file"))
    assert a_file.exit_code == 2 and "not a folder" in a_file.output
    bad = _runs("ftp://host/runs")
    assert bad.exit_code == 2 and "unsupported run location scheme" in bad.output
    empty = _runs(str(tmp_path))
    assert empty.exit_code == 0 and empty.output.strip() == f"no runs under {tmp_path}"
