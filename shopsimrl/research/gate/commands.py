"""``shopsimrl gate plan | run | fit``: the skill gate from GATE.yaml to its selection.

- ``plan`` freezes the gate (masks, baseline, the masked experiment) in the gate directory,
  with ``--shards N --run URI`` also the sharded masked run at ``URI`` (an ordinary frozen plan:
  ``shopsimrl run masked_experiment.yaml --shards N --run URI``, ``worker`` or a Helm release run
  it, ``reduce`` merges it), and with ``--helm-values F`` the chart's values for that release;
- ``run`` plans, runs the masked rollouts in this process into the gate directory (resumable:
  run it again after an interruption or with failed episodes) and fits;
- ``fit`` reads the bare run and the masked run (wherever ``plan`` put it, or ``--masked-run``)
  and writes the outputs, offline, as often as wanted.

A gate whose masked rollouts are not all completed is ``incomplete``: its manifest says how many
failed or are missing, and no contribution or selection file is written (stale ones are removed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from shopsimrl.config import WorkerSettings
from shopsimrl.exitcodes import ExitCode
from shopsimrl.manifest import FingerprintMismatchError, plan_diff
from shopsimrl.research.gate.checks import GateCheckError, normalised, pair_observations, read_strict
from shopsimrl.research.gate.earlier import compare_with_earlier, is_earlier_gate, load_earlier_gate, recorded_drops
from shopsimrl.research.gate.fit import fit_paired_delta_ols
from shopsimrl.research.gate.freeze import (
    ESTIMATOR,
    FORMULA,
    MASKED_CONFIG_FILE,
    FrozenGate,
    GatePlanError,
    freeze,
    planned_location,
    read_gate_plan,
    write_frozen,
)
from shopsimrl.research.gate.outputs import contributions, remove_outputs, write_outputs
from shopsimrl.research.gate.spec import load_gate_spec
from shopsimrl.runner.local import run_local
from shopsimrl.schemas import fingerprint, redact_uri
from shopsimrl.storage.local import LocalRunStore, atomic_write_json
from shopsimrl.storage.reading import open_run
from shopsimrl.storage.sharded import ShardedRunStore

__all__ = ["GateResult", "PlanReport", "fit_gate", "plan_gate", "run_gate"]

GATE_A_MANIFEST_SCHEMA: Final = "shopsimrl-trace2skill-gate-a-v2"
ONLINE_MANIFEST_SCHEMA: Final = "shopsimrl-online-validation-gate-v2"


def _shown(location: str) -> str:
    return redact_uri(location) if "://" in location else location


def _relative(path: Path | str, start: Path) -> str:
    """A local path relative to the gate directory (portable, no absolute layout); URIs redacted."""
    text = str(path)
    return redact_uri(text) if "://" in text else os.path.relpath(text, start)


@dataclass
class PlanReport:
    gate_dir: Path
    masked_config: Path
    masked_run: str
    masked_plan_fingerprint: str
    episodes: int
    columns: list[str]
    included_counts: dict[str, int]
    baseline: dict[str, Any]
    shards: int | None
    helm_values: Path | None = None


@dataclass
class GateResult:
    status: str
    """``complete`` or ``incomplete``."""
    code: ExitCode
    gate_dir: Path
    manifest: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    """The contribution rows (complete gates)."""


def _check_masked_location(frozen: FrozenGate, location: str) -> None:
    """Refuse (exit 42) before anything is written when the masked location holds another plan."""
    if "://" in location or Path(location, "shards.json").exists():
        manifest = ShardedRunStore(location).read_manifest()
    else:
        manifest = LocalRunStore(location).read_manifest()
    if manifest is not None and manifest.plan_fingerprint != frozen.masked_fingerprint:
        raise FingerprintMismatchError(
            _shown(location),
            manifest.plan_fingerprint,
            frozen.masked_fingerprint,
            plan_diff(manifest.plan.as_dict(), frozen.masked_experiment.plan()),
        )


def _refuse_earlier(gate_dir: Path) -> None:
    if is_earlier_gate(gate_dir):
        raise GatePlanError(
            f"{gate_dir} holds rollouts or masks but no gate_plan.json: a gate of the earlier implementation "
            "(`shopsimrl gate fit` refits it into refit/) or another run; plan or run a new gate into another output_dir"
        )


def _included(frozen: FrozenGate) -> dict[str, int]:
    return {column: sum(a.mask[index] for a in frozen.assignments) for index, column in enumerate(frozen.columns)}


def plan_gate(
    gate_config: Path,
    *,
    shards: int | None = None,
    run: str | None = None,
    settings: WorkerSettings | None = None,
    helm_values: Path | None = None,
    failed_episodes: str | None = None,
    max_dropped_share: float | None = None,
) -> PlanReport:
    """Freeze the gate; with ``shards`` and ``run``, freeze the sharded masked run too, and with
    ``helm_values`` write the chart's values for it (config, split and assignments inline)."""
    from shopsimrl.planning import PlanError
    from shopsimrl.research.gate.helm import helm_values as values_for
    from shopsimrl.runner.worker import plan_run

    if (shards is None) != (run is None):
        raise GatePlanError("--shards and --run go together: a sharded masked run needs a location (a dir or s3://…)")
    if helm_values is not None and run is None:
        raise GatePlanError("--helm-values needs --shards N --run URI: a release runs a sharded masked run")
    if helm_values is not None and run is not None and "://" not in run:
        raise GatePlanError(
            f"--helm-values needs --run in object storage (s3://…), not {run}: the release's pods cannot reach a local directory"
        )
    spec = load_gate_spec(gate_config, failed_episodes=failed_episodes, max_dropped_share=max_dropped_share)
    _refuse_earlier(spec.gate_dir)
    frozen = freeze(spec, settings)
    location = run or str(spec.gate_dir)
    _check_masked_location(frozen, location)
    masked = write_frozen(frozen, location, shards)
    values_text = None if helm_values is None or shards is None else values_for(frozen, location, shards)
    if shards is not None:
        try:
            plan_run(masked, ShardedRunStore(location), shards)
        except PlanError as exc:
            raise GatePlanError(str(exc)) from None
    if helm_values is not None and values_text is not None:
        helm_values.parent.mkdir(parents=True, exist_ok=True)
        tmp = helm_values.with_name(f".{helm_values.name}.tmp")
        tmp.write_text(values_text, encoding="utf-8")
        os.replace(tmp, helm_values)
    return PlanReport(
        gate_dir=spec.gate_dir,
        masked_config=spec.gate_dir / MASKED_CONFIG_FILE,
        masked_run=_shown(location),
        masked_plan_fingerprint=frozen.masked_fingerprint,
        episodes=len(frozen.assignments),
        columns=frozen.columns,
        included_counts=_included(frozen),
        baseline=frozen.baseline.record,
        shards=shards,
        helm_values=helm_values,
    )


