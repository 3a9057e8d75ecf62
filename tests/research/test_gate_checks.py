"""The gate's strict reading, bare preflight and pairing checks: every check has a case that fails
with a clear message. Bare records are the real testbed records of the research fixture's run;
masked records are made from them with a known treatment, so the fit recovers it exactly."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.manifest import build_manifest
from shopsimrl.records import to_plain
from shopsimrl.research.gate.checks import GateCheckError, bare_preflight, pair_observations, read_strict
from shopsimrl.research.gate.fit import fit_paired_delta_ols
from shopsimrl.research.gate.masks import Assignment, gate_a_assignments
from shopsimrl.schemas import EpisodeJob, fingerprint
from shopsimrl.storage.local import LocalRunStore, atomic_write_json
from shopsimrl.storage.reading import open_run
from tests.fakes import written

from .conftest import ResearchRuns

pytestmark = pytest.mark.slow

CHUNKS = ("c-one", "c-two")
EFFECTS = (0.125, -0.0625)  # exact in binary: the deltas are exact, so the fit is too


@pytest.fixture(scope="module")
def bare(research_runs: ResearchRuns) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run = open_run(research_runs.local)
    assert run.manifest is not None
    return run.manifest.plan.as_dict(), sorted((written(record) for record in run.records()), key=lambda r: r["episode_id"])


def assignments_for(plan: dict[str, Any]) -> list[Assignment]:
    return gate_a_assignments([EpisodeJob.from_dict(job) for job in plan["jobs"]], CHUNKS, 20260901)


def masked_records(plan: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each bare record as if its mask's chunks had been shown, with a known effect on every metric."""
    by_id = {record["episode_id"]: record for record in records}
    masked = []
    for assignment in assignments_for(plan):
        record = copy.deepcopy(by_id[assignment.job.episode_id])
        record["selected_skills"] = [
            {"skill_id": c, "content": c, "version": "1", "metadata": {}, "content_sha256": fingerprint(c)}
            for c in assignment.included
        ]
        record["provenance"]["skills"] = {"provider": "assigned_skills", "assignments_sha256": "x", "skills": 2, "episodes": 24}
        bump = sum(bit * effect for bit, effect in zip(assignment.mask, EFFECTS, strict=True))
        final = record["final"]
        final["reward"] += bump
        for key in final["reward_detail"]:
            if key.startswith("r_"):
                final["reward_detail"][key] += bump
        masked.append(record)
    return masked


