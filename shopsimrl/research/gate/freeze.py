"""The frozen gate: masks, the bare baseline, and the masked rollouts as an ordinary run.

:func:`freeze` derives everything from GATE.yaml and the bare run, deterministically, and checks it
before any rollout: the experiment is a bare val experiment with one sample per task, the mask
design has full rank (the fit on zeros), and the bare run passes the preflight. The masked
rollouts are then an ordinary experiment, written into the gate directory:

``skill_assignments.json``
    the skill assignment file (``shopsimrl-skill-assignments-v1``, read by
    :class:`shopsimrl.skills.AssignedSkills`): the chunks in column order, each episode's
    included chunk ids, and the gate's protocol (mask seed, draft or pool digest, the bare
    baseline's digest). Its sha256 is the masked plan's skill identity, so a changed mask, chunk
    or bare run changes the plan fingerprint and a masked run of the old one is never resumed.
``masked_experiment.yaml``
    the bare run's experiment config with ``skills.path: skill_assignments.json``, named after the
    gate directory and writing its run into it (relative paths rewritten to stay valid). ``shopsimrl
    run``, ``run --shards``, ``worker`` and the Helm chart run it like any config.
``mask_assignments.json``
    the earlier implementation's record of the masks (``shopsimrl-chunk-mask-assignments-v1`` or
    ``shopsimrl-online-skill-assignments-v1``).
``gate_plan.json``
    where the masked rollouts are (the gate directory, or the ``--run`` location of a sharded run)
    and the masked plan's fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import yaml

from shopsimrl.config import ConfigError, ExperimentConfig, SkillsSection, WorkerSettings, load_experiment_config, safe_name
from shopsimrl.research.gate.checks import Baseline, bare_preflight
from shopsimrl.research.gate.drafts import Chunk, GateADraft, OnlinePool, load_candidate_pool, load_gate_a_draft
from shopsimrl.research.gate.fit import check_design
from shopsimrl.research.gate.masks import MASK_PROBABILITY, Assignment, gate_a_assignments, online_assignments
from shopsimrl.research.gate.spec import GateSpec
from shopsimrl.runner.experiment import PreparedExperiment, prepare
from shopsimrl.schemas import fingerprint, read_json_file, redact_uri
from shopsimrl.skills import ASSIGNMENTS_SCHEMA_VERSION, AssignedSkills
from shopsimrl.storage.local import atomic_write_json
from shopsimrl.storage.reading import open_run

__all__ = [
    "ASSIGNMENTS_FILE",
    "ESTIMATOR",
    "FORMULA",
    "GATE_PLAN_FILE",
    "MASKED_CONFIG_FILE",
    "FrozenGate",
    "GatePlanError",
    "freeze",
    "planned_location",
    "read_gate_plan",
    "recorded_location",
    "write_frozen",
]

ESTIMATOR: Final = "paired_delta_ols_main_effects_no_intercept"
FORMULA: Final = "R_i - B_i = C_i^T beta + epsilon_i"
ASSIGNMENTS_FILE: Final = "skill_assignments.json"
MASKED_CONFIG_FILE: Final = "masked_experiment.yaml"
MASK_ASSIGNMENTS_FILE: Final = "mask_assignments.json"
GATE_PLAN_FILE: Final = "gate_plan.json"
GATE_PLAN_SCHEMA_VERSION: Final = "shopsimrl-gate-plan-v1"
GATE_A_ASSIGNMENT_SCHEMA: Final = "shopsimrl-chunk-mask-assignments-v1"
ONLINE_ASSIGNMENT_SCHEMA: Final = "shopsimrl-online-skill-assignments-v1"
_PATH_KEYS: Final = (("tasks", "split_file"), ("prompt", "system_prompt_file"), ("experiment", "dotenv"))


class GatePlanError(ValueError):
    """The gate cannot be planned as configured (exit 2)."""


def _now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class FrozenGate:
    spec: GateSpec
    config: ExperimentConfig | None
    """The bare run's experiment config (with the SHOPSIMRL_* overrides applied); None for a gate
    directory of the earlier implementation, which is fitted from its own files."""
    bare_plan: dict[str, Any]
    chunks: list[Chunk]
    """The columns, in order."""
    assignments: list[Assignment]
    baseline: Baseline
    budget: int
    draft: GateADraft | None
    pool: OnlinePool | None
    assignment_core: dict[str, Any]
    """``mask_assignments.json`` without ``schema_version``, ``created_at`` and its own digest."""
    skill_document: dict[str, Any]
    masked: PreparedExperiment | None
    """The masked experiment, as ``masked_experiment.yaml`` prepares it (None: an earlier gate)."""
    settings: WorkerSettings
    recorded_masked_fingerprint: str | None = None
    """An earlier gate's masked run: the plan fingerprint its manifest records (its plan is not ours to rebuild)."""

    @property
    def columns(self) -> list[str]:
        return [chunk.chunk_id for chunk in self.chunks]

    @property
    def assignment_sha256(self) -> str:
        return fingerprint(self.assignment_core)

    @property
    def split(self) -> str:
        return str(self.bare_plan["task_split"]["name"])

    @property
    def send_seed(self) -> bool:
        return bool(self.bare_plan["model"]["sampling"].get("send_seed", True))

    @property
    def masked_fingerprint(self) -> str:
        if self.recorded_masked_fingerprint is not None:
            return self.recorded_masked_fingerprint
        return fingerprint(self.masked_experiment.plan())

    @property
    def masked_experiment(self) -> PreparedExperiment:
        if self.masked is None:
            raise GatePlanError(
                f"{self.spec.gate_dir} is a gate of the earlier implementation: it can be fitted, not planned or run"
            )
        return self.masked

    @property
    def experiment(self) -> ExperimentConfig:
        if self.config is None:
            raise GatePlanError(
                f"{self.spec.gate_dir} is a gate of the earlier implementation: it can be fitted, not planned or run"
            )
        return self.config


