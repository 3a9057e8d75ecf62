"""The online gate end to end on the testbed: a candidate pool of current chunks, REWRITE and ADD
candidates, one slot per family, the REWRITE resolution, the proposal ledger. 200 val tasks with a
checkpoint id (the online gate requires one); about a minute."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import yaml

from shopsimrl.research.gate.masks import slot_choice
from shopsimrl.schemas import EpisodeJob, fingerprint
from tests.sharded.conftest import REPO, SPLIT_FILE, cli
from tests.testbed_process import start_testbed

pytestmark = pytest.mark.slow

OPTIONS = "在商品页选中用户想要的规格。[[testbed:choose-options]]"


def pool_document() -> dict[str, Any]:
    pool: dict[str, Any] = {
        "schema_version": "shopsimrl-skill-candidate-pool-v1",
        "round_id": "round-3",
        "proposal_checkpoint": "ckpt-proposer",
        "current_skills": [
            {"skill_id": "options", "version": "2", "content": OPTIONS, "metadata": {"selected_intervention_id": "cand-options"}},
            {"skill_id": "quiet", "content": "每轮只调用一个工具，不写说明。"},
        ],
        "candidates": [
            {
                "candidate_id": "options-v3",
                "operation": "REWRITE",
                "target_chunk_id": "options",
                "content": "对照偏好逐项选规格。" + OPTIONS,
            },
            {"candidate_id": "buy-first", "operation": "ADD", "content": "只搜品类，买第一个结果。[[testbed:buy-first]]"},
        ],
    }
    pool["pool_sha256"] = fingerprint(pool)
    return pool


@pytest.fixture(scope="module")
def online(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("online-gate")
    bare = yaml.safe_load((REPO / "configs" / "gate_demo" / "bare.yaml").read_text(encoding="utf-8"))
    bare["experiment"]["output_dir"] = str(root / "runs")
    bare["tasks"] |= {"split_file": str(SPLIT_FILE), "sample_size": 200}
    bare["model"]["checkpoint_id"] = "heuristic-2026-12"
    (root / "bare.yaml").write_text(yaml.safe_dump(bare), encoding="utf-8")
    (root / "pool.json").write_text(json.dumps(pool_document(), ensure_ascii=False), encoding="utf-8")
    history = {"candidate_id": "cand-options", "operation": "ADD", "stage": "online", "content": OPTIONS}
    (root / "proposal_ledger.jsonl").write_text(json.dumps(history, ensure_ascii=False) + "\n", encoding="utf-8")
    spec = {
        "online_gate": {
            "output_dir": "runs/online",
            "experiment_config": "bare.yaml",
            "bare_run_dir": "runs/bare",
            "candidate_pool_path": "pool.json",
            "mask_seed": 5,
            "active_skill_budget": 2,
        }
    }
    (root / "online.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    with start_testbed(SHOPSIM_POLICY_OPTIONS_NEED_SKILL="1") as bed:
        env = bed.env(SHOPSIMRL_LOG_LEVEL="warning")
        made = cli("run", str(root / "bare.yaml"), "--no-progress", env=env, timeout=600)
        assert made.returncode == 0, made.stderr[-3000:]
        gated = cli("gate", "run", str(root / "online.yaml"), "--no-progress", env=env, timeout=600)
        assert gated.returncode == 0, gated.stderr[-3000:] + gated.stdout[-2000:]
        print(gated.stdout)
    gate_dir = root / "runs" / "online"
    yield {"dir": gate_dir, "contributions": json.loads((gate_dir / "contributions.json").read_text(encoding="utf-8"))}
    shutil.rmtree(root / "runs", ignore_errors=True)


def test_slots_follow_the_formula_and_rewrites_are_mutually_exclusive(online: dict[str, Any]) -> None:
    masks = json.loads((online["dir"] / "mask_assignments.json").read_text(encoding="utf-8"))
    assert masks["schema_version"] == "shopsimrl-online-skill-assignments-v1"
    assert masks["columns"] == ["options", "options-v3", "quiet", "buy-first"]
    assert [slot["slot_id"] for slot in masks["slots"]] == ["options", "quiet", "buy-first"]
    for row in masks["assignments"]:
        job = EpisodeJob.from_dict({k: row[k] for k in ("task_id", "sample_id", "seed", "split")})
        for slot in masks["slots"]:
            choice = slot_choice(5, job, slot["slot_id"], len(slot["versions"]))
            assert row["slot_states"][slot["slot_id"]] == (None if choice == 0 else slot["versions"][choice - 1])
        assert row["mask"][0] + row["mask"][1] <= 1  # never the old and the new version together
        assert row["included_chunk_ids"] == [c for c, bit in zip(masks["columns"], row["mask"], strict=True) if bit]


def test_the_rewrite_family_resolves_to_one_version_and_harm_is_not_selected(online: dict[str, Any]) -> None:
    contributions = online["contributions"]
    rows = {row["intervention_id"]: row for row in contributions["contributions"]}
    family = [rows["options"], rows["options-v3"]]
    assert sorted(row["status"] for row in family) == ["rewrite_loser", "selected"]
    winner = max(family, key=lambda row: (row["coefficient"], row["intervention_id"] == "options"))
    assert winner["status"] == "selected" and winner["coefficient"] > 0
    assert contributions["replacement_winners"]["options"] == winner["intervention_id"]
    assert rows["buy-first"]["coefficient"] < 0 and rows["buy-first"]["status"] == "non_positive"
    assert rows["buy-first"]["ci_high"] < 0
    assert rows["quiet"]["status"] in ("selected", "retired")  # a current chunk that is not kept is retired
    assert (
        rows[winner["intervention_id"]]["rank"] is not None
        and rows["options-v3" if winner is family[0] else "options"]["rank"] is None
    )

    selected = json.loads((online["dir"] / "selected_skillbank.json").read_text(encoding="utf-8"))
    assert selected["bank_version"] == "online-round-3-selected-v1"
    assert selected["skills"][0]["skill_id"] == "options"  # the logical chunk id, whichever version won
    assert selected["skills"][0]["metadata"]["selected_intervention_id"] == winner["intervention_id"]
    assert selected["metadata"]["bare_baseline"]["checkpoint_id"] == "heuristic-2026-12"

    manifest = json.loads((online["dir"] / "online_gate_manifest.json").read_text(encoding="utf-8"))
    assert manifest["status"] == "complete" and manifest["input"]["chunk_ids"] == ["options", "options-v3", "quiet", "buy-first"]
    assert manifest["input"]["proposal_checkpoint"] == "ckpt-proposer"


def test_the_proposal_ledger_follows_each_proposal(online: dict[str, Any]) -> None:
    rows = [json.loads(line) for line in (online["dir"] / "proposal_ledger.jsonl").read_text(encoding="utf-8").splitlines()]
    by_id = {row["candidate_id"]: row for row in rows}
    assert list(by_id) == ["cand-options", "options-v3", "buy-first"]
    # The earlier round's proposal is the current chunk "options" now: its row follows that chunk.
    earlier = by_id["cand-options"]
    assert earlier["active_chunk_id"] == "options" and earlier["intervention_id"] == "options"
    assert earlier["validation_result"] in ("selected", "retired") and len(earlier["validation_history"]) == 1
    assert by_id["options-v3"]["replacement_family_id"] == "options" and by_id["options-v3"]["stage"] == "online"
    assert (
        by_id["buy-first"]["validation_result"] == "non_positive"
        and by_id["buy-first"]["evaluation_checkpoint"] == "heuristic-2026-12"
    )