def write_run(directory: Path, plan: dict[str, Any], records: list[dict[str, Any]], *, raw_tail: bytes = b"") -> Path:
    store = LocalRunStore(directory)
    atomic_write_json(store.manifest_path, to_plain(build_manifest(plan)))
    # json.dumps keeps a NaN as NaN, as the earlier implementation's writer did (this one writes null).
    lines = b"".join(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n" for record in records)
    store.traces_path.write_bytes(lines + raw_tail)
    return directory


def pair(
    tmp_path: Path, plan: dict[str, Any], bare_records: list[dict[str, Any]], masked: list[dict[str, Any]], **kw: Any
) -> Any:
    bare_read = read_strict(open_run(write_run(tmp_path / "bare", plan, bare_records)), "bare run")
    masked_read = read_strict(open_run(write_run(tmp_path / "masked", plan, masked)), "masked run")
    return pair_observations(
        assignments_for(plan), masked_read.observations, bare_read.observations, split="val", send_seed=kw.get("send_seed", True)
    )


def test_pairs_recover_a_known_effect_on_every_metric(tmp_path: Path, bare: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    plan, records = bare
    shuffled = list(reversed(masked_records(plan, records)))  # the order of the traces does not matter
    pairs = pair(tmp_path, plan, records, shuffled)
    assert len(pairs.rows) == 24 and {"reward", "r_strict", "r_success"} <= set(pairs.outcomes)
    for metric, values in pairs.outcomes.items():
        fit = fit_paired_delta_ols(pairs.masks, values)
        assert fit.coefficients == pytest.approx(EFFECTS, abs=1e-12), metric
    row = pairs.rows[0]
    assert row["delta_reward"] == pytest.approx(row["reward"] - row["bare_reward"], abs=1e-15)
    assert len({r["bare_reward"] for r in pairs.rows}) > 1  # the bare rewards vary by task


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(record: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = record
        for key in parents:
            target = target[key]
        target[last] = value

    return mutate


# One mutation of one record each; (side, mutation, the message it must give).
MUTATIONS: list[tuple[str, Any, str]] = [
    ("bare-missing", None, r"pair coverage mismatch: 24 assignments, 24 masked and 23 bare"),
    ("masked-task", _set("job.task_id", 999999), r"episode_id does not match its job"),
    ("masked-split", _set("job.split", "train"), r"job mismatch: the masked rollout ran .*'split': 'train'"),
    ("masked-seed", _set("job.seed", 12345), r"job mismatch: the masked rollout ran .*'seed': 12345"),
    ("masked-skills", _set("selected_skills", [{"skill_id": "c-three"}]), r"was shown \['c-three'\], its frozen mask assigns"),
    ("bare-skills", _set("provenance.skills", {"provider": "json_skillbank"}), r"the bare rollout carries skills"),
    ("masked-provenance", _set("provenance.prompt", {}), r"provenance must hold non-empty \['model', 'environment'"),
    (
        "masked-checkpoint",
        _set("provenance.model.checkpoint_id", "ckpt-2"),
        r"model mismatch between the masked and bare rollouts",
    ),
    ("masked-sampling", _set("provenance.model.sampling.temperature", 0.7), r"model mismatch .*sampling.temperature"),
    ("masked-prompt", _set("provenance.prompt.system_prompt_sha256", "0" * 64), r"prompt mismatch"),
    ("masked-environment", _set("provenance.environment.environment_version", "v9"), r"environment mismatch"),
    ("masked-runtime", _set("provenance.runtime.max_steps", 40), r"runtime mismatch"),
    ("masked-nan", _set("final.reward", math.nan), r"reward must be a finite number, got nan"),
    ("masked-bool", _set("final.reward_detail.r_success", True), r"r_success must be a finite number, got True"),
    ("masked-extra", _set("final.reward_detail.r_extra", 0.5), r"reward components differ"),
    ("masked-strict", _set("final.reward", 0.123456), r"reward 0.123456 differs from r_strict"),
    ("masked-detail", _set("final.reward_detail", {"r_strict": 0.0}), r"reward_detail must hold \['r_strict', 'r_success'\]"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_each_pairing_check_has_its_failing_case(
    tmp_path: Path, bare: tuple[dict[str, Any], list[dict[str, Any]]], case: str, mutate: Any, message: str
) -> None:
    plan, records = bare
    bare_records, masked = copy.deepcopy(records), masked_records(plan, records)
    target = (bare_records if case.startswith("bare") else masked)[5]
    if mutate is None:
        bare_records.remove(target)
    else:
        mutate(target)
    with pytest.raises(GateCheckError, match=message):
        pair(tmp_path, plan, bare_records, masked)


def test_a_seed_change_is_tolerated_when_seeds_are_not_sent_but_a_sample_change_is_not(
    tmp_path: Path, bare: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    plan, records = bare
    masked = masked_records(plan, records)
    masked[3]["job"]["seed"] += 1
    assert len(pair(tmp_path / "a", plan, records, masked, send_seed=False).rows) == 24
    masked[3]["job"]["sample_id"] = 1
    masked[3]["episode_id"] = EpisodeJob.from_dict(masked[3]["job"]).episode_id
    with pytest.raises(GateCheckError, match="pair coverage mismatch"):
        pair(tmp_path / "b", plan, records, masked, send_seed=False)


def test_a_mixed_protocol_across_pairs_is_refused(tmp_path: Path, bare: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    plan, records = bare
    bare_records, masked = copy.deepcopy(records), masked_records(plan, records)
    episode_id = masked[7]["episode_id"]
    for record in (r for r in [*bare_records, *masked] if r["episode_id"] == episode_id):  # one pair consistent in itself
        record["provenance"]["model"]["checkpoint_id"] = "ckpt-other"
    with pytest.raises(GateCheckError, match="another checkpoint or protocol"):
        pair(tmp_path, plan, bare_records, masked)


# --------------------------------------------------------------------------- strict reading


def test_strict_reading_of_attempts(tmp_path: Path, bare: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    plan, records = bare
    completed = records[0]
    failed = {**copy.deepcopy(completed), "status": "failed", "final": None, "failure_class": "infrastructure"}
    read = read_strict(open_run(write_run(tmp_path / "ok", plan, [failed, completed])), "run")
    assert list(read.observations) == [completed["episode_id"]] and not read.unfinished

    with pytest.raises(GateCheckError, match="has a duplicate completed record"):
        read_strict(open_run(write_run(tmp_path / "dup", plan, [completed, completed])), "run")
    with pytest.raises(GateCheckError, match="an attempt follows its completed record"):
        read_strict(open_run(write_run(tmp_path / "after", plan, [completed, failed])), "run")
    with pytest.raises(GateCheckError, match=r"1 line\(s\) are not trace records"):
        read_strict(open_run(write_run(tmp_path / "torn", plan, [completed], raw_tail=b"{not json\n")), "run")
    unfinished = read_strict(open_run(write_run(tmp_path / "failed", plan, [failed])), "run")
    assert unfinished.unfinished == {completed["episode_id"]: "infrastructure"}


# --------------------------------------------------------------------------- the bare preflight


def test_the_preflight_passes_a_real_bare_run_local_and_sharded(
    research_runs: ResearchRuns, s3_env: dict[str, str], bare: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    plan, _ = bare
    local = bare_preflight(open_run(research_runs.local), plan)
    sharded = bare_preflight(open_run(research_runs.sharded), plan)
    assert local.record["observations"] == 24 and len(local.observations) == 24
    # Two executions of one plan: the same outcomes, though not byte-identical records.
    assert local.record["mean_outcomes"] == sharded.record["mean_outcomes"]
    assert local.record["plan_fingerprint"] == sharded.record["plan_fingerprint"]
    assert sharded.record["run"] == research_runs.sharded.split("?")[0]
    assert local.record["mean_outcomes"]["reward"] == pytest.approx(
        sum(o.outcomes["reward"] for o in local.observations.values()) / 24
    )
    # Execution settings of the earlier implementation's plans are not compared.
    tolerant = copy.deepcopy(plan)
    tolerant["model"]["transport"] = {"timeout_seconds": 1}
    tolerant["runtime"]["concurrency"] = 64
    tolerant["task_split"]["source_path"] = "/elsewhere/splits.json"
    assert bare_preflight(open_run(research_runs.local), tolerant).frozen() == local.frozen()


@pytest.mark.parametrize("field", ["model", "runtime", "prompt", "environment", "task_split"])
def test_the_preflight_refuses_another_protocol(
    research_runs: ResearchRuns, bare: tuple[dict[str, Any], Any], field: str
) -> None:
    plan = copy.deepcopy(bare[0])
    plan[field]["changed"] = 1
    with pytest.raises(GateCheckError, match=rf"plan\.{field} mismatch with the gate's experiment config \({field}\.changed"):
        bare_preflight(open_run(research_runs.local), plan)


def test_the_preflight_refuses_other_jobs_a_missing_checkpoint_and_legacy_runs(
    research_runs: ResearchRuns, bare: tuple[dict[str, Any], Any]
) -> None:
    plan = copy.deepcopy(bare[0])
    plan["jobs"] = [{**job, "split": "train"} for job in plan["jobs"]]
    with pytest.raises(GateCheckError, match=r"job coverage mismatch: it plans 24 episodes, the gate 24, 0 in common"):
        bare_preflight(open_run(research_runs.local), plan)
    with pytest.raises(GateCheckError, match=r"the online gate needs model\.checkpoint_id"):
        bare_preflight(open_run(research_runs.local), bare[0], require_checkpoint=True)
    with pytest.raises(GateCheckError, match=r"has no manifest\.json"):
        bare_preflight(open_run(research_runs.legacy), bare[0])


def test_the_preflight_refuses_an_incomplete_an_equipped_or_a_torn_bare_run(
    tmp_path: Path, bare: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    plan, records = bare
    failed = [copy.deepcopy(r) for r in records]
    failed[2].update(status="failed", final=None, failure_class="model_error")
    with pytest.raises(GateCheckError, match=r"is incomplete: 1 episode\(s\) failed, 0 have no record"):
        bare_preflight(open_run(write_run(tmp_path / "failed", plan, failed)), plan)
    with pytest.raises(GateCheckError, match=r"0 episode\(s\) failed, 1 have no record"):
        bare_preflight(open_run(write_run(tmp_path / "missing", plan, records[1:])), plan)
    equipped_plan = {**plan, "skills": {"provider": "json_skillbank"}}
    with pytest.raises(GateCheckError, match=r"needs skills\.path: null"):
        bare_preflight(open_run(write_run(tmp_path / "equipped", equipped_plan, records)), equipped_plan)
    with pytest.raises(GateCheckError, match="not trace records"):
        bare_preflight(open_run(write_run(tmp_path / "torn", plan, records, raw_tail=b"garbage\n")), plan)
    skilled = [copy.deepcopy(r) for r in records]
    skilled[4]["selected_skills"] = [{"skill_id": "x"}]
    with pytest.raises(GateCheckError, match=r"is not bare: skills \['x'\]"):
        bare_preflight(open_run(write_run(tmp_path / "skilled", plan, skilled)), plan)
    versions = [copy.deepcopy(r) for r in records]
    versions[6]["provenance"]["environment"]["observation_version"] = "shopping-observation-v6"
    with pytest.raises(GateCheckError, match="mixes 2 environments"):
        bare_preflight(open_run(write_run(tmp_path / "versions", plan, versions)), plan)
    edited = write_run(tmp_path / "edited", plan, records)
    manifest = json.loads((edited / "manifest.json").read_text(encoding="utf-8"))
    manifest["plan"]["experiment"] = "edited"
    (edited / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(Exception, match="plan_fingerprint does not match"):
        bare_preflight(open_run(edited), plan)
