"""The other stages in the trackers: a skill gate's fit, the offline judge's summary, a training
rollout step and the skill builder's stage (:func:`log_skill_stage`). Each is one call of :func:`track_stage` (the hook a stage calls when its figures
exist): scalars (with a step for training rounds, so successive rounds draw a curve), tables and
files, under the stage's identity. The commands call them after their own outputs are written
(``gate run/fit``, ``judge``, ``training step`` with ``--track``); slime's rollout-log hook can call
:func:`track_stage` with its ``rollout_id`` as the step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shopsimrl.config import TrackingSection
from shopsimrl.research.tracking.base import TrackedRun, TrackerOutcome, Tracking

__all__ = [
    "log_online_analysis",
    "log_skill_stage",
    "numeric_leaves",
    "track_gate",
    "track_judge",
    "track_stage",
    "track_training_step",
]

Table = tuple[str, Sequence[str], Sequence[Sequence[Any]]]


def numeric_leaves(value: Any, prefix: str = "") -> dict[str, float]:
    """Every finite number in a nested record as ``prefix/a/b`` (bools and text left out)."""
    found: dict[str, float] = {}
    if isinstance(value, Mapping):
        for key, item in value.items():
            found.update(numeric_leaves(item, f"{prefix}/{key}" if prefix else str(key)))
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        found[prefix] = float(value)
    return found


def track_stage(
    settings: TrackingSection,
    *,
    kind: str,
    name: str,
    identity: Mapping[str, Any],
    scalars: Mapping[str, Any],
    step: int | None = None,
    tables: Sequence[Table] = (),
    files: Mapping[str, bytes | Path] | None = None,
    tags: Mapping[str, str] | None = None,
) -> list[TrackerOutcome]:
    """One stage's figures to ``settings.backends``: never raises for a tracker (see
    :class:`~shopsimrl.research.tracking.base.Tracking`)."""
    if not settings.backends:
        return []
    with Tracking(settings, TrackedRun(settings.name or name, kind, dict(identity), dict(tags or {}))) as tracked:
        tracked.log_scalars(scalars, step)
        for table_name, columns, rows in tables:
            tracked.log_table(table_name, columns, rows)
        if files:
            tracked.log_files(f"{name}-{kind}", f"shopsimrl-{kind}", files)
    return tracked.outcomes


_GATE_COLUMNS = ("chunk", "coefficient", "standard_error", "ci_low", "ci_high", "rank", "status")


def track_gate(settings: TrackingSection, result: Any) -> list[TrackerOutcome]:
    """A gate's fit (``GateResult``): its summary counts, the contribution of each chunk as a
    table, the selection's size, the gate's files (manifest, contributions, selected bank)."""
    manifest: Mapping[str, Any] = result.manifest
    runs = manifest.get("runs") or {}
    selected = (manifest.get("output") or {}).get("selected_chunk_ids")
    scalars = {**numeric_leaves(manifest.get("summary") or {}, "gate"), "gate/complete": float(result.status == "complete")}
    if isinstance(selected, list):
        scalars["gate/selected_chunks"] = len(selected)
    rows = [[row.get("chunk_id") or row.get("intervention_id"), *(row.get(c) for c in _GATE_COLUMNS[1:])] for row in result.rows]
    identity = {
        "gate_dir": str(result.gate_dir),
        "status": result.status,
        "masked_plan_fingerprint": runs.get("masked_plan_fingerprint"),
        "schema_version": manifest.get("schema_version"),
    }
    files = {Path(path).name: Path(path) for path in result.files.values() if Path(path).is_file()}
    return track_stage(
        settings,
        kind="gate",
        name=Path(result.gate_dir).name,
        identity=identity,
        scalars=scalars,
        tables=[("contributions", _GATE_COLUMNS, rows)] if rows else [],
        files=files,
        tags={"shopsimrl.gate": Path(result.gate_dir).name},
    )


def track_judge(settings: TrackingSection, result: Any, config_path: Path) -> list[TrackerOutcome]:
    """The judge's summary (``judge_summary.json``): its counts, verdicts, usage and agreement
    (kappa, raw agreement) as scalars, the summary as a file."""
    summary: Mapping[str, Any] = result.summary
    scalars = numeric_leaves({key: summary.get(key) for key in ("episodes", "status", "verdicts", "usage", "agreement")}, "judge")
    identity = {key: value for key, value in summary.items() if key not in _JUDGE_FIGURES}
    files: dict[str, bytes | Path] = {}
    if Path(result.summary_path).is_file():
        files["judge_summary.json"] = Path(result.summary_path)
    return track_stage(
        settings,
        kind="judge",
        name=config_path.stem,
        identity={**identity, "config": str(config_path)},
        scalars=scalars,
        files=files,
    )


_JUDGE_FIGURES = frozenset(
    {"episodes", "status", "repaired", "verdicts", "failure_categories", "usage", "agreement", "created_at"}
)
"""The judge summary's figures; its other keys (rubric, judge model, source run, config) are its identity."""

