"""The viewer and the steps export on a large run: 40,000 episodes, local and as 4 shards on S3.

    .venv/bin/python bench/viewer_scale.py [--tasks 400] [--samples 100] [--shards 4]
                                           [--templates RUN_DIR] [--dir DIR] [--out FILE]

The run is the real plan of ``--tasks`` val tasks × ``--samples`` samples (``shopsimrl plan
--shards``), its records copies of a testbed run's (``--templates``, or 24 episodes run here
against the testbed processes) with each job's identity and perturbed outcomes, written in parts
of 10 records (the workers' default flush) and committed as workers do, on a moto S3 server in
this process; the local copy is the same records in one ``traces.jsonl`` (2.1 GB at the
defaults, removed at the end). Measured, for the local and the sharded run: the viewer's start
(reading every record), opening 24 episodes at random (each part read for the first time),
three table pages (filtered, sorted, paged) and its peak memory; then a steps export of the
local run (rows, seconds, peak memory). Every page is checked to be right; the figures are
printed as JSON and written to ``--out`` (docs/benchmarks.md, "Research tools at scale").
Was tests/research/test_viewer_scale.py (it wrote 2 GB per suite run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq  # noqa: E402
import s3fs  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from shopsimrl.records import to_plain  # noqa: E402
from shopsimrl.schemas import EpisodeJob  # noqa: E402
from shopsimrl.storage.reading import open_run  # noqa: E402
from shopsimrl.storage.sharded import ShardedRunStore  # noqa: E402
from tests.research.synthetic import sharded_copy, synthetic_line_of  # noqa: E402
from tests.research.test_viewer import serving  # noqa: E402
from tests.testbed_process import start_testbed, write_config  # noqa: E402

SPLIT_FILE = ROOT / "configs" / "splits" / "persona_splits.v1.json"
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def plan_config(directory: Path, tasks: int, samples: int) -> Path:
    path = directory / "big.yaml"
    path.write_text(
        f"""experiment:
  name: big
  output_dir: {directory / "local-runs"}
  seed: 20260901
tasks:
  split_file: {SPLIT_FILE}
  split: val
  sample_size: {tasks}
  repeats: {samples}
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


def cli(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )
    if done.returncode != 0:
        raise SystemExit(f"shopsimrl {' '.join(args[:2])} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def template_run(directory: Path) -> Path:
    """24 episodes of the heuristic policy against the testbed processes: the records to copy."""
    directory.mkdir(parents=True)
    with start_testbed() as bed:
        config = write_config(directory, name="templates", sample_size=24)
        cli("run", str(config), "--no-progress", env=bed.env())
    return directory / "runs" / "templates"


def measure_viewer(location: str, env: dict[str, str], ids: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    with serving(location, env, ready_within=3600) as viewer:
        ready = time.perf_counter() - started
        read_line = next(line for line in viewer.lines if line.startswith("read "))
        assert read_line.startswith(f"read {len(ids)} episodes of "), read_line
        openings = []
        # Episodes from every shard and part, none opened before (a part's first opening reads it).
        for episode_id in random.Random(20260901).sample(ids, min(24, len(ids))):
            began = time.perf_counter()
            page = viewer.get(f"/episodes/{episode_id}")
            openings.append(time.perf_counter() - began)
            assert page.status_code == 200 and f'<h1 id="episode-id">{episode_id}</h1>' in page.text, episode_id
        tables = []
        last_page = str(max(1, len(ids) // 100 - 100))
        for params in (
            {},
            {"sort": "reward", "desc": "1", "page": last_page},
            {"status": "completed", "reward_min": "0.5", "sort": "steps"},
        ):
            began = time.perf_counter()
            page = viewer.get("/", params=params)
            tables.append(time.perf_counter() - began)
            assert page.status_code == 200 and f"of {len(ids)} episodes" in page.text, params
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


def measure_export(local: str, env: dict[str, str], output: Path) -> dict[str, Any]:
    # The export's own peak memory, printed by the process itself as it exits.
    measured = (
        "import atexit, resource, sys; "
        "atexit.register(lambda: print('peak_rss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); "
        "from shopsimrl.cli import main; sys.argv[0] = 'shopsimrl'; main()"
    )
    command = [sys.executable, "-c", measured, "export", "table", local, "--to", "parquet", "--level", "steps", "-o", str(output)]
    began = time.perf_counter()
    exported = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
    seconds = time.perf_counter() - began
    if exported.returncode != 0:
        raise SystemExit(f"the steps export exited {exported.returncode}:\n{exported.stderr[-2000:]}")
    rows = pq.ParquetFile(output).metadata.num_rows
    assert exported.stdout.strip() == f"wrote {rows} step rows to {output}", exported.stdout
    peak_kb = int(exported.stderr.rsplit("peak_rss_kb", 1)[1].split()[0])
    return {"rows": rows, "seconds": round(seconds, 1), "peak_rss_mb": round(peak_kb / 1024)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=400, help="val tasks in the plan (default 400)")
    parser.add_argument("--samples", type=int, default=100, help="samples per task (default 100)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument(
        "--templates", type=Path, help="a local run directory whose records are copied (default: 24 testbed episodes run here)"
    )
    parser.add_argument("--dir", type=Path, help="where the runs are written (default a temporary directory, removed at the end)")
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "bench" / "viewer-scale.json", help="the figures as JSON")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="viewer-scale-", dir=args.dir))
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per S3 request otherwise
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        s3 = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
        os.environ.update(s3)  # this process writes the sharded copy
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SHOPSIMRL_")}, **s3}
        bucket = f"shopsimrl-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(
            key=s3["AWS_ACCESS_KEY_ID"],
            secret=s3["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": s3["AWS_ENDPOINT_URL"]},
        ).mkdir(bucket)
        uri = f"s3://{bucket}/runs/big"

        templates_dir = args.templates or template_run(base / "templates")
        templates = [to_plain(record) for record in open_run(templates_dir).records()]
        cli("plan", str(plan_config(base, args.tasks, args.samples)), "--shards", str(args.shards), "--run", uri, env=env)
        store = ShardedRunStore(uri)
        manifest_bytes = store.read_bytes("manifest.json")
        assert manifest_bytes is not None
        plan = json.loads(manifest_bytes)["plan"]
        jobs = [EpisodeJob.from_dict(job) for job in plan["jobs"]]
        assert len(jobs) == args.tasks * args.samples, len(jobs)
        line_of = synthetic_line_of(templates, jobs)
        started = time.perf_counter()
        sharded_copy(uri, plan, line_of, args.shards, per_part=10)
        written_s3 = time.perf_counter() - started
        local = base / "local"
        local.mkdir()
        (local / "manifest.json").write_bytes(manifest_bytes)
        with (local / "traces.jsonl").open("wb") as handle:
            for job in jobs:
                handle.write(line_of(job.episode_id))

        ids = [job.episode_id for job in jobs]
        figures: dict[str, Any] = {
            "episodes": len(ids),
            "templates": len(templates),
            "traces_bytes": (local / "traces.jsonl").stat().st_size,
            "written_s3_s": round(written_s3, 1),
            "local": measure_viewer(str(local), env, ids),
            f"sharded_s3_{args.shards}": measure_viewer(uri, env, ids),
            "export_steps_local": measure_export(str(local), env, base / "steps.parquet"),
            "load_average": os.getloadavg(),
        }
    finally:
        moto.stop()
        shutil.rmtree(base, ignore_errors=True)  # gigabytes of traces
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
