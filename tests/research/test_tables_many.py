"""Tables across runs (issue 26, item 4): the analysis readers and ``export table`` over a folder
of runs or a list of runs, every row with its run's identity columns as ``shopsimrl runs`` shows
them, Parquet files carrying the runs as key/value metadata, steps streamed one run at a time,
runs that cannot be read left out with a warning (or, strict, failing the read); a single run
read as before. Real runs written as shopsimrl writes them (tests/run_index_fixtures.py), local
and sharded; the same over S3 in tests/sharded/test_tables_many.py."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.records import dump_line
from shopsimrl.research import analysis, runset
from shopsimrl.research.episodes import CORE_COLUMNS
from shopsimrl.research.outputs import OutputError
from shopsimrl.runner.runs import list_runs
from shopsimrl.storage.reading import Run, RunReadError, open_run
from tests.run_index_fixtures import legacy_run, local_run, plan, sharded_run
from tests.sharded.conftest import cli

from .conftest import ResearchRuns, run_location
from .synthetic import sharded_copy

RUN_COLUMNS = ["run_location", "run_experiment", "run_model", "run_checkpoint", "run_fingerprint", "run_split"]
READABLE = ["ckpt-1", "ckpt-2", "cluster/ckpt-3", "earlier/v4"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of runs: two local checkpoints (one with a failed episode), a sharded one, traces
    of the earlier implementation, a run with a torn manifest and no traces, an empty folder."""
    root = tmp_path_factory.mktemp("sweep") / "runs"
    local_run(root / "ckpt-1", plan("sweep", "ckpt-1"), [1.0, 0.5, 0.0, None])
    local_run(root / "ckpt-2", plan("sweep", "ckpt-2", repeats=2), [1.0] * 8)
    sharded_run(str(root / "cluster" / "ckpt-3"), plan("sweep", "ckpt-3"), [0.0, 1.0, 1.0, 0.5])
    legacy_run(root / "earlier" / "v4", [1.0, 0.0])
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text('{"schema_version": "shopsimrl-run-manifest-v2", "pl', encoding="utf-8")
    (root / "empty").mkdir()
    return root


def _rows_by_run(table: pa.Table) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        out.setdefault(row["run_location"], []).append(row)
    return out


def _without_run_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in row.items() if not key.startswith("run_")} for row in rows]


def _quietly(read: Any, *args: Any, **kwargs: Any) -> Any:
    with pytest.warns(analysis.RunSkippedWarning):
        return read(*args, **kwargs)


# --------------------------------------------------------------------------- a folder of runs


def test_a_folder_of_runs_is_one_episode_table_with_each_runs_identity(sweep: Path) -> None:
    with pytest.warns(analysis.RunSkippedWarning, match=r"broken holds no traces\.jsonl") as caught:
        table = analysis.episodes_table(sweep)
    assert len(caught) == 1  # the broken run, once; the empty folder is no run at all
    assert table.column_names[: len(RUN_COLUMNS) + len(CORE_COLUMNS)] == [*RUN_COLUMNS, *CORE_COLUMNS]
    entries = {entry.location: entry for entry in list_runs(str(sweep))}
    by_run = _rows_by_run(table)
    assert list(by_run) == [str(sweep / name) for name in READABLE]  # runs by name, each run's rows together
    for location, rows in by_run.items():
        entry = entries[location]  # what `shopsimrl runs` shows for it
        for row in rows:
            assert row["run_experiment"] == entry.experiment and row["run_model"] == entry.model
            assert row["run_checkpoint"] == entry.checkpoint and row["run_split"] == entry.split
            assert row["run_fingerprint"] == entry.fingerprint
        # The rows are that run's own table, read by itself, with every column it has.
        alone = analysis.episodes_table(location).to_pylist()
        assert [{key: row[key] for key in alone[0]} for row in rows] == alone
    assert by_run[str(sweep / "ckpt-1")][0]["run_checkpoint"] == "ckpt-1"
    assert (
        by_run[str(sweep / "ckpt-1")][0]["run_fingerprint"]
        == json.loads((sweep / "ckpt-1" / "manifest.json").read_text())["plan_fingerprint"]
    )
    assert {row["run_experiment"] for row in by_run[str(sweep / "earlier/v4")]} == {None}  # no manifest: nothing to say
    assert [len(by_run[str(sweep / name)]) for name in READABLE] == [4, 8, 4, 2]

    meta = analysis.runs_metadata(table)
    assert [run["name"] for run in meta["runs"]] == READABLE
    assert [run["rows"] for run in meta["runs"]] == [4, 8, 4, 2]
    assert meta["runs"][2]["kind"] == "sharded" and meta["runs"][2]["checkpoint"] == "ckpt-3"
    assert meta["runs"][0]["fingerprint"] == entries[str(sweep / "ckpt-1")].fingerprint
    assert meta["runs"][0]["created"] == entries[str(sweep / "ckpt-1")].created
    (skipped,) = meta["skipped_runs"]
    assert skipped["location"] == str(sweep / "broken") and "no traces.jsonl" in skipped["error"]


