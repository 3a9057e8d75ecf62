"""What makes a gate's pairs comparable: strict reading, the bare preflight, the pairing checks.

Both runs are read strictly (:func:`read_strict`): a line that is not a record is an error (an
ordinary reader skips it), an episode with two completed records is an error (no tie-break among
completions), and in a local run an attempt written after an episode's completed record is an
error. Each completed record's outcomes are checked: ``reward_detail`` holds ``r_strict`` and
``r_success``, ``reward`` and every ``r_*`` are finite numbers (not booleans), and
``|reward − r_strict| ≤ 1e-12``.

Identities are compared after one normalisation (:func:`normalised`): the model without
``transport`` and ``base_url``, the environment without ``base_url``, the runtime without
``concurrency``, the split without ``source_path``. Where the model and the shop are reached
changes no outcome here (a sharded run points its pods at in-cluster URLs), so a masked run made
on a cluster pairs with a bare run made elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from shopsimrl.manifest import plan_diff
from shopsimrl.records import EpisodeTrace, to_plain
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.gate.masks import Assignment
from shopsimrl.schemas import EpisodeJob, TraceFormatError, fingerprint
from shopsimrl.storage.reading import Run

__all__ = [
    "Baseline",
    "GateCheckError",
    "Observation",
    "Pairs",
    "StrictRead",
    "bare_preflight",
    "job_key",
    "normalised",
    "pair_observations",
    "read_strict",
]

REQUIRED_COMPONENTS: Final = ("r_strict", "r_success")
PROVENANCE_FIELDS: Final = ("model", "environment", "prompt", "runtime", "skills")
PAIRED_FIELDS: Final = ("model", "environment", "prompt", "runtime")
PLAN_FIELDS: Final = ("model", "prompt", "runtime", "environment", "task_split")
BARE_SKILLS: Final = {"provider": "none"}
_DROPPED: Final = {
    "model": ("transport", "base_url"),
    "environment": ("base_url",),
    "runtime": ("concurrency",),
    "task_split": ("source_path",),
}


class GateCheckError(ValueError):
    """A run cannot be paired (exit 2); the message names the run, the episode and the check."""


def normalised(name: str, identity: Any) -> dict[str, Any]:
    """An identity block as the gate compares it (see the module docstring)."""
    if not isinstance(identity, Mapping):
        return {}
    return {key: value for key, value in identity.items() if key not in _DROPPED.get(name, ())}


def job_key(job: Mapping[str, Any], *, send_seed: bool) -> tuple[Any, ...]:
    """What pairs two rollouts: split, task, sample, and the seed when it is sent to the model."""
    fields = ("split", "task_id", "sample_id", "seed") if send_seed else ("split", "task_id", "sample_id")
    return tuple(job.get(name) for name in fields)


def _differences(name: str, left: Any, right: Any) -> str:
    lines = plan_diff({name: left, "jobs": []}, {name: right, "jobs": []})
    return "; ".join(lines[:3]) + (f"; … {len(lines) - 3} more" if len(lines) > 3 else "")


@dataclass
class Observation:
    """What the gate keeps of an episode's completed record."""

    episode_id: str
    job: dict[str, Any]
    skill_ids: list[str | None]
    provenance: dict[str, Any]
    outcomes: dict[str, float]
    """``reward`` and every ``r_*``."""
    digest: str
    """sha256 of the record's episode_id, job, provenance, selected_skills and final."""

    @property
    def bare(self) -> bool:
        return not self.skill_ids and self.provenance.get("skills") == BARE_SKILLS


@dataclass
class StrictRead:
    location: str
    observations: dict[str, Observation] = field(default_factory=dict)
    unfinished: dict[str, str] = field(default_factory=dict)
    """Episodes whose winning record is not completed → its failure class (or status)."""