_GROUP_COLUMNS = ("group_index", "task_id", "kept", "reason", "samples", "reward_mean", "trained_tokens")


def track_training_step(
    settings: TrackingSection, record: Mapping[str, Any], out: Path, *, step: int | None = None
) -> list[TrackerOutcome]:
    """A training rollout step (``training step``'s record): the ``rollout/shopsim/*`` metrics at
    ``step`` (a round's number: successive rounds draw curves), a table of its groups (kept or
    dropped, why, mean reward), the record as a file."""
    args = record.get("args") or {}
    groups = []
    for group in record.get("groups") or []:
        samples = group.get("samples") or []
        rewards = [s["reward"]["reward"] for s in samples if isinstance(s.get("reward"), Mapping) and not s.get("remove_sample")]
        groups.append(
            [
                group.get("group_index"),
                group.get("task_id"),
                group.get("kept"),
                group.get("reason"),
                len(samples),
                sum(rewards) / len(rewards) if rewards else None,
                sum(int(s.get("trained_tokens") or 0) for s in samples),
            ]
        )
    identity = {"config": record.get("config"), "schema_version": record.get("schema_version"), "args": args}
    return track_stage(
        settings,
        kind="training",
        name=str(Path(str(record.get("config") or out)).stem),
        identity=identity,
        scalars=record.get("metrics") or {},
        step=step,
        tables=[("groups", _GROUP_COLUMNS, groups)],
        files={"step.json": out} if out.is_file() else None,
    )


_FIREWALL_COLUMNS = ("rule", "findings")


