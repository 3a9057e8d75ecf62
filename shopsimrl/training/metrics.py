"""Training-time rollout metrics: the ``rollout/shopsim/*`` family, through slime's two hooks.

Point slime at them with::

    --rollout-all-samples-process-path shopsimrl.training.metrics.record_generated_rollout_groups
    --custom-rollout-log-function-path shopsimrl.training.metrics.enrich_rollout_metrics

slime (THUDM/slime 624b824, ``slime/rollout/sglang_rollout.py::generate_rollout_async``) calls
the first once per rollout step with every group generated in the step **before** the dynamic
filter dropped any (``process(args, all_samples, data_source)``); :func:`record_generated_rollout_groups`
keeps a small summary of them (no token ids). Then ``slime/ray/rollout.py::RolloutManager.generate``
calls the second with the step's trained samples, flattened, and slime's own metric dict
(``log(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool``, True skips slime's
default logging); :func:`enrich_rollout_metrics` adds the figures below to that dict and returns
False, so they reach the tracker through slime's own logging (no tracker call here).

Every figure counts a trajectory once per ``(group_index, rollout_id)``: the siblings of a forked
episode are one trajectory. "Generated" is what the first hook saw, "trained" what slime trains
on. A ratio whose denominator is 0 is left out (no figure rather than a made-up 0).

=====================================  ==========================================================
``rollout/shopsim/…``                  value
=====================================  ==========================================================
``trajectory_count``, ``group_count``  generated trajectories and groups
``train_trajectory_count``,            trained trajectories and groups
``train_group_count``
``scored_rate``                        scored generated trajectories / generated trajectories
``reward_mean``,                       mean ``reward``, ``r_strict``, ``r_success`` of the scored
``strict_reward_mean``,                generated trajectories
``success_rate``
``q``                                  the curriculum's skill-free probability (mean over the
                                       generated groups that carry a draw)
``rho_min``, ``rho_mean``, ``rho_max`` over the chunks' target inclusion probabilities rho
``skill_free_group_rate``,             groups drawn ``skill_free`` / ``assisted_empty``, over the
``assisted_empty_group_rate``          generated groups that carry a draw
``skills_per_assisted_group_mean``     chunks per group, over the groups not ``skill_free``
                                       (``assisted`` and ``assisted_empty``; its expectation is the sum of the rhos)
``chunk/<id>/inclusion_rate``          groups given the chunk / groups not ``skill_free``
                                       (its expectation is the chunk's rho)
``chunk/<id>/target_rho``              the chunk's rho
``triage_group_count``                 generated groups with a triage record
``all_wrong_group_rate``               triaged groups whose samples were all scored and failed
``full_skill_retry_rate``              triaged groups that ran a diagnostic
``full_skill_retry_success_rate``      diagnostics that succeeded / diagnostics run
``internalization_deficit_rate``,      triaged groups classified ``model_internalization_deficit``,
``pending_analysis_rate``,             ``full_skill_failure_pending_analysis``,
``runtime_error_group_rate``           ``environment_or_runtime_error`` (each over triaged groups)
``technical_group_drop_count``,        groups slime dropped for an unscored sample / for no reward
``zero_std_group_drop_count``          spread
``technical_group_drop_rate``,         those counts / (trained groups + both counts)
``zero_std_group_drop_rate``
=====================================  ==========================================================

The curriculum figures read the draw each sample carries in its metadata (``metadata["curriculum"]``,
read through :func:`shopsimrl.training.samples.curriculum_of`); the triage figures read
``<run dir>/training/triage/group-*.json`` of the step's groups (:mod:`shopsimrl.training.triage`).
A drop is a group the filter (:mod:`shopsimrl.training.grpo`) answered "drop" that slime did not
train on: a zero-spread group slime kept because too few groups remained is not a drop, and
neither is a kept group slime had no room for. Without the all-samples hook the generated,
curriculum and triage figures are left out (a warning says which flag is missing); the trained
counts and drops remain.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from shopsimrl.training.config import TrainingConfig, config_path, load_training_config
from shopsimrl.training.grpo import UNSCORED_REASON, ZERO_SPREAD_REASON, FilterDecision, group_filter, is_scored
from shopsimrl.training.samples import curriculum_of
from shopsimrl.training.triage import INTERNALIZATION_DEFICIT, PENDING_ANALYSIS, RUNTIME_ERROR, read_triage

__all__ = [
    "PREFIX",
    "GroupSummary",
    "TrajectorySummary",
    "enrich_rollout_metrics",
    "record_generated_rollout_groups",
    "rollout_metrics",
    "summarize_groups",
]

_log = structlog.get_logger("shopsimrl.training.metrics")

PREFIX = "rollout/shopsim/"


@dataclass(frozen=True)
class TrajectorySummary:
    """One ``(group_index, rollout_id)``: what the metrics need of its samples."""

    scored: bool
    reward: float | None
    strict: float | None
    success: float | None


@dataclass
class GroupSummary:
    group_index: int
    trajectories: dict[int, TrajectorySummary] = field(default_factory=dict)
    """By ``rollout_id`` (the sample's ``index`` when it has none)."""
    curriculum: dict[str, Any] | None = None


def _samples(items: Iterable[Any]) -> Iterable[Any]:
    """Samples out of slime's nesting (groups of samples, or of lists of siblings)."""
    for item in items:
        if isinstance(item, list | tuple):
            yield from _samples(item)
        else:
            yield item


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def summarize_groups(samples: Iterable[Any], reward_key: str | None = None) -> dict[int, GroupSummary]:
    """Samples (flat or nested as slime holds them) → one summary per group, one trajectory per
    ``(group_index, rollout_id)`` (the first sibling seen stands for the rollout). Samples
    without a ``group_index`` are left out."""
    groups: dict[int, GroupSummary] = {}
    for sample in _samples(samples):
        group_index = _int(getattr(sample, "group_index", None))
        if group_index is None:
            continue
        group = groups.setdefault(group_index, GroupSummary(group_index))
        rollout = _int(getattr(sample, "rollout_id", None))
        rollout = _int(getattr(sample, "index", None)) if rollout is None else rollout
        if rollout is None or rollout in group.trajectories:
            continue
        reward = getattr(sample, "reward", None)
        detail = reward if isinstance(reward, dict) else {}
        scored = is_scored(sample, reward_key)
        group.trajectories[rollout] = TrajectorySummary(
            scored=scored,
            reward=_number(detail.get(reward_key or "reward") if detail else reward) if scored else None,
            strict=_number(detail.get("r_strict")) if scored else None,
            success=_number(detail.get("r_success")) if scored else None,
        )
        if group.curriculum is None:
            group.curriculum = curriculum_of(getattr(sample, "metadata", None))
    return groups


def _mean(values: Sequence[float]) -> float | None:
    if not values:
        return None
    # One curriculum state gives every group the same q and rho: report that value, not a sum's
    # rounding of it (a dashboard compares it with the state's).
    if all(value == values[0] for value in values):
        return float(values[0])
    return math.fsum(values) / len(values)


def _put(out: dict[str, float], name: str, value: float | None) -> None:
    if value is not None:
        out[PREFIX + name] = float(value)


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def _curriculum(out: dict[str, float], groups: Iterable[GroupSummary]) -> None:
    drawn = [group.curriculum for group in groups if group.curriculum is not None]
    if not drawn:
        return
    _put(out, "q", _mean([q for c in drawn if (q := _number(c.get("q"))) is not None]))
    targets: dict[str, list[float]] = {}
    for c in drawn:
        for chunk, rho in (c.get("rho") or {}).items():
            if (value := _number(rho)) is not None:
                targets.setdefault(str(chunk), []).append(value)
    rho = {chunk: mean for chunk, values in targets.items() if (mean := _mean(values)) is not None}
    if rho:
        _put(out, "rho_min", min(rho.values()))
        _put(out, "rho_mean", _mean(list(rho.values())))
        _put(out, "rho_max", max(rho.values()))
    modes = [c.get("mode") for c in drawn]
    _put(out, "skill_free_group_rate", modes.count("skill_free") / len(drawn))
    _put(out, "assisted_empty_group_rate", modes.count("assisted_empty") / len(drawn))
    assisted = [c for c in drawn if c.get("mode") != "skill_free"]
    chunk_ids = sorted(set(rho) | {str(chunk) for c in assisted for chunk in c.get("chunks") or []})
    if assisted:
        _put(out, "skills_per_assisted_group_mean", sum(len(c.get("chunks") or []) for c in assisted) / len(assisted))
        for chunk in chunk_ids:
            given = sum(chunk in {str(x) for x in c.get("chunks") or []} for c in assisted)
            _put(out, f"chunk/{chunk}/inclusion_rate", given / len(assisted))
    for chunk, value in rho.items():
        _put(out, f"chunk/{chunk}/target_rho", value)


def _triage(out: dict[str, float], records: Sequence[Mapping[str, Any]]) -> None:
    n = len(records)
    _put(out, "triage_group_count", n)
    if not n:
        return
    classes = [record.get("classification") for record in records]
    retried = [record["diagnostic"] for record in records if isinstance(record.get("diagnostic"), dict)]
    _put(out, "all_wrong_group_rate", sum(record.get("all_wrong") is True for record in records) / n)
    _put(out, "full_skill_retry_rate", len(retried) / n)
    _put(out, "full_skill_retry_success_rate", _ratio(sum(d.get("succeeded") is True for d in retried), len(retried)))
    _put(out, "internalization_deficit_rate", classes.count(INTERNALIZATION_DEFICIT) / n)
    _put(out, "pending_analysis_rate", classes.count(PENDING_ANALYSIS) / n)
    _put(out, "runtime_error_group_rate", classes.count(RUNTIME_ERROR) / n)


def rollout_metrics(
    *,
    generated: Mapping[int, GroupSummary] | None,
    trained: Mapping[int, GroupSummary],
    triage: Mapping[int, Mapping[str, Any]],
    decisions: Mapping[int, FilterDecision],
) -> dict[str, float]:
    """The ``rollout/shopsim/*`` figures of one step (module docstring). ``generated`` None: the
    all-samples hook did not run, so only the trained counts and the drops are given."""
    out: dict[str, float] = {}
    _put(out, "train_trajectory_count", sum(len(group.trajectories) for group in trained.values()))
    _put(out, "train_group_count", len(trained))
    if generated is not None:
        trajectories = [t for group in generated.values() for t in group.trajectories.values()]
        scored = [t for t in trajectories if t.scored]
        _put(out, "trajectory_count", len(trajectories))
        _put(out, "group_count", len(generated))
        _put(out, "scored_rate", _ratio(len(scored), len(trajectories)))
        _put(out, "reward_mean", _mean([t.reward for t in scored if t.reward is not None]))
        _put(out, "strict_reward_mean", _mean([t.strict for t in scored if t.strict is not None]))
        _put(out, "success_rate", _mean([t.success for t in scored if t.success is not None]))
        _curriculum(out, generated.values())
        _triage(out, [triage[group] for group in sorted(generated) if group in triage])
    drops = {UNSCORED_REASON: 0, ZERO_SPREAD_REASON: 0}
    for group, decision in decisions.items():
        if not decision.keep and group not in trained and decision.reason in drops:
            drops[decision.reason] += 1
    considered = len(trained) + sum(drops.values())
    for name, reason in (("technical_group_drop", UNSCORED_REASON), ("zero_std_group_drop", ZERO_SPREAD_REASON)):
        _put(out, f"{name}_count", drops[reason])
        _put(out, f"{name}_rate", _ratio(drops[reason], considered))
    return out


# --------------------------------------------------------------------------- slime's hooks

_lock = threading.Lock()
"""slime calls the all-samples hook on its rollout loop's thread, the log hook on its own."""
_generated: dict[str, dict[int, GroupSummary]] = {}
_configs: dict[str, TrainingConfig] = {}
_warned: set[str] = set()


def _config(args: Any) -> tuple[str, TrainingConfig]:
    path = str(config_path(args, dict(os.environ)).resolve())
    with _lock:
        if path not in _configs:
            _configs[path] = load_training_config(path)
        return path, _configs[path]


def record_generated_rollout_groups(args: Any, all_samples: Sequence[Any], data_source: Any = None) -> None:
    """slime's ``--rollout-all-samples-process-path`` function: remember the step's generated
    groups (a summary without tokens) for :func:`enrich_rollout_metrics`."""
    path, _ = _config(args)
    summary = summarize_groups(all_samples, getattr(args, "reward_key", None))
    with _lock:
        _generated[path] = summary


def enrich_rollout_metrics(
    rollout_id: int, args: Any, samples: Sequence[Any], rollout_extra_metrics: dict[str, Any] | None, rollout_time: float
) -> bool:
    """slime's ``--custom-rollout-log-function-path`` function: add the step's ``rollout/shopsim/*``
    figures to slime's metric dict and return False (slime logs the dict as usual)."""
    path, config = _config(args)
    with _lock:
        generated = _generated.pop(path, None)
    if generated is None and path not in _warned:
        _warned.add(path)
        _log.warning(
            "rollout_metrics_without_generated_groups",
            hint="set --rollout-all-samples-process-path shopsimrl.training.metrics.record_generated_rollout_groups; "
            "until then only the trained counts and the drops are logged",
        )
    trained = summarize_groups(samples, getattr(args, "reward_key", None))
    triage = read_triage(config.run_location, set(generated)) if generated is not None else {}
    metrics = rollout_metrics(generated=generated, trained=trained, triage=triage, decisions=group_filter(args).take_decisions())
    if rollout_extra_metrics is not None:
        rollout_extra_metrics.update(metrics)
    return False
