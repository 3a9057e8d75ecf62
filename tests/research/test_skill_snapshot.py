"""Review and the immutable skill bank snapshot, as users run them: a draft built by ``skills
build`` against the real HTTP model stub, ``skills review`` and ``skills snapshot`` through the
CLI, the snapshot read back by Gate A's draft reader, by the evaluation's skill provider and by
``training build-curriculum``; edits after freezing are refused, writes are once only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.research.gate.drafts import DraftError, load_gate_a_draft
from shopsimrl.research.skills.snapshot import (
    REVIEW_NAME,
    SNAPSHOT_NAME,
    SnapshotConflictError,
    build_snapshot,
    freeze_snapshot,
    review_status,
)
from shopsimrl.schemas import fingerprint, sha256_hex
from shopsimrl.skills import SkillBankError, open_skill_provider
from tests.openai_stub import OpenAIStub, Received, Reply, completion, tool_call
from tests.research.test_gate_cli import gate, research_config, write_gate
from tests.research.test_skill_builder import good_card, numbered, write_traces
from tests.research.test_skills_build import NO_PROPOSAL_CARD, write_config
from tests.testbed_process import LocalTestbed

from .conftest import ResearchRuns

pytestmark = pytest.mark.slow  # the draft is built against the stub's HTTP server

LESSONS = {1: "先用核心品类词加关键属性搜索", 2: "先用核心品类词加关键属性搜索", 3: "下单前逐项核对选项是否与要求一致"}


def _tool_name(request: Received) -> str:
    return str(request.json["tools"][0]["function"]["name"])


def answer(request: Received) -> Reply:
    """Two behaviours, two clusters, two chunks: ``search-with-attributes`` and ``check-options``."""
    name = _tool_name(request)
    user = orjson.loads(request.json["messages"][1]["content"])
    if any(tool["function"]["name"] == "submit_failure_card" for tool in request.json["tools"]):
        return Reply(json=completion(tool_calls=[tool_call("submit_failure_card", orjson.dumps(NO_PROPOSAL_CARD).decode())]))
    if name == "submit_success_cards":
        task = int(user["trace"]["instruction"].split("#")[-1])
        arguments: dict[str, Any] = {"cards": [good_card(lesson=LESSONS[task])]}
    elif name == "submit_clusters":
        search = [c["card_id"] for c in user["cards"] if "搜索" in c["generalizable_lesson"]]
        check = [c["card_id"] for c in user["cards"] if c["card_id"] not in search]
        arguments = {
            "clusters": [
                {
                    "workflow_stage": stage,
                    "mechanism": "机制",
                    "applicable_when": "任务给出明确属性时",
                    "procedure": [step],
                    "verification": "核对结果",
                    "common_failure": "遗漏属性",
                    "evidence_card_ids": ids,
                }
                for stage, step, ids in (("搜索", "用品类词加属性词搜索", search), ("下单", "逐项核对选项", check))
            ],
            "evidence_only_card_ids": [],
        }
    else:
        titles = {"搜索": "Search with attributes", "下单": "Check options"}
        chunks = [
            {
                "title": titles[cluster["workflow_stage"]],
                "workflow_stage": cluster["workflow_stage"],
                "applicable_when": cluster["applicable_when"],
                "procedure": cluster["procedure"],
                "verification": cluster["verification"],
                "common_failure": cluster["common_failure"],
                "evidence_cluster_ids": [cluster["cluster_id"]],
            }
            for cluster in user["clusters"]
        ]
        arguments = {"skill_title": "购物技能", "chunks": chunks}
    return Reply(json=completion(tool_calls=[tool_call(name, orjson.dumps(arguments).decode())]))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, served: tuple[OpenAIStub, str], testbed: LocalTestbed) -> Path:
    server, url = served
    server.reset()
    server.responder = answer
    root = tmp_path_factory.mktemp("draft")
    write_traces(root / "traces.jsonl", [numbered(1), numbered(2), numbered(3), numbered(4, success=False)])
    config = write_config(root, url, shop=testbed.shop_url)  # the failed trajectory is replayed there
    result = CliRunner().invoke(app, ["skills", "build", str(config)], prog_name="shopsimrl")
    assert result.exit_code == 0, result.output
    return root / "out"


@pytest.fixture
def draft(built: Path, tmp_path: Path) -> Path:
    """A fresh copy of the built draft folder for one test."""
    return Path(shutil.copytree(built, tmp_path / "out"))


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), prog_name="shopsimrl")


def test_review_appends_decisions_and_refuses_what_it_cannot_apply(draft: Path, tmp_path: Path) -> None:
    assert list(review_status(draft)) == ["search-with-attributes", "check-options"]
    result = cli("skills", "review", str(draft), "--accept", "search-with-attributes", "--reviewer", "lin", "--note", "grounded")
    assert result.exit_code == 0, result.output
    assert "search-with-attributes           accepted" in result.output
    rows = [json.loads(line) for line in (draft / REVIEW_NAME).read_text(encoding="utf-8").splitlines()]
    assert [(r["chunk_id"], r["decision"], r["reviewer"], r["note"]) for r in rows] == [
        ("search-with-attributes", "accepted", "lin", "grounded")
    ]
    assert rows[0]["reviewed_at"].endswith("Z") and len(rows[0]["content_sha256"]) == 64

    review_file = tmp_path / "review.yaml"
    review_file.write_text(
        "reviewer: wu\ndecisions:\n  - {chunk_id: check-options, decision: reject, note: too narrow}\n"
        "  - {chunk_id: search-with-attributes, decision: reject, note: changed my mind}\n",
        encoding="utf-8",
    )
    assert cli("skills", "review", str(draft), "--file", str(review_file)).exit_code == 0
    status = review_status(draft)
    assert status["check-options"] == {
        "status": "rejected",
        "reviewer": "wu",
        "note": "too narrow",
        "reviewed_at": status["check-options"]["reviewed_at"],
    }
    assert status["search-with-attributes"]["status"] == "rejected"  # the latest decision counts
    assert len((draft / REVIEW_NAME).read_text(encoding="utf-8").splitlines()) == 3  # kept, never rewritten

    before = (draft / REVIEW_NAME).read_bytes()
    for args, message in [
        (["--accept", "no-such-chunk", "--reviewer", "lin"], "no chunk 'no-such-chunk'"),
        (["--accept", "check-options", "--reject", "check-options", "--reviewer", "lin"], "both accepted and rejected"),
        (["--accept", "check-options"], "--reviewer: required"),
        (["--reviewer", "lin"], "nothing to review"),
    ]:
        refused = cli("skills", "review", str(draft), *args)
        assert refused.exit_code == 2 and message in refused.output, refused.output
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text("reviewer: wu\ndecisions: [{chunk_id: check-options, decision: maybe}]\n", encoding="utf-8")
    refused = cli("skills", "review", str(draft), "--file", str(bad_file))
    assert refused.exit_code == 2 and "decisions[0].decision: must be accept or reject" in refused.output
    assert (draft / REVIEW_NAME).read_bytes() == before  # nothing of a refused review is written


def test_a_decision_does_not_carry_over_to_a_changed_chunk(draft: Path) -> None:
    assert cli("skills", "review", str(draft), "--accept", "check-options", "--reviewer", "lin").exit_code == 0
    bank = json.loads((draft / "initial_skillbank.json").read_text(encoding="utf-8"))
    bank["skills"][1]["content"] += "\n- 补充：先看评价"
    (draft / "initial_skillbank.json").write_text(json.dumps(bank, ensure_ascii=False), encoding="utf-8")
    assert review_status(draft)["check-options"]["status"] == "unreviewed"


def test_snapshot_freezes_accepted_chunks_with_their_provenance(draft: Path) -> None:
    assert cli("skills", "review", str(draft), "--accept", "check-options", "--reviewer", "lin", "--note", "ok").exit_code == 0
    result = cli("skills", "snapshot", str(draft))
    assert result.exit_code == 0, result.output
    assert (
        "enabled   check-options" in result.output
        and "unreviewed (recorded, not enabled): search-with-attributes" in result.output
    )
    path = draft / SNAPSHOT_NAME
    snapshot = json.loads(path.read_text(encoding="utf-8"))
    assert snapshot["schema_version"] == "shopsimrl-skillbank-snapshot-v1" and snapshot["stage"] == "draft"
    assert snapshot["snapshot_id"] == fingerprint({k: v for k, v in snapshot.items() if k != "snapshot_id"})
    assert snapshot["snapshot_id"] in result.output

    by_id = {skill["skill_id"]: skill for skill in snapshot["skills"]}
    assert [s["skill_id"] for s in snapshot["skills"]] == ["search-with-attributes", "check-options"]
    accepted, unreviewed = by_id["check-options"], by_id["search-with-attributes"]
    assert accepted["enabled"] is True and unreviewed["enabled"] is False
    assert accepted["review"]["status"] == "accepted" and accepted["review"]["reviewer"] == "lin"
    assert accepted["review"]["note"] == "ok" and unreviewed["review"]["status"] == "unreviewed"
    assert accepted["leakage"] == {"status": "clean", "findings": []}
    # Evidence: the card of task 3 (the only one with the options lesson) and its step.
    assert accepted["evidence"]["card_ids"] == ["success-task-000003__sample-000-01"]
    assert accepted["evidence"]["refs"] == [
        {"card_id": "success-task-000003__sample-000-01", "episode_id": "task-000003__sample-000", "step": 1}
    ]
    assert len(unreviewed["evidence"]["refs"]) == 2
    draft_doc = json.loads((draft / "initial_skill_draft.json").read_text(encoding="utf-8"))
    assert accepted["dedup_cluster_ids"] == draft_doc["chunks"][1]["evidence_cluster_ids"]
    bank = json.loads((draft / "initial_skillbank.json").read_text(encoding="utf-8"))
    assert accepted["content_sha256"] == sha256_hex(bank["skills"][1]["content"])
    # The builder: each stage's model and prompt/tool hashes, as their summaries recorded them.
    analysis = json.loads((draft / "analysis_summary.json").read_text(encoding="utf-8"))
    manifest = json.loads((draft / "trace2skill_manifest.json").read_text(encoding="utf-8"))
    builder = snapshot["builder"]
    assert builder["analyst"]["analyst"] == analysis["analyst"] and builder["analyst"]["tool_sha256"] == analysis["tool_sha256"]
    assert builder["compiler"]["prompt_sha256"] == manifest["prompt_sha256"]
    assert builder["consolidator"]["consolidator"]["model"] == "stub-model"
    assert snapshot["source"]["draft_sha256"] == sha256_hex((draft / "initial_skill_draft.json").read_bytes())
    # The bank inside: the accepted chunks only, as the draft bank has them.
    assert snapshot["bank"]["skills"] == [
        {
            "skill_id": "check-options",
            "content": bank["skills"][1]["content"],
            "metadata": {"draft_only": True, "title": "Check options", "workflow_stage": "下单"},
        }
    ]

    # Written once: the same snapshot again is a no-op; another one at that path is refused.
    data, stat = path.read_bytes(), path.stat()
    again = cli("skills", "snapshot", str(draft))
    assert again.exit_code == 0 and "already there (identical; nothing written)" in again.output
    assert path.read_bytes() == data and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert cli("skills", "review", str(draft), "--accept", "search-with-attributes", "--reviewer", "lin").exit_code == 0
    refused = cli("skills", "snapshot", str(draft))
    assert refused.exit_code == 2 and f"{path} already holds another snapshot" in refused.output
    assert path.read_bytes() == data
    elsewhere = cli("skills", "snapshot", str(draft), "--out", str(draft / "v2.snapshot.json"))
    assert elsewhere.exit_code == 0 and "enabled   search-with-attributes, check-options" in elsewhere.output


def test_gate_a_and_the_skill_provider_read_a_snapshot_and_refuse_a_tampered_one(draft: Path) -> None:
    assert cli("skills", "review", str(draft), "--accept", "check-options", "--reviewer", "lin").exit_code == 0
    assert cli("skills", "review", str(draft), "--reject", "search-with-attributes", "--reviewer", "lin").exit_code == 0
    assert cli("skills", "snapshot", str(draft)).exit_code == 0
    path = draft / SNAPSHOT_NAME
    gate_draft = load_gate_a_draft(path, draft / "no-such-bank.json", None)
    assert gate_draft.chunk_ids == ["check-options"] and gate_draft.budget == 1
    assert [chunk.order for chunk in gate_draft.chunks] == [1]
    assert gate_draft.history and gate_draft.history[0]["candidate_id"] == "search-with-attributes"  # the ledger beside it
    provider = open_skill_provider(path)
    snapshot = json.loads(path.read_text(encoding="utf-8"))
    assert provider.identity()["snapshot_id"] == snapshot["snapshot_id"]
    assert [skill.skill_id for skill in provider.select({"task_id": 1})] == ["check-options"]

    tampered = json.loads(path.read_text(encoding="utf-8"))
    tampered["bank"]["skills"][0]["content"] = "### Buy anything\n- 步骤：买第一个"
    path.write_text(json.dumps(tampered, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(
        DraftError, match=r"snapshot .*skillbank.snapshot.json: its content has sha256 [0-9a-f]{64} but its snapshot_id"
    ):
        load_gate_a_draft(path, draft / "initial_skillbank.json", None)
    with pytest.raises(SkillBankError, match="changed after it was frozen"):
        open_skill_provider(path)


def test_nothing_accepted_or_a_leaking_chunk_is_not_frozen(draft: Path) -> None:
    refused = cli("skills", "snapshot", str(draft))
    assert refused.exit_code == 2 and "no chunk is accepted" in refused.output
    bank = json.loads((draft / "initial_skillbank.json").read_text(encoding="utf-8"))
    bank["skills"][0]["content"] += "\n- 例如 task-12 的商品 1234567890"
    (draft / "initial_skillbank.json").write_text(json.dumps(bank, ensure_ascii=False), encoding="utf-8")
    assert cli("skills", "review", str(draft), "--accept", "search-with-attributes", "--reviewer", "lin").exit_code == 0
    refused = cli("skills", "snapshot", str(draft))
    assert refused.exit_code == 2, refused.output
    assert "chunk 'search-with-attributes' is accepted but the firewall finds" in refused.output
    assert "contains_long_identifier" in refused.output and "contains_task_id" in refused.output
    assert not (draft / SNAPSHOT_NAME).exists()


def test_a_placeholder_card_without_evidence_refs_is_frozen_with_none(draft: Path) -> None:
    """An empty answer's placeholder card has no evidence_refs key (as the analysis writes it);
    the snapshot reads it as citing nothing. A real card without the key is still refused."""
    cards = draft / "evidence_cards.jsonl"
    lines = cards.read_text(encoding="utf-8").splitlines()
    placeholder = {
        "card_id": "success-task-000009__sample-000-00",
        "channel": "success",
        "episode_id": "task-000009__sample-000",
        "placeholder": True,
        "eligible": False,
        "ineligible_reasons": ["empty_answer"],
        "card": None,
        "firewall_findings": [],
    }
    cards.write_text("\n".join([*lines, json.dumps(placeholder)]) + "\n", encoding="utf-8")
    assert cli("skills", "review", str(draft), "--accept", "search-with-attributes", "--reviewer", "lin").exit_code == 0
    frozen = cli("skills", "snapshot", str(draft))
    assert frozen.exit_code == 0, frozen.output
    assert "enabled   search-with-attributes" in frozen.output
    (draft / SNAPSHOT_NAME).unlink()
    real = {**placeholder, "card_id": "success-task-000009__sample-000-01", "placeholder": False}
    cards.write_text("\n".join([*lines, json.dumps(real)]) + "\n", encoding="utf-8")
    refused = cli("skills", "snapshot", str(draft))
    assert refused.exit_code == 2 and f"{cards}:{len(lines) + 1}: not an evidence card" in refused.output


def _selected_bank(draft: Path, effects: dict[str, float]) -> Path:
    """A gate-selected bank in Gate A's layout (records of the draft's chunks with estimated effects)."""
    bank = json.loads((draft / "initial_skillbank.json").read_text(encoding="utf-8"))
    records = [
        {
            "skill_id": record["skill_id"],
            "version": "active-1",
            "enabled": True,
            "content": record["content"],
            "metadata": {"validation_result": "selected", "estimated_effect": effects[record["skill_id"]]},
        }
        for record in bank["skills"]
        if record["skill_id"] in effects
    ]
    path = draft.parent / "gate" / "selected_skillbank.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        json.dumps({"schema_version": "shopsimrl-skillbank-v1", "bank_version": "gate-a-selected-v1", "skills": records})
    )
    return path


def test_a_snapshot_of_a_gate_selection_feeds_the_curriculum(draft: Path, tmp_path: Path) -> None:
    for chunk_id in ("search-with-attributes", "check-options"):
        assert cli("skills", "review", str(draft), "--accept", chunk_id, "--reviewer", "lin").exit_code == 0
    selected = _selected_bank(draft, {"check-options": 0.15})
    out = tmp_path / "selected.snapshot.json"
    result = cli("skills", "snapshot", str(draft), "--selected", str(selected), "--out", str(out))
    assert result.exit_code == 0, result.output
    snapshot = json.loads(out.read_text(encoding="utf-8"))
    assert snapshot["stage"] == "selected" and [r["skill_id"] for r in snapshot["bank"]["skills"]] == ["check-options"]
    assert [(s["skill_id"], s["enabled"], s["gate"]) for s in snapshot["skills"]] == [
        ("search-with-attributes", False, {"selected": False}),
        ("check-options", True, {"selected": True}),
    ]
    with pytest.raises(DraftError, match="holds no draft; Gate A measures a snapshot frozen from a draft"):
        load_gate_a_draft(out, draft / "initial_skillbank.json", None)

    state = tmp_path / "curriculum.json"
    common = ["--round-id", "round-001", "--skill-free-probability", "0.2", "--rho-min", "0.2", "--rho-max", "0.9"]
    built = cli("training", "build-curriculum", str(out), str(state), *common)
    assert built.exit_code == 0, built.output
    document = json.loads(state.read_text(encoding="utf-8"))
    assert [(c["skill_id"], c["contribution"]) for c in document["chunks"]] == [("check-options", 0.15)]

    tampered = json.loads(out.read_text(encoding="utf-8"))
    tampered["bank"]["skills"][0]["metadata"]["estimated_effect"] = 0.5
    out.write_text(json.dumps(tampered, ensure_ascii=False), encoding="utf-8")
    refused = cli("training", "build-curriculum", str(out), str(tmp_path / "other.json"), *common)
    assert refused.exit_code == 2 and "changed after it was frozen" in refused.output, refused.output

    # A draft snapshot carries no estimated effects: the curriculum says what to give it.
    assert cli("skills", "snapshot", str(draft)).exit_code == 0
    refused = cli("training", "build-curriculum", str(draft / SNAPSHOT_NAME), str(tmp_path / "x.json"), *common)
    assert refused.exit_code == 2 and "no numeric metadata.estimated_effect" in refused.output

    foreign = _selected_bank(draft, {"check-options": 0.1})
    bank = json.loads(foreign.read_text(encoding="utf-8"))
    bank["skills"][0]["content"] = "### Something else\n- 步骤：别的"
    foreign.write_text(json.dumps(bank, ensure_ascii=False), encoding="utf-8")
    refused = cli("skills", "snapshot", str(draft), "--selected", str(foreign), "--out", str(tmp_path / "y.json"))
    assert refused.exit_code == 2 and "differs from the draft's chunk of that id" in refused.output


def test_gate_plan_takes_a_snapshot_as_its_draft(draft: Path, tmp_path: Path, research_runs: ResearchRuns) -> None:
    for chunk_id in ("search-with-attributes", "check-options"):
        assert cli("skills", "review", str(draft), "--accept", chunk_id, "--reviewer", "lin").exit_code == 0
    assert cli("skills", "snapshot", str(draft)).exit_code == 0
    snapshot = json.loads((draft / SNAPSHOT_NAME).read_text(encoding="utf-8"))
    gate_yaml = write_gate(
        tmp_path / "gate.yaml",
        output_dir=str(tmp_path / "gate"),
        experiment_config=str(research_config(research_runs)),
        bare_run_dir=str(research_runs.local),
        draft_path=str(draft / SNAPSHOT_NAME),
    )
    planned = gate("plan", str(gate_yaml))
    assert planned.returncode == 0, planned.stderr[-2000:]
    assignments = json.loads((tmp_path / "gate/skill_assignments.json").read_text(encoding="utf-8"))
    assert [s["skill_id"] for s in assignments["skills"]] == ["search-with-attributes", "check-options"]
    assert [s["content"] for s in assignments["skills"]] == [r["content"] for r in snapshot["bank"]["skills"]]
    assert assignments["protocol"]["skillbank_snapshot_id"] == snapshot["snapshot_id"]

    tampered = dict(snapshot, skill_title="edited")
    (draft / SNAPSHOT_NAME).write_text(json.dumps(tampered, ensure_ascii=False), encoding="utf-8")
    refused = gate(
        "plan", str(write_gate(tmp_path / "gate2.yaml", **{**yaml_section(gate_yaml), "output_dir": str(tmp_path / "g2")}))
    )
    assert refused.returncode == 2 and "changed after it was frozen" in refused.stderr, refused.stderr[-2000:]


def yaml_section(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text(encoding="utf-8"))["gate_a"])


def test_a_writer_that_loses_the_race_never_replaces_the_snapshot(draft: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer's snapshot lands between the check and the link (forced): a different one is
    refused and left alone; the same one is a no-op."""
    assert cli("skills", "review", str(draft), "--accept", "check-options", "--reviewer", "lin").exit_code == 0
    path = draft / SNAPSHOT_NAME
    real_link = os.link
    other = b'{"schema_version": "shopsimrl-skillbank-snapshot-v1", "snapshot_id": "another writer"}\n'

    def link_after_another_writer(source: Any, target: Any) -> None:
        Path(target).write_bytes(other)
        real_link(source, target)

    monkeypatch.setattr(os, "link", link_after_another_writer)
    with pytest.raises(SnapshotConflictError, match=f"{path} already holds another snapshot"):
        freeze_snapshot(draft)
    assert path.read_bytes() == other and not list(draft.glob(".skillbank.snapshot.json.tmp-*"))

    path.unlink()
    mine = build_snapshot(draft)
    same = (json.dumps(mine, ensure_ascii=False, indent=2, sort_keys=True) + "\n").encode("utf-8")

    def link_after_the_same_writer(source: Any, target: Any) -> None:
        Path(target).write_bytes(same)
        real_link(source, target)

    monkeypatch.setattr(os, "link", link_after_the_same_writer)
    result = freeze_snapshot(draft)
    assert result.written is False and result.snapshot["snapshot_id"] == mine["snapshot_id"] and path.read_bytes() == same