def log_skill_stage(
    settings: TrackingSection,
    *,
    name: str,
    analysis: Mapping[str, Any] | None = None,
    consolidation: Mapping[str, Any] | None = None,
    manifest: Mapping[str, Any] | None = None,
    output_dir: Path | None = None,
    step: int | None = None,
    stage: str = "cold_start",
) -> list[TrackerOutcome]:
    """The skill builder's figures (``skills build``, or an online analysis round with its round
    as ``step``): trajectories and cards (total, eligible, placeholders), clusters and
    evidence-only cards, chunks, the firewall's findings per rule (also as a table), and the
    stage's summaries and manifest from ``output_dir`` as files. Never raises for a tracker."""
    analysis, consolidation, manifest = analysis or {}, consolidation or {}, manifest or {}
    findings = {str(rule): count for rule, count in (analysis.get("firewall_findings") or {}).items()}
    scalars: dict[str, Any] = {
        **numeric_leaves(analysis.get("episodes") or {}, "skills/trajectories"),
        **numeric_leaves(analysis.get("cards") or {}, "skills/cards"),
        **numeric_leaves(findings, "skills/firewall_findings"),
        "skills/firewall_findings/total": sum(v for v in findings.values() if isinstance(v, int)),
    }
    for key in ("cards", "clusters", "evidence_only_cards"):
        if key in consolidation:
            scalars[f"skills/consolidation/{key}"] = consolidation[key]
    if isinstance(manifest.get("chunks"), int):
        scalars["skills/chunks"] = manifest["chunks"]
    scalars["skills/complete"] = float(analysis.get("status") == "complete" and manifest.get("status") == "complete")
    files: dict[str, bytes | Path] = {}
    if output_dir is not None:
        for file_name in ("analysis_summary.json", "consolidation_summary.json", "trace2skill_manifest.json"):
            if (output_dir / file_name).is_file():
                files[file_name] = output_dir / file_name
    identity = {
        "stage": stage,
        "output_dir": None if output_dir is None else str(output_dir),
        "analyst": analysis.get("analyst"),
        "compiler": manifest.get("compiler"),
        "compilation_input_sha256": manifest.get("compilation_input_sha256"),
    }
    return track_stage(
        settings,
        kind="skills",
        name=name,
        identity=identity,
        scalars=scalars,
        step=step,
        tables=[("firewall_findings", _FIREWALL_COLUMNS, sorted(findings.items()))],
        files=files,
        tags={"shopsimrl.skills": stage},
    )


_ONLINE_FILES = ("analysis_summary.json", "candidate_pool.json", "proposal_ledger.jsonl", "failure_cards.jsonl")


def log_online_analysis(
    settings: TrackingSection, *, name: str, summary: Mapping[str, Any], output_dir: Path | None = None
) -> list[TrackerOutcome]:
    """An online analysis round (``skills analyze``): a tracker run ``{name}-analysis`` with the
    earlier ``analysis/*`` scalars (triage groups, analysed and eligible cards, candidates,
    evidence-only cards) plus the NO_PROPOSAL and ANALYST_ERROR cards, the forced NO_PROPOSAL
    reasons (``firewall_finding`` among them) and ``analysis/complete``; the round's summary,
    pool, ledger and cards as files. A failed round is logged too (its empty pool). Never raises
    for a tracker."""
    cards = summary.get("cards") or {}
    triage = summary.get("triage") or {}
    by_classification = triage.get("by_classification") or {}
    scalars: dict[str, Any] = {
        "analysis/triage_groups": sum(v for v in by_classification.values() if isinstance(v, int)),
        "analysis/pending_retries": triage.get("pending"),
        "analysis/analyzed_cards": cards.get("total"),
        "analysis/eligible_cards": cards.get("eligible"),
        "analysis/no_proposal_cards": cards.get("no_proposal"),
        "analysis/analyst_errors": cards.get("analyst_errors"),
        "analysis/candidates": summary.get("candidates"),
        "analysis/evidence_only_cards": len(summary.get("evidence_only_card_ids") or ()),
        **numeric_leaves(dict(summary.get("forced_no_proposal") or {}), "analysis/forced_no_proposal"),
        "analysis/complete": float(summary.get("status") == "complete"),
    }
    files: dict[str, bytes | Path] = {}
    if output_dir is not None:
        files = {file_name: output_dir / file_name for file_name in _ONLINE_FILES if (output_dir / file_name).is_file()}
    identity = {
        "stage": "online",
        "round_id": summary.get("round_id"),
        "output_dir": None if output_dir is None else str(output_dir),
        "compiler": summary.get("compiler"),
        "proposal_checkpoint": summary.get("proposal_checkpoint"),
        "compilation_input_sha256": summary.get("compilation_input_sha256"),
        "pool_sha256": summary.get("pool_sha256"),
    }
    return track_stage(
        settings,
        kind="skills",
        name=f"{name}-analysis",
        identity=identity,
        scalars={key: value for key, value in scalars.items() if value is not None},
        files=files,
        tags={"shopsimrl.skills": "online"},
    )