def _outcomes(record: EpisodeTrace, final: dict[str, Any], where: str) -> dict[str, float]:
    # Checked on the values as stored: the typed reading takes a value of the wrong type for absent.
    detail = final.get("reward_detail")
    if not isinstance(detail, dict) or not set(REQUIRED_COMPONENTS) <= set(detail):
        raise GateCheckError(f"{where}: final.reward_detail must hold {list(REQUIRED_COMPONENTS)}")
    values = {"reward": final.get("reward"), **{k: v for k, v in detail.items() if isinstance(k, str) and k.startswith("r_")}}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise GateCheckError(f"{where}: {name} must be a finite number, got {value!r}")
    if abs(values["reward"] - values["r_strict"]) > 1e-12:
        raise GateCheckError(f"{where}: reward {values['reward']!r} differs from r_strict {values['r_strict']!r}")
    # Checked strictly above; the values themselves are read as every research tool reads them.
    row = episode_row(record)
    return {name: float(row[name]) for name in sorted(values)}


def _observe(record: EpisodeTrace, where: str) -> Observation:
    episode_id = record.episode_id
    job_written = to_plain(record.job)
    try:
        job = EpisodeJob.from_dict(job_written)
    except TraceFormatError as exc:
        raise GateCheckError(f"{where}: {exc}") from None
    if job.episode_id != episode_id:
        raise GateCheckError(f"{where}: episode_id does not match its job (task {job.task_id}, sample {job.sample_id})")
    provenance = record.provenance
    if any(not isinstance(provenance.get(f), dict) or not provenance[f] for f in PROVENANCE_FIELDS):
        raise GateCheckError(f"{where}: provenance must hold non-empty {list(PROVENANCE_FIELDS)} objects")
    if "selected_skills" not in record.model_fields_set:
        raise GateCheckError(f"{where}: selected_skills must be a list of objects")
    assert record.final is not None  # a completed record has one
    final = record.final.as_dict()
    return Observation(
        episode_id=episode_id,
        job=job.to_dict(),
        skill_ids=[skill.skill_id for skill in record.selected_skills],
        provenance={f: provenance[f] for f in PROVENANCE_FIELDS},
        outcomes=_outcomes(record, final, where),
        digest=fingerprint(
            {
                "episode_id": episode_id,
                "job": job_written,
                "provenance": provenance,
                "selected_skills": to_plain(record.selected_skills),
                "final": final,
            }
        ),
    )


def read_strict(run: Run, what: str) -> StrictRead:
    """Every record of ``run`` under the strict rules; ``what`` names the run in messages."""
    read = StrictRead(run.location)
    completed: set[str] = set()
    for is_winner, record in run.all_records():
        episode_id = record.episode_id
        where = f"{what} {run.location}: {episode_id}"
        if record.completed:
            if episode_id in completed:
                raise GateCheckError(f"{where} has a duplicate completed record (a gate pairs exactly one rollout per episode)")
            completed.add(episode_id)
        elif episode_id in completed and run.kind == "local":
            raise GateCheckError(f"{where}: an attempt follows its completed record")
        if not is_winner:
            continue
        if record.completed:
            read.observations[episode_id] = _observe(record, where)
        else:
            read.unfinished[episode_id] = record.failure_class or record.status
    if run.unreadable_lines:
        raise GateCheckError(
            f"{what} {run.location}: {run.unreadable_lines} line(s) are not trace records (torn or garbled); "
            "a gate reads its runs strictly"
        )
    return read


# --------------------------------------------------------------------------- the bare preflight


@dataclass
class Baseline:
    record: dict[str, Any]
    """``{run, plan_fingerprint, observations_sha256, observations, checkpoint_id, mean_outcomes}``."""
    observations: dict[str, Observation]

    def frozen(self) -> dict[str, Any]:
        """What enters the masked plan's fingerprint: the baseline minus where it was read from."""
        return {key: value for key, value in self.record.items() if key != "run"}


def _check_against_plan(observation: Observation, plan: Mapping[str, Any], where: str) -> None:
    provenance = observation.provenance
    for name in ("model", "prompt", "runtime"):
        if normalised(name, provenance[name]) != normalised(name, plan.get(name)):
            raise GateCheckError(
                f"{where}: provenance.{name} differs from the run's plan: "
                f"{_differences(name, normalised(name, plan.get(name)), normalised(name, provenance[name]))}"
            )
    observed = provenance["environment"]
    for key, value in (plan.get("environment") or {}).items():
        seen_key = {
            "expected_environment_version": "environment_version",
            "expected_observation_version": "observation_version",
        }.get(key, key)
        if observed.get(seen_key) != value:
            raise GateCheckError(
                f"{where}: provenance.environment.{seen_key} is {observed.get(seen_key)!r}, the run's plan says {value!r}"
            )


