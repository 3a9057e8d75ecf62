"""The judge summary: counts per status, the verdict distribution, and the judge's agreement with
the environment's reward and with the rule labels (2×2 tables, raw agreement, Cohen's kappa
with a bootstrap interval over tasks).

Binary variables, per episode with a parsed verdict (status ``ok``):

- reward: judge ``verdict == "success"`` against ``r_success == 1`` (an episode without a
  reward, one that failed, counts as not successful). ``partial`` is not success;
- labels, where a judge failure category names the same fault as a rule label:
  ``wrong_product`` ↔ ``wrong_product``, ``wrong_options`` ↔ ``wrong_or_missing_options``,
  ``over_budget`` ↔ ``budget_violation``, ``invalid_actions`` ↔ ``invalid_action``,
  ``no_purchase`` ↔ not completed with a purchase; and ``clean``: judge ``success`` against an
  episode without any rule label.

Cohen's kappa is ``(p_o − p_e) / (1 − p_e)`` over the table ``[[both yes, judge only],
[other only, both no]]``. It is undefined (null, with the reason) without episodes, or when
``p_e == 1`` (both raters gave one and the same answer to every episode). The interval is the
percentile interval of kappa over resamples of tasks with replacement (a task's episodes move
together), from the seeded generator of :mod:`shopsimrl.research.paired_stats`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import numpy as np
import numpy.typing as npt

from shopsimrl.research.paired_stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED

__all__ = ["CATEGORY_LABELS", "JUDGE_SUMMARY_VERSION", "agreement", "cohen_kappa", "judge_summary"]

JUDGE_SUMMARY_VERSION = "shopsimrl-judge-summary-v1"
CATEGORY_LABELS = {
    "wrong_product": "wrong_product",
    "wrong_options": "wrong_or_missing_options",
    "over_budget": "budget_violation",
    "invalid_actions": "invalid_action",
}
"""Judge failure category → the rule label that names the same fault (docs/analysis.md §6)."""
_CHUNK = 2_000


def cohen_kappa(both: int, judge_only: int, other_only: int, neither: int) -> tuple[float | None, str | None]:
    """Kappa of a 2×2 table, or (None, why) when it is undefined."""
    n = both + judge_only + other_only + neither
    if n == 0:
        return None, "no episodes"
    observed = (both + neither) / n
    judge_yes, other_yes = (both + judge_only) / n, (both + other_only) / n
    expected = judge_yes * other_yes + (1 - judge_yes) * (1 - other_yes)
    if expected >= 1.0:
        return None, "chance agreement is 1: both raters gave one and the same answer to every episode"
    return (observed - expected) / (1 - expected), None


def _kappas(tables: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Kappa of each row ``[both, judge_only, other_only, neither]`` (NaN where undefined)."""
    n = tables.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        observed = (tables[:, 0] + tables[:, 3]) / n
        judge_yes = (tables[:, 0] + tables[:, 1]) / n
        other_yes = (tables[:, 0] + tables[:, 2]) / n
        expected = judge_yes * other_yes + (1 - judge_yes) * (1 - other_yes)
        kappa = (observed - expected) / (1 - expected)
    kappa[~(expected < 1.0)] = np.nan
    return np.asarray(kappa, dtype=np.float64)


