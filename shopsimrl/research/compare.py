"""``shopsimrl compare``: paired comparison of runs of one frozen job list (checkpoints of one
evaluation, or runs that differ in prompt, skills or sampling).

Episodes are paired by ``episode_id``: the same task, sample and seed in both runs. Runs whose
job keys differ are refused, naming the difference, unless the caller allows a partial
comparison over the episodes they share. With more than two runs each is compared with the
first (the baseline), in order.

Which episodes count (docs/research.md "compare"): the headline, first, is ``reward_itt`` and
``success_itt``, the summary's intent-to-treat values: a failed episode counts 0, so a run that
fails on hard tasks is not flattered, except one failed for infrastructure, which is excused:
that pair drops out of the intent-to-treat rows for both runs (a paired difference needs both
sides; the excused pairs are counted in ``itt_excused``). ``reward`` and ``success``, second, are
conditional on completing (``summary.json`` ``primary``): a pair counts when the episode
completed in both runs. Reward components, behaviour, tokens and latency are over pairs
completed in both runs, as the summary counts them over completed episodes.
"""

from __future__ import annotations

import math
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from shopsimrl.manifest import plan_diff
from shopsimrl.metrics import SummaryAccumulator, student_t_quantile, wilson_interval
from shopsimrl.records import EpisodeTrace
from shopsimrl.research.episodes import CORE_COLUMNS, episode_row, task_key
from shopsimrl.research.labels import LABELS_VERSION, TAXONOMY, LabelCounts, episode_labels, label_counts
from shopsimrl.research.paired_stats import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    bootstrap_p_value,
    cluster_sums,
    holm_adjust,
    mcnemar_exact,
    percentile_interval,
    resampled_differences,
)
from shopsimrl.storage.reading import Run, open_run

__all__ = [
    "COMPARE_SCHEMA_VERSION",
    "CompareError",
    "LoadedRun",
    "Metric",
    "compare_loaded",
    "compare_runs",
    "format_comparison",
    "load_run",
]

COMPARE_SCHEMA_VERSION = "shopsimrl-compare-v1"
_SHOWN_IDS = 5
MIN_SLICE_PAIRS = 10
"""A category slice needs this many paired episodes; smaller ones are folded into ``other``."""
OTHER_SLICE = "other"
_TIE = 1e-12
"""Task mean differences below this are ties (float noise of equal rewards)."""


class CompareError(ValueError):
    """The runs cannot be compared as asked (exit 2); the message names the difference."""


# --------------------------------------------------------------------------- runs


@dataclass
class LoadedRun:
    """A run read once: its identity, plan, job keys and one slim row per episode."""

    location: str
    kind: str
    """``local``, ``sharded``, or ``legacy`` (traces of the earlier implementation, no manifest)."""
    identity: dict[str, Any]
    plan: dict[str, Any] | None
    job_keys: dict[str, tuple[Any, ...]]
    """``episode_id`` → (task_id, sample_id, seed, split): from the manifest's job list, or from
    the records when the run has no manifest."""
    rows: dict[str, dict[str, Any]]
    summary: dict[str, Any]
    """The summary of these records, computed as ``summary.json`` is."""
    shard_states: dict[int, str] = field(default_factory=dict)
    unreadable_lines: int = 0
    label_counts: LabelCounts | None = None
    """Episodes per rule label over the run (each row also carries its episode's ``labels``)."""