def test_reward_components_of_every_run_and_dataframes_with_their_runs(sweep: Path) -> None:
    frame = _quietly(analysis.episodes, sweep)
    assert str(frame["run_checkpoint"].dtype) in ("object", "str", "string")
    by_checkpoint = frame.groupby("run_checkpoint")["reward_itt"].mean().to_dict()
    assert by_checkpoint == pytest.approx({"ckpt-1": 1.5 / 4, "ckpt-2": 1.0, "ckpt-3": 2.5 / 4})
    assert "r_success" in frame.columns and frame["r_success"].notna().sum() == 3 + 8 + 4 + 2
    assert [run["name"] for run in frame.attrs["runs"]] == READABLE and len(frame.attrs["skipped_runs"]) == 1


def test_steps_of_many_runs_stream_run_after_run_never_mixing_two_in_a_batch(sweep: Path) -> None:
    table = _quietly(analysis.steps_table, sweep)
    assert table.schema == pa.schema([*analysis.RUN_COLUMNS, *analysis.STEP_SCHEMA])
    by_run = _rows_by_run(table)
    for location, rows in by_run.items():
        assert _without_run_columns(rows) == analysis.steps_table(location).to_pylist()
    assert [run["rows"] for run in analysis.runs_metadata(table)["runs"]] == [
        4,
        8,
        4,
        2,
    ]  # one model call per episode, the failed one too

    batches = _quietly(lambda: list(analysis.step_batches(sweep, batch_rows=3)))
    assert [batch.num_rows for batch in batches] == [3, 1, 3, 3, 2, 3, 1, 2]
    assert all(len(set(batch.column("run_location").to_pylist())) == 1 for batch in batches)
    assert pa.Table.from_batches(batches).equals(table)


