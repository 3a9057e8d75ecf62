"""`reduce` names its run and clusters repeats that landed on different shards (issue 10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shopsimrl import __version__
from shopsimrl.manifest import manifest_head, run_identity
from shopsimrl.metrics import summarize_traces
from shopsimrl.records import to_plain
from shopsimrl.runner.reduce import reduce_run
from shopsimrl.storage.sharded import ShardedRunStore, iter_part_records

from .conftest import Backend, Testbed, cli, worker_env, write_config


@pytest.mark.slow
def test_reduced_summary_names_its_run_and_clusters_repeats_across_shards(
    backend: Backend, testbed: Testbed, tmp_path: Path
) -> None:
    config = write_config(tmp_path, testbed, episodes=5, name="named")
    config.write_text(config.read_text().replace("sample_size: 5", "sample_size: 5\n  repeats: 2"))
    uri = backend.uri("identity")
    result = cli("run", str(config), "--shards", "3", "--run", uri, env=worker_env(backend))
    assert result.returncode == 0, result.stderr[-3000:]
    store = ShardedRunStore(uri)
    summary = json.loads(store.read_bytes("summary.json"))
    manifest = store.read_manifest()
    assert manifest is not None
    assert summary["run"] == run_identity(manifest, uri=store.display_uri)
    identity = summary["run"]
    assert identity["experiment"] == "named" and identity["model_id"] == "shopsim-heuristic"
    assert identity["model_name"] == "shopsim-heuristic" and identity["checkpoint_id"] is None
    assert identity["plan_fingerprint"] == manifest.plan_fingerprint and identity["split"]["name"] == "val"
    assert identity["split"]["task_ids_sha256"] == manifest.plan.task_split["task_ids_sha256"]
    assert identity["versions"]["shopsimrl"] == __version__
    assert identity["uri"] == store.display_uri and "testing-secret" not in json.dumps(summary)

    # Round-robin over 3 shards puts the two repeats of a task on different shards; the
    # reducer's statistics equal those of all winning records summarised at once.
    winners = {}
    shards_of_task: dict[int, set[int]] = {}
    for index in range(3):
        for name in store.list_shard(index).parts:
            for record in iter_part_records(name, store.read_part(index, name) or b""):
                if record is not None and record.completed:
                    winners.setdefault(record.episode_id, record)
                    shards_of_task.setdefault(record.job.task_id, set()).add(index)
    assert len(winners) == 10 and any(len(shards) > 1 for shards in shards_of_task.values())
    direct = summarize_traces(winners.values())
    for block in ("primary", "intent_to_treat", "per_task", "intervals"):
        assert summary[block] == direct[block], block
    assert summary["per_task"]["episodes_per_task"] == {"min": 2, "max": 2} and summary["intervals"]["clusters"] == 5
    again = reduce_run(store, write=False)
    assert again["run"] == identity


def test_manifest_head_reads_the_identity_without_the_job_list() -> None:
    from shopsimrl.manifest import build_manifest

    plan = {
        "pipeline_version": "v",
        "fingerprint_version": "f",
        "experiment": "e",
        "model_id": "m",
        "model": {"model": "Qwen/Qwen3.5-4B", "checkpoint_id": "step-900", "sampling": {"extra_body": {"k": "\u201c}"}}},
        "task_split": {"name": "val", "task_count": 2, "task_ids_sha256": "ab" * 32},
        "jobs": [{"task_id": n, "sample_id": 0, "seed": n, "split": "val"} for n in range(20_000)],
    }
    data = (json.dumps(to_plain(build_manifest(plan)), ensure_ascii=False, indent=2) + "\n").encode("utf-8")
    head = manifest_head(data[:4096])
    assert head is not None and "jobs" not in head["plan"]
    assert run_identity(head, uri="s3://key:secret@bucket/runs/x") == run_identity(json.loads(data), uri="s3://bucket/runs/x")
    assert manifest_head(data[:300]) is None  # the head ends inside the plan: the caller reads the whole file
    assert manifest_head(b"") is None and manifest_head(b'["not", "a manifest"]') is None
