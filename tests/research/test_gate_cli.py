"""`shopsimrl gate plan | run | fit` on the research fixture's bare run (24 val tasks, local and on
moto S3): what is checked before any rollout, bad input as one line with exit 2, an incomplete gate
and its resume, and the online gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from shopsimrl.schemas import fingerprint
from tests.sharded.conftest import cli
from tests.testbed_process import LocalTestbed, start_testbed

from .conftest import ResearchRuns

pytestmark = pytest.mark.slow


def research_config(runs: ResearchRuns) -> Path:
    """The experiment config the fixture's bare run was made with (tests/sharded/conftest.write_config)."""
    path = runs.local.parent.parent / "research-0.0.yaml"
    assert path.is_file()
    return path


def write_draft(directory: Path, chunks: dict[str, str], *, budget: int = 1, draft_only: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    draft = {
        "schema_version": "shopsimrl-initial-skill-draft-v2",
        "skill_title": "test skill",
        "active_skill_budget": budget,
        "chunks": [{"chunk_id": chunk_id, "order": i + 1, "title": chunk_id} for i, chunk_id in enumerate(chunks)],
    }
    bank = {
        "schema_version": "shopsimrl-skillbank-v1",
        "skills": [{"skill_id": c, "content": text, "metadata": {"draft_only": draft_only}} for c, text in chunks.items()],
    }
    (directory / "initial_skill_draft.json").write_text(json.dumps(draft, ensure_ascii=False), encoding="utf-8")
    (directory / "initial_skillbank.json").write_text(json.dumps(bank, ensure_ascii=False), encoding="utf-8")
    return directory / "initial_skill_draft.json"


CHUNKS = {"options": "选规格时对照用户要求。[[testbed:choose-options]]", "quiet": "每轮只调用一个工具。"}


def write_gate(path: Path, **section: Any) -> Path:
    path.write_text(yaml.safe_dump({"gate_a": section}, allow_unicode=True), encoding="utf-8")
    return path


def gate(*args: str, env: dict[str, str] | None = None) -> Any:
    return cli("gate", *args, env=env, timeout=300)


def assert_bad_input(result: Any, message: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.fixture
def basic(tmp_path: Path, research_runs: ResearchRuns) -> dict[str, Any]:
    return {
        "output_dir": str(tmp_path / "gate"),
        "experiment_config": str(research_config(research_runs)),
        "bare_run_dir": str(research_runs.local),
        "draft_path": str(write_draft(tmp_path / "draft", CHUNKS)),
    }


def test_plan_checks_the_bare_run_and_the_design_and_starts_no_rollout(
    tmp_path: Path, basic: dict[str, Any], research_runs: ResearchRuns
) -> None:
    planned = gate("plan", str(write_gate(tmp_path / "gate.yaml", **basic)))
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "full rank" in planned.stdout and "24 completed rollouts" in planned.stdout
    gate_dir = tmp_path / "gate"
    assert sorted(p.name for p in gate_dir.iterdir()) == [
        "gate_plan.json",
        "mask_assignments.json",
        "masked_experiment.yaml",
        "skill_assignments.json",
    ]
    skills = json.loads((gate_dir / "skill_assignments.json").read_text(encoding="utf-8"))
    assert [s["skill_id"] for s in skills["skills"]] == list(CHUNKS)
    assert skills["protocol"]["bare_baseline"]["observations"] == 24 and "run" not in skills["protocol"]["bare_baseline"]
    masked = yaml.safe_load((gate_dir / "masked_experiment.yaml").read_text(encoding="utf-8"))
    assert masked["skills"] == {"path": "skill_assignments.json"} and masked["experiment"]["name"] == "gate"
    # The ordinary `plan` reads the masked experiment like any config, with the same fingerprint.
    shown = cli("plan", str(gate_dir / "masked_experiment.yaml"), "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    gate_plan = json.loads((gate_dir / "gate_plan.json").read_text(encoding="utf-8"))
    assert (
        report["plan_fingerprint"] == gate_plan["masked_plan_fingerprint"] and report["skills"]["provider"] == "assigned_skills"
    )
    assert report["run_dir"] == str(gate_dir)


def test_plan_reads_a_sharded_bare_run_on_s3(tmp_path: Path, basic: dict[str, Any], research_runs: ResearchRuns) -> None:
    import os

    env = {**os.environ, **research_runs.env}
    planned = gate("plan", str(write_gate(tmp_path / "gate.yaml", **{**basic, "bare_run_dir": research_runs.sharded})), env=env)
    assert planned.returncode == 0, planned.stderr[-2000:]
    manifest_free = json.loads((tmp_path / "gate" / "gate_plan.json").read_text(encoding="utf-8"))
    assert manifest_free["bare_run"].startswith("s3://") and "testing-secret" not in json.dumps(manifest_free)


def test_bad_input_is_one_line_with_exit_2_before_any_rollout(
    tmp_path: Path, basic: dict[str, Any], research_runs: ResearchRuns
) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"bare_run_dir": str(tmp_path / "nowhere")}, "does not exist"),
        ({"bare_run_dir": str(research_runs.legacy)}, "has no manifest.json; run the bare val run"),
        ({"mask_probability": 0.25}, "gate_a.mask_probability: Value error, must be 0.5"),
        ({"active_skill_budget": 2}, "gate_a.active_skill_budget is 2 but the draft"),
        ({"draft_path": str(write_draft(tmp_path / "d2", CHUNKS, budget=3))}, "must be between 1 and 2 (the chunk count), got 3"),
        ({"draft_path": str(write_draft(tmp_path / "d1", CHUNKS, draft_only=False))}, "needs metadata.draft_only: true"),
        ({"masked": "x"}, "gate_a.masked: unknown key"),
    ]
    for index, (change, message) in enumerate(cases):
        result = gate("plan", str(write_gate(tmp_path / f"gate{index}.yaml", **{**basic, **change})))
        assert_bad_input(result, message)
        assert not (tmp_path / "gate" / "traces.jsonl").exists()

    # Too few tasks for the columns: found by the design check, before the bare run is even read.
    small = yaml.safe_load(research_config(research_runs).read_text(encoding="utf-8"))
    small["tasks"]["sample_size"] = 2
    small_path = tmp_path / "small.yaml"
    small_path.write_text(yaml.safe_dump(small), encoding="utf-8")
    result = gate("plan", str(write_gate(tmp_path / "small-gate.yaml", **{**basic, "experiment_config": str(small_path)})))
    assert_bad_input(result, "OLS needs more observations than columns: 2 rows for 2 columns")
    equipped = {**small, "skills": {"path": str(tmp_path / "draft" / "initial_skillbank.json")}}
    small_path.write_text(yaml.safe_dump(equipped), encoding="utf-8")
    assert_bad_input(gate("plan", str(tmp_path / "small-gate.yaml")), "must be the bare run's: skills.path: null")

    unplanned = write_gate(tmp_path / "unplanned.yaml", **{**basic, "output_dir": str(tmp_path / "unplanned")})
    assert_bad_input(gate("fit", str(unplanned)), "has no gate_plan.json")
    assert_bad_input(gate("fit", str(unplanned), "--masked-run", str(research_runs.local)), "is not this gate's masked plan")


