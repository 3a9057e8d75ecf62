"""The skill compiler against a real HTTP stub: consolidated clusters in, the Gate A draft files
out (read back by the gate's own draft reader), the contract repaired, resume by input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.model import OpenAICompatibleSettings
from shopsimrl.research.gate.drafts import load_gate_a_draft
from shopsimrl.research.skills.analyst import SkillInputError
from shopsimrl.research.skills.cards import INITIAL_SKILL_TOOL, SkillChunk
from shopsimrl.research.skills.compile import (
    BANK_NAME,
    DRAFT_NAME,
    INVALID_ATTEMPTS_NAME,
    LEDGER_NAME,
    MANIFEST_NAME,
    MARKDOWN_NAME,
    CompilerConfig,
    chunk_ids,
    compile_skill,
    render_chunk,
)
from shopsimrl.research.skills.consolidate import BATCHES_NAME
from tests.openai_stub import OpenAIStub, Reply, completion, tool_call


def chunk(title: str, *clusters: str, procedure: str = "先补全所有规格再购买") -> dict[str, Any]:
    return {
        "title": title,
        "workflow_stage": "变体与价格",
        "applicable_when": "详情页有未选规格时",
        "procedure": [procedure, "核对价格"],
        "verification": "规格全部已选",
        "common_failure": "漏选规格",
        "evidence_cluster_ids": list(clusters),
    }


def skill_reply(chunks: list[dict[str, Any]], evidence_only: list[str] = ()) -> Reply:  # type: ignore[assignment]
    arguments = {"skill_title": "购物技能", "chunks": chunks, "evidence_only_cluster_ids": list(evidence_only)}
    return Reply(json=completion(tool_calls=[tool_call(INITIAL_SKILL_TOOL, orjson.dumps(arguments).decode())]))


def write_batches(directory: Path, clusters_per_batch: list[int]) -> list[str]:
    ids, lines = [], []
    for index, count in enumerate(clusters_per_batch, start=1):
        clusters = []
        for number in range(1, count + 1):
            cluster_id = f"success-batch-{index:03d}-cluster-{number:02d}"
            ids.append(cluster_id)
            clusters.append(
                {
                    "cluster_id": cluster_id,
                    "workflow_stage": "搜索",
                    "mechanism": "机制",
                    "applicable_when": "总是",
                    "procedure": ["一步"],
                    "verification": "验证",
                    "common_failure": "失败",
                    "evidence_card_ids": [f"success-task-{index:06d}__sample-000-{number:02d}"],
                }
            )
        lines.append(
            {
                "batch_version": "shopsimrl-cluster-batch-v1",
                "batch_id": f"success-batch-{index:03d}",
                "channel": "success",
                "batch_index": index,
                "status": "ok",
                "clusters": clusters,
                "evidence_only_card_ids": [],
            }
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / BATCHES_NAME).write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return ids


def config(url: str, **limits: Any) -> CompilerConfig:
    settings = OpenAICompatibleSettings(
        model="stub-model", base_url=url, api_key_env=None, max_retries=1, retry_backoff_seconds=0.0,
        tool_choice={"type": "function", "function": {"name": INITIAL_SKILL_TOOL}},
    )  # fmt: skip
    return CompilerConfig(model=settings, **limits)


def test_chunk_ids_from_titles_with_a_fingerprint_for_titles_without_ascii() -> None:
    def of(title: str, *clusters: str) -> SkillChunk:
        return SkillChunk.model_validate(chunk(title, *(clusters or ("c1",))))

    ids = chunk_ids([of("Choose options 先选规格"), of("Choose options"), of("只看价格", "c2", "c1"), of("只看价格", "c3")])
    assert ids[0] == "choose-options" and ids[1] == "choose-options-2"
    assert ids[2].startswith("chunk-") and len(ids[2]) == len("chunk-") + 12 and ids[3] != ids[2]
    assert chunk_ids([of("只看价格", "c1", "c2")]) == [ids[2]]  # sorted cluster ids: the same id
    text = render_chunk(of("Choose options"))
    assert text.startswith("### Choose options\n- 适用情形：") and "   1. 先补全所有规格再购买\n   2. 核对价格" in text


def test_config_limits_are_checked() -> None:
    with pytest.raises(SkillInputError, match="validation_dimension_cap must be 1 to 16"):
        config("http://127.0.0.1:1/v1", validation_dimension_cap=17)
    with pytest.raises(SkillInputError, match="active_skill_budget must be 1 to validation_dimension_cap"):
        config("http://127.0.0.1:1/v1", validation_dimension_cap=4, active_skill_budget=5)


def test_no_consolidation_or_an_incomplete_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SkillInputError, match=r"cluster_batches\.jsonl: missing; run the consolidation first"):
        compile_skill(tmp_path, config("http://127.0.0.1:1/v1"))
    write_batches(tmp_path, [1])
    (tmp_path / "consolidation_summary.json").write_text(
        '{"status": "incomplete", "batches": {"failed_batch_ids": ["success-batch-002"]}}', encoding="utf-8"
    )
    with pytest.raises(SkillInputError, match=r"incomplete \(failed batches: \['success-batch-002'\]\)"):
        compile_skill(tmp_path, config("http://127.0.0.1:1/v1"))


@pytest.mark.slow
def test_the_draft_the_compiler_writes_is_the_draft_gate_a_reads(tmp_path: Path, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    a, b, c, d = write_batches(tmp_path, [3, 1])
    server.queue(
        skill_reply([chunk("Fill options", a, b)]),  # c, d unaccounted
        skill_reply([chunk("Fill options", a, b), chunk("Check price", c, "success-batch-009-cluster-01")], [d]),
        skill_reply([chunk("Fill options", a, b), chunk("Buy at 光明店", c)], [d]),  # no firewall trace: fine
        skill_reply([chunk("Fill options", a, b), chunk("Check price B0ABCDEFGH", c)], [d]),  # an ASIN
        skill_reply([chunk("Fill options", a, b), chunk("Check price", c)], [d]),
    )
    manifest = compile_skill(tmp_path, config(url, active_skill_budget=3), inputs={"evidence_cards.jsonl": "ab" * 32})
    # The third reply is valid (a brand without its trace is not an instance fact the compiler knows).
    assert manifest["status"] == "complete" and manifest["attempts"] == 3
    repairs = [request.json["messages"][-1]["content"] for request in server.completions[1:]]
    assert f"cluster ids in no chunk and not evidence-only: {c}, {d}" in repairs[0]
    assert "cluster ids not among those given: success-batch-009-cluster-01" in repairs[1]
    invalid = [orjson.loads(line) for line in (tmp_path / INVALID_ATTEMPTS_NAME).read_bytes().splitlines()]
    assert [row["attempt"] for row in invalid] == [1, 2]
    sent = orjson.loads(server.completions[0].json["messages"][1]["content"])
    assert sent["validation_dimension_cap"] == 4 and "evidence_card_ids" not in sent["clusters"][0]

    draft = load_gate_a_draft(tmp_path / DRAFT_NAME, tmp_path / BANK_NAME, None)
    assert draft.chunk_ids == ["fill-options", "buy-at"] and draft.budget == 2  # min(3, chunks)
    assert draft.chunks[0].content.startswith("### Fill options\n") and draft.chunks[0].metadata["draft_only"] is True
    ledger = [orjson.loads(line) for line in (tmp_path / LEDGER_NAME).read_bytes().splitlines()]
    assert [(row["candidate_id"], row["operation"], row["status"]) for row in ledger] == [
        ("fill-options", "ADD", "proposed"),
        ("buy-at", "ADD", "proposed"),
    ]
    assert ledger[0]["evidence_card_ids"] == ["success-task-000001__sample-000-01", "success-task-000001__sample-000-02"]
    assert draft.history == ledger  # the gate carries the ledger forward
    assert (tmp_path / MARKDOWN_NAME).read_text(encoding="utf-8").startswith("# 购物技能\n\n### Fill options")
    written = orjson.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert set(written["outputs"]) == {DRAFT_NAME, BANK_NAME, MARKDOWN_NAME, LEDGER_NAME}
    assert written["inputs"]["evidence_cards.jsonl"] == "ab" * 32 and BATCHES_NAME in written["inputs"]

    # The same input again: nothing is asked.
    server.reset()
    assert (
        compile_skill(tmp_path, config(url, active_skill_budget=3))["compilation_input_sha256"]
        == manifest["compilation_input_sha256"]
    )
    assert server.completions == []


@pytest.mark.slow
def test_attempts_exhausted_write_a_failed_manifest_and_no_draft(tmp_path: Path, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    write_batches(tmp_path, [2])
    server.responder = lambda request: skill_reply([])
    manifest = compile_skill(tmp_path, config(url))
    assert manifest["status"] == "failed" and manifest["attempts"] == 5 and manifest["error"]["type"] == "ContractError"
    assert not (tmp_path / DRAFT_NAME).exists() and not (tmp_path / BANK_NAME).exists()
    assert len((tmp_path / INVALID_ATTEMPTS_NAME).read_bytes().splitlines()) == 5
