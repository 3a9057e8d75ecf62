"""Fitting a Gate A directory written by the earlier implementation (``gate fit`` on its GATE.yaml).

Such a directory holds the masked rollouts as a run of that implementation (``manifest.json``,
``traces.jsonl``), the masks (``mask_assignments.json``, ``shopsimrl-chunk-mask-assignments-v1``:
``mask_seed``, ``chunk_ids`` and one row per episode with ``episode_id``, the job fields, ``mask``
and ``included_chunk_ids``) and its own fit (``contributions.json``, ``gate_a_manifest.json``…);
its bare run is an ordinary run directory of it. Their plans are not this project's plans (the
earlier fingerprint covers paths, transport and concurrency), so nothing is re-planned: the
gate is read from its own files and checked as strictly as one of ours —

- every recorded mask is the formula's for its job and ``mask_seed``, over the draft's chunks;
- the bare run passes the bare preflight against its own plan and the assignments' jobs;
- the masked run's plan has the bare run's model, prompt, runtime, environment and split
  (after the usual normalisation), and every pair passes the pairing checks.

The outputs go to ``<gate dir>/refit/``: the earlier implementation's files are left as they
are, and the refit's manifest says whether its coefficients reproduce the earlier
``contributions.json`` (``earlier_fit``).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from shopsimrl.config import WorkerSettings
from shopsimrl.research.gate.checks import PLAN_FIELDS, GateCheckError, bare_preflight, normalised
from shopsimrl.research.gate.drafts import load_gate_a_draft
from shopsimrl.research.gate.freeze import (
    ASSIGNMENTS_FILE,
    GATE_A_ASSIGNMENT_SCHEMA,
    GATE_PLAN_FILE,
    MASK_ASSIGNMENTS_FILE,
    ONLINE_ASSIGNMENT_SCHEMA,
    FrozenGate,
    GatePlanError,
)
from shopsimrl.research.gate.masks import MASK_PROBABILITY, gate_a_assignments
from shopsimrl.research.gate.spec import GateSpec
from shopsimrl.schemas import EpisodeJob, read_json_file
from shopsimrl.storage.reading import open_run

__all__ = [
    "REFIT_DIR",
    "EarlierGateError",
    "compare_with_earlier",
    "is_earlier_gate",
    "load_earlier_gate",
    "recorded_drops",
]

REFIT_DIR: Final = "refit"
CONTRIBUTIONS_FILE: Final = "contributions.json"
_AGREEMENT: Final = 1e-9
"""Coefficients of the same rows and deltas agree far closer than this; more is another fit."""


class EarlierGateError(GatePlanError):
    """An earlier gate directory is missing a file or holds a malformed one (exit 2)."""


def is_earlier_gate(gate_dir: Path) -> bool:
    """A gate directory the earlier implementation wrote: masks and rollouts, no ``gate_plan.json``."""
    if (gate_dir / GATE_PLAN_FILE).exists() or (gate_dir / ASSIGNMENTS_FILE).exists():
        return False  # ours (a plan interrupted before gate_plan.json has written the assignments already)
    return (gate_dir / MASK_ASSIGNMENTS_FILE).exists() or (
        (gate_dir / "manifest.json").exists() and (gate_dir / "traces.jsonl").exists()
    )


def _read_json(path: Path, what: str) -> Any:
    if not path.exists():
        raise EarlierGateError(f"{path}: missing; an earlier gate directory holds {what}")
    return read_json_file(path, what, EarlierGateError)


def _integer(row: dict[str, Any], key: str, where: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EarlierGateError(f"{where}.{key} must be an integer, got {value!r}")
    return value


def _read_masks(gate_dir: Path, spec: GateSpec, chunk_ids: list[str]) -> tuple[dict[str, Any], list[EpisodeJob], list[list[int]]]:
    path = gate_dir / MASK_ASSIGNMENTS_FILE
    document = _read_json(path, "the masks (mask_assignments.json)")
    if not isinstance(document, dict):
        raise EarlierGateError(f"{path} must be a JSON object")
    version = document.get("schema_version")
    if version == ONLINE_ASSIGNMENT_SCHEMA:
        raise EarlierGateError(f"{path}: an online gate of the earlier implementation; only its Gate A directories are read")
    if version != GATE_A_ASSIGNMENT_SCHEMA:
        raise EarlierGateError(f"{path}: schema_version must be {GATE_A_ASSIGNMENT_SCHEMA!r}, got {version!r}")
    seed = _integer(document, "mask_seed", str(path))
    if seed != spec.mask_seed:
        raise EarlierGateError(f"{path}: mask_seed {seed} differs from the gate config's {spec.mask_seed}")
    probability = document.get("mask_probability", MASK_PROBABILITY)
    if probability != MASK_PROBABILITY:
        raise EarlierGateError(f"{path}: mask_probability must be {MASK_PROBABILITY}, got {probability!r}")
    if document.get("chunk_ids") != chunk_ids:
        raise EarlierGateError(f"{path}: chunk_ids {document.get('chunk_ids')!r} are not the draft's {chunk_ids}")
    rows = document.get("assignments")
    if not isinstance(rows, list) or not rows:
        raise EarlierGateError(f"{path}: assignments must be a non-empty list")
    jobs, masks, seen = [], [], set()
    for index, row in enumerate(rows):
        where = f"{path}: assignments[{index}]"
        if not isinstance(row, dict):
            raise EarlierGateError(f"{where} must be an object")
        split = row.get("split")
        if not isinstance(split, str) or not split:
            raise EarlierGateError(f"{where}.split must be a non-empty string, got {split!r}")
        job = EpisodeJob(
            task_id=_integer(row, "task_id", where),
            sample_id=_integer(row, "sample_id", where),
            seed=_integer(row, "seed", where),
            split=split,
        )
        if row.get("episode_id") != job.episode_id:
            raise EarlierGateError(f"{where}.episode_id {row.get('episode_id')!r} is not its job's ({job.episode_id!r})")
        if job.episode_id in seen:
            raise EarlierGateError(f"{where}: episode {job.episode_id} is assigned twice")
        seen.add(job.episode_id)
        mask = row.get("mask")
        if (
            not isinstance(mask, list)
            or len(mask) != len(chunk_ids)
            or any(bit not in (0, 1) or isinstance(bit, bool) for bit in mask)
        ):
            raise EarlierGateError(f"{where}.mask must be {len(chunk_ids)} bits (0 or 1), got {mask!r}")
        included = [chunk for chunk, bit in zip(chunk_ids, mask, strict=True) if bit]
        if row.get("included_chunk_ids") != included:
            raise EarlierGateError(
                f"{where}.included_chunk_ids {row.get('included_chunk_ids')!r} do not follow its mask ({included})"
            )
        jobs.append(job)
        masks.append(mask)
    return document, jobs, masks


def load_earlier_gate(spec: GateSpec, masked_run: str | None = None) -> tuple[FrozenGate, str]:
    """The earlier gate at ``spec.gate_dir`` as a frozen gate writing into ``refit/``, checked;
    and the masked run's location."""
    if spec.kind != "gate_a":
        raise EarlierGateError(f"{spec.gate_dir}: only Gate A directories of the earlier implementation are read")
    gate_dir = spec.gate_dir
    assert spec.draft_path is not None and spec.draft_skillbank_path is not None
    draft = load_gate_a_draft(spec.draft_path, spec.draft_skillbank_path, spec.active_skill_budget)
    document, jobs, masks = _read_masks(gate_dir, spec, draft.chunk_ids)
    assignments = gate_a_assignments(jobs, draft.chunk_ids, spec.mask_seed)
    for assignment, recorded in zip(assignments, masks, strict=True):
        if list(assignment.mask) != recorded:
            raise EarlierGateError(
                f"{gate_dir / MASK_ASSIGNMENTS_FILE}: the mask of {assignment.job.episode_id} is {recorded}, the formula's "
                f"(mask_seed {spec.mask_seed}) is {list(assignment.mask)}"
            )

    bare_run = open_run(spec.bare_run)
    if bare_run.manifest is None:
        raise GateCheckError(f"bare run {bare_run.location} has no manifest.json; the earlier bare run directory holds one")
    bare_plan = bare_run.manifest.plan.as_dict()
    splits = {job.split for job in jobs}
    if splits != {(bare_plan.get("task_split") or {}).get("name")}:
        raise GateCheckError(f"the masks cover splits {sorted(splits)}, the bare run's split is {bare_plan.get('task_split')!r}")
    # The bare run's own plan, restricted to the jobs the masks cover: the preflight then checks
    # that it covers exactly them, completely, bare, with one environment.
    baseline = bare_preflight(bare_run, {**bare_plan, "jobs": [job.to_dict() for job in jobs]})
    if "://" not in spec.bare_run:  # relative to where the refit's files are, as in a gate of ours
        baseline.record["run"] = os.path.relpath(spec.bare_run, gate_dir / REFIT_DIR)

    location = masked_run or str(gate_dir)
    masked = open_run(location)
    if masked.manifest is None:
        raise GateCheckError(f"masked run {masked.location} has no manifest.json; the earlier gate directory holds one")
    masked_plan = masked.manifest.plan.as_dict()
    for name in PLAN_FIELDS:
        if normalised(name, masked_plan.get(name)) != normalised(name, bare_plan.get(name)):
            raise GateCheckError(
                f"masked run {masked.location}: plan.{name} differs from the bare run's; the gate pairs rollouts of one protocol"
            )

    refit = replace(spec, gate_dir=gate_dir / REFIT_DIR)
    core = {key: value for key, value in document.items() if key not in ("schema_version", "created_at", "assignment_sha256")}
    core.setdefault("mask_probability", MASK_PROBABILITY)
    frozen = FrozenGate(
        spec=refit,
        config=None,
        bare_plan=bare_plan,
        chunks=draft.chunks,
        assignments=assignments,
        baseline=baseline,
        budget=draft.budget,
        draft=draft,
        pool=None,
        assignment_core=core,
        skill_document={},
        masked=None,
        settings=WorkerSettings(),
        recorded_masked_fingerprint=masked.manifest.plan_fingerprint,
    )
    refit.gate_dir.mkdir(parents=True, exist_ok=True)
    return frozen, location


