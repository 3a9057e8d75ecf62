"""Runs made from the records of a real one: the same plan written as a sharded run (any part
size, compressed or plain parts), and large runs whose records are copies of real records with
the identity of each planned job and perturbed outcomes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from shopsimrl.schemas import EpisodeJob
from shopsimrl.storage.sharded import ShardedRunStore, marker_document, part_entry

WRITER = "5e1ec7ed"


def sharded_copy(
    uri: str,
    plan: dict[str, Any],
    line_of: Callable[[str], bytes],
    shards: int,
    *,
    per_part: int = 10,
    compressed: bool = True,
) -> None:
    """Freeze ``plan`` at ``uri`` as ``shards`` shards and commit each: parts of ``per_part``
    trace lines (``line_of(episode_id)``, one JSON line), then a commit marker, as a worker does."""
    store = ShardedRunStore(uri)
    manifest = store.freeze_plan(plan)
    jobs = [EpisodeJob.from_dict(job) for job in plan["jobs"]]
    shard_map = store.ensure_shard_map(jobs, shards, manifest.plan_fingerprint)

    def commit(shard: int) -> None:
        ids = shard_map.episode_ids[shard]
        entries, completed = [], 0
        for seq, start in enumerate(range(0, len(ids), per_part)):
            lines = [line_of(episode_id) for episode_id in ids[start : start + per_part]]
            completed += sum(b'"status":"completed"' in line for line in lines)
            name, data = store.write_part(shard, seq, WRITER, b"".join(lines), compressed=compressed)
            entries.append(part_entry(name, data, len(lines)))
        store.create_marker(
            shard,
            marker_document(
                shard=shard,
                plan_fingerprint=manifest.plan_fingerprint,
                completed=completed,
                failed=len(ids) - completed,
                episode_ids_sha256=shard_map.ids_sha256(shard),
                parts=entries,
                writer=WRITER,
            ),
        )

    with ThreadPoolExecutor(max_workers=shards) as pool:  # the shards' workers write at once, as in a run
        list(pool.map(commit, range(shards)))


def trace_line(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record) + b"\n"


def perturbed(template: dict[str, Any], job: EpisodeJob, position: int) -> dict[str, Any]:
    """``template`` (a real completed record) as the record of ``job``: its identity, and by
    position a failed episode (1 in 13), an action-limit ending (1 in 7) or another reward."""
    record = dict(template)
    record["episode_id"] = job.episode_id
    record["job"] = {"task_id": job.task_id, "sample_id": job.sample_id, "seed": job.seed, "split": job.split}
    if position % 13 == 5:
        record.update(status="failed", final=None, failure_class="environment_error")
        record["error"] = {"stage": "environment_step_3", "type": "ShopEnvironmentError", "message": "server error 500"}
        return record
    final = copy.deepcopy(template["final"])
    detail = final["reward_detail"]
    if position % 7 == 3:
        final["termination_reason"] = detail["termination_reason"] = "action_limit"
        reward = 0.0
    else:
        reward = (position % 11) / 10
    final["reward"] = detail["r_strict"] = reward
    detail["r_success"] = 1 if reward == 1.0 else 0
    record["final"] = final
    return record


def synthetic_line_of(templates: Sequence[dict[str, Any]], jobs: Sequence[EpisodeJob]) -> Callable[[str], bytes]:
    """Episode id → its trace line, made when asked (40,000 lines are gigabytes): the template
    at the job's position (round robin), perturbed."""
    positions = {job.episode_id: (position, job) for position, job in enumerate(jobs)}

    def line_of(episode_id: str) -> bytes:
        position, job = positions[episode_id]
        return trace_line(perturbed(templates[position % len(templates)], job, position))

    return line_of


HOSTILE = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"
"""Markup a model could write: run as HTML, it would retitle the page."""
HOSTILE_ID = "task-999999__sample-000"
LONG_THINKING_END = "END-OF-THINKING"


def hostile_record(template: dict[str, Any]) -> dict[str, Any]:
    """``template`` (a real completed record) as episode ``HOSTILE_ID`` whose texts hold markup,
    rich markup and terminal escape sequences, whose first step's thinking is long, and whose
    first model call took two HTTP attempts (a 503, then the answer)."""
    record = copy.deepcopy(template)
    record["episode_id"] = HOSTILE_ID
    record["job"] = {**record["job"], "task_id": 999999, "sample_id": 0}
    record["reset"]["task_instruction"] = f"买一把键盘 \"'><svg onload=alert(1)> {HOSTILE}"
    record["reset"]["user_persona"] = {**record["reset"]["user_persona"], "<b>备注</b>": HOSTILE}
    step = record["steps"][0]
    model = step["model"]
    model["reasoning"] = "先想一想。" * 80 + "\x1b]0;pwned\x07\x1b[2J" + HOSTILE + LONG_THINKING_END
    model["content"] = f"[bold red]rich markup[/] {HOSTILE}"
    step["observation"] += f"</pre>{HOSTILE}"
    model["attempt_count"] = 2
    model["attempts"] = [
        {"attempt": 1, "latency_ms": 12.5, "status": 503, "error": "HTTP 503 <overloaded>", "backoff_ms": 200.0},
        {"attempt": 2, "latency_ms": model["latency_ms"], "status": 200, "error": None, "backoff_ms": 0.0},
    ]
    record["final"]["reward_detail"]["note"] = HOSTILE
    record["final"]["goal"]["category"] = f"数码›{HOSTILE}"
    return record