def run_gate(
    gate_config: Path,
    *,
    settings: WorkerSettings | None = None,
    show_progress: bool = True,
    announce: Callable[[str], None] = lambda line: None,
    failed_episodes: str | None = None,
    max_dropped_share: float | None = None,
) -> GateResult:
    """Plan, run the masked rollouts in this process (into the gate directory), fit. Raises
    :class:`~shopsimrl.runner.local.RunStopped` when the rollouts stop early (exit 3 to resume)."""
    spec = load_gate_spec(gate_config, failed_episodes=failed_episodes, max_dropped_share=max_dropped_share)
    _refuse_earlier(spec.gate_dir)
    frozen = freeze(spec, settings)
    location = str(spec.gate_dir)
    planned = read_gate_plan(spec.gate_dir)
    if planned is not None and planned_location(planned, spec.gate_dir) != location:
        raise GatePlanError(
            f"{spec.gate_dir} was planned with sharded masked rollouts at {planned.get('masked_run')}; run them with "
            f"`shopsimrl run {spec.gate_dir / MASKED_CONFIG_FILE} --shards {planned.get('shards')} --run URI` "
            "(or workers), then `shopsimrl gate fit`"
        )
    _check_masked_location(frozen, location)
    masked = write_frozen(frozen, location, None)
    masked.model().check_api_key()
    announce(f"gate {spec.name}: {len(frozen.assignments)} masked rollouts over {len(frozen.columns)} chunks → {spec.gate_dir}")
    run_local(masked, show_progress=show_progress, announce=announce)
    return _fit(frozen, location)


