"""A fitted gate's files: contributions, the selection, the proposal ledger, the gate manifest.

The file names and shapes are the earlier implementation's (``contributions.json`` / ``.csv``,
``selected_skillbank.json``, ``selected_skill.md``, ``proposal_ledger.jsonl``,
``gate_a_manifest.json`` / ``online_gate_manifest.json``), with additive keys: every coefficient
also has a standard error and a 95 % interval (``standard_errors``, ``ci_low``, ``ci_high`` per
metric; ``standard_error``, ``ci_low``, ``ci_high`` per chunk row and CSV column).

Selection: keep the strictly positive ``reward`` coefficients, highest first (ties by id), up to
the budget; a short list is not padded. The online gate first resolves each REWRITE family to one
version: the highest coefficient wins, the current version wins a tie, then the earlier version.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from shopsimrl.research.gate.checks import Pairs
from shopsimrl.research.gate.drafts import Chunk
from shopsimrl.research.gate.fit import CONFIDENCE, STANDARD_ERROR, ZERO_TOLERANCE, Fit
from shopsimrl.research.gate.freeze import ESTIMATOR, FORMULA, FrozenGate
from shopsimrl.research.outputs import write_output
from shopsimrl.schemas import fingerprint
from shopsimrl.storage.local import atomic_write_json

__all__ = ["OUTPUT_FILES", "contributions", "write_outputs"]

OUTPUT_FILES: Final = (
    "contributions.json",
    "contributions.csv",
    "selected_skillbank.json",
    "selected_skill.md",
    "proposal_ledger.jsonl",
)
GATE_A_CONTRIBUTIONS: Final = "shopsimrl-chunk-contributions-v2"
ONLINE_CONTRIBUTIONS: Final = "shopsimrl-online-chunk-contributions-v2"
GATE_A_SELECTED_BANK: Final = "cold-start-gate-a-selected-v2"


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _estimates(columns: Sequence[str], pairs: Pairs, fits: Mapping[str, Fit]) -> dict[str, Any]:
    estimates: dict[str, Any] = {}
    for metric, fit in fits.items():
        masked = [row["reward"] if metric == "reward" else row["reward_detail"][metric] for row in pairs.rows]
        bare = [row["bare_reward"] if metric == "reward" else row["bare_reward_detail"][metric] for row in pairs.rows]
        delta = pairs.outcomes[metric]
        estimates[metric] = {
            "intercept": 0.0,
            "coefficients": dict(zip(columns, fit.coefficients, strict=True)),
            "standard_errors": dict(zip(columns, fit.standard_errors, strict=True)),
            "ci_low": {c: None if i is None else i[0] for c, i in zip(columns, fit.intervals, strict=True)},
            "ci_high": {c: None if i is None else i[1] for c, i in zip(columns, fit.intervals, strict=True)},
            "observations": fit.observations,
            "degrees_of_freedom": fit.degrees_of_freedom,
            "residual_sd": fit.residual_sd,
            "masked_mean": math.fsum(masked) / len(masked),
            "bare_mean": math.fsum(bare) / len(bare),
            "delta_mean": math.fsum(delta) / len(delta),
        }
    return estimates


def _ranked(ids: Sequence[str], primary: Mapping[str, float]) -> list[str]:
    return sorted(ids, key=lambda chunk_id: (-primary[chunk_id], chunk_id))


def _estimator(frozen: FrozenGate) -> dict[str, Any]:
    block: dict[str, Any] = {
        "name": ESTIMATOR,
        "formula": FORMULA,
        "fit_intercept": False,
        "baseline": "same_task_bare_validation",
        "primary_outcome": "reward",
        "selection_rule": "strictly_positive_top_k",
        "numerical_zero_tolerance": ZERO_TOLERANCE,
        "standard_error": STANDARD_ERROR,
        "confidence": CONFIDENCE,
        "interval": "coefficient ± t(0.975, n − k) · standard_error",
    }
    if frozen.pool is not None:
        block["rewrite_rule"] = "mutually_exclusive_family_argmax_old_on_tie"
        block["selection_rule"] = "rewrite_winners_then_strictly_positive_top_k"
    return block


def _row_statistics(estimates: Mapping[str, Any], chunk_id: str) -> dict[str, Any]:
    reward = estimates["reward"]
    return {
        "coefficient": reward["coefficients"][chunk_id],
        "standard_error": reward["standard_errors"][chunk_id],
        "ci_low": reward["ci_low"][chunk_id],
        "ci_high": reward["ci_high"][chunk_id],
    }


def contributions(frozen: FrozenGate, pairs: Pairs, fits: Mapping[str, Fit]) -> dict[str, Any]:
    """``contributions.json``: estimates per metric, one row per column with rank and status."""
    columns = frozen.columns
    estimates = _estimates(columns, pairs, fits)
    primary = estimates["reward"]["coefficients"]
    aux = {c: {m: e["coefficients"][c] for m, e in estimates.items() if m != "reward"} for c in columns}
    head: dict[str, Any] = {
        "schema_version": GATE_A_CONTRIBUTIONS if frozen.pool is None else ONLINE_CONTRIBUTIONS,
        "created_at": _now(),
        "estimator": _estimator(frozen),
    }
    if frozen.pool is None:
        ranked = _ranked(columns, primary)
        selected = set([c for c in ranked if primary[c] > 0.0][: frozen.budget])
        rows = [
            {
                "chunk_id": chunk.chunk_id,
                "draft_order": chunk.order,
                "title": chunk.title,
                **_row_statistics(estimates, chunk.chunk_id),
                "rank": ranked.index(chunk.chunk_id) + 1,
                "status": "selected"
                if chunk.chunk_id in selected
                else "non_positive"
                if primary[chunk.chunk_id] <= 0
                else "budget_excluded",
                "auxiliary_coefficients": aux[chunk.chunk_id],
            }
            for chunk in frozen.chunks
        ]
        assert frozen.draft is not None
        return {
            **head,
            "draft_sha256": frozen.draft.sha256,
            "assignment_sha256": frozen.assignment_sha256,
            "mask_seed": frozen.spec.mask_seed,
            "mask_probability": frozen.assignment_core["mask_probability"],
            "observations": len(pairs.rows),
            "active_skill_budget": frozen.budget,
            "selected_count": len(selected),
            "selected_chunk_ids": [c for c in columns if c in selected],
            "estimates": estimates,
            "contributions": rows,
            "observations_table": pairs.rows,
            "bare_baseline": frozen.baseline.record,
        }
    return _online(frozen, pairs, estimates, aux, head)


def _online(
    frozen: FrozenGate, pairs: Pairs, estimates: dict[str, Any], aux: dict[str, Any], head: dict[str, Any]
) -> dict[str, Any]:
    assert frozen.pool is not None
    primary = estimates["reward"]["coefficients"]
    winners: dict[str, str] = {}
    losers: set[str] = set()
    for slot in frozen.pool.slots:
        # The highest coefficient; on a tie the current version, then the earlier one.
        best = max(slot.versions, key=lambda v: (primary[v], v == slot.old_version_id, -slot.versions.index(v)))
        winners[slot.slot_id] = best
        losers |= set(slot.versions) - {best}
    ranked = _ranked(list(winners.values()), primary)
    selected = set([v for v in ranked if primary[v] > 0.0][: frozen.budget])
    by_id = {chunk.chunk_id: chunk for chunk in frozen.chunks}
    rows = []
    for chunk in frozen.chunks:
        column = chunk.chunk_id
        if column in losers:
            status = "rewrite_loser"
        elif column in selected:
            status = "selected"
        elif chunk.kind == "current":
            status = "retired"
        else:
            status = "non_positive" if primary[column] <= 0.0 else "budget_excluded"
        rows.append(
            {
                "intervention_id": column,
                "kind": chunk.kind,
                "logical_chunk_id": chunk.logical_chunk_id,
                "operation": chunk.operation,
                "order": chunk.order,
                **_row_statistics(estimates, column),
                "rank": ranked.index(column) + 1 if column in ranked else None,
                "status": status,
                "auxiliary_coefficients": aux[column],
            }
        )
    chosen = sorted(selected, key=lambda v: (by_id[v].order, by_id[v].logical_chunk_id or v))
    return {
        **head,
        "pool_sha256": frozen.pool.sha256,
        "assignment_sha256": frozen.assignment_sha256,
        "mask_seed": frozen.spec.mask_seed,
        "observations": len(pairs.rows),
        "active_skill_budget": frozen.budget,
        "selected_intervention_ids": chosen,
        "selected_count": len(chosen),
        "replacement_winners": winners,
        "estimates": estimates,
        "contributions": rows,
        "observations_table": pairs.rows,
        "bare_baseline": frozen.baseline.record,
    }


# --------------------------------------------------------------------------- the files


def _csv(document: Mapping[str, Any]) -> str:
    metrics = [m for m in document["estimates"] if m != "reward"]
    online = "intervention_id" in (document["contributions"] or [{}])[0]
    ids = (
        ["intervention_id", "kind", "logical_chunk_id", "operation", "order"] if online else ["chunk_id", "draft_order", "title"]
    )
    fields = [*ids, "coefficient_reward", *(f"coefficient_{m}" for m in metrics), "rank", "status"]
    fields += ["standard_error_reward", "ci_low_reward", "ci_high_reward"]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in document["contributions"]:
        writer.writerow(
            {
                **{key: row[key] for key in ids},
                "coefficient_reward": row["coefficient"],
                **{f"coefficient_{m}": row["auxiliary_coefficients"].get(m) for m in metrics},
                "rank": row["rank"],
                "status": row["status"],
                "standard_error_reward": row["standard_error"],
                "ci_low_reward": row["ci_low"],
                "ci_high_reward": row["ci_high"],
            }
        )
    return out.getvalue()


def _selected_bank(frozen: FrozenGate, document: Mapping[str, Any]) -> dict[str, Any]:
    results = {row.get("chunk_id") or row.get("intervention_id"): row for row in document["contributions"]}
    chunks: dict[str, Chunk] = {chunk.chunk_id: chunk for chunk in frozen.chunks}
    metadata: dict[str, Any] = {
        "assignment_sha256": document["assignment_sha256"],
        "active_skill_budget": document["active_skill_budget"],
        "selected_count": document["selected_count"],
        "estimator": document["estimator"],
        "bare_baseline": document["bare_baseline"],
    }
    records = []
    if frozen.draft is not None:
        for chunk_id in document["selected_chunk_ids"]:
            chunk, result = chunks[chunk_id], results[chunk_id]
            extra = {k: v for k, v in chunk.metadata.items() if k != "draft_only"}
            extra |= {
                "validation_result": "selected",
                "estimated_effect": result["coefficient"],
                "standard_error": result["standard_error"],
                "contribution_rank": result["rank"],
                "draft_order": result["draft_order"],
            }
            records.append(
                {"skill_id": chunk_id, "version": "active-1", "enabled": True, "content": chunk.content, "metadata": extra}
            )
        metadata = {
            "skill_title": frozen.draft.draft.get("skill_title", "Shopping Skill"),
            "gate_status": {"gate_a": "passed", "gate_b": "not_run"},
            "draft_sha256": document["draft_sha256"],
            **metadata,
            "selected_chunk_ids": list(document["selected_chunk_ids"]),
            "injection_order": "canonical_draft_order",
        }
        return {
            "schema_version": "shopsimrl-skillbank-v1",
            "bank_version": GATE_A_SELECTED_BANK,
            "metadata": metadata,
            "skills": records,
        }
    assert frozen.pool is not None
    for version in document["selected_intervention_ids"]:
        chunk, result = chunks[version], results[version]
        extra = dict(chunk.metadata) | {
            "validation_result": "selected",
            "estimated_effect": result["coefficient"],
            "standard_error": result["standard_error"],
            "contribution_rank": result["rank"],
            "selected_intervention_id": version,
        }
        records.append(
            {
                "skill_id": chunk.logical_chunk_id,
                "version": chunk.version,
                "enabled": True,
                "content": chunk.content,
                "metadata": extra,
            }
        )
    pool = frozen.pool.pool
    metadata = {
        "round_id": pool.get("round_id"),
        "proposal_checkpoint": pool.get("proposal_checkpoint"),
        "pool_sha256": document["pool_sha256"],
        **metadata,
        "selected_intervention_ids": list(document["selected_intervention_ids"]),
    }
    return {
        "schema_version": "shopsimrl-skillbank-v1",
        "bank_version": f"online-{pool.get('round_id', 'round')}-selected-v1",
        "metadata": metadata,
        "skills": records,
    }


def _selected_markdown(frozen: FrozenGate, bank: Mapping[str, Any]) -> str:
    gate = "Gate A (cold start)" if frozen.draft is not None else "the online gate"
    title = bank["metadata"].get("skill_title") or "Shopping Skill"
    if bank["skills"]:
        body = "\n\n".join(record["content"].strip() for record in bank["skills"])
    else:
        body = "_No chunk had a positive effect on reward; nothing was selected._"
    note = f"> Chunks kept by {gate}: a positive reward coefficient against the same tasks' bare rollouts, within the budget."
    return f"# {title}\n\n{note}\n\n{body}\n"


def _ledger(frozen: FrozenGate, document: Mapping[str, Any]) -> list[dict[str, Any]]:
    baseline = document["bare_baseline"]
    results = {row.get("chunk_id") or row.get("intervention_id"): row for row in document["contributions"]}
    common = {
        "validation_estimator": ESTIMATOR,
        "validation_assignment_sha256": document["assignment_sha256"],
        "bare_validation_observations_sha256": baseline["observations_sha256"],
    }
    if frozen.draft is not None:
        history = {r["candidate_id"]: r for r in frozen.draft.history if isinstance(r.get("candidate_id"), str)}
        rows = []
        for chunk in frozen.chunks:
            result = results[chunk.chunk_id]
            row = {"candidate_id": chunk.chunk_id, "operation": "ADD", "stage": "cold_start", **history.get(chunk.chunk_id, {})}
            row |= {
                "validation_result": result["status"],
                "estimated_effect": result["coefficient"],
                "contribution_rank": result["rank"],
            }
            rows.append(row | common)
        return rows
    assert frozen.pool is not None
    pool = frozen.pool.pool
    by_id = {str(r["candidate_id"]): dict(r) for r in frozen.pool.history if isinstance(r.get("candidate_id"), str)}
    order = list(by_id)

    def record_event(row: dict[str, Any], version: str, status: str) -> None:
        event = {
            "proposal_checkpoint": pool.get("proposal_checkpoint"),
            "evaluation_checkpoint": baseline.get("checkpoint_id"),
            "validation_estimator": ESTIMATOR,
            "bare_validation_observations_sha256": baseline["observations_sha256"],
            "intervention_id": version,
            "validation_result": status,
            "estimated_effect": results[version]["coefficient"],
            "contribution_rank": results[version]["rank"],
            "pool_sha256": document["pool_sha256"],
            "assignment_sha256": document["assignment_sha256"],
        }
        same = ("assignment_sha256", "validation_estimator", "bare_validation_observations_sha256")
        earlier = [
            e for e in row.get("validation_history") or [] if isinstance(e, dict) and any(e.get(k) != event[k] for k in same)
        ]
        row.update(event)
        row["validation_history"] = [*earlier, event]

    # A proposal selected in an earlier round is a current chunk now: its row follows it (selected
    # again, or retired), rather than being judged as a new candidate.
    for current in pool["current_skills"]:
        origin = (current.get("metadata") or {}).get("selected_intervention_id") or current["skill_id"]
        if origin in by_id:
            by_id[origin]["active_chunk_id"] = current["skill_id"]
            status = "selected" if results[current["skill_id"]]["status"] == "selected" else "retired"
            record_event(by_id[origin], current["skill_id"], status)
    for candidate in pool["candidates"]:
        candidate_id = candidate["candidate_id"]
        metadata = candidate.get("metadata") or {}
        if candidate_id not in by_id:
            order.append(candidate_id)
        row = by_id.get(candidate_id, {})
        row |= {
            "candidate_id": candidate_id,
            "operation": candidate["operation"],
            "target_chunk_id": candidate.get("target_chunk_id") or None,
            "source_card_ids": list(metadata.get("evidence_card_ids") or []),
            "failure_mechanism": metadata.get("failure_mechanism"),
            "proposal_checkpoint": pool.get("proposal_checkpoint"),
            "stage": "online",
            "consolidation_cluster_id": metadata.get("consolidation_cluster_id"),
            "replacement_family_id": candidate.get("target_chunk_id") if candidate["operation"] == "REWRITE" else None,
            "content": candidate["content"],
        }
        record_event(row, candidate_id, results[candidate_id]["status"])
        by_id[candidate_id] = row
    return [by_id[candidate_id] for candidate_id in order]


def _write_text(path: Path, text: str) -> None:
    write_output(path, text.encode("utf-8"))  # whole or not at all, as every research output


def write_outputs(frozen: FrozenGate, document: dict[str, Any]) -> dict[str, Any]:
    """Write the selection files of a complete gate; returns the manifest's ``output`` block."""
    gate_dir = frozen.spec.gate_dir
    bank = _selected_bank(frozen, document)
    ledger = _ledger(frozen, document)
    atomic_write_json(gate_dir / "contributions.json", document)
    _write_text(gate_dir / "contributions.csv", _csv(document))
    atomic_write_json(gate_dir / "selected_skillbank.json", bank)
    _write_text(gate_dir / "selected_skill.md", _selected_markdown(frozen, bank))
    _write_text(
        gate_dir / "proposal_ledger.jsonl",
        "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n" for row in ledger),
    )
    return {
        "contributions_sha256": fingerprint(document),
        "selected_skillbank_sha256": fingerprint(bank),
        "proposal_ledger_sha256": fingerprint(ledger),
        "selected_chunk_ids": [record["skill_id"] for record in bank["skills"]],
    }


def remove_outputs(gate_dir: Path) -> list[str]:
    """Remove selection files a refit cannot stand behind (the gate is incomplete now)."""
    removed = []
    for name in OUTPUT_FILES:
        path = gate_dir / name
        if path.is_file():
            path.unlink()
            removed.append(name)
    return removed