# --------------------------------------------------------------------------- incomplete, then resumed


@pytest.fixture(scope="module")
def faulty_testbed() -> Any:
    """Model calls answer 500 now and then (seeded per request body)."""
    with start_testbed(SHOPSIM_POLICY_RATE_500="0.06", SHOPSIM_POLICY_FAULT_SEED="11") as bed:
        yield bed


def test_an_incomplete_gate_selects_nothing_and_a_rerun_runs_only_the_failed_episodes(
    tmp_path: Path, basic: dict[str, Any], research_runs: ResearchRuns, faulty_testbed: LocalTestbed, testbed: LocalTestbed
) -> None:
    # The gate's experiment: the bare run's, with no retries at all (transport and retry settings
    # are not part of the plan, so it still pairs with the bare run).
    config = yaml.safe_load(research_config(research_runs).read_text(encoding="utf-8"))
    config["model"]["max_retries"] = 1
    config["runtime"]["max_episode_retries"] = 0
    experiment = tmp_path / "no-retries.yaml"
    experiment.write_text(yaml.safe_dump(config), encoding="utf-8")
    spec = write_gate(tmp_path / "gate.yaml", **{**basic, "experiment_config": str(experiment)})
    gate_dir = tmp_path / "gate"

    first = gate("run", str(spec), "--no-progress", env=faulty_testbed.env())
    assert first.returncode == 1, first.stderr[-2000:]
    manifest = json.loads((gate_dir / "gate_a_manifest.json").read_text(encoding="utf-8"))
    failed = manifest["summary"]["failed"]
    assert manifest["status"] == "incomplete" and 0 < failed < 24 and manifest["output"] is None
    assert manifest["runs"]["masked_plan_fingerprint"] == json.loads((gate_dir / "manifest.json").read_text())["plan_fingerprint"]
    assert not any((gate_dir / name).exists() for name in ("contributions.json", "selected_skillbank.json", "selected_skill.md"))
    assert "no contributions or selection written" in first.stdout
    lines = (gate_dir / "traces.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 24

    # Another mask seed is another masked plan: refused (42) before any file is touched.
    frozen_files = {p.name: p.read_bytes() for p in gate_dir.iterdir() if p.is_file()}
    reseeded = write_gate(tmp_path / "reseeded.yaml", **{**basic, "experiment_config": str(experiment), "mask_seed": 7})
    refused = gate("run", str(reseeded), "--no-progress", env=testbed.env())
    assert refused.returncode == 42, refused.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in gate_dir.iterdir() if p.is_file()} == frozen_files

    second = gate("run", str(spec), "--no-progress", env=testbed.env())
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"{24 - failed} already completed, {failed} to run" in second.stderr
    assert len((gate_dir / "traces.jsonl").read_text(encoding="utf-8").splitlines()) == 24 + failed
    contributions = json.loads((gate_dir / "contributions.json").read_text(encoding="utf-8"))
    assert contributions["observations"] == 24 and len(contributions["observations_table"]) == 24
    assert json.loads((gate_dir / "gate_a_manifest.json").read_text(encoding="utf-8"))["status"] == "complete"