def agreement(
    pairs: Iterable[tuple[Any, bool, bool]], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> dict[str, Any]:
    """Agreement of ``(task, judge_says, other_says)`` pairs: the table, raw agreement, kappa and
    its 95% interval over task resamples."""
    index: dict[Any, int] = {}
    rows: list[list[float]] = []
    for task, judge, other in pairs:
        position = index.setdefault(task, len(index))
        if position == len(rows):
            rows.append([0.0, 0.0, 0.0, 0.0])
        rows[position][(0 if other else 1) if judge else (2 if other else 3)] += 1
    per_task = np.array(rows, dtype=np.float64).reshape(-1, 4)
    total = per_task.sum(axis=0)
    both, judge_only, other_only, neither = (int(v) for v in total)
    n = both + judge_only + other_only + neither
    kappa, why = cohen_kappa(both, judge_only, other_only, neither)
    result: dict[str, Any] = {
        "episodes": n,
        "table": {"both": both, "judge_only": judge_only, "other_only": other_only, "neither": neither},
        "raw_agreement": (both + neither) / n if n else None,
        "kappa": kappa,
        "kappa_undefined": why,
        "kappa_ci95": None,
    }
    if kappa is None or len(per_task) < 2:
        return result
    rng = np.random.default_rng(seed)
    kappas = []
    for start in range(0, resamples, _CHUNK):
        rows_now = min(_CHUNK, resamples - start)
        drawn = rng.integers(0, len(per_task), size=(rows_now, len(per_task)))
        weights = np.apply_along_axis(np.bincount, 1, drawn, minlength=len(per_task)).astype(np.float64)
        kappas.append(_kappas(weights @ per_task))
    values = np.concatenate(kappas)
    finite = values[np.isfinite(values)]
    if finite.size * 2 >= values.size and finite.size:
        low, high = np.quantile(finite, [0.025, 0.975])
        result["kappa_ci95"] = {
            "low": float(low),
            "high": float(high),
            "resamples": resamples,
            "defined": int(finite.size),
            "cluster": "task",
        }
    return result


def judge_summary(
    records: Iterable[Mapping[str, Any]],
    episodes: Mapping[str, tuple[dict[str, Any], list[str]]],
    *,
    selected: int,
    header: Mapping[str, Any],
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> dict[str, Any]:
    """The summary over judge output records. ``episodes``: episode id → (``episode_row``, rule
    labels) of the run judged; ``header``: identity fields (rubric, model, source, config)."""
    statuses = {"ok": 0, "unparseable": 0, "error": 0}
    verdicts: dict[str, int] = {}
    categories: dict[str, int] = {}
    repaired = 0
    usage: dict[str, int] = {}
    judged: list[tuple[dict[str, Any], dict[str, Any], list[str]]] = []
    # By episode id: the interval's resamples draw tasks in first-seen order, so a local stage
    # (records in completion order) and a reduced one give the same summary.
    for record in sorted(records, key=lambda item: str(item["episode_id"])):
        statuses[record["status"]] = statuses.get(record["status"], 0) + 1
        for key, value in (record.get("usage") or {}).items():
            usage[key] = usage.get(key, 0) + int(value)
        if record["status"] != "ok":
            continue
        verdict = record["verdict"]
        repaired += record.get("repairs", 0) > 0
        verdicts[str(verdict.get("verdict"))] = verdicts.get(str(verdict.get("verdict")), 0) + 1
        for category in verdict.get("failure_categories") or []:
            categories[str(category)] = categories.get(str(category), 0) + 1
        row, labels = episodes[record["episode_id"]]
        judged.append((verdict, row, labels))

    def pairs(judge: Any, other: Any) -> list[tuple[Any, bool, bool]]:
        return [(row["task_id"], bool(judge(v)), bool(other(row, labels))) for v, row, labels in judged]

    def says(category: str) -> Any:
        return lambda v: category in (v.get("failure_categories") or [])

    vs_labels = {
        "clean": agreement(pairs(lambda v: v.get("verdict") == "success", lambda row, labels: not labels), resamples=resamples),
        "no_purchase": agreement(
            pairs(says("no_purchase"), lambda row, labels: not (row["completed"] and row["termination_reason"] == "purchase")),
            resamples=resamples,
        ),
    }
    for category, label in CATEGORY_LABELS.items():
        vs_labels[f"{category}~{label}"] = agreement(
            pairs(says(category), lambda row, labels, label=label: label in labels), resamples=resamples
        )
    return {
        "judge_summary_version": JUDGE_SUMMARY_VERSION,
        "created_at": datetime.now(UTC).isoformat(),
        **header,
        "episodes": {"selected": selected, "judged": sum(statuses.values()), "missing": selected - sum(statuses.values())},
        "status": statuses,
        "repaired": repaired,
        "verdicts": dict(sorted(verdicts.items())),
        "failure_categories": dict(sorted(categories.items())),
        "usage": usage,
        "agreement": {
            "reward": {
                "definition": "judge verdict == success vs r_success == 1 (no reward: not successful); over status ok",
                **agreement(
                    pairs(lambda v: v.get("verdict") == "success", lambda row, labels: row.get("success") == 1),
                    resamples=resamples,
                ),
            },
            "labels": vs_labels,
            "label_mapping": {
                **CATEGORY_LABELS,
                "no_purchase": "not completed with a purchase",
                "success": "no rule label (clean)",
            },
        },
    }