def _slim(record: EpisodeTrace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The episode's slim row and its label record without the evidence (names and codes: what
    the counts need)."""
    row = episode_row(record)
    slim = {key: row[key] for key in _KEPT}
    slim.update({key: value for key, value in row.items() if key.startswith("r_")})
    slim["task"] = task_key(record)
    slim["job_key"] = (row["task_id"], row["sample_id"], row["seed"], row["split"])
    labelled = episode_labels(record)
    slim["labels"] = tuple(labelled["labels"])
    codes = {name: {"codes": detail["codes"]} for name, detail in labelled["details"].items() if "codes" in detail}
    return slim, {"labels": labelled["labels"], "details": codes}


def load_run(location: str) -> LoadedRun:
    """Open and read a run (raises :class:`shopsimrl.storage.reading.RunReadError`)."""
    run: Run = open_run(location)
    jobs = run.jobs
    accumulator = SummaryAccumulator(
        requested_episode_ids=[job.episode_id for job in jobs] if jobs is not None else None,
        execution=run.manifest.execution if run.manifest is not None else None,
    )
    rows: dict[str, dict[str, Any]] = {}
    labelled: dict[str, dict[str, Any]] = {}
    # Every record, as summary.json counts them: the winners make the rows; the others add what
    # they spent (tokens, time). A completed record that does not win is a duplicate, which the
    # reducer counts apart from superseded attempts (a local run's summary does not).
    for is_winner, record in run.all_records():
        if not is_winner:
            if run.kind == "sharded" and record.completed:
                accumulator.note_duplicate(record)
            else:
                accumulator.note_superseded_attempt(record)
            continue
        accumulator.add(record)
        row, labels = _slim(record)
        rows[row["episode_id"]] = row
        labelled[row["episode_id"]] = labels
    if jobs is not None:
        keys = {job.episode_id: (job.task_id, job.sample_id, job.seed, job.split) for job in jobs}
    else:
        keys = {episode_id: row["job_key"] for episode_id, row in rows.items()}
    kind = run.kind if run.manifest is not None else "legacy"
    summary = accumulator.result()
    return LoadedRun(
        run.location,
        kind,
        run.identity,
        run.plan,
        keys,
        rows,
        summary,
        dict(run.shard_states),
        run.unreadable_lines,
        label_counts(labelled.values()),
    )


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric:
    name: str
    numerator: str
    denominator: str | None
    """A row column summed as the denominator (a rate), or None for a mean per episode."""
    population: Literal["completed", "itt"]
    """``completed``: pairs completed in both runs; ``itt``: pairs with an intent-to-treat value
    in both (failures count 0, infrastructure failures are excused)."""
    binary: bool = False
    """A success indicator: McNemar's exact test on the discordant pairs is added."""
    unit: bool = False
    """Values live in [0, 1] (rewards, success, components): a difference lies in [−1, 1]."""


HEAD_METRICS = (
    Metric("reward_itt", "reward_itt", None, "itt", unit=True),
    Metric("success_itt", "success_itt", None, "itt", binary=True, unit=True),
    Metric("reward", "reward", None, "completed", unit=True),
    Metric("success", "success", None, "completed", binary=True, unit=True),
)
"""The intent-to-treat rows first: they count every paired episode (the number to quote); the
conditional rows, over pairs completed in both runs, second."""
DISPLAY_NAMES = {
    "reward_itt": "reward (ITT)",
    "success_itt": "success (ITT)",
    "reward": "reward (completed)",
    "success": "success (completed)",
}
"""How the head metrics are printed (the JSON keeps the metric names)."""
TAIL_METRICS = (
    Metric("steps", "steps", None, "completed"),
    Metric("invalid_action_rate", "invalid_actions", "actions", "completed"),
    Metric("protocol_errors", "protocol_errors", None, "completed"),
    Metric("prompt_tokens", "prompt_tokens", None, "completed"),
    Metric("completion_tokens", "completion_tokens", None, "completed"),
    Metric("total_tokens", "total_tokens", None, "completed"),
    Metric("model_latency_ms", "model_latency_ms_total", None, "completed"),
    Metric("duration_ms", "duration_ms", None, "completed"),
)
"""After the reward components. ``invalid_action_rate`` is pooled (invalid actions over actions),
as in the summary; the rest are means per episode (model latency: the episode's total)."""

_OUTCOME_COLUMNS = frozenset({"episode_id", "completed", "failure_class", "termination_reason", "category"})
_KEPT = tuple(
    column
    for column in CORE_COLUMNS
    if column in _OUTCOME_COLUMNS
    or any(column in (metric.numerator, metric.denominator) for metric in (*HEAD_METRICS, *TAIL_METRICS))
)
"""The episode-row columns a loaded run keeps: pairing and outcome, and what the metrics read
(the ``r_*`` components are kept apart)."""


def metrics_for(runs: Iterable[LoadedRun]) -> list[Metric]:
    """The metrics of a comparison: the head, every ``r_*`` component any run has, the tail."""
    components = sorted({key for run in runs for row in run.rows.values() for key in row if key.startswith("r_")})
    return [*HEAD_METRICS, *(Metric(name, name, None, "completed", unit=True) for name in components), *TAIL_METRICS]


