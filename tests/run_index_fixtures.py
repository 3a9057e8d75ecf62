"""Runs written as shopsimrl writes them (manifest, traces or parts, markers, summary), for the
run index tests: local and sharded, finished, in progress, unreadable; at any store location."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shopsimrl.manifest import run_identity
from shopsimrl.metrics import SummaryAccumulator
from shopsimrl.records import dump_line, read_trace
from shopsimrl.runner.local import summarize_local
from shopsimrl.runner.reduce import reduce_run
from shopsimrl.schemas import TRACE_SCHEMA_VERSION, EpisodeJob
from shopsimrl.storage.local import LocalRunStore
from shopsimrl.storage.sharded import ShardedRunStore, marker_document, part_entry

PRICES = {"prompt_per_million": 1.0, "completion_per_million": 2.0, "accelerators": 1, "accelerator_per_hour": 3.0}
TASKS = (3, 5, 8, 13)


def plan(experiment: str, checkpoint: str, *, seed: int = 7, split: str = "val", repeats: int = 1) -> dict[str, Any]:
    """A plan as ``prepare`` builds it (identity keys before the job list): four tasks × ``repeats``."""
    jobs = [
        EpisodeJob(task_id=task, sample_id=sample, seed=seed * 100_000 + task * 1000 + sample, split=split)
        for task in TASKS
        for sample in range(repeats)
    ]
    return {
        "pipeline_version": "shopsimrl-test",
        "fingerprint_version": "v2",
        "experiment": experiment,
        "model_id": "policy",
        "model": {"provider": "openai-compatible", "model": "org/policy-4b", "checkpoint_id": checkpoint},
        "task_split": {"name": split, "split_version": "v1", "task_count": 400, "task_ids_sha256": f"ids-of-{split}"},
        "sampling": {"seed": seed, "sample_size": len(TASKS), "repeats": repeats},
        "jobs": [job.to_dict() for job in jobs],
        "environment": {"mode": "persona"},
    }


def record(job: dict[str, Any], reward: float, *, completed: bool = True, minute: int = 0, length: int = 1) -> dict[str, Any]:
    episode_id = EpisodeJob.from_dict(job).episode_id
    out: dict[str, Any] = {
        "schema_version": TRACE_SCHEMA_VERSION,
        "episode_id": episode_id,
        "status": "completed" if completed else "failed",
        "attempt": 1,
        "job": job,
        "started_at": f"2026-02-01T10:{minute:02d}:00+00:00",
        "ended_at": f"2026-02-01T10:{minute + length:02d}:00+00:00",
        "steps": [{"step_index": 0, "model": {"usage": {"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050}}}],
    }
    if completed:
        out["final"] = {"done": True, "reward": reward, "reward_detail": {"r_success": 1.0 if reward == 1.0 else 0.0}}
    else:
        out.update(failure_class="policy", error={"type": "PolicyError"})
    return out


def local_run(
    directory: Path, the_plan: dict[str, Any], rewards: list[float | None], *, summarize: bool = True, length: int = 1
) -> LocalRunStore:
    """A local run directory, one record per reward (``None``: that episode failed as an outcome),
    episode ``i`` from minute ``i`` for ``length`` minutes."""
    store = LocalRunStore(directory)
    manifest = store.freeze_plan(the_plan, {"concurrency": 2, "cost": PRICES})
    jobs = the_plan["jobs"]
    store.save_traces(
        [
            read_trace(record(job, reward or 0.0, completed=reward is not None, minute=i, length=length))
            for i, (job, reward) in enumerate(zip(jobs, rewards, strict=False))
        ]
    )
    if summarize:
        summarize_local(store, manifest, [EpisodeJob.from_dict(job).episode_id for job in jobs])
    return store


def sharded_run(
    uri: str, the_plan: dict[str, Any], rewards: list[float], *, shards: int = 2, commit: int | None = None, reduce: bool = True
) -> ShardedRunStore:
    """A sharded run at ``uri``: each of the first ``commit`` shards (all by default) written as a
    worker writes it (a compressed part, then a commit marker), then reduced."""
    store = ShardedRunStore(uri)
    manifest = store.freeze_plan(the_plan, {"concurrency": 2, "cost": PRICES, "run": uri})
    jobs = [EpisodeJob.from_dict(job) for job in the_plan["jobs"]]
    shard_map = store.ensure_shard_map(jobs, shards, manifest.plan_fingerprint)
    by_id = {job.episode_id: (job.to_dict(), reward, i) for i, (job, reward) in enumerate(zip(jobs, rewards, strict=True))}
    for shard in range(shards if commit is None else commit):
        ids = shard_map.episode_ids[shard]
        lines = b"".join(dump_line(read_trace(record(by_id[i][0], by_id[i][1], minute=by_id[i][2]))) for i in ids)
        name, data = store.write_part(shard, 0, "0123abcd", lines)
        store.create_marker(
            shard,
            marker_document(
                shard=shard,
                plan_fingerprint=manifest.plan_fingerprint,
                completed=len(ids),
                failed=0,
                episode_ids_sha256=shard_map.ids_sha256(shard),
                parts=[part_entry(name, data, len(ids))],
                writer="0123abcd",
            ),
        )
    if reduce:
        reduce_run(store)
    return store


def legacy_run(directory: Path, rewards: list[float]) -> None:
    """Traces and a summary of the earlier implementation: no manifest."""
    directory.mkdir(parents=True)
    records = [
        record({"task_id": task, "sample_id": 0, "seed": task, "split": "val"}, reward)
        for task, reward in zip(TASKS, rewards, strict=False)
    ]
    (directory / "traces.jsonl").write_bytes(b"".join(dump_line(read_trace(r)) for r in records))
    accumulator = SummaryAccumulator()
    for r in records:
        accumulator.add(read_trace(r))
    summary = accumulator.result()
    summary["run"] = run_identity(None, uri=str(directory))
    (directory / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