def fit_gate(
    gate_config: Path,
    *,
    masked_run: str | None = None,
    settings: WorkerSettings | None = None,
    failed_episodes: str | None = None,
    max_dropped_share: float | None = None,
) -> GateResult:
    """Fit from the bare run and the masked run, offline. A gate directory of the earlier
    implementation is refitted from its own files into ``refit/`` (see :mod:`.earlier`)."""
    spec = load_gate_spec(gate_config, failed_episodes=failed_episodes, max_dropped_share=max_dropped_share)
    if is_earlier_gate(spec.gate_dir):
        if recorded_drops(spec.gate_dir):
            # The earlier fit dropped failed pairs: the refit drops the same ones (checked below,
            # dropped_episodes_agree) whatever the policy, or it could never reproduce that fit.
            spec = replace(spec, failed_episodes="drop", max_dropped_share=1.0)
        earlier, location = load_earlier_gate(spec, masked_run)
        result = _fit(earlier, location)
        if result.status == "complete":
            result.manifest["earlier_fit"] = compare_with_earlier(
                spec.gate_dir, result.rows, result.manifest["summary"].get("dropped_episode_ids")
            )
            atomic_write_json(result.files["manifest"], result.manifest)
        return result
    frozen = freeze(spec, settings)
    planned = read_gate_plan(spec.gate_dir)
    if planned is not None and planned.get("masked_plan_fingerprint") != frozen.masked_fingerprint:
        raise GateCheckError(
            f"the gate's inputs changed since `gate plan` froze {spec.gate_dir} (masked plan {str(planned.get('masked_plan_fingerprint'))[:12]}…, "
            f"now {frozen.masked_fingerprint[:12]}…): the draft, the bare run, the mask seed or the experiment config; "
            "plan the gate again into another output_dir"
        )
    if masked_run is None and planned is None:
        raise GatePlanError(f"{spec.gate_dir} has no gate_plan.json: run `shopsimrl gate plan` or `gate run` first")
    location = masked_run if masked_run is not None else planned_location(planned, spec.gate_dir)  # type: ignore[arg-type]
    return _fit(frozen, location)


# --------------------------------------------------------------------------- the fit


def _observed_provenance(observations: Any) -> dict[str, list[Any]]:
    distinct: dict[str, dict[str, Any]] = {name: {} for name in ("model", "environment", "prompt", "runtime")}
    for observation in observations:
        for name, seen in distinct.items():
            value = normalised(name, observation.provenance[name])
            seen.setdefault(fingerprint(value), value)
    return {name: [seen[key] for key in sorted(seen)] for name, seen in distinct.items()}


def _manifest(frozen: FrozenGate, location: str, status: str, summary: dict[str, Any], observations: Any) -> dict[str, Any]:
    spec = frozen.spec
    gate_dir = spec.gate_dir
    protocol: dict[str, Any] = {
        "split": frozen.split,
        "masked_rollouts_per_task": 1,
        "reused_bare_rollouts_per_task": 1,
        "mask_seed": spec.mask_seed,
        "active_skill_budget": frozen.budget,
        "estimator": ESTIMATOR,
        "formula": FORMULA,
    }
    if frozen.draft is not None:
        protocol |= {"mask_probability": frozen.assignment_core["mask_probability"], "selection": "strictly_positive_top_k"}
        inputs: dict[str, Any] = {"draft_sha256": frozen.draft.sha256}
        if frozen.draft.snapshot_id is not None:
            inputs["skillbank_snapshot_id"] = frozen.draft.snapshot_id
    else:
        assert frozen.pool is not None
        protocol |= {
            "masking": "uniform_absent_or_one_version_per_logical_slot",
            "rewrite_treatment": "mutually_exclusive_absent_old_new",
            "selection": "replacement_winner_then_strictly_positive_top_k",
        }
        inputs = {"proposal_checkpoint": frozen.pool.pool.get("proposal_checkpoint"), "pool_sha256": frozen.pool.sha256}
    resolved: dict[str, Path | str | None] = {
        "output_dir": gate_dir,
        "experiment_config": spec.experiment_config,
        "bare_run_dir": spec.bare_run,
        "draft_path": spec.draft_path,
        "draft_skillbank_path": spec.draft_skillbank_path,
        "candidate_pool_path": spec.candidate_pool_path,
    }
    paths = {key: _relative(value, gate_dir) for key, value in resolved.items() if value is not None and key in (spec.raw or {})}
    return {
        "schema_version": GATE_A_MANIFEST_SCHEMA if frozen.draft is not None else ONLINE_MANIFEST_SCHEMA,
        "created_at": datetime.now(UTC).isoformat(),
        "status": status,
        "config": {**(spec.raw or {}), **paths, "gate_config": _relative(spec.source, gate_dir)},
        "protocol": protocol,
        "input": {
            **inputs,
            "assignment_sha256": frozen.assignment_sha256,
            "chunk_ids": frozen.columns,
            "task_ids": [a.job.task_id for a in frozen.assignments],
            "model": frozen.bare_plan["model"],
            "environment": frozen.bare_plan["environment"],
            "observed_provenance": _observed_provenance(observations),
            "bare_baseline": frozen.baseline.record,
        },
        "runs": {
            "bare": _relative(frozen.spec.bare_run, gate_dir),
            "masked": _relative(location, gate_dir),
            "masked_plan_fingerprint": frozen.masked_fingerprint,
        },
        "summary": summary,
        "output": None,
    }