def _column(rows: Sequence[dict[str, Any]], key: str | None) -> np.ndarray:
    """A row column as floats, NaN where it is missing or not a number (a denominator of None: 1)."""
    if key is None:
        return np.ones(len(rows))
    values = (row.get(key) for row in rows)
    return np.fromiter(
        (float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan for v in values),
        dtype=np.float64,
        count=len(rows),
    )


def _values(rows: Sequence[dict[str, Any]], metric: Metric) -> tuple[np.ndarray, np.ndarray]:
    """(numerator, denominator) per episode, NaN where the episode does not count for the metric."""
    numerator, denominator = _column(rows, metric.numerator), _column(rows, metric.denominator)
    if metric.population == "completed":
        completed = np.fromiter((bool(row["completed"]) for row in rows), dtype=bool, count=len(rows))
        numerator[~completed] = math.nan
    return numerator, denominator


# --------------------------------------------------------------------------- pairing


@dataclass(frozen=True)
class Pairing:
    episode_ids: list[str]
    dropped: dict[str, int]
    """Why episodes of either run are not compared (partial comparisons only): count per reason."""


def _ids(ids: Iterable[str]) -> str:
    ordered = sorted(ids)
    shown = ", ".join(ordered[:_SHOWN_IDS])
    return shown + (f", … ({len(ordered)} in all)" if len(ordered) > _SHOWN_IDS else "")