def bare_preflight(run: Run, expected_plan: Mapping[str, Any], *, require_checkpoint: bool = False) -> Baseline:
    """Check that ``run`` is a complete, strictly readable bare run of ``expected_plan``'s jobs made
    with the same model, prompt, runtime, environment and split; return its baseline. Runs before
    any rollout of the gate."""
    where = f"bare run {run.location}"
    checkpoint = (expected_plan.get("model") or {}).get("checkpoint_id")
    if require_checkpoint and not checkpoint:
        raise GateCheckError(
            "the online gate needs model.checkpoint_id in the experiment config: it names the frozen weights the "
            "bare and masked rollouts both come from"
        )
    manifest = run.manifest
    if manifest is None:
        raise GateCheckError(f"{where} has no manifest.json; run the bare val run with `shopsimrl run` first")
    plan = manifest.plan.as_dict()
    if manifest.plan_fingerprint != fingerprint(plan):
        raise GateCheckError(f"{where}: manifest plan_fingerprint does not match its plan")
    if plan.get("skills") != BARE_SKILLS:
        raise GateCheckError(f"{where} was made with skills {plan.get('skills')!r}; the bare run needs skills.path: null")
    for name in PLAN_FIELDS:
        left, right = normalised(name, plan.get(name)), normalised(name, expected_plan.get(name))
        if left != right:
            raise GateCheckError(
                f"{where}: plan.{name} mismatch with the gate's experiment config "
                f"({_differences(name, left, right)}); use the same checkpoint and evaluation protocol"
            )
    send_seed = bool(((expected_plan.get("model") or {}).get("sampling") or {}).get("send_seed", True))
    expected = {job_key(job, send_seed=send_seed) for job in expected_plan["jobs"]}
    planned = [job_key(job, send_seed=send_seed) for job in plan.get("jobs", []) if isinstance(job, dict)]
    if len(planned) != len(set(planned)) or set(planned) != expected:
        raise GateCheckError(
            f"{where}: job coverage mismatch: it plans {len(set(planned))} episodes, the gate {len(expected)}, "
            f"{len(set(planned) & expected)} in common (split, task, sample{', seed' if send_seed else ''})"
        )

    read = read_strict(run, "bare run")
    expected_ids = {EpisodeJob.from_dict(job).episode_id for job in expected_plan["jobs"]}
    missing = sorted(expected_ids - set(read.observations) - set(read.unfinished))
    if read.unfinished or missing:
        shown = sorted(read.unfinished)[:3] + missing[:3]
        raise GateCheckError(
            f"{where} is incomplete: {len(read.unfinished)} episode(s) failed, {len(missing)} have no record "
            f"(e.g. {shown}); complete the bare val run first (rerun `shopsimrl run` on it)"
        )
    extra = sorted(set(read.observations) - expected_ids)
    if extra:
        raise GateCheckError(f"{where} holds {len(extra)} episode(s) outside its plan (e.g. {extra[:3]})")
    components: set[str] | None = None
    environments: dict[str, dict[str, Any]] = {}
    for episode_id in sorted(read.observations):
        observation = read.observations[episode_id]
        at = f"{where}: {episode_id}"
        if job_key(observation.job, send_seed=send_seed) not in expected:
            raise GateCheckError(f"{at}: its job {observation.job} is not one the gate plans")
        if not observation.bare:
            raise GateCheckError(f"{at} is not bare: skills {observation.skill_ids} from {observation.provenance['skills']}")
        _check_against_plan(observation, plan, at)
        if components is None:
            components = set(observation.outcomes)
        elif set(observation.outcomes) != components:
            raise GateCheckError(f"{at}: reward components {sorted(observation.outcomes)} differ from {sorted(components)}")
        environment = normalised("environment", observation.provenance["environment"])
        environments.setdefault(fingerprint(environment), environment)
    if len(environments) > 1:
        first, second = list(environments.values())[:2]
        raise GateCheckError(f"{where} mixes {len(environments)} environments (e.g. {first} and {second}); a gate needs one")

    metrics = sorted(components or ())
    count = len(read.observations)
    record = {
        "run": run.location,
        "plan_fingerprint": manifest.plan_fingerprint,
        "observations_sha256": fingerprint(sorted([eid, o.digest] for eid, o in read.observations.items())),
        "observations": count,
        "checkpoint_id": checkpoint,
        # fsum: exact, so the same outcomes give the same means in any reading order (they enter the masked plan).
        "mean_outcomes": {m: math.fsum(o.outcomes[m] for o in read.observations.values()) / count for m in metrics},
    }
    return Baseline(record, read.observations)


