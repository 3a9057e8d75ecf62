"""Exporting the steps (and episodes) of one run against those of a folder of runs: the memory a
multi-run export holds stays that of one run, since runs are read one after the other.

    .venv/bin/python bench/tables_across_runs.py [--runs 8] [--episodes 2000] [--steps 10]

Writes ``--runs`` local runs (tests/run_index_fixtures.py, records of ``--steps`` model calls
each) into a temporary folder, then, each measurement in a fresh process, exports the steps and
the episodes as Parquet of the first run alone and of the whole folder
(``analysis.export_table``). Prints rows, seconds, the peak of Python allocations (tracemalloc)
and the process's peak resident memory; the rows are checked.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.records import read_trace
from shopsimrl.storage.local import LocalRunStore
from tests.run_index_fixtures import PRICES, plan, record


def write_runs(root: Path, runs: int, episodes: int, steps: int) -> None:
    repeats = -(-episodes // 4)  # the fixture plan has four tasks
    for index in range(runs):
        the_plan = plan("bench", f"ckpt-{index}", repeats=repeats)
        store = LocalRunStore(root / f"ckpt-{index}")
        store.freeze_plan(the_plan, {"concurrency": 2, "cost": PRICES})
        traces = []
        for job in the_plan["jobs"][:episodes]:
            document = record(job, 1.0)
            document["steps"] = [{**document["steps"][0], "step_index": step} for step in range(steps)]
            traces.append(read_trace(document))
        store.save_traces(traces)


def measure(location: str, level: str, out: str, queue: Any) -> None:
    import warnings

    from shopsimrl.research import analysis

    warnings.simplefilter("ignore")
    tracemalloc.start()
    started = time.perf_counter()
    rows = analysis.export_table(location, out, to="parquet", level=level)  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    runs = len(analysis.runs_metadata(out)["runs"])
    queue.put((rows, runs, seconds, peak / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "runs"
        started = time.perf_counter()
        write_runs(root, args.runs, args.episodes, args.steps)
        print(
            f"{args.runs} runs of {args.episodes} episodes × {args.steps} steps written in {time.perf_counter() - started:.1f} s"
        )
        print(f"{'level':>8}  {'read':>8}  {'rows':>8}  {'s':>6}  {'Python peak MB':>14}  {'max RSS MB':>10}")
        results: dict[str, Any] = {}
        for level in ("steps", "episodes"):
            for label, location in (("1 run", root / "ckpt-0"), (f"{args.runs} runs", root)):
                queue = context.Queue()
                process = context.Process(target=measure, args=(str(location), level, f"{folder}/{level}.parquet", queue))
                process.start()
                rows, runs, seconds, peak, rss = queue.get()
                process.join()
                per_run = args.episodes * (args.steps if level == "steps" else 1)
                assert rows == per_run * runs and runs == (1 if label == "1 run" else args.runs), (rows, runs)
                results[f"{level} {label}"] = {"rows": rows, "seconds": seconds, "python_peak_mb": peak, "max_rss_mb": rss}
                print(f"{level:>8}  {label:>8}  {rows:>8}  {seconds:>6.1f}  {peak:>14.1f}  {rss:>10.0f}")
        print(json.dumps(results))


if __name__ == "__main__":
    main()
