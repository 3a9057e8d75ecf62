"""An evaluation run in the trackers, as lm-eval logs results and samples: the summary's headline
as scalars, a table per catalog category and a table of episodes (one row per planned episode),
the summary (JSON and the terminal's table) and the HTML report as one artifact, and the run's
identity (experiment, model, checkpoint, split, plan fingerprint) as config, parameters and tags.

Called by the commands that write a summary (``run``, ``reduce``, ``summarize`` with ``--track``
or a ``tracking:`` block) once it is written; the numbers are the summary's, the rows are read
from the run's records as ``compare`` and ``report`` read them (:func:`~shopsimrl.research.compare.load_run`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from shopsimrl.config import TrackingSection
from shopsimrl.research.tracking.base import TrackedRun, TrackerOutcome, Tracking

__all__ = [
    "CATEGORY_COLUMNS",
    "EPISODE_COLUMNS",
    "category_rows",
    "episode_rows",
    "evaluation_identity",
    "headline_scalars",
    "track_evaluation",
]

_log = structlog.get_logger("shopsimrl.tracking")

EPISODE_COLUMNS = (
    "episode_id",
    "task_id",
    "sample_id",
    "category",
    "status",
    "failure_class",
    "termination_reason",
    "reward",
    "reward_itt",
    "success",
    "steps",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "duration_ms",
)
"""The episode table: one row per planned episode; ``status`` is ``completed``, ``failed`` or
``missing`` (planned, no record yet); ``reward_itt`` is the summary's intent-to-treat value."""

CATEGORY_COLUMNS = (
    "category",
    "episodes",
    "completed",
    "failed",
    "reward_itt_mean",
    "success_itt_rate",
    "reward_mean_completed",
    "total_tokens",
)
"""Per catalog category (the goal's): episodes with a record, the intent-to-treat means over
those with a value, the conditional mean over completed ones, their tokens. No intervals: a
category holds few episodes; the run's interval is the summary's."""


