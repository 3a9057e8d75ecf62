"""Reducer throughput and memory: N realistic traces over 64 shards on a local dir, then 2N.

    .venv/bin/python bench/reduce_bench.py [--episodes 20000] [--shards 64] [--dir DIR]
                                           [--traces runs/x/traces.jsonl] [--plain]

Traces are shaped like the testbed's (v4 records: reset, conversation, 4 steps with Chinese
observation text, tool calls, usage, final reward detail), about 8 KB each; with ``--traces``
the records of a real run are used instead (re-keyed to the bench's jobs, in turn), e.g. the
~70 KB traces of ``make demo``. They are written as committed shards the way a worker writes
them (10 records per part, zstd unless ``--plain``, a commit marker per shard) plus a
sprinkling of failed attempts and duplicates so the de-duplication path is exercised. Each
reduce runs in a fresh process, so its peak RSS (VmHWM) is the reducer's own. Prints
episodes/s and MB/s of uncompressed trace bytes (per wall-clock and per CPU second: on a shared
machine the CPU figure is the one to compare), bytes stored per episode against the
uncompressed JSONL, part bytes read per part byte stored, peak RSS, and the ratios between N
and 2N: memory must stay flat while the time grows linearly.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.records import dump_line
from shopsimrl.schemas import EpisodeJob, fingerprint
from shopsimrl.storage.sharded import ShardedRunStore, marker_document, part_entry

OBSERVATION = "搜索结果：第1页，共20页。\n" + "".join(
    f"[{i}] 商品{i}：简约玻璃水杯 大容量 耐热 带盖 ￥{10 + i}.90\n" for i in range(12)
)


def make_trace(job: EpisodeJob, rng: random.Random, status: str = "completed", attempt: int = 1) -> dict:
    steps = []
    for k in range(4):
        steps.append(
            {
                "step_index": k,
                "observation": {"text": OBSERVATION, "state": {"page": "search", "actions": [f"商品{i}" for i in range(12)]}},
                "tools": [{"type": "function", "function": {"name": "click"}}],
                "model": {
                    "content": None,
                    "reasoning": None,
                    "tool_calls": [
                        {
                            "call_id": f"c{k}",
                            "name": "click",
                            "arguments": {"value": "商品3"},
                            "raw_arguments": '{"value": "商品3"}',
                        }
                    ],
                    "finish_reason": "tool_calls",
                    "usage": {"prompt_tokens": 900 + k, "completion_tokens": 12, "total_tokens": 912 + k},
                    "latency_ms": rng.uniform(5, 40),
                    "attempt_count": 1,
                    "attempts": [],
                },
                "action": {"type": "click", "value": "商品3"},
                "environment": {"reward": 0.0, "done": k == 3, "action_feedback": {"valid": True}},
            }
        )
    reward = rng.choice([0.0, 0.25, 0.5, 1.0])
    done = status == "completed"
    return {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": job.episode_id,
        "status": status,
        "job": job.to_dict(),
        "attempt": attempt,
        "provenance": {"model": {"model": "bench"}},
        "started_at": "2026-11-29T10:00:00+00:00",
        "ended_at": "2026-11-29T10:00:02+00:00",
        "duration_ms": rng.uniform(200, 900),
        "reset": {"instruction": "买一个玻璃水杯"},
        "selected_skills": [],
        "conversation": [{"role": "user", "content": "购物任务：买一个玻璃水杯\n" + OBSERVATION}],
        "steps": steps if done else [],
        "final": {
            "done": True,
            "reward": reward,
            "termination_reason": "purchase",
            "reward_detail": {"r_strict": reward, "r_success": float(reward == 1.0), "r_type": 1.0, "r_att": 0.5},
        }
        if done
        else None,
        "error": None if done else {"stage": "model_step_1", "type": "ConnectError", "message": "refused"},
        "failure_class": None if done else "infrastructure",
    }


class Templates:
    """Records of a real run, handed out in turn and re-keyed to the bench's job."""

    def __init__(self, path: Path) -> None:
        self.records = [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
        self.completed = [r for r in self.records if r.get("status") == "completed"]
        self.next = 0

    def make(self, job: EpisodeJob, rng: random.Random, status: str = "completed", attempt: int = 1) -> dict:
        if status != "completed":
            return make_trace(job, rng, status, attempt)
        record = self.completed[self.next % len(self.completed)]
        self.next += 1
        return {**record, "episode_id": job.episode_id, "job": job.to_dict(), "attempt": attempt}


def build_run(
    root: Path,
    episodes: int,
    shards: int,
    seed: int = 7,
    templates: Templates | None = None,
    compressed: bool = True,
    tasks: int = 2000,
) -> tuple[int, int, int]:
    """Returns the episodes, the uncompressed JSONL bytes and the bytes stored."""
    rng = random.Random(seed)
    make = templates.make if templates else make_trace
    # A fixed task set with repeats, as in a real split: the summary keeps one row per task by
    # design (clustered statistics), so only the traces change between N and 2N.
    jobs = [EpisodeJob(task_id=i % tasks, sample_id=i // tasks, seed=i, split="val") for i in range(episodes)]
    plan = {"experiment": "bench", "jobs": [j.to_dict() for j in jobs]}
    store = ShardedRunStore(str(root))
    store.freeze_plan(plan)
    shard_map = store.ensure_shard_map(jobs, shards, fingerprint(plan))
    by_id = {j.episode_id: j for j in jobs}
    total_bytes = stored_bytes = 0
    for index, ids in enumerate(shard_map.episode_ids):
        records = []
        for eid in ids:
            if rng.random() < 0.03:  # a failed attempt, retried
                records.append(make(by_id[eid], rng, "failed"))
                records.append(make(by_id[eid], rng, attempt=2))
            else:
                records.append(make(by_id[eid], rng))
            if rng.random() < 0.01:  # a duplicate from a second writer
                records.append(make(by_id[eid], rng))
        entries = []
        for seq, start in enumerate(range(0, len(records), 10)):
            data = b"".join(dump_line(r) for r in records[start : start + 10])
            name, stored = store.write_part(index, seq, "0123abcd", data, compressed=compressed)
            entries.append(part_entry(name, stored, len(records[start : start + 10])))
            total_bytes += len(data)
            stored_bytes += len(stored)
        store.create_marker(
            index,
            marker_document(
                shard=index,
                plan_fingerprint=fingerprint(plan),
                completed=len(ids),
                failed=0,
                episode_ids_sha256=fingerprint(ids),
                parts=entries,
                writer="0123abcd",
            ),
        )
    return episodes, total_bytes, stored_bytes


def peak_rss_mb() -> float:
    """VmHWM of this process. Unlike ru_maxrss, which Linux carries across fork+exec (so a child
    would report the parent's peak), VmHWM belongs to the current address space."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reduce_child(root: str) -> None:
    import gc

    from shopsimrl.runner.reduce import reduce_run
    from shopsimrl.storage.sharded import load_frozen_plan

    plan = load_frozen_plan(ShardedRunStore(root))  # the plan alone: manifest job list + shard map
    plan_rss_mb = peak_rss_mb()
    del plan
    gc.collect()
    store = ShardedRunStore(root)
    part_bytes_read = 0
    read_part = store.read_part

    def counted(index: int, name: str) -> bytes | None:
        nonlocal part_bytes_read
        data = read_part(index, name)
        part_bytes_read += len(data or b"")
        return data

    store.read_part = counted  # type: ignore[method-assign]
    started, cpu = time.perf_counter(), time.process_time()
    summary = reduce_run(store)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    rss_mb = peak_rss_mb()
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "cpu_seconds": cpu,
                "peak_rss_mb": rss_mb,
                "plan_rss_mb": plan_rss_mb,
                "completed": summary["counts"]["completed"],
                "duplicates": summary["shards"]["duplicate_records"],
                "part_bytes_read": part_bytes_read,
            }
        )
    )


def measure(root: Path, episodes: int, shards: int, templates: Templates | None, compressed: bool) -> dict:
    t0 = time.perf_counter()
    _, size, stored = build_run(root, episodes, shards, templates=templates, compressed=compressed)
    build_s = time.perf_counter() - t0
    out = subprocess.run([sys.executable, __file__, "--reduce-child", str(root)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["completed"] == episodes, result
    mb = size / 1e6
    return {
        **result,
        "episodes": episodes,
        "mb": mb,
        "stored_mb": stored / 1e6,
        "build_s": build_s,
        "episodes_per_s": episodes / result["seconds"],
        "mb_per_s": mb / result["seconds"],
        "mb_per_cpu_s": mb / result["cpu_seconds"],
        "reads_per_stored_byte": result["part_bytes_read"] / stored,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=20000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--traces", type=Path, default=None, help="a traces.jsonl whose completed records are the templates")
    parser.add_argument("--plain", action="store_true", help="write plain .jsonl parts (as before zstd)")
    parser.add_argument("--reduce-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reduce_child:
        reduce_child(args.reduce_child)
        return
    base = Path(tempfile.mkdtemp(prefix="reduce-bench-", dir=args.dir))
    try:
        baseline = subprocess.run(
            [
                sys.executable,
                "-c",
                "import shopsimrl.runner.reduce, pathlib; print(next(int(l.split()[1]) / 1024 for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM:')))",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        import_mb = float(baseline.stdout.strip())
        rows = []
        templates = Templates(args.traces) if args.traces else None
        for n in (args.episodes, 2 * args.episodes):
            row = measure(base / f"n{n}", n, args.shards, templates, not args.plain)
            rows.append(row)
            print(
                f"{n:>7} episodes / {args.shards} shards: {row['mb']:.0f} MB of traces, {row['stored_mb']:.1f} MB stored "
                f"({row['stored_mb'] * 1e3 / n:.1f} KB per episode, 1/{row['mb'] / row['stored_mb']:.1f} of the JSONL) · "
                f"reduce {row['seconds']:.1f} s ({row['cpu_seconds']:.1f} s CPU) · "
                f"{row['episodes_per_s']:.0f} episodes/s · {row['mb_per_s']:.1f} MB/s ({row['mb_per_cpu_s']:.1f} MB per CPU second) · "
                f"part bytes read per byte stored {row['reads_per_stored_byte']:.2f} · peak RSS {row['peak_rss_mb']:.1f} MB "
                f"(imports alone {import_mb:.1f} MB, after loading the plan {row['plan_rss_mb']:.1f} MB; traces add {row['peak_rss_mb'] - row['plan_rss_mb']:.1f} MB) · duplicates found {row['duplicates']}"
            )
            shutil.rmtree(base / f"n{n}")
        a, b = rows
        print(
            f"2x episodes → time x{b['seconds'] / a['seconds']:.2f}, CPU x{b['cpu_seconds'] / a['cpu_seconds']:.2f} (ideal 2.00), peak RSS x{b['peak_rss_mb'] / a['peak_rss_mb']:.2f} (flat = 1.00), "
            f"RSS above imports x{(b['peak_rss_mb'] - import_mb) / max(1e-9, a['peak_rss_mb'] - import_mb):.2f}; "
            f"memory for traces (peak − plan) {a['peak_rss_mb'] - a['plan_rss_mb']:.1f} → {b['peak_rss_mb'] - b['plan_rss_mb']:.1f} MB"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
