"""The viewer on a 40,000-episode run, local and as 4 shards on moto S3, and its steps export.

The run is the real plan of 400 val tasks × 100 samples (``shopsimrl plan --shards 4``), its
records copies of the testbed run's with each job's identity and perturbed outcomes, written in
parts of 10 records (the workers' default flush) and committed as workers do. Timings are
printed and saved to ``.cache/test-artifacts/viewer-40k.json``, not asserted: the machine is
shared. What is asserted is that every page is right."""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from shopsimrl.research.runs import open_run
from shopsimrl.schemas import EpisodeJob
from shopsimrl.sharded.layout import ShardedRunStore
from tests.fakes import written
from tests.sharded.conftest import REPO, SPLIT_FILE, _make_bucket, cli

from .conftest import ARTIFACTS, ResearchRuns, run_location
from .synthetic import sharded_copy, synthetic_line_of
from .test_viewer import serving

pytestmark = pytest.mark.slow

TASKS, SAMPLES = 400, 100


def _config(directory: Path) -> Path:
    path = directory / "big.yaml"
    path.write_text(
        f"""experiment:
  name: big
  output_dir: {directory / "local-runs"}
  seed: 20260901
tasks:
  split_file: {SPLIT_FILE}
  split: val
  sample_size: {TASKS}
  repeats: {SAMPLES}
environment:
  base_url: http://127.0.0.1:5700
model:
  id: shopsim-heuristic
  name: shopsim-heuristic
  base_url: http://127.0.0.1:8000/v1
  api_key_env: null
""",
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def big_runs(
    research_runs: ResearchRuns, moto_endpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("big")
    _, env = run_location(research_runs, "sharded")
    bucket = _make_bucket(moto_endpoint, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    uri = f"s3://{bucket}/runs/big"
    planned = cli("plan", str(_config(base)), "--shards", "4", "--run", uri, env=env)
    assert planned.returncode == 0, planned.stderr[-2000:]
    templates = [written(record) for record in open_run(research_runs.local).records()]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in research_runs.env.items():
            patch.setenv(name, value)
        store = ShardedRunStore(uri)
        manifest_bytes = store.read_bytes("manifest.json")
        assert manifest_bytes is not None
        plan = json.loads(manifest_bytes)["plan"]
        jobs = [EpisodeJob.from_dict(job) for job in plan["jobs"]]
        assert len(jobs) == TASKS * SAMPLES
        line_of = synthetic_line_of(templates, jobs)
        started = time.perf_counter()
        sharded_copy(uri, plan, line_of, 4, per_part=10)
        written_s3 = time.perf_counter() - started
    local = base / "local"
    local.mkdir()
    (local / "manifest.json").write_bytes(manifest_bytes)
    with (local / "traces.jsonl").open("wb") as handle:
        for job in jobs:
            handle.write(line_of(job.episode_id))
    try:
        yield {
            "local": str(local),
            "sharded": uri,
            "env": env,
            "ids": [job.episode_id for job in jobs],
            "bytes": (local / "traces.jsonl").stat().st_size,
            "written_s3_s": written_s3,
        }
    finally:
        shutil.rmtree(local)  # 2 GB of traces


def _measure_viewer(location: str, env: dict[str, str], ids: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    with serving(location, env, ready_within=1800) as viewer:
        ready = time.perf_counter() - started
        read_line = next(line for line in viewer.lines if line.startswith("read "))
        assert read_line.startswith(f"read {len(ids)} episodes of ")
        openings = []
        # Episodes from every shard and part, none opened before (a part's first opening reads it).
        for episode_id in random.Random(20260901).sample(ids, 24):
            began = time.perf_counter()
            page = viewer.get(f"/episodes/{episode_id}")
            openings.append(time.perf_counter() - began)
            assert page.status_code == 200 and f'<h1 id="episode-id">{episode_id}</h1>' in page.text
        tables = []
        for params in (
            {},
            {"sort": "reward", "desc": "1", "page": "300"},
            {"status": "completed", "reward_min": "0.5", "sort": "steps"},
        ):
            began = time.perf_counter()
            page = viewer.get("/", params=params)
            tables.append(time.perf_counter() - began)
            assert page.status_code == 200 and f"of {len(ids)} episodes" in page.text
        status = Path(f"/proc/{viewer.process.pid}/status").read_text()
        peak_rss_mb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024
    return {
        "ready_s": round(ready, 1),
        "read_line": read_line,
        "open_episode_s": {
            "median": round(statistics.median(openings), 3),
            "max": round(max(openings), 3),
            "all": [round(value, 3) for value in openings],
        },
        "table_page_s": [round(value, 3) for value in tables],
        "peak_rss_mb": round(peak_rss_mb),
    }


def test_viewer_and_steps_export_on_40000_episodes(
    big_runs: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    figures: dict[str, Any] = {
        "episodes": len(big_runs["ids"]),
        "traces_bytes": big_runs["bytes"],
        "written_s3_s": round(big_runs["written_s3_s"], 1),
    }
    figures["local"] = _measure_viewer(big_runs["local"], big_runs["env"], big_runs["ids"])
    figures["sharded_s3"] = _measure_viewer(big_runs["sharded"], big_runs["env"], big_runs["ids"])

    output = tmp_path / "steps.parquet"
    # The export's own peak memory, printed by the process itself as it exits.
    measured = (
        "import atexit, resource, sys; "
        "atexit.register(lambda: print('peak_rss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); "
        "from shopsimrl.cli import main; sys.argv[0] = 'shopsimrl'; main()"
    )
    began = time.perf_counter()
    exported = subprocess.run(
        [
            sys.executable,
            "-c",
            measured,
            "export",
            "table",
            big_runs["local"],
            "--to",
            "parquet",
            "--level",
            "steps",
            "-o",
            str(output),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=big_runs["env"],
        timeout=3600,
    )
    seconds = time.perf_counter() - began
    assert exported.returncode == 0, exported.stderr[-2000:]
    rows = pq.ParquetFile(output).metadata.num_rows
    assert exported.stdout.strip() == f"wrote {rows} step rows to {output}"
    peak_kb = int(exported.stderr.rsplit("peak_rss_kb", 1)[1].split()[0])
    figures["export_steps_local"] = {"rows": rows, "seconds": round(seconds, 1), "peak_rss_mb": round(peak_kb / 1024)}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "viewer-40k.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    with capsys.disabled():
        print("\n40,000-episode run:", json.dumps(figures, indent=2))