def test_steps_over_many_runs_hold_one_run_at_a_time(sweep: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run is opened when its first batch is asked for, and the previous run's reader is
    gone by then: nothing but the stream's current run is held."""
    opened: list[weakref.ref[Run]] = []
    real_open = runset.open_run

    def watched(location: str, **kwargs: Any) -> Run:
        run = real_open(location, **kwargs)
        opened.append(weakref.ref(run))
        return run

    monkeypatch.setattr(runset, "open_run", watched)
    stream = analysis.step_batches([sweep / "ckpt-1", sweep / "ckpt-2", sweep / "cluster" / "ckpt-3"], batch_rows=2)
    assert opened == []  # a list of runs: identities read, no run opened yet
    alive_at_batch: list[tuple[str, int, int]] = []
    for batch in stream:
        gc.collect()
        alive = sum(ref() is not None for ref in opened)
        alive_at_batch.append((batch.column("run_checkpoint")[0].as_py(), len(opened), alive))
    assert [checkpoint for checkpoint, _, _ in alive_at_batch] == ["ckpt-1"] * 2 + ["ckpt-2"] * 4 + ["ckpt-3"] * 2
    assert [count for _, count, _ in alive_at_batch] == [1] * 2 + [2] * 4 + [3] * 2  # opened in turn
    assert {alive for _, _, alive in alive_at_batch} == {1}  # the earlier runs' readers are gone


# --------------------------------------------------------------------------- one run, lists, errors


def test_a_single_run_keeps_its_columns_and_gains_its_identity_on_request(sweep: Path) -> None:
    run = sweep / "ckpt-1"
    episodes = analysis.episodes_table(run)
    assert episodes.column_names == [*CORE_COLUMNS, "r_success"]
    assert analysis.steps_table(run).schema == analysis.STEP_SCHEMA
    assert all(batch.schema == analysis.STEP_SCHEMA for batch in analysis.step_batches(run))
    (only,) = analysis.runs_metadata(episodes)["runs"]
    assert (only["location"], only["checkpoint"], only["rows"]) == (str(run), "ckpt-1", 4)

    with_identity = analysis.episodes_table(run, identity=True)
    assert with_identity.column_names == [*RUN_COLUMNS, *episodes.column_names]
    assert set(with_identity.column("run_checkpoint").to_pylist()) == {"ckpt-1"}
    assert with_identity.select(episodes.column_names).equals(episodes)
    steps = analysis.steps_table(open_run(run), identity=True)
    assert steps.column_names[:6] == RUN_COLUMNS and set(steps.column("run_location").to_pylist()) == {str(run)}


def test_a_list_of_runs_in_the_order_given_and_a_run_given_twice_refused(sweep: Path) -> None:
    table = analysis.episodes_table([sweep / "cluster", open_run(sweep / "ckpt-2"), str(sweep / "ckpt-1")])
    assert list(_rows_by_run(table)) == [str(sweep / "cluster" / "ckpt-3"), str(sweep / "ckpt-2"), str(sweep / "ckpt-1")]
    assert [run["name"] for run in analysis.runs_metadata(table)["runs"]] == [
        "ckpt-3",  # under the location given
        str(sweep / "ckpt-2"),  # a run given by itself: its location
        str(sweep / "ckpt-1"),
    ]
    assert analysis.runs_metadata(table)["skipped_runs"] == []
    one = analysis.episodes_table([sweep / "ckpt-1"])  # a list is several runs, even of one
    assert one.column_names[:6] == RUN_COLUMNS

    with pytest.raises(RunReadError, match=r"the run .*ckpt-1 is given twice"):
        analysis.episodes_table([sweep / "ckpt-1", sweep / "ckpt-1"])
    with pytest.raises(ValueError, match="identity=False"):
        analysis.steps_table(sweep / "cluster", identity=False)
    with pytest.raises(RunReadError, match=r"empty: no run there"):
        analysis.episodes_table([sweep / "ckpt-1", sweep / "empty"])


def test_strict_fails_on_the_run_that_cannot_be_read_naming_it(sweep: Path) -> None:
    with pytest.raises(RunReadError, match=r"broken holds no traces\.jsonl"):
        analysis.episodes_table(sweep, strict=True)
    with pytest.raises(RunReadError, match=r"broken holds no traces\.jsonl"):
        list(analysis.step_batches(sweep, strict=True))
    told: list[analysis.SkippedRun] = []
    analysis.episodes_table(sweep, on_skip=told.append)  # told instead of warned
    assert [item.name for item in told] == ["broken"]


def test_a_folder_without_runs_keeps_the_one_run_error_and_all_unreadable_fails(sweep: Path, tmp_path: Path) -> None:
    for location, message in ((sweep / "empty", "not a run directory"), (tmp_path / "nope", "does not exist")):
        with pytest.raises(RunReadError) as caught:
            analysis.episodes_table(location)
        with pytest.raises(RunReadError) as before:
            open_run(location)
        assert str(caught.value) == str(before.value) and message in str(caught.value)
    only_broken = tmp_path / "only-broken"
    shutil.copytree(sweep / "broken", only_broken / "a")
    shutil.copytree(sweep / "broken", only_broken / "b")
    with (
        pytest.warns(analysis.RunSkippedWarning),
        pytest.raises(RunReadError, match=r"none of the 2 runs could be read: .*a holds"),
    ):
        analysis.episodes_table(only_broken)
    with pytest.warns(analysis.RunSkippedWarning), pytest.raises(RunReadError, match="none of the 2 runs could be read"):
        list(analysis.step_batches(only_broken))


def _foreign(run: Path, line: int) -> None:
    """Line ``line`` of the run's traces of another schema version: refused, never skipped, by a reader."""
    lines = (run / "traces.jsonl").read_bytes().splitlines(keepends=True)
    lines[line] = lines[line].replace(b"shopsimrl-episode-v4", b"shopsimrl-episode-v5", 1)
    (run / "traces.jsonl").write_bytes(b"".join(lines))


def test_a_run_of_another_version_is_left_out_whole_or_fails_once_its_rows_are_out(sweep: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    shutil.copytree(sweep / "ckpt-1", root / "a")
    shutil.copytree(sweep / "ckpt-2", root / "b")
    _foreign(root / "b", 5)  # a local run is indexed whole before its first record is handed out
    with pytest.warns(analysis.RunSkippedWarning, match="shopsimrl-episode-v5"):
        table = analysis.episodes_table(root)  # the whole run left out, none of its rows kept
    assert set(table.column("run_location").to_pylist()) == {str(root / "a")}
    assert [item["name"] for item in analysis.runs_metadata(table)["skipped_runs"]] == ["b"]
    with pytest.warns(analysis.RunSkippedWarning, match="shopsimrl-episode-v5"):
        batches = list(analysis.step_batches(root, batch_rows=2))
    assert {batch.column("run_location")[0].as_py() for batch in batches} == {str(root / "a")}
    with pytest.raises(RunReadError, match=r"b/traces\.jsonl:6: trace record schema_version 'shopsimrl-episode-v5'"):
        analysis.episodes_table(root, strict=True)

    # A sharded run is read shard by shard: its shard 0's batches are out before shard 1's
    # foreign records are met, so the stream fails, strict or not; a table leaves it out whole.
    shutil.rmtree(root / "b")
    the_plan = json.loads((sweep / "ckpt-2" / "manifest.json").read_text(encoding="utf-8"))["plan"]
    lines = {record.episode_id: dump_line(record) for record in open_run(sweep / "ckpt-2").records()}
    sharded_copy(str(tmp_path / "probe"), the_plan, lines.__getitem__, 2, per_part=2)
    shard_of = {episode_id: source.shard for episode_id, source in open_run(tmp_path / "probe").index().items()}
    first_shard = sum(shard == 0 for shard in shard_of.values())
    assert 0 < first_shard < len(shard_of)

    def line_of(episode_id: str) -> bytes:
        line = lines[episode_id]
        return line.replace(b"shopsimrl-episode-v4", b"shopsimrl-episode-v5", 1) if shard_of[episode_id] == 1 else line

    sharded_copy(str(root / "c"), the_plan, line_of, 2, per_part=2)
    handed: list[pa.RecordBatch] = []
    with pytest.raises(RunReadError, match=rf"shopsimrl-episode-v5.*\(after {first_shard} of its step rows were read\)"):
        for batch in analysis.step_batches(root, batch_rows=2):
            handed.append(batch)
    assert [batch.column("run_location")[0].as_py() for batch in handed][-1] == str(root / "c")
    with pytest.warns(analysis.RunSkippedWarning, match="shopsimrl-episode-v5"):
        table = analysis.episodes_table(root)
    assert set(table.column("run_location").to_pylist()) == {str(root / "a")}


def test_a_file_url_prefix_reads_local_and_sharded_runs(sweep: Path) -> None:
    table = _quietly(analysis.episodes_table, f"file://{sweep}")
    assert list(_rows_by_run(table)) == [f"file://{sweep}/{name}" for name in READABLE]


# --------------------------------------------------------------------------- Parquet and CSV exports


@pytest.mark.parametrize("level", ["episodes", "steps"])
def test_a_parquet_export_of_many_runs_carries_their_identity_as_columns_and_metadata(
    sweep: Path, tmp_path: Path, level: str
) -> None:
    expected = _quietly(analysis.episodes_table if level == "episodes" else analysis.steps_table, sweep)
    path = tmp_path / f"{level}.parquet"
    rows = _quietly(analysis.export_table, sweep, path, to="parquet", level=level, batch_rows=3)
    assert rows == expected.num_rows
    back = pq.read_table(path)
    assert back.equals(expected) and back.column_names[:6] == RUN_COLUMNS
    footer = pq.read_metadata(path).metadata  # the file's key/value metadata, read with pyarrow alone
    runs = json.loads(footer[b"shopsimrl.runs"])
    assert [(run["name"], run["rows"]) for run in runs] == [
        (run["name"], run["rows"]) for run in analysis.runs_metadata(expected)["runs"]
    ]
    assert {run["checkpoint"] for run in runs} == {"ckpt-1", "ckpt-2", "ckpt-3", None}
    assert [run["location"] for run in json.loads(footer[b"shopsimrl.skipped_runs"])] == [str(sweep / "broken")]
    assert analysis.runs_metadata(path) == analysis.runs_metadata(back) == analysis.runs_metadata(expected)

    csv_path = tmp_path / f"{level}.csv"
    _quietly(analysis.export_table, sweep, csv_path, to="csv", level=level)
    assert analysis.read_csv_table(csv_path, expected.schema).equals(expected)


@pytest.mark.parametrize("level", ["episodes", "steps"])
def test_a_single_run_export_keeps_its_columns_and_names_its_run_in_the_metadata(sweep: Path, tmp_path: Path, level: str) -> None:
    run = sweep / "cluster" / "ckpt-3"
    path = tmp_path / f"{level}.parquet"
    analysis.export_table(run, path, to="parquet", level=level)
    back = pq.read_table(path)
    assert not [name for name in back.column_names if name.startswith("run_")]
    (only,) = json.loads(pq.read_metadata(path).metadata[b"shopsimrl.runs"])
    assert (only["location"], only["kind"], only["checkpoint"], only["rows"]) == (str(run), "sharded", "ckpt-3", 4)
    assert only["fingerprint"] == open_run(run).identity["plan_fingerprint"]


def test_the_export_refuses_an_output_inside_any_run_read(sweep: Path, tmp_path: Path) -> None:
    with pytest.raises(OutputError, match=r"all\.parquet is inside the run .*ckpt-2"):
        analysis.export_table(sweep, sweep / "ckpt-2" / "all.parquet", to="parquet", level="episodes")
    assert not (sweep / "ckpt-2" / "all.parquet").exists()


# --------------------------------------------------------------------------- the command


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), prog_name="shopsimrl")