# --------------------------------------------------------------------------- the pairing checks


@dataclass
class Pairs:
    masks: list[list[int]]
    outcomes: dict[str, list[float]]
    """Per metric, the deltas ``R_i − B_i`` in assignment order."""
    rows: list[dict[str, Any]]


def pair_observations(
    assignments: Iterable[Assignment],
    masked: Mapping[str, Observation],
    bare: Mapping[str, Observation],
    *,
    split: str,
    send_seed: bool,
) -> Pairs:
    """Pair every assignment's masked rollout with the same episode's bare rollout, with every
    check of the earlier implementation; the masked run must be complete."""
    assignments = list(assignments)
    expected = [a.job.episode_id for a in assignments]
    if len(set(expected)) != len(expected) or set(masked) != set(expected) or set(bare) != set(expected):
        raise GateCheckError(
            f"pair coverage mismatch: {len(expected)} assignments, {len(masked)} masked and {len(bare)} bare rollouts "
            f"(masked without assignment: {sorted(set(masked) - set(expected))[:3]}, "
            f"bare without assignment: {sorted(set(bare) - set(expected))[:3]})"
        )
    pairs = Pairs([], {}, [])
    signature: str | None = None
    for assignment in assignments:
        episode_id = assignment.job.episode_id
        treated, control = masked[episode_id], bare[episode_id]
        if not control.bare:
            raise GateCheckError(f"{episode_id}: the bare rollout carries skills {control.skill_ids}")
        for name in PAIRED_FIELDS:
            left, right = normalised(name, treated.provenance[name]), normalised(name, control.provenance[name])
            if left != right:
                raise GateCheckError(
                    f"{episode_id}: {name} mismatch between the masked and bare rollouts ({_differences(name, right, left)})"
                )
        current = fingerprint({name: normalised(name, control.provenance[name]) for name in PAIRED_FIELDS})
        if signature is not None and current != signature:
            raise GateCheckError(f"{episode_id}: its pair was made with another checkpoint or protocol than the pairs before it")
        signature = current
        wanted = job_key(assignment.job.to_dict(), send_seed=send_seed)
        for role, observation in (("masked", treated), ("bare", control)):
            if observation.job.get("split") != split or job_key(observation.job, send_seed=send_seed) != wanted:
                raise GateCheckError(
                    f"{episode_id}: job mismatch: the {role} rollout ran {observation.job}, the gate assigned {wanted}"
                )
        if treated.skill_ids != list(assignment.included):
            raise GateCheckError(
                f"{episode_id}: the masked rollout was shown {treated.skill_ids}, its frozen mask assigns {list(assignment.included)}"
            )
        if set(treated.outcomes) != set(control.outcomes) or (pairs.outcomes and set(treated.outcomes) != set(pairs.outcomes)):
            raise GateCheckError(
                f"{episode_id}: reward components differ (masked {sorted(treated.outcomes)}, bare {sorted(control.outcomes)})"
            )
        delta = {name: treated.outcomes[name] - control.outcomes[name] for name in treated.outcomes}
        for name, value in delta.items():
            pairs.outcomes.setdefault(name, []).append(value)
        pairs.masks.append(list(assignment.mask))
        pairs.rows.append(
            {
                "episode_id": episode_id,
                "split": assignment.job.split,
                "task_id": assignment.job.task_id,
                "sample_id": assignment.job.sample_id,
                "mask": list(assignment.mask),
                "included_chunk_ids": list(assignment.included),
                "reward": treated.outcomes["reward"],
                "bare_reward": control.outcomes["reward"],
                "delta_reward": delta["reward"],
                "reward_detail": {k: v for k, v in treated.outcomes.items() if k != "reward"},
                "bare_reward_detail": {k: v for k, v in control.outcomes.items() if k != "reward"},
                "delta_reward_detail": {k: v for k, v in delta.items() if k != "reward"},
            }
        )
    return pairs