def _key_change(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    names = ("task_id", "sample_id", "seed", "split")
    return ", ".join(f"{name} {a!r} -> {b!r}" for name, a, b in zip(names, old, new, strict=True) if a != b)


def pair_runs(base: LoadedRun, other: LoadedRun, *, allow_partial: bool) -> Pairing:
    """The episodes both runs can be compared on. Refuses (CompareError) job keys that differ and
    planned episodes without a record, unless ``allow_partial``."""
    only_base = set(base.job_keys) - set(other.job_keys)
    only_other = set(other.job_keys) - set(base.job_keys)
    changed = sorted(e for e in set(base.job_keys) & set(other.job_keys) if base.job_keys[e] != other.job_keys[e])
    problems: dict[str, tuple[int, str]] = {}
    if only_base:
        problems["only in the baseline's jobs"] = (
            len(only_base),
            f"{len(only_base)} episodes only in {base.location}: {_ids(only_base)}",
        )
    if only_other:
        problems["only in the other run's jobs"] = (
            len(only_other),
            f"{len(only_other)} episodes only in {other.location}: {_ids(only_other)}",
        )
    if changed:
        shown = "; ".join(f"{e}: {_key_change(base.job_keys[e], other.job_keys[e])}" for e in changed[:_SHOWN_IDS])
        problems["another job key (seed, split)"] = (len(changed), f"{len(changed)} episodes with another job key: {shown}")
    shared = (set(base.job_keys) & set(other.job_keys)) - set(changed)
    for run, name in ((base, "no record in the baseline"), (other, "no record in the other run")):
        missing = {e for e in shared if e not in run.rows}
        if missing:
            states = {shard: state for shard, state in run.shard_states.items() if state != "committed"}
            why = f" (shards not committed: {states})" if states else " (an unfinished run?)"
            problems[name] = (
                len(missing),
                f"{run.location} has no record of {len(missing)} planned episodes{why}: {_ids(missing)}",
            )
    episode_ids = sorted(e for e in shared if e in base.rows and e in other.rows)
    if problems and not allow_partial:
        lines = "\n  ".join(message for _, message in problems.values())
        hint = (
            f"--allow-partial compares the {len(episode_ids)} episodes both runs have with the same job key"
            if episode_ids
            else "they share no episode with the same job key: not runs of one plan"
        )
        raise CompareError(f"{other.location} cannot be paired with {base.location}:\n  {lines}\n{hint}")
    if not episode_ids:
        raise CompareError(f"{other.location} and {base.location} have no episode in common with the same job key")
    return Pairing(episode_ids, {reason: count for reason, (count, _) in problems.items()})


# --------------------------------------------------------------------------- one comparison


def _outcome_label(row: dict[str, Any]) -> str:
    if row["completed"]:
        return str(row["termination_reason"] or "unknown")
    return f"failed: {row['failure_class'] or 'unknown'}"


def _number(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _metric_table(
    metrics: Sequence[Metric],
    pairs: list[tuple[dict[str, Any], dict[str, Any]]],
    *,
    resamples: int,
    seed: int,
    p_values: bool = False,
) -> list[dict[str, Any]]:
    """Per metric: pairs, tasks, both means, B − A and its bootstrap interval over tasks (and
    McNemar for success indicators). ``p_values``: also a two-sided ``p_value`` per metric,
    McNemar's for a 0/1 indicator, else the bootstrap's."""
    a_rows, b_rows = [a for a, _ in pairs], [b for _, b in pairs]
    columns = [(*_values(a_rows, metric), *_values(b_rows, metric)) for metric in metrics]
    a_num, a_den, b_num, b_den = (np.column_stack([c[k] for c in columns]).reshape(len(pairs), len(metrics)) for k in range(4))
    counted = np.isfinite(a_num) & np.isfinite(a_den) & np.isfinite(b_num) & np.isfinite(b_den)
    for matrix in (a_num, a_den, b_num, b_den):
        matrix[~counted] = 0.0  # a pair that does not count adds nothing to either sum
    tasks = [a["task"] for a, _ in pairs]
    sums = cluster_sums(tasks, a_num, b_num, a_den, b_den)
    mean_a, mean_b, difference = sums.estimates()
    differences = resampled_differences(sums, resamples=resamples, seed=seed)
    intervals = percentile_interval(differences)
    table = []
    for j, metric in enumerate(metrics):
        rows = np.flatnonzero(counted[:, j])
        clusters = len({tasks[i] for i in rows})
        # As in the summary: below two tasks the spread between tasks is unknown, so no interval.
        interval = intervals[j] if clusters >= 2 and intervals[j].low is not None else None
        ci95 = [interval.low, interval.high] if interval is not None else None
        entry: dict[str, Any] = {
            "metric": metric.name,
            "population": metric.population,
            "pairs": int(rows.size),
            "tasks": clusters,
            "a": _number(mean_a[j]) if rows.size else None,
            "b": _number(mean_b[j]) if rows.size else None,
            "difference": _number(difference[j]) if rows.size else None,
            "ci95": ci95,
        }
        width = None
        if interval is not None and interval.low is not None and interval.high is not None:
            width = interval.high - interval.low
        if width is not None and width <= _TIE and entry["difference"] is not None:
            bounded = metric.unit and all(
                bool(((values[rows, j] >= 0.0) & (values[rows, j] <= 1.0)).all()) for values in (a_num, b_num)
            )
            entry["ci95"], entry["ci95_note"] = _no_spread_interval(entry["difference"], clusters, bounded=bounded)
        if metric.binary:
            entry["mcnemar"] = _mcnemar(a_num[rows, j], b_num[rows, j]) if rows.size else None
        if p_values:
            test = entry.get("mcnemar")
            entry["p_value"] = test["p_value"] if test else bootstrap_p_value(differences[:, j]) if rows.size else None
        table.append(entry)
    return table


def _no_spread_interval(difference: float, clusters: int, *, bounded: bool) -> tuple[list[float] | None, str]:
    """Every resample gave the same difference: every task's pairs differ by the same amount (two
    runs of one deterministic policy differ by 0 everywhere). A zero-width interval would claim
    an exactness the data do not have, so, as the summary does for equal task means: for values
    in [0, 1], whose difference lies in [−1, 1], the interval assumes the largest spread a
    difference with this mean can have, one observation per task (Wilson's interval for the
    difference mapped onto [0, 1], t(0.975, G−1) quantile, G tasks); otherwise no interval."""
    if not bounded:
        return None, f"all {clusters} tasks differ by the same amount: no spread between tasks was seen, so there is no interval"
    share = min(1.0, max(0.0, (difference + 1.0) / 2.0))
    low, high = wilson_interval(share, clusters, student_t_quantile(0.975, clusters - 1))
    note = (
        f"all {clusters} tasks differ by {difference:.6g}: no spread between tasks was seen, so the interval assumes "
        "the largest spread a difference in [-1, 1] with this mean can have, one observation per task"
    )
    return [2.0 * low - 1.0, 2.0 * high - 1.0], note


def _mcnemar(a: np.ndarray, b: np.ndarray) -> dict[str, Any] | None:
    if not np.isin(a, (0.0, 1.0)).all() or not np.isin(b, (0.0, 1.0)).all():
        return None  # not a 0/1 indicator: the test does not apply
    only_a, only_b = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    both, neither = int(((a == 1) & (b == 1)).sum()), int(((a == 0) & (b == 0)).sum())
    return {"only_a": only_a, "only_b": only_b, "both": both, "neither": neither, "p_value": mcnemar_exact(only_a, only_b)}


def _per_task(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Win/tie/loss of B against A per task, on the headline: the intent-to-treat reward (a
    failure counts 0; a pair with an infrastructure failure on either side does not count)."""
    by_task: dict[str, list[tuple[float, float]]] = defaultdict(list)
    categories: dict[str, str | None] = {}
    for a, b in pairs:
        categories.setdefault(a["task"], a["category"] or b["category"])
        if a["reward_itt"] is not None and b["reward_itt"] is not None:
            by_task[a["task"]].append((a["reward_itt"], b["reward_itt"]))
    tasks = []
    counts = Counter({"win": 0, "tie": 0, "loss": 0})
    for task, values in sorted(by_task.items(), key=lambda item: (len(item[0]), item[0])):
        mean_a = math.fsum(v for v, _ in values) / len(values)
        mean_b = math.fsum(v for _, v in values) / len(values)
        delta = mean_b - mean_a
        outcome = "win" if delta > _TIE else "loss" if delta < -_TIE else "tie"
        counts[outcome] += 1
        tasks.append(
            {
                "task": task,
                "category": categories.get(task),
                "episodes": len(values),
                "a": mean_a,
                "b": mean_b,
                "outcome": outcome,
            }
        )
    without = len({a["task"] for a, _ in pairs} - set(by_task))
    return {
        "metric": "reward_itt",
        "win": counts["win"],
        "tie": counts["tie"],
        "loss": counts["loss"],
        "no_pair": without,
        "tasks": tasks,
    }


def _transitions(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    counted = Counter((_outcome_label(a), _outcome_label(b)) for a, b in pairs)
    return [{"a": a, "b": b, "episodes": n} for (a, b), n in sorted(counted.items(), key=lambda item: (-item[1], item[0]))]


def _label_changes(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Per rule label, over the paired episodes: how many carry it in A and in B, and the paired
    transitions (``gained``: absent in A, present in B; ``lost``: the reverse), so that
    ``b = a + gained - lost``."""
    rows = []
    for name in TAXONOMY:
        in_a = [name in a["labels"] for a, _ in pairs]
        in_b = [name in b["labels"] for _, b in pairs]
        rows.append(
            {
                "label": name,
                "a": sum(in_a),
                "b": sum(in_b),
                "gained": sum(not x and y for x, y in zip(in_a, in_b, strict=True)),
                "lost": sum(x and not y for x, y in zip(in_a, in_b, strict=True)),
            }
        )
    return {
        "labels_version": LABELS_VERSION,
        "episodes": len(pairs),
        "clean_a": sum(not a["labels"] for a, _ in pairs),
        "clean_b": sum(not b["labels"] for _, b in pairs),
        "rows": rows,
    }


def _slices(pairs: list[tuple[dict[str, Any], dict[str, Any]]], *, resamples: int, seed: int) -> list[dict[str, Any]]:
    """The headline metrics per catalog category. A category with fewer than
    ``MIN_SLICE_PAIRS`` paired episodes is folded into ``other`` (its interval would be noise);
    each metric's p-values are Holm-adjusted over the slices, one family per metric (``p_holm``):
    with dozens of categories some unadjusted p < 0.05 is expected by chance alone."""
    by_category: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for a, b in pairs:
        by_category[a["category"] or b["category"] or "unknown"].append((a, b))
    kept = {name: members for name, members in by_category.items() if len(members) >= MIN_SLICE_PAIRS}
    folded = sorted(set(by_category) - set(kept))
    pieces: list[tuple[str, list[tuple[dict[str, Any], dict[str, Any]]], list[str]]] = [
        (name, members, []) for name, members in sorted(kept.items())
    ]
    if folded:
        name = OTHER_SLICE if OTHER_SLICE not in kept else f"{OTHER_SLICE} (folded)"
        pieces.append((name, [pair for category in folded for pair in by_category[category]], folded))
    slices = []
    for category, members, folded_names in pieces:
        table = _metric_table(HEAD_METRICS[:2], members, resamples=resamples, seed=seed, p_values=True)
        piece: dict[str, Any] = {"category": category, "episodes": len(members), "metrics": table}
        if folded_names:
            piece["folded"] = folded_names
        slices.append(piece)
    for j in range(len(HEAD_METRICS[:2])):
        adjusted = holm_adjust([piece["metrics"][j]["p_value"] for piece in slices])
        for piece, value in zip(slices, adjusted, strict=True):
            piece["metrics"][j]["p_holm"] = value
    return slices


def _repeats(episode_ids: Sequence[str], rows: dict[str, dict[str, Any]]) -> int:
    return max(Counter(rows[e]["task"] for e in episode_ids).values())


def compare_pair(
    base: LoadedRun, other: LoadedRun, *, allow_partial: bool, resamples: int, seed: int, metrics: Sequence[Metric]
) -> dict[str, Any]:
    """The comparison of ``other`` (B) with ``base`` (A)."""
    pairing = pair_runs(base, other, allow_partial=allow_partial)
    pairs = [(base.rows[e], other.rows[e]) for e in pairing.episode_ids]
    completed = Counter((a["completed"], b["completed"]) for a, b in pairs)
    excused = Counter((a["reward_itt"] is None, b["reward_itt"] is None) for a, b in pairs)
    if base.plan is None or other.plan is None:
        plan_lines = [f"{run.location} has no manifest: its plan is unknown" for run in (base, other) if run.plan is None]
    else:
        plan_lines = plan_diff(
            {k: v for k, v in base.plan.items() if k != "jobs"}, {k: v for k, v in other.plan.items() if k != "jobs"}
        )
    return {
        "a": base.location,
        "b": other.location,
        "plan_differences": plan_lines,
        "episodes": len(pairs),
        "dropped": pairing.dropped,
        "tasks": len({a["task"] for a, _ in pairs}),
        "repeats": _repeats(pairing.episode_ids, base.rows),
        "completed_in_both": completed[(True, True)],
        "failed_only_in_a": completed[(False, True)],
        "failed_only_in_b": completed[(True, False)],
        "failed_in_both": completed[(False, False)],
        "itt_excused": {
            "only_a": excused[(True, False)],
            "only_b": excused[(False, True)],
            "both": excused[(True, True)],
        },
        "metrics": _metric_table(metrics, pairs, resamples=resamples, seed=seed),
        "per_task": _per_task(pairs),
        "termination_transitions": _transitions(pairs),
        "labels": _label_changes(pairs),
        "categories": _slices(pairs, resamples=resamples, seed=seed),
        "category_slices": {"min_pairs": MIN_SLICE_PAIRS, "p_adjust": "holm", "family": "the slices of one metric"},
    }


def _run_block(run: LoadedRun) -> dict[str, Any]:
    primary, itt = run.summary["primary"], run.summary["intent_to_treat"]
    counts = run.summary["counts"]
    return {
        "location": run.location,
        "kind": run.kind,
        "identity": run.identity,
        "episodes": len(run.rows),
        "completed": counts["completed"],
        "failed": counts["failed"],
        "coverage": counts["coverage"],
        "reward_mean": primary["reward_mean"],
        "reward_ci95": primary["reward_ci95"],
        "success_rate": primary["success_rate"],
        "success_ci95": primary["success_ci95"],
        "reward_mean_itt": itt["reward_mean"],
        "reward_itt_ci95": itt["reward_ci95"],
        "success_rate_itt": itt["success_rate"],
        "success_itt_ci95": itt["success_ci95"],
        "itt_episodes": itt["episodes"],
        "unreadable_lines": run.unreadable_lines,
        "labels": run.label_counts.to_dict() if run.label_counts is not None else None,
    }


def compare_loaded(
    runs: Sequence[LoadedRun], *, allow_partial: bool = False, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> dict[str, Any]:
    """Each run after the first against the first. The JSON ``--json`` writes."""
    if len(runs) < 2:
        raise CompareError("compare needs at least two runs")
    if resamples < 1:
        raise CompareError(f"--resamples must be at least 1, got {resamples}")
    metrics = metrics_for(runs)
    return {
        "schema_version": COMPARE_SCHEMA_VERSION,
        "bootstrap": {"resamples": resamples, "seed": seed, "confidence": 0.95, "unit": "task", "interval": "percentile"},
        "runs": [_run_block(run) for run in runs],
        "comparisons": [
            compare_pair(runs[0], other, allow_partial=allow_partial, resamples=resamples, seed=seed, metrics=metrics)
            for other in runs[1:]
        ],
    }


def compare_runs(
    locations: Sequence[str], *, allow_partial: bool = False, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> dict[str, Any]:
    """Open the runs and compare them (raises CompareError or RunReadError: bad input)."""
    if len(locations) < 2:
        raise CompareError("compare needs at least two runs")
    return compare_loaded(
        [load_run(location) for location in locations], allow_partial=allow_partial, resamples=resamples, seed=seed
    )


# --------------------------------------------------------------------------- text


def decimals_for(values: Iterable[float | None]) -> int:
    """One precision for a row of numbers (both means, the difference, its bounds), from the
    row's largest magnitude, so that the numbers of a row line up and read alike."""
    largest = max((abs(v) for v in values if v is not None and math.isfinite(v)), default=0.0)
    return 0 if largest >= 1000 else 1 if largest >= 100 else 3


def _fmt(value: float | None, decimals: int | None = None) -> str:
    if value is None:
        return "–"
    places = decimals_for([value]) if decimals is None else decimals
    return f"{value:,.{places}f}"


def _width(text: str) -> int:
    """Terminal columns: East Asian wide characters (category names) take two."""
    return sum(2 if unicodedata.east_asian_width(char) in "WF" else 1 for char in text)


def _pad(text: str, width: int, *, left: bool) -> str:
    fill = " " * (width - _width(text))
    return text + fill if left else fill + text


def _ci(ci: list[float | None] | None, decimals: int | None = None) -> str:
    return f"[{_fmt(ci[0], decimals)}, {_fmt(ci[1], decimals)}]" if ci else "–"


def display_name(metric: str) -> str:
    """The printed name of a metric (the head metrics say which population they count)."""
    return DISPLAY_NAMES.get(metric, metric)


def metric_cells(entry: dict[str, Any]) -> list[str]:
    """A, B, B − A and the interval of one metric row, with one precision for the row."""
    ci = entry["ci95"] or []
    places = decimals_for([entry["a"], entry["b"], entry["difference"], *ci])
    interval = _ci(entry["ci95"], places) + (" *" if entry.get("ci95_note") else "")
    return [_fmt(entry["a"], places), _fmt(entry["b"], places), _fmt(entry["difference"], places), interval]


NO_SPREAD_FOOTNOTE = (
    "* no spread between tasks (every task's pairs differ by the same amount): not an exact result; the interval "
    "assumes the largest spread a difference in [-1, 1] can have, one observation per task, or there is none "
    "(ci95_note in --json)"
)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(_width(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = []
    for row in (header, *rows):
        cells = [_pad(cell, width, left=i == 0) for i, (cell, width) in enumerate(zip(row, widths, strict=True))]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines


def _label_lines(changes: dict[str, Any]) -> list[str]:
    """The rule-label table of a comparison: labels no paired episode carries in either run are left out."""
    rows = [
        [row["label"], str(row["a"]), str(row["b"]), f"+{row['gained']}", f"-{row['lost']}"]
        for row in changes["rows"]
        if row["a"] or row["b"]
    ]
    rows.append(["(no label)", str(changes["clean_a"]), str(changes["clean_b"]), "", ""])
    head = f"  rule labels over the {changes['episodes']} paired episodes ({changes['labels_version']}; gained: not in A, in B):"
    return [head, *_table(["label", "A", "B", "gained", "lost"], rows, indent="    ")]


def format_p(value: float | None) -> str:
    """A p-value with three decimals (one format for a column), below 0.001 as such."""
    if value is None:
        return "–"
    return "<0.001" if value < 0.001 else f"{value:.3f}"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _run_line(index: int, run: dict[str, Any]) -> str:
    """A run's own summary: the intent-to-treat headline with its interval and the coverage, then
    the conditional mean over completed episodes, named as such."""
    identity = run["identity"]
    return (
        f"  {chr(65 + index) if index < 26 else index}  {run['location']}  [{run['kind']}]  "
        f"experiment {identity.get('experiment') or '–'} · checkpoint {identity.get('checkpoint_id') or '–'} · "
        f"{run['completed']} completed, {run['failed']} failed (coverage {_percent(run.get('coverage'))}) · "
        f"reward (ITT) {_fmt(run.get('reward_mean_itt'), 3)} {_ci(run.get('reward_itt_ci95'), 3)} · "
        f"success (ITT) {_fmt(run.get('success_rate_itt'), 3)} · "
        f"reward (completed) {_fmt(run['reward_mean'], 3)} {_ci(run['reward_ci95'], 3)}"
    )


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as text for a terminal."""
    boot = result["bootstrap"]
    lines = ["runs (the first is the baseline):"]
    lines += [_run_line(index, run) for index, run in enumerate(result["runs"])]
    lines.append(
        f"paired bootstrap: {boot['resamples']:,} resamples of tasks, seed {boot['seed']}, 95% percentile intervals; "
        "(ITT) rows, the headline, count every paired episode, a failure as 0 (a pair with an infrastructure failure "
        "on either side is left out); (completed) rows only the episodes completed in both runs"
    )
    for comparison in result["comparisons"]:
        lines += ["", f"{comparison['b']}  vs  {comparison['a']} (baseline)"]
        if comparison["plan_differences"]:
            lines.append("  plan differences:")
            lines += [f"    {line}" for line in comparison["plan_differences"]]
        else:
            lines.append("  plan differences: none")
        lines.append(
            f"  {comparison['episodes']} paired episodes over {comparison['tasks']} tasks (up to {comparison['repeats']} per task"
            f"{', resampled by task' if comparison['repeats'] > 1 else ''}); completed in both {comparison['completed_in_both']}, "
            f"failed only in A {comparison['failed_only_in_a']}, only in B {comparison['failed_only_in_b']}, "
            f"in both {comparison['failed_in_both']}"
        )
        excused = comparison.get("itt_excused") or {}
        if any(excused.values()):
            lines.append(
                f"  left out of the (ITT) rows, an infrastructure failure: {sum(excused.values())} pairs "
                f"(only in A {excused['only_a']}, only in B {excused['only_b']}, in both {excused['both']})"
            )
        if comparison["dropped"]:
            dropped = ", ".join(f"{count} {reason}" for reason, count in comparison["dropped"].items())
            lines.append(f"  partial comparison (--allow-partial): dropped {sum(comparison['dropped'].values())} ({dropped})")
        rows = []
        for entry in comparison["metrics"]:
            test = entry.get("mcnemar")
            note = f"McNemar p={format_p(test['p_value'])} (only A {test['only_a']}, only B {test['only_b']})" if test else ""
            rows.append([display_name(entry["metric"]), str(entry["pairs"]), *metric_cells(entry), note])
        lines += _table(["metric", "pairs", "A", "B", "B−A", "95% CI", ""], rows)
        if any(entry.get("ci95_note") for entry in comparison["metrics"]):
            lines.append(f"  {NO_SPREAD_FOOTNOTE}")
        per_task = comparison["per_task"]
        lines.append(
            f"  per task (mean reward (ITT), B vs A): {per_task['win']} wins, {per_task['tie']} ties, {per_task['loss']} losses"
            + (f", {per_task['no_pair']} without a pair counted for ITT" if per_task["no_pair"] else "")
        )
        lines.append("  termination (A -> B):")
        lines += [f"    {t['a']} -> {t['b']}: {t['episodes']}" for t in comparison["termination_transitions"]]
        lines += _label_lines(comparison["labels"])
        lines.append(
            f"  by category (reward (ITT); fewer than {MIN_SLICE_PAIRS} pairs folded into {OTHER_SLICE}; "
            "p: bootstrap, Holm-adjusted over the slices):"
        )
        slice_rows = []
        for piece in comparison["categories"]:
            reward = piece["metrics"][0]
            name = piece["category"] + (f" ({len(piece['folded'])} categories)" if piece.get("folded") else "")
            slice_rows.append(
                [
                    name,
                    str(reward["pairs"]),
                    *metric_cells(reward),
                    format_p(reward.get("p_value")),
                    format_p(reward.get("p_holm")),
                ]
            )
        lines += _table(["category", "pairs", "A", "B", "B−A", "95% CI", "p", "p (Holm)"], slice_rows, indent="    ")
    return "\n".join(lines)