def _interval(value: Any, index: int) -> Any:
    return value[index] if isinstance(value, list) and len(value) == 2 else None


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def headline_scalars(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The summary's headline as flat scalars (``itt/…`` first: the numbers to quote)."""
    itt, counts, primary = _map(summary.get("intent_to_treat")), _map(summary.get("counts")), _map(summary.get("primary"))
    cost, behavior, per_task = _map(summary.get("cost")), _map(summary.get("behavior")), _map(summary.get("per_task"))
    scalars: dict[str, Any] = {
        "itt/score": itt.get("score"),
        "itt/reward_mean": itt.get("reward_mean"),
        "itt/reward_sem": itt.get("reward_sem"),
        "itt/reward_ci95_low": _interval(itt.get("reward_ci95"), 0),
        "itt/reward_ci95_high": _interval(itt.get("reward_ci95"), 1),
        "itt/success_rate": itt.get("success_rate"),
        "itt/success_ci95_low": _interval(itt.get("success_ci95"), 0),
        "itt/success_ci95_high": _interval(itt.get("success_ci95"), 1),
        "itt/episodes": itt.get("episodes"),
        "itt/failed_counted_as_zero": itt.get("failed_counted_as_zero"),
        "itt/failed_excused": (itt.get("failed_infrastructure_excluded") or 0) + (itt.get("failed_configuration_excluded") or 0),
        "counts/requested": counts.get("requested"),
        "counts/completed": counts.get("completed"),
        "counts/failed": counts.get("failed"),
        "counts/missing": counts.get("missing"),
        "counts/coverage": counts.get("coverage"),
        "completed/reward_mean": primary.get("reward_mean"),
        "completed/success_rate": primary.get("success_rate"),
        "behavior/steps_mean": behavior.get("steps_mean"),
        "behavior/invalid_action_rate": behavior.get("invalid_action_rate"),
        "behavior/protocol_error_rate": behavior.get("protocol_error_rate"),
        "cost/accelerator_hours": cost.get("accelerator_hours"),
        "cost/money_total": _map(cost.get("money")).get("total"),
    }
    for key, value in _map(cost.get("tokens")).items():
        scalars[f"tokens/{key}"] = value
    for name, count in _map(summary.get("failure_classes")).items():
        scalars[f"failures/{name}"] = count
    for k, value in _map(per_task.get("pass_at_k")).items():
        scalars[f"pass_at_k/{k}"] = value
    return scalars


def episode_rows(rows: Mapping[str, Mapping[str, Any]], job_keys: Mapping[str, tuple[Any, ...]]) -> list[list[Any]]:
    """One row per planned episode (the plan's order), then records not in the plan."""
    table = []
    for episode_id in [*job_keys, *(episode_id for episode_id in rows if episode_id not in job_keys)]:
        row = rows.get(episode_id)
        key = job_keys.get(episode_id) or (row or {}).get("job_key") or (None, None)
        if row is None:
            table.append([episode_id, key[0], key[1], *([None] * (len(EPISODE_COLUMNS) - 3))])
            table[-1][EPISODE_COLUMNS.index("status")] = "missing"
            continue
        values = {
            **row,
            "episode_id": episode_id,
            "task_id": key[0],
            "sample_id": key[1],
            "status": "completed" if row.get("completed") else "failed",
        }
        table.append([values.get(column) for column in EPISODE_COLUMNS])
    return table


@dataclass
class _Category:
    episodes: int = 0
    completed: int = 0
    failed: int = 0
    itt_reward: float = 0.0
    itt_reward_n: int = 0
    itt_success: float = 0.0
    itt_success_n: int = 0
    reward: float = 0.0
    reward_n: int = 0
    tokens: int = 0


def category_rows(rows: Mapping[str, Mapping[str, Any]]) -> list[list[Any]]:
    """The per-category table, largest category first."""
    found: dict[str, _Category] = {}
    for row in rows.values():
        piece = found.setdefault(str(row.get("category") or "unknown"), _Category())
        piece.episodes += 1
        piece.completed += bool(row.get("completed"))
        piece.failed += not row.get("completed")
        if row.get("reward_itt") is not None:
            piece.itt_reward += float(row["reward_itt"])
            piece.itt_reward_n += 1
        if row.get("success_itt") is not None:
            piece.itt_success += float(row["success_itt"])
            piece.itt_success_n += 1
        if row.get("completed") and row.get("reward") is not None:
            piece.reward += float(row["reward"])
            piece.reward_n += 1
        piece.tokens += int(row.get("total_tokens") or 0)

    def mean(total: float, count: int) -> float | None:
        return total / count if count else None

    return [
        [
            name,
            piece.episodes,
            piece.completed,
            piece.failed,
            mean(piece.itt_reward, piece.itt_reward_n),
            mean(piece.itt_success, piece.itt_success_n),
            mean(piece.reward, piece.reward_n),
            piece.tokens,
        ]
        for name, piece in sorted(found.items(), key=lambda item: (-item[1].episodes, item[0]))
    ]


def evaluation_identity(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The run's identity (the summary's ``run`` block) and the summary's schema."""
    identity = dict(_map(summary.get("run")))
    return {**identity, "summary_schema": summary.get("schema_version")}


def _tags(identity: Mapping[str, Any]) -> dict[str, str]:
    split = _map(identity.get("split"))
    tags = {
        "shopsimrl.experiment": identity.get("experiment"),
        "shopsimrl.model": identity.get("model_name"),
        "shopsimrl.checkpoint": identity.get("checkpoint_id"),
        "shopsimrl.split": split.get("name"),
        "shopsimrl.fingerprint": identity.get("plan_fingerprint"),
        "shopsimrl.run": identity.get("uri"),
    }
    return {key: str(value) for key, value in tags.items() if value is not None}


def track_evaluation(location: str, summary: Mapping[str, Any], settings: TrackingSection) -> list[TrackerOutcome]:
    """Log the run at ``location`` and its ``summary`` (as just written) to ``settings.backends``.

    Never raises for a tracker or for a part that cannot be made (the run's records unreadable,
    the report): what cannot be logged is logged as a warning, and the rest still goes. The
    trackers start first, so a run whose trackers all fail to start reads nothing more."""
    from shopsimrl.metrics import format_summary_table

    if not settings.backends:
        return []
    identity = evaluation_identity(summary)
    name = settings.name or str(identity.get("experiment") or location.rstrip("/").rsplit("/", 1)[-1])
    with Tracking(settings, TrackedRun(name, "evaluation", identity, _tags(identity))) as tracked:
        if not tracked.active:
            return tracked.outcomes
        loaded = _load(location) if settings.episodes or settings.report else None
        scalars = headline_scalars(summary)
        tables: list[tuple[str, tuple[str, ...], list[list[Any]]]] = []
        if loaded is not None:
            tables.append(("categories", CATEGORY_COLUMNS, category_rows(loaded.rows)))
            if settings.episodes:
                episodes = episode_rows(loaded.rows, loaded.job_keys)
                if len(episodes) > settings.max_episode_rows:
                    _log.warning("tracking_episode_rows_cut", run=location, rows=len(episodes), logged=settings.max_episode_rows)
                scalars["tracking/episode_rows"] = min(len(episodes), settings.max_episode_rows)
                tables.append(("episodes", EPISODE_COLUMNS, episodes[: settings.max_episode_rows]))
        tracked.log_scalars(scalars)
        for table_name, columns, rows in tables:
            tracked.log_table(table_name, columns, rows)
        files: dict[str, bytes | Path] = {
            "summary.json": json.dumps(summary, ensure_ascii=False, indent=2).encode("utf-8"),
            "summary.txt": (format_summary_table(summary) + "\n").encode("utf-8"),
        }
        if loaded is not None and settings.report:
            report = _report(loaded, location)
            if report is not None:
                files["report.html"] = report
        tracked.log_files(f"{name}-evaluation", "shopsimrl-evaluation", files)
    return tracked.outcomes


def _load(location: str) -> Any:
    from shopsimrl.research.compare import load_run

    try:
        return load_run(location)
    except Exception as exc:  # the summary is written; the trackers then get what there is
        _log.warning("tracking_without_episodes", run=location, error=str(exc))
        return None


def _report(loaded: Any, location: str) -> bytes | None:
    try:
        from shopsimrl.research.report import build_report

        return build_report([loaded]).html.encode("utf-8")
    except Exception as exc:  # a report that cannot be drawn leaves the numbers and tables
        _log.warning("tracking_without_report", run=location, error=str(exc))
        return None