def recorded_drops(gate_dir: Path) -> list[str]:
    """The episodes the earlier fit dropped (``dropped_episode_ids`` of its ``contributions.json``;
    empty when the file or the key is absent: the earlier versions that refused failures)."""
    path = gate_dir / CONTRIBUTIONS_FILE
    if not path.exists():
        return []
    document = _read_json(path, "the earlier fit")
    dropped = document.get("dropped_episode_ids") if isinstance(document, dict) else None
    if dropped is None:
        return []
    if not isinstance(dropped, list) or not all(isinstance(item, str) and item for item in dropped):
        raise EarlierGateError(f"{path}: dropped_episode_ids must be a list of episode ids")
    return sorted(dropped)


def compare_with_earlier(gate_dir: Path, rows: list[dict[str, Any]], dropped: list[str] | None = None) -> dict[str, Any] | None:
    """How the refit's reward coefficients, statuses and dropped episodes compare with the earlier
    ``contributions.json`` (rows ``chunk_id``, ``coefficient``, ``status``; ``dropped_episode_ids``);
    None when there is no such file."""
    path = gate_dir / CONTRIBUTIONS_FILE
    if not path.exists():
        return None
    earlier = _read_json(path, "the earlier fit")
    earlier_rows = earlier.get("contributions") if isinstance(earlier, dict) else None
    if not isinstance(earlier_rows, list) or not all(isinstance(r, dict) for r in earlier_rows):
        raise EarlierGateError(f"{path}: contributions must be a list of rows with chunk_id, coefficient and status")
    by_id = {r.get("chunk_id"): r for r in earlier_rows}
    if set(by_id) != {row["chunk_id"] for row in rows}:
        raise EarlierGateError(
            f"{path}: its rows are chunks {sorted(map(str, by_id))}, the gate's {[r['chunk_id'] for r in rows]}"
        )
    differences = []
    statuses_agree = True
    for row in rows:
        before = by_id[row["chunk_id"]]
        coefficient = before.get("coefficient")
        if isinstance(coefficient, bool) or not isinstance(coefficient, int | float) or not math.isfinite(coefficient):
            raise EarlierGateError(f"{path}: chunk {row['chunk_id']}: coefficient must be a finite number, got {coefficient!r}")
        differences.append(abs(float(coefficient) - row["coefficient"]))
        statuses_agree = statuses_agree and before.get("status") == row["status"]
    largest = max(differences)
    drops_agree = recorded_drops(gate_dir) == sorted(dropped or [])
    return {
        "file": f"../{CONTRIBUTIONS_FILE}",
        "max_abs_coefficient_difference": largest,
        "statuses_agree": statuses_agree,
        "dropped_episodes_agree": drops_agree,
        "reproduced": largest <= _AGREEMENT and statuses_agree and drops_agree,
    }
