"""One flat row per episode: what every research tool (compare, report, viewer, tables, labels)
reads of a trace record, computed in one place with the summary's own step reading
(:func:`shopsimrl.metrics.step_facts`).

Rewards: ``reward`` is the environment's reward of a completed episode (None otherwise);
``reward_itt`` is the summary's intent-to-treat value: a failed episode counts 0, except one
whose failure says nothing about the agent (``infrastructure``, ``configuration_error``; None:
excused, as in ``summary.json``). ``success`` likewise from
``r_success``.
"""

from __future__ import annotations

import math
from typing import Any

from shopsimrl.metrics import step_facts
from shopsimrl.records import read_trace
from shopsimrl.records.trace import EXCUSED_FAILURE_CLASSES

__all__ = ["CORE_COLUMNS", "episode_row", "task_key"]

CORE_COLUMNS = (
    "episode_id",
    "task_id",
    "sample_id",
    "seed",
    "split",
    "status",
    "completed",
    "failure_class",
    "error_type",
    "termination_reason",
    "category",
    "reward",
    "reward_itt",
    "success",
    "success_itt",
    "steps",
    "actions",
    "invalid_actions",
    "invalid_action_rate",
    "protocol_errors",
    "policy_failures",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "reasoning_tokens",
    "model_latency_ms_total",
    "model_latency_ms_max",
    "model_retries",
    "duration_ms",
    "attempt",
    "started_at",
    "ended_at",
)
"""The row's fixed columns, in order; the reward components (``r_*``) follow them."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def task_key(record: dict[str, Any]) -> str:
    """The task an episode belongs to (its samples share it): the job's task id, else the
    episode id's task part."""
    task_id = _map(record.get("job")).get("task_id")
    if isinstance(task_id, int) and not isinstance(task_id, bool):
        return str(task_id)
    return str(record.get("episode_id", "")).split("__sample-")[0]


def episode_row(record: dict[str, Any]) -> dict[str, Any]:
    """The flat row of one trace record (the winning record of its episode)."""
    job = _map(record.get("job"))
    final = _map(record.get("final"))
    detail = _map(final.get("reward_detail"))
    completed = read_trace(record).completed
    failure_class = record.get("failure_class")
    excused = not completed and failure_class in EXCUSED_FAILURE_CLASSES

    reward = _number(final.get("reward")) if completed else None
    success = _number(detail.get("r_success")) if completed else None
    goal = _map(final.get("goal"))
    purchase = _map(final.get("purchase"))

    steps = record.get("steps")
    if not isinstance(steps, list):
        steps = []
    actions = invalid = protocol = policy = retries = 0
    tokens: dict[str, int] = {}
    latency_total, latency_max = 0.0, None
    for step in steps:
        if not isinstance(step, dict):
            continue
        facts = step_facts(step)
        actions += facts.acted
        invalid += facts.invalid_action
        protocol += facts.protocol_error
        policy += facts.policy_failure is not None
        retries += facts.retries
        for key, count in facts.tokens.items():
            tokens[key] = tokens.get(key, 0) + count
        if facts.latency_ms is not None:
            latency_total += facts.latency_ms
            latency_max = facts.latency_ms if latency_max is None else max(latency_max, facts.latency_ms)

    error = record.get("error")
    row: dict[str, Any] = {
        "episode_id": record.get("episode_id"),
        "task_id": job.get("task_id"),
        "sample_id": job.get("sample_id"),
        "seed": job.get("seed"),
        "split": job.get("split"),
        "status": record.get("status"),
        "completed": completed,
        "failure_class": failure_class if isinstance(failure_class, str) else None,
        "error_type": _map(error).get("type") if error else None,
        "termination_reason": final.get("termination_reason") if completed else None,
        "category": goal.get("category") or purchase.get("product_category") or None,
        "reward": reward,
        "reward_itt": None if excused else (reward if completed else 0.0) or 0.0,
        "success": success,
        "success_itt": None if excused else (success if completed else 0.0) or 0.0,
        "steps": len(steps),
        "actions": actions,
        "invalid_actions": invalid,
        "invalid_action_rate": invalid / actions if actions else None,
        "protocol_errors": protocol,
        "policy_failures": policy,
        "prompt_tokens": tokens.get("prompt_tokens"),
        "completion_tokens": tokens.get("completion_tokens"),
        "total_tokens": tokens.get("total_tokens"),
        "reasoning_tokens": tokens.get("reasoning_tokens"),
        "model_latency_ms_total": latency_total if latency_max is not None else None,
        "model_latency_ms_max": latency_max,
        "model_retries": retries,
        "duration_ms": _number(record.get("duration_ms")),
        "attempt": record.get("attempt") if isinstance(record.get("attempt"), int) else 1,
        "started_at": record.get("started_at"),
        "ended_at": record.get("ended_at"),
    }
    if completed:
        for key, value in sorted(detail.items()):
            if isinstance(key, str) and key.startswith("r_") and _number(value) is not None:
                row[key] = _number(value)
    return row
