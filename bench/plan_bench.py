"""Time to plan and freeze 100,000 jobs in a run location, and to load the frozen plan again.

    .venv/bin/python bench/plan_bench.py [--jobs 100000] [--shards 64]

Steps, each timed in wall-clock and CPU seconds (CPU time is what to compare on a shared
machine: it does not count the time other processes held the core):

- job list: sampling and the per-episode sha256 seeds (``planning.build_jobs``);
- freeze: what ``shopsimrl plan --shards`` and the first worker do: the plan fingerprint,
  ``manifest.json``, ``jobs.jsonl`` and ``shards.json`` written create-only to a local dir;
- a worker starting: the same calls against the frozen files (read, check, compare);
- reduce/status loading the plan (``sharded.layout.load_frozen_plan``), in a fresh process so that its peak
  RSS is its own: from the shard map bound to the manifest's sha256 (runs frozen by this
  version), and with the full checks that runs frozen before it need (the job list parsed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.planning import EvaluationPlan, build_jobs
from shopsimrl.schemas import fingerprint
from shopsimrl.storage.sharded import ShardedRunStore


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_child(root: str, full: bool) -> None:
    """One reduce/status plan load in this (fresh) process; prints seconds and peak RSS."""
    from shopsimrl.storage.sharded import load_frozen_plan

    before = peak_rss_mb()
    store = ShardedRunStore(root)
    if full:  # as for a run frozen before shards.json recorded the manifest's sha256
        original = store.read_shard_map

        def unbound():  # type: ignore[no-untyped-def]
            shard_map = original()
            shard_map.manifest_sha256 = None
            return shard_map

        store.read_shard_map = unbound  # type: ignore[method-assign]
    wall, cpu = timed(lambda: load_frozen_plan(store))
    print(json.dumps({"wall": wall, "cpu": cpu, "rss_mb": peak_rss_mb(), "rss_before_mb": before}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--load-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--full", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        load_child(args.load_child, args.full)
        return
    tasks = args.jobs // 4
    rows: dict[str, tuple[float, float]] = {}
    holder: dict[str, object] = {}

    def job_list() -> None:
        holder["jobs"] = build_jobs(
            EvaluationPlan(split="val", task_ids=tuple(range(1, tasks * 2 + 1)), seed=20260830, sample_size=tasks, repeats=4)
        )

    rows["job list (sampling + sha256 seeds)"] = timed(job_list)
    jobs = holder["jobs"]
    plan = {"experiment": "bench", "jobs": [job.to_dict() for job in jobs]}  # type: ignore[attr-defined]
    root = Path(tempfile.mkdtemp(prefix="plan-bench-"))
    try:
        uri = str(root / "run")

        def freeze() -> None:
            store = ShardedRunStore(uri)
            manifest = store.freeze_plan(plan)
            store.ensure_shard_map(jobs, args.shards, manifest.plan_fingerprint)  # type: ignore[arg-type]

        rows["freeze (fingerprint; manifest, jobs.jsonl, shards.json)"] = timed(freeze)

        def verify() -> None:
            store = ShardedRunStore(uri)
            store.freeze_plan(plan)
            store.ensure_shard_map(jobs, args.shards, fingerprint(plan))  # type: ignore[arg-type]

        worker = timed(verify)
        loads = {}
        for full in (False, True):
            out = subprocess.run(
                [sys.executable, __file__, "--load-child", uri] + (["--full"] if full else []),
                capture_output=True,
                text=True,
                check=True,
            )
            loads[full] = json.loads(out.stdout.strip().splitlines()[-1])
        sizes = {p.name: p.stat().st_size / 1e6 for p in (root / "run").iterdir()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{len(jobs)} jobs, {args.shards} shards")  # type: ignore[arg-type]
    for name, (wall, cpu) in rows.items():
        print(f"  {name:<58} {wall * 1000:7.0f} ms wall  {cpu * 1000:7.0f} ms CPU")
    wall, cpu = (sum(r[i] for r in rows.values()) for i in (0, 1))
    print(f"  {'plan + freeze':<58} {wall * 1000:7.0f} ms wall  {cpu * 1000:7.0f} ms CPU  ({len(jobs) / wall:,.0f} jobs/s)")  # type: ignore[arg-type]
    print(
        f"  {'a worker starting (read + check the frozen plan)':<58} {worker[0] * 1000:7.0f} ms wall  {worker[1] * 1000:7.0f} ms CPU"
    )
    for full, label in (
        (False, "reduce/status load, shard map bound to the manifest"),
        (True, "reduce/status load, full checks (older runs)"),
    ):
        load = loads[full]
        print(
            f"  {label:<58} {load['wall'] * 1000:7.0f} ms wall  {load['cpu'] * 1000:7.0f} ms CPU  "
            f"peak RSS {load['rss_mb']:.0f} MB ({load['rss_mb'] - load['rss_before_mb']:+.0f} MB over the imports)"
        )
    print("  sizes: " + ", ".join(f"{k} {v:.1f} MB" for k, v in sorted(sizes.items())))


if __name__ == "__main__":
    main()