def _fit(frozen: FrozenGate, location: str) -> GateResult:
    spec = frozen.spec
    run = open_run(location)
    if run.manifest is None or run.manifest.plan_fingerprint != frozen.masked_fingerprint:
        found = None if run.manifest is None else run.manifest.plan_fingerprint
        raise GateCheckError(
            f"the masked run at {run.location} is not this gate's masked plan (its fingerprint {found}, "
            f"the gate's {frozen.masked_fingerprint}); give the run that `gate plan` froze"
        )
    read = read_strict(run, "masked run")
    expected = {a.job.episode_id for a in frozen.assignments}
    extra = sorted((set(read.observations) | set(read.unfinished)) - expected)
    if extra:
        raise GateCheckError(f"masked run {run.location} holds {len(extra)} episode(s) without an assignment (e.g. {extra[:3]})")
    missing = sorted(expected - set(read.observations) - set(read.unfinished))
    failure_classes: dict[str, int] = {}
    for failure in read.unfinished.values():
        failure_classes[failure] = failure_classes.get(failure, 0) + 1
    summary = {
        "episodes": len(expected),
        "completed": len(read.observations),
        "failed": len(read.unfinished),
        "missing": len(missing),
        "failure_classes": failure_classes,
        "shard_states": dict(run.shard_states) or None,
    }
    manifest_path = spec.gate_dir / spec.manifest_name
    dropped: list[str] = []
    if spec.failed_episodes == "drop" and read.unfinished and not missing:
        # Only failures are dropped: a missing record is a run not yet finished, not an outcome.
        dropped = sorted(read.unfinished)
        share = len(dropped) / len(expected)
        summary |= {
            "requested_observations": len(expected),
            "dropped_observations": len(dropped),
            "dropped_episode_ids": dropped,
            "max_dropped_share": spec.max_dropped_share,
        }
        if share > spec.max_dropped_share:
            summary["dropped_share_exceeded"] = True
            dropped = []
    if (read.unfinished and not dropped) or missing:
        manifest = _manifest(frozen, location, "incomplete", summary, read.observations.values())
        removed = remove_outputs(spec.gate_dir)
        if removed:
            manifest["removed_stale_outputs"] = removed
        atomic_write_json(manifest_path, manifest)
        return GateResult("incomplete", ExitCode.EPISODES_FAILED, spec.gate_dir, manifest, {"manifest": manifest_path})
    if dropped:
        kept = [a for a in frozen.assignments if a.job.episode_id not in read.unfinished]
        kept_ids = {a.job.episode_id for a in kept}
        frozen = replace(frozen, assignments=kept)
        baseline = {key: value for key, value in frozen.baseline.observations.items() if key in kept_ids}
    else:
        baseline = dict(frozen.baseline.observations)
    pairs = pair_observations(frozen.assignments, read.observations, baseline, split=frozen.split, send_seed=frozen.send_seed)
    metrics = ["reward", *sorted(m for m in pairs.outcomes if m != "reward")]
    fits = {metric: fit_paired_delta_ols(pairs.masks, pairs.outcomes[metric]) for metric in metrics}
    document = contributions(frozen, pairs, fits)
    if spec.failed_episodes == "drop":
        document |= {
            "requested_observations": len(expected),
            "dropped_observations": len(dropped),
            "dropped_episode_ids": dropped,
        }
    manifest = _manifest(frozen, location, "complete", summary, read.observations.values())
    manifest["output"] = write_outputs(frozen, document)
    atomic_write_json(manifest_path, manifest)
    files = {name: spec.gate_dir / name for name in ("contributions.json", "contributions.csv", "selected_skillbank.json")}
    files |= {
        "selected_skill.md": spec.gate_dir / "selected_skill.md",
        "proposal_ledger.jsonl": spec.gate_dir / "proposal_ledger.jsonl",
        "mask_assignments.json": spec.gate_dir / "mask_assignments.json",
        "manifest": manifest_path,
    }
    return GateResult("complete", ExitCode.OK, spec.gate_dir, manifest, files, document["contributions"])