def test_failed_episodes_drop_records_the_drops_and_the_cap_refuses(
    tmp_path: Path, basic: dict[str, Any], research_runs: ResearchRuns, faulty_testbed: LocalTestbed
) -> None:
    config = yaml.safe_load(research_config(research_runs).read_text(encoding="utf-8"))
    config["model"]["max_retries"] = 1
    config["runtime"]["max_episode_retries"] = 0
    experiment = tmp_path / "no-retries.yaml"
    experiment.write_text(yaml.safe_dump(config), encoding="utf-8")
    spec = write_gate(tmp_path / "gate.yaml", **{**basic, "experiment_config": str(experiment), "failed_episodes": "drop"})
    gate_dir = tmp_path / "gate"

    # Drop, with the default cap of 2 %: one failure in 24 pairs is already over it.
    capped = gate("run", str(spec), "--no-progress", env=faulty_testbed.env())
    assert capped.returncode == 1, capped.stderr[-2000:]
    manifest = json.loads((gate_dir / "gate_a_manifest.json").read_text(encoding="utf-8"))
    summary = manifest["summary"]
    failed = summary["failed"]
    assert manifest["status"] == "incomplete" and 0 < failed < 24
    assert summary["requested_observations"] == 24 and summary["dropped_observations"] == failed
    assert summary["dropped_share_exceeded"] is True and summary["max_dropped_share"] == 0.02
    assert "over max_dropped_share 0.02" in capped.stdout and f"{failed}/24 pairs failed" in capped.stdout
    assert not (gate_dir / "contributions.json").exists()

    # Refuse (the flag wins over the file): the message points at the option.
    refused = gate("fit", str(spec), "--failed-episodes", "refuse")
    assert refused.returncode == 1 and "failed_episodes: drop" in refused.stdout
    assert "requested_observations" not in json.loads((gate_dir / "gate_a_manifest.json").read_text(encoding="utf-8"))["summary"]

    assert_bad_input(gate("fit", str(spec), "--max-dropped-share", "1.5"), "--max-dropped-share must be between 0 and 1")
    assert_bad_input(gate("fit", str(spec), "--failed-episodes", "skip"), "--failed-episodes must be refuse or drop")

    # A cap the failures fit under: the pairs are dropped and recorded, the fit uses the rest.
    dropped = gate("fit", str(spec), "--max-dropped-share", "1")
    assert dropped.returncode == 0, dropped.stderr[-2000:]
    manifest = json.loads((gate_dir / "gate_a_manifest.json").read_text(encoding="utf-8"))
    ids = manifest["summary"]["dropped_episode_ids"]
    assert manifest["status"] == "complete" and len(ids) == failed and ids == sorted(ids)
    assert manifest["config"]["failed_episodes"] == "drop" and manifest["config"]["max_dropped_share"] == 1.0
    contributions = json.loads((gate_dir / "contributions.json").read_text(encoding="utf-8"))
    assert contributions["dropped_episode_ids"] == ids
    assert contributions["requested_observations"] == 24 and contributions["dropped_observations"] == failed
    assert contributions["observations"] == 24 - failed and len(contributions["observations_table"]) == 24 - failed
    assert not set(ids) & {row["episode_id"] for row in contributions["observations_table"]}
    assert f"dropped {failed}/24 pairs" in dropped.stdout