def test_export_table_over_a_folder_and_several_runs(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "all.parquet"
    result = _invoke("export", "table", str(sweep), "--to", "parquet", "--level", "steps", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote 18 step rows of 4 runs to {out} (1 left out: see the warnings)\n"
    assert result.stderr.startswith(f"warning: left out a run that cannot be read: {sweep / 'broken'} holds no traces.jsonl")
    assert [run["name"] for run in analysis.runs_metadata(out)["runs"]] == READABLE

    two = tmp_path / "two.csv"
    result = _invoke("export", "table", str(sweep / "ckpt-1"), str(sweep / "ckpt-2"), "--to", "csv", "-o", str(two))
    assert result.exit_code == 0 and result.stdout == f"wrote 12 episode rows of 2 runs to {two}\n" and result.stderr == ""
    assert two.read_text(encoding="utf-8").startswith('"run_location","run_experiment","run_model","run_checkpoint"')

    one = tmp_path / "one.parquet"
    result = _invoke("export", "table", str(sweep / "ckpt-1"), "--to", "parquet", "--identity", "-o", str(one))
    assert result.exit_code == 0 and result.stdout == f"wrote 4 episode rows to {one}\n"  # as before, one run
    assert pq.read_table(one).column_names[:6] == RUN_COLUMNS


def test_export_table_strict_exits_2_naming_the_run(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "all.parquet"
    result = _invoke("export", "table", str(sweep), "--to", "parquet", "--strict", "-o", str(out))
    assert result.exit_code == 2, result.output
    assert f"{sweep / 'broken'} holds no traces.jsonl" in result.stderr and "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- testbed runs


@pytest.mark.slow
def test_testbed_runs_local_and_on_s3_as_one_table_through_the_command(
    research_runs: ResearchRuns, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The same plan run by the real CLI against the testbed, locally and as 4 shards on moto: one
    table of both, told apart by location only (same plan, same fingerprint), written by the
    command in a subprocess."""
    location, env = run_location(research_runs, "sharded")
    out = tmp_path / "steps.parquet"
    done = cli(
        "export", "table", str(research_runs.local), location, "--to", "parquet", "--level", "steps", "-o", str(out), env=env
    )
    assert done.returncode == 0, done.stderr
    back = pq.read_table(out)
    expected = {str(research_runs.local): analysis.steps_table(research_runs.local), location: analysis.steps_table(location)}
    assert done.stdout.strip() == f"wrote {sum(t.num_rows for t in expected.values())} step rows of 2 runs to {out}"
    for where, alone in expected.items():
        mine = back.filter(pc.equal(back.column("run_location"), where))
        assert mine.select(alone.column_names).equals(alone) and alone.num_rows > research_runs.episodes
    runs = json.loads(pq.read_metadata(out).metadata[b"shopsimrl.runs"])
    assert [(run["location"], run["kind"]) for run in runs] == [(str(research_runs.local), "local"), (location, "sharded")]
    assert runs[0]["fingerprint"] == runs[1]["fingerprint"] == open_run(research_runs.local).identity["plan_fingerprint"]
    assert len(set(back.column("run_fingerprint").to_pylist())) == 1 and None not in back.column("run_model").to_pylist()
    assert research_runs.env["AWS_SECRET_ACCESS_KEY"].encode() not in out.read_bytes()