def format_plan(report: PlanReport) -> str:
    baseline = report.baseline
    lines = [
        f"gate dir        {report.gate_dir}",
        f"masked config   {report.masked_config}",
        f"masked run      {report.masked_run}" + (f" ({report.shards} shards, frozen)" if report.shards else ""),
        f"masked plan     {report.masked_plan_fingerprint}",
        f"episodes        {report.episodes} masked rollouts, paired with the bare run's",
        f"bare run        {baseline['run']}: {baseline['observations']} completed rollouts, reward mean "
        f"{baseline['mean_outcomes'].get('reward', 0.0):.4f}, checkpoint {baseline['checkpoint_id'] or '–'}",
        "columns (shown in how many rollouts):",
        *(f"  {column:<32} {count}" for column, count in report.included_counts.items()),
        "design          full rank (checked by fitting zeros)",
    ]
    if report.helm_values is not None:
        lines.append(
            f"helm values     {report.helm_values}  (helm install NAME helm/shopsimrl -f my-values.yaml -f {report.helm_values})"
        )
    if report.shards:
        lines.append(
            f"next: shopsimrl run {report.masked_config} --shards {report.shards} --run {report.masked_run}  "
            "(or workers / a Helm release with that config), then shopsimrl gate fit"
        )
    else:
        lines.append("next: shopsimrl gate run GATE.yaml  (runs the masked rollouts here, then fits)")
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:+.4f}"


def format_result(result: GateResult) -> str:
    manifest = result.manifest
    summary = manifest["summary"]
    lines = [
        f"gate {result.status}: {summary['completed']}/{summary['episodes']} masked rollouts completed, "
        f"{summary['failed']} failed, {summary['missing']} missing"
    ]
    if result.status == "complete" and summary.get("dropped_observations"):
        lines.append(
            f"dropped {summary['dropped_observations']}/{summary['requested_observations']} pairs whose masked episode failed "
            f"(failed_episodes: drop): {summary['dropped_episode_ids']}"
        )
    if result.rows:
        lines.append(f"{'chunk':<28} {'coef':>8} {'SE':>7} {'95% CI':>19} {'rank':>4}  status")
        for row in result.rows:
            name = row.get("chunk_id") or row.get("intervention_id")
            interval = "–" if row["ci_low"] is None else f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]"
            se = "–" if row["standard_error"] is None else f"{row['standard_error']:.4f}"
            lines.append(
                f"{name:<28} {_number(row['coefficient']):>8} {se:>7} {interval:>19} {row['rank'] or '–':>4}  {row['status']}"
            )
        lines.append(f"selected: {manifest['output']['selected_chunk_ids']}")
        earlier = manifest.get("earlier_fit")
        if earlier is not None:
            verdict = "reproduced" if earlier["reproduced"] else "NOT reproduced"
            lines.append(
                f"earlier fit ({earlier['file']}): {verdict}, largest coefficient difference "
                f"{earlier['max_abs_coefficient_difference']:.3g}, statuses {'agree' if earlier['statuses_agree'] else 'differ'}, "
                f"dropped episodes {'agree' if earlier['dropped_episodes_agree'] else 'differ'}"
            )
    elif summary.get("dropped_share_exceeded"):
        lines.append(
            f"no contributions or selection written: {summary['dropped_observations']}/{summary['requested_observations']} "
            f"pairs failed, a dropped share of {summary['dropped_observations'] / summary['requested_observations']:.4f} "
            f"over max_dropped_share {summary['max_dropped_share']}; rerun the failed masked rollouts, then fit again"
        )
    else:
        lines.append(
            "no contributions or selection written: rerun the failed or missing masked rollouts, then fit again "
            "(or, with failed_episodes: drop, fit without the failed pairs)"
        )
    for name, path in result.files.items():
        lines.append(f"{name + ':':<24} {path}")
    return "\n".join(lines)