def _bare_experiment(spec: GateSpec, settings: WorkerSettings) -> tuple[ExperimentConfig, PreparedExperiment]:
    try:
        config = load_experiment_config(spec.experiment_config).with_overrides(settings)
    except ConfigError as exc:
        raise GatePlanError(str(exc)) from None
    where = f"the gate's experiment config {spec.experiment_config}"
    if config.skills.path is not None:
        raise GatePlanError(f"{where} must be the bare run's: skills.path: null (the gate injects the chunks itself)")
    if config.tasks.repeats != 1:
        raise GatePlanError(f"{where}: tasks.repeats must be 1 (one bare and one masked rollout per task)")
    try:
        prepared = prepare(config)
    except ValueError as exc:  # split, plan, prompt and model settings errors are all ValueErrors
        raise GatePlanError(str(exc)) from None
    split = prepared.split
    if not (split.role == "val" or (split.role is None and split.name == "val")):
        raise GatePlanError(f"{where}: split {split.name!r} has role {split.role!r}; a gate selects skills on a val split")
    return config, prepared


def freeze(spec: GateSpec, settings: WorkerSettings | None = None) -> FrozenGate:
    """Everything the gate freezes, checked, without writing anything or calling a service."""
    gate_dir = spec.gate_dir
    if safe_name(gate_dir.name) != gate_dir.name:
        raise GatePlanError(
            f"output_dir {gate_dir}: its last segment must be a plain name ([A-Za-z0-9._-]); it names the masked run"
        )
    settings = settings or WorkerSettings()
    config, bare = _bare_experiment(spec, settings)
    draft = pool = None
    if spec.kind == "gate_a":
        assert spec.draft_path is not None and spec.draft_skillbank_path is not None
        draft = load_gate_a_draft(spec.draft_path, spec.draft_skillbank_path, spec.active_skill_budget)
        chunks, budget = draft.chunks, draft.budget
        assignments = gate_a_assignments(bare.jobs, draft.chunk_ids, spec.mask_seed)
        core: dict[str, Any] = {
            "mask_seed": spec.mask_seed,
            "mask_probability": MASK_PROBABILITY,
            "draft_sha256": draft.sha256,
            "chunk_ids": draft.chunk_ids,
            "assignments": [a.to_dict() for a in assignments],
        }
    else:
        assert spec.candidate_pool_path is not None and spec.active_skill_budget is not None
        pool = load_candidate_pool(spec.candidate_pool_path)
        chunks, budget = pool.chunks, spec.active_skill_budget
        assignments = online_assignments(bare.jobs, pool.slots, spec.mask_seed)
        core = {
            "mask_seed": spec.mask_seed,
            "pool_sha256": pool.sha256,
            "columns": pool.columns,
            "slots": [
                {"slot_id": s.slot_id, "old_version_id": s.old_version_id, "versions": list(s.versions)} for s in pool.slots
            ],
            "assignments": [a.to_dict() for a in assignments],
        }
    check_design([list(a.mask) for a in assignments])  # before any rollout, and before reading the bare run
    baseline = bare_preflight(open_run(spec.bare_run), bare.plan(), require_checkpoint=spec.kind == "online")
    if "://" not in spec.bare_run:  # recorded relative to the gate directory: no absolute layout in its files
        baseline.record["run"] = os.path.relpath(spec.bare_run, gate_dir)
    protocol = {
        "gate": "A" if spec.kind == "gate_a" else "online",
        "estimator": ESTIMATOR,
        "mask_seed": spec.mask_seed,
        "assignment_sha256": fingerprint(core),
        "active_skill_budget": budget,
        "bare_baseline": baseline.frozen(),
        **({"draft_sha256": draft.sha256, "mask_probability": MASK_PROBABILITY} if draft else {}),
        **({"skillbank_snapshot_id": draft.snapshot_id} if draft and draft.snapshot_id else {}),
        **({"pool_sha256": pool.sha256, "rewrite_treatment": "mutually_exclusive_absent_old_new"} if pool else {}),
    }
    skill_document = {
        "schema_version": ASSIGNMENTS_SCHEMA_VERSION,
        "skills": [chunk.bank_record() for chunk in chunks],
        "assignments": [
            {"split": a.job.split, "task_id": a.job.task_id, "sample_id": a.job.sample_id, "skill_ids": list(a.included)}
            for a in assignments
        ],
        "protocol": protocol,
    }
    masked_config = config.model_copy(
        update={
            "experiment": config.experiment.model_copy(update={"name": gate_dir.name, "output_dir": str(gate_dir.parent)}),
            "skills": SkillsSection(path=str(gate_dir / ASSIGNMENTS_FILE)),
        }
    )
    masked = dataclasses.replace(
        bare, config=masked_config, skills=AssignedSkills(gate_dir / ASSIGNMENTS_FILE, skill_document), _plan=None
    )
    return FrozenGate(
        spec, config, bare.plan(), chunks, assignments, baseline, budget, draft, pool, core, skill_document, masked, settings
    )