# --------------------------------------------------------------------------- the online gate


def write_pool(path: Path, current: list[dict[str, Any]], candidates: list[dict[str, Any]]) -> Path:
    pool: dict[str, Any] = {
        "schema_version": "shopsimrl-skill-candidate-pool-v1",
        "round_id": "r1",
        "proposal_checkpoint": "ckpt-0",
        "current_skills": current,
        "candidates": candidates,
    }
    pool["pool_sha256"] = fingerprint(pool)
    path.write_text(json.dumps(pool, ensure_ascii=False), encoding="utf-8")
    return path


def test_the_online_gate_needs_a_checkpoint_id(tmp_path: Path, research_runs: ResearchRuns) -> None:
    pool = write_pool(tmp_path / "pool.json", [{"skill_id": "a", "content": "x"}], [])
    spec = tmp_path / "online.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "online_gate": {
                    "output_dir": str(tmp_path / "online"),
                    "experiment_config": str(research_config(research_runs)),
                    "bare_run_dir": str(research_runs.local),
                    "candidate_pool_path": str(pool),
                }
            }
        ),
        encoding="utf-8",
    )
    assert_bad_input(gate("plan", str(spec)), "the online gate needs model.checkpoint_id")
    shutil.rmtree(tmp_path / "online", ignore_errors=True)


def test_gate_run_with_shards_runs_the_masked_plan_as_workers_and_fits_the_same(
    tmp_path: Path, basic: dict[str, Any], research_runs: ResearchRuns
) -> None:
    local = gate("run", str(write_gate(tmp_path / "local.yaml", **basic)), "--no-progress")
    assert local.returncode == 0, local.stderr[-3000:]
    reference = json.loads((tmp_path / "gate" / "contributions.json").read_text(encoding="utf-8"))

    sharded_yaml = write_gate(tmp_path / "sharded.yaml", **{**basic, "output_dir": str(tmp_path / "sharded-gate")})
    alone = gate("run", str(sharded_yaml), "--shards", "2")
    assert_bad_input(alone, "--shards and --run go together")
    masked = tmp_path / "masked-run"
    ran = gate("run", str(sharded_yaml), "--shards", "2", "--run", str(masked), "--no-progress")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "gate complete: 24/24 masked rollouts completed" in ran.stdout
    assert (masked / "shards" / "00001" / "_SUCCESS.json").is_file() and (masked / "summary.json").is_file()
    document = json.loads((tmp_path / "sharded-gate" / "contributions.json").read_text(encoding="utf-8"))
    assert document["estimates"] == reference["estimates"]
    assert document["contributions"] == reference["contributions"]
    # Run again: every shard is committed, nothing reruns, the fit is the same.
    again = gate("run", str(sharded_yaml), "--shards", "2", "--run", str(masked), "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        json.loads((tmp_path / "sharded-gate" / "contributions.json").read_text(encoding="utf-8"))["estimates"]
        == (reference["estimates"])
    )
