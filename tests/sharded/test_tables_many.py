"""Tables across runs (issue 26, item 4) over an ``s3://`` prefix, on moto and SeaweedFS: the runs
under the prefix found as ``shopsimrl runs`` finds them, every row with its run's identity, a
Parquet export (through the command) carrying the runs as key/value metadata, read back with
pyarrow; a run that cannot be read left out and listed."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.research import analysis
from shopsimrl.runner.runs import list_runs
from shopsimrl.storage.sharded import ShardedRunStore
from tests.run_index_fixtures import plan, sharded_run

from .conftest import S3_TEST_ENV, S3Server

pytestmark = [pytest.mark.slow, pytest.mark.s3]


def test_the_runs_under_an_s3_prefix_as_one_table(s3_server: S3Server, tmp_path: Path) -> None:
    base = f"s3://{s3_server.bucket}/team/runs"
    sharded_run(f"{base}/ckpt-1", plan("sweep", "ckpt-1"), [1.0, 0.0, 0.0, 0.0])
    sharded_run(f"{base}/ckpt-2", plan("sweep", "ckpt-2", repeats=2), [1.0, 1.0] * 4, shards=3)
    sharded_run(f"{base}/later/ckpt-3", plan("sweep", "ckpt-3"), [1.0] * 4, commit=1, reduce=False)  # half committed
    ShardedRunStore(f"{base}/broken").overwrite("manifest.json", b'{"schema_version": "shopsimrl-run-manifest-v2", "pl')

    with pytest.warns(analysis.RunSkippedWarning, match=r"broken"):
        table = analysis.episodes_table(base)
    entries = {entry.location: entry for entry in list_runs(base)}
    names = ["ckpt-1", "ckpt-2", "later/ckpt-3"]
    locations = [f"{base}/{name}" for name in names]
    assert [run["location"] for run in analysis.runs_metadata(table)["runs"]] == locations
    assert [run["rows"] for run in analysis.runs_metadata(table)["runs"]] == [4, 8, 2]  # ckpt-3: its committed shard
    for row in table.to_pylist():
        entry = entries[row["run_location"]]
        assert (row["run_experiment"], row["run_model"], row["run_checkpoint"], row["run_split"], row["run_fingerprint"]) == (
            entry.experiment,
            entry.model,
            entry.checkpoint,
            entry.split,
            entry.fingerprint,
        )
    for location in locations:  # each run's rows are its own table's
        alone = analysis.episodes_table(location)
        mine = table.filter(pc.equal(table.column("run_location"), location))
        assert mine.select(alone.column_names).equals(alone)

    out = tmp_path / "steps.parquet"
    result = CliRunner().invoke(
        app, ["export", "table", base, "--to", "parquet", "--level", "steps", "-o", str(out)], prog_name="shopsimrl"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote 14 step rows of 3 runs to {out} (1 left out: see the warnings)\n"
    footer = pq.read_metadata(out).metadata
    runs = json.loads(footer[b"shopsimrl.runs"])
    assert [(run["name"], run["kind"], run["checkpoint"], run["rows"]) for run in runs] == [
        ("ckpt-1", "sharded", "ckpt-1", 4),
        ("ckpt-2", "sharded", "ckpt-2", 8),
        ("later/ckpt-3", "sharded", "ckpt-3", 2),
    ]
    assert [run["fingerprint"] for run in runs] == [entries[location].fingerprint for location in locations]
    (skipped,) = json.loads(footer[b"shopsimrl.skipped_runs"])
    assert skipped["location"] == f"{base}/broken" and "manifest.json" in skipped["error"]
    back = pq.read_table(out)
    assert back.column_names[:6] == [
        "run_location",
        "run_experiment",
        "run_model",
        "run_checkpoint",
        "run_fingerprint",
        "run_split",
    ]
    assert back.num_rows == 14 and set(back.column("run_location").to_pylist()) == set(locations)
    everything = out.read_bytes()
    assert S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"].encode() not in everything
    assert S3_TEST_ENV["AWS_ACCESS_KEY_ID"].encode() not in everything

    strict = CliRunner().invoke(
        app, ["export", "table", base, "--to", "csv", "--strict", "-o", str(tmp_path / "t.csv")], prog_name="shopsimrl"
    )
    assert strict.exit_code == 2 and f"{base}/broken" in strict.stderr and not (tmp_path / "t.csv").exists()