# --------------------------------------------------------------------------- the gate directory


def _masked_config_text(spec: GateSpec) -> str:
    """The bare experiment's YAML, rewritten to run the masked rollouts from the gate directory."""
    source = spec.experiment_config
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    gate_dir = spec.gate_dir
    for section, key in _PATH_KEYS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str):
            path = Path(os.path.expanduser(value))
            resolved = path if path.is_absolute() else (source.resolve().parent / path).resolve()
            data[section][key] = os.path.relpath(resolved, gate_dir)
    experiment = data.setdefault("experiment", {})
    experiment["name"] = gate_dir.name
    experiment["output_dir"] = ".."
    data["skills"] = {"path": ASSIGNMENTS_FILE}
    head = (
        f"# The masked rollouts of the skill gate {spec.source.name} (written by `shopsimrl gate plan`; do not edit):\n"
        f"# {source.name} with skills.path set to the frozen mask assignments. Runs like any config:\n"
        f"#   shopsimrl run {MASKED_CONFIG_FILE}   |   shopsimrl run {MASKED_CONFIG_FILE} --shards N --run URI\n"
    )
    return head + yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def _write_text(path: Path, text: str) -> None:
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def recorded_location(location: str, gate_dir: Path) -> str:
    """How ``gate_plan.json`` records the masked run: ``.`` for the gate directory itself (so the
    directory can move), a URI without credentials otherwise."""
    return "." if location == str(gate_dir) else redact_uri(location)


