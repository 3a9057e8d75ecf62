"""Time to plan and shard 100,000 jobs and to freeze them in a run location.

    .venv/bin/python bench/plan_bench.py [--jobs 100000] [--shards 64]

Steps timed separately: the job list (sampling + per-episode sha256 seeds), the plan
fingerprint over the full job list, the round-robin shard map, and writing manifest.json,
jobs.jsonl and shards.json to a local dir (create-only), then reading the map back.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.planning import EvaluationPlan, build_jobs  # noqa: E402
from shopsimrl.schemas import fingerprint  # noqa: E402
from shopsimrl.shardstore import ShardedRunStore, ShardMap  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=64)
    args = parser.parse_args()
    tasks = args.jobs // 4
    timings: dict[str, float] = {}

    t = time.perf_counter()
    jobs = build_jobs(EvaluationPlan(split="val", task_ids=tuple(range(1, tasks * 2 + 1)), seed=20260830, sample_size=tasks, repeats=4))
    timings["build_jobs"] = time.perf_counter() - t
    plan = {"experiment": "bench", "jobs": [job.to_dict() for job in jobs]}
    t = time.perf_counter()
    plan_fp = fingerprint(plan)
    timings["fingerprint"] = time.perf_counter() - t
    t = time.perf_counter()
    ShardMap.build(jobs, args.shards, plan_fp)
    timings["shard_map"] = time.perf_counter() - t
    root = Path(tempfile.mkdtemp(prefix="plan-bench-"))
    try:
        store = ShardedRunStore(str(root / "run"))
        t = time.perf_counter()
        store.initialize(plan)
        store.ensure_shard_map(jobs, args.shards, plan_fp)
        timings["freeze (write manifest, jobs.jsonl, shards.json)"] = time.perf_counter() - t
        t = time.perf_counter()
        ShardedRunStore(str(root / "run")).ensure_shard_map(jobs, args.shards, plan_fp)  # a worker's verify path
        timings["verify (a worker starting)"] = time.perf_counter() - t
        sizes = {p.name: p.stat().st_size / 1e6 for p in (root / "run").iterdir()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = sum(timings.values())
    print(f"{len(jobs)} jobs, {args.shards} shards")
    for name, seconds in timings.items():
        print(f"  {name:<50} {seconds * 1000:8.0f} ms")
    print(f"  {'total':<50} {total * 1000:8.0f} ms  ({len(jobs) / total:,.0f} jobs/s)")
    print("  sizes: " + ", ".join(f"{k} {v:.1f} MB" for k, v in sorted(sizes.items())))


if __name__ == "__main__":
    main()