def test_a_draft_or_selection_holding_nan_is_refused_naming_the_file(draft: Path, tmp_path: Path) -> None:
    """Files read back are strict JSON: NaN or Infinity in one is exit 2 naming the file, and a
    missing draft keeps its hint on how to make one."""
    assert cli("skills", "review", str(draft), "--accept", "check-options", "--reviewer", "lin").exit_code == 0
    selected = _selected_bank(draft, {"check-options": 0.15})
    selected.write_text(selected.read_text(encoding="utf-8").replace("0.15", "Infinity"), encoding="utf-8")
    refused = cli("skills", "snapshot", str(draft), "--selected", str(selected), "--out", str(tmp_path / "s.json"))
    assert refused.exit_code == 2, refused.output
    assert f"skill bank {selected} is not valid JSON: Infinity is not JSON" in refused.output
    assert not (tmp_path / "s.json").exists()

    path = draft / "initial_skill_draft.json"
    text = path.read_text(encoding="utf-8")
    path.write_text('{"probe": NaN, ' + text.lstrip()[1:], encoding="utf-8")
    for args in (("review", str(draft), "--accept", "check-options", "--reviewer", "lin"), ("snapshot", str(draft))):
        refused = cli("skills", *args)
        assert refused.exit_code == 2, refused.output
        assert f"skill draft {path} is not valid JSON: NaN is not JSON" in refused.output
    assert not (draft / SNAPSHOT_NAME).exists()

    path.unlink()
    refused = cli("skills", "snapshot", str(draft))
    assert refused.exit_code == 2 and f"{path}: no such skill draft (run `shopsimrl skills build` first)" in refused.output