def planned_location(plan: dict[str, Any], gate_dir: Path) -> str:
    """The masked run ``gate_plan.json`` records, as ``open_run`` takes it."""
    recorded = str(plan.get("masked_run"))
    return str(gate_dir) if recorded == "." else recorded


def read_gate_plan(gate_dir: Path) -> dict[str, Any] | None:
    path = gate_dir / GATE_PLAN_FILE
    if not path.is_file():
        return None
    plan = read_json_file(path, "the gate plan", GatePlanError)
    if not isinstance(plan, dict) or plan.get("schema_version") != GATE_PLAN_SCHEMA_VERSION:
        raise GatePlanError(f"{path}: not a {GATE_PLAN_SCHEMA_VERSION} document")
    return plan


def write_frozen(frozen: FrozenGate, masked_run: str, shards: int | None) -> PreparedExperiment:
    """Write the gate directory's frozen files for masked rollouts at ``masked_run`` (the gate
    directory itself, or a sharded run location); returns the masked experiment as
    ``masked_experiment.yaml`` prepares it (what a worker will run)."""
    spec = frozen.spec
    gate_dir = spec.gate_dir
    existing = read_gate_plan(gate_dir)
    recorded = recorded_location(masked_run, gate_dir)
    if existing is not None and existing.get("masked_run") != recorded:
        raise GatePlanError(
            f"{gate_dir} was planned with its masked rollouts at {existing.get('masked_run')}, not {recorded}; "
            "use another output_dir for another location"
        )
    gate_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(gate_dir / ASSIGNMENTS_FILE, frozen.skill_document)
    _write_text(gate_dir / MASKED_CONFIG_FILE, _masked_config_text(spec))
    schema = GATE_A_ASSIGNMENT_SCHEMA if spec.kind == "gate_a" else ONLINE_ASSIGNMENT_SCHEMA
    current = gate_dir / MASK_ASSIGNMENTS_FILE
    if not (
        current.is_file() and json.loads(current.read_text(encoding="utf-8")).get("assignment_sha256") == frozen.assignment_sha256
    ):
        atomic_write_json(
            current,
            {
                "schema_version": schema,
                "created_at": _now(),
                **frozen.assignment_core,
                "assignment_sha256": frozen.assignment_sha256,
            },
        )
    try:
        written = prepare(load_experiment_config(gate_dir / MASKED_CONFIG_FILE).with_overrides(frozen.settings))
    except ValueError as exc:
        raise GatePlanError(f"{gate_dir / MASKED_CONFIG_FILE}: {exc}") from None
    if fingerprint(written.plan()) != frozen.masked_fingerprint:
        raise GatePlanError(f"{gate_dir / MASKED_CONFIG_FILE} does not reproduce the gate's masked plan")  # a writer bug
    plan = {
        "schema_version": GATE_PLAN_SCHEMA_VERSION,
        "created_at": (existing or {}).get("created_at") or _now(),
        "gate": spec.kind,
        "name": spec.name,
        "gate_config": str(spec.source),
        "masked_run": recorded,
        "shards": shards,
        "masked_plan_fingerprint": frozen.masked_fingerprint,
        "assignment_sha256": frozen.assignment_sha256,
        "bare_run": frozen.baseline.record["run"],  # relative to the gate directory, or a redacted URI
        "bare_observations_sha256": frozen.baseline.record["observations_sha256"],
        "columns": frozen.columns,
    }
    atomic_write_json(gate_dir / GATE_PLAN_FILE, plan)
    return written
