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

from typing import Any

from shopsimrl.metrics import step_facts
from shopsimrl.records import EpisodeTrace
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


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def task_key(record: EpisodeTrace) -> str:
    """The task an episode belongs to (its samples share it): the job's task id."""
    return str(record.job.task_id)


def episode_row(record: EpisodeTrace) -> dict[str, Any]:
    """The flat row of one trace record (the winning record of its episode)."""
    job = record.job
    final = record.final
    completed = record.completed
    failure_class = record.failure_class
    excused = not completed and failure_class in EXCUSED_FAILURE_CLASSES

    reward = final.reward if completed and final is not None else None
    success = final.component("r_success") if completed and final is not None else None
    goal = _map(final.get("goal")) if final is not None else {}
    purchase = _map(final.get("purchase")) if final is not None else {}

    actions = invalid = protocol = policy = retries = 0
    tokens: dict[str, int] = {}
    latency_total, latency_max = 0.0, None
    for step in record.steps:
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

    row: dict[str, Any] = {
        "episode_id": record.episode_id,
        "task_id": job.task_id,
        "sample_id": job.sample_id,
        "seed": job.seed,
        "split": job.split,
        "status": record.status,
        "completed": completed,
        "failure_class": failure_class,
        "error_type": record.error.type if record.error is not None else None,
        # As stored: the open payload's value, whatever its type (the tables type it).
        # ``time_limit`` for an episode the runtime ended at its time limit (the shop was told action_limit).
        "termination_reason": ("time_limit" if record.time_limit is not None else final.get("termination_reason"))
        if completed and final is not None
        else None,
        "category": goal.get("category") or purchase.get("product_category") or None,
        "reward": reward,
        "reward_itt": None if excused else (reward if completed else 0.0) or 0.0,
        "success": success,
        "success_itt": None if excused else (success if completed else 0.0) or 0.0,
        "steps": len(record.steps),
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
        "duration_ms": record.duration_ms,
        "attempt": record.attempt if record.attempt is not None else 1,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
    }
    if completed and final is not None:
        for key in sorted(final.reward_detail):
            value = final.component(key)
            if key.startswith("r_") and value is not None:
                row[key] = value
    return row
