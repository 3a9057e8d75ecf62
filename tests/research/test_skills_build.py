"""``shopsimrl skills build SKILLS.yaml`` as users run it: a train run's traces, a real HTTP model
stub answering the analyst, consolidator and compiler, the Gate A draft at the end; a rerun asks
nothing; a bad config names its key (exit 2)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.research.gate.drafts import load_gate_a_draft
from tests.openai_stub import OpenAIStub, Received, Reply, completion, tool_call
from tests.research.test_skill_builder import good_card, numbered, write_traces
from tests.testbed_process import LocalTestbed


def _tool_name(request: Received) -> str:
    return str(request.json["tools"][0]["function"]["name"])


NO_PROPOSAL_CARD = {
    "status": "NO_PROPOSAL",
    "privileged_audit": {
        "failure_surface": "买错了商品",
        "earliest_divergence": {"step": 1, "description": "没有核对属性"},
        "oracle_comparison": "属性不一致",
        "minimal_repair": "核对属性后再买",
        "repair_validation_result": "未验证",
    },
}


def answer(request: Received) -> Reply:
    name = _tool_name(request)
    user = orjson.loads(request.json["messages"][1]["content"])
    if any(t["function"]["name"] == "submit_failure_card" for t in request.json["tools"]):
        name, arguments = "submit_failure_card", NO_PROPOSAL_CARD
    elif name == "submit_success_cards":
        arguments = {"cards": [good_card()]}
    elif name == "submit_clusters":
        ids = [card["card_id"] for card in user["cards"]]
        cluster = {
            "workflow_stage": "搜索",
            "mechanism": "关键词包含核心属性",
            "applicable_when": "任务给出明确属性时",
            "procedure": ["用品类词加属性词搜索"],
            "verification": "结果与属性一致",
            "common_failure": "只用品类词",
            "evidence_card_ids": ids,
        }
        arguments = {"clusters": [cluster], "evidence_only_card_ids": []}
    else:
        (only,) = user["clusters"]
        chunk = {
            "title": "Search with attributes",
            "workflow_stage": "搜索",
            "applicable_when": only["applicable_when"],
            "procedure": only["procedure"],
            "verification": only["verification"],
            "common_failure": only["common_failure"],
            "evidence_cluster_ids": [only["cluster_id"]],
        }
        arguments = {"skill_title": "购物技能", "chunks": [chunk]}
    return Reply(json=completion(tool_calls=[tool_call(name, orjson.dumps(arguments).decode())]))


def write_config(tmp_path: Path, url: str, expected: int = 4, extra: str = "", shop: str = "http://127.0.0.1:1") -> Path:
    path = tmp_path / "skills.yaml"
    path.write_text(
        f"experiment: {{traces: traces.jsonl, output_dir: out, expected_trajectories: {expected}, concurrency: 2}}\n"
        f"environment: {{base_url: '{shop}'}}\n"
        "proposal_checkpoint: qwen35-4b-initial\n"
        f"analyst_model: {{name: stub-model, base_url: '{url}', api_key_env: null, max_retries: 1}}\n" + extra,
        encoding="utf-8",
    )
    return path


@pytest.mark.slow
def test_traces_to_a_gate_a_draft_then_a_rerun_asks_nothing(
    tmp_path: Path, served: tuple[OpenAIStub, str], testbed: LocalTestbed
) -> None:
    server, url = served
    server.reset()
    server.responder = answer
    write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(2), numbered(3), numbered(4, success=False)])
    config = write_config(tmp_path, url, shop=testbed.shop_url)
    result = CliRunner().invoke(app, ["skills", "build", str(config)], prog_name="shopsimrl")
    assert result.exit_code == 0, result.output
    assert "4 of 4 trajectories analysed (4 now: 3 successful, 1 failed)" in result.stdout
    assert "0 failure proposals, 1 NO_PROPOSAL" in result.stdout
    assert "compilation    complete: 1 chunks (search-with-attributes)" in result.stdout
    names = sorted(_tool_name(r) for r in server.completions[:4])
    assert names == ["search", "submit_success_cards", "submit_success_cards", "submit_success_cards"]
    assert [_tool_name(r) for r in server.completions[4:]] == ["submit_clusters", "submit_initial_skill"]
    for request in server.completions:
        forced = _tool_name(request) != "search"  # the failure analyst's live call offers the page's tools
        assert request.json["tool_choice"] == (
            {"type": "function", "function": {"name": _tool_name(request)}} if forced else "required"
        )
    assert testbed.healthz()["free_slots"] == testbed.healthz()["environment_slots"]

    out = tmp_path / "out"
    draft = load_gate_a_draft(out / "initial_skill_draft.json", out / "initial_skillbank.json", None)
    assert draft.chunk_ids == ["search-with-attributes"] and draft.budget == 1
    assert draft.history[0]["proposal_checkpoint"] == "qwen35-4b-initial"
    manifest = orjson.loads((out / "trace2skill_manifest.json").read_bytes())
    assert set(manifest["inputs"]) == {"traces.jsonl", "evidence_cards.jsonl", "cluster_batches.jsonl"}

    server.reset()
    server.responder = answer
    again = CliRunner().invoke(app, ["skills", "build", str(config)], prog_name="shopsimrl")
    assert again.exit_code == 0, again.output
    assert server.completions == []


@pytest.mark.parametrize(
    ("expected", "extra", "message"),
    [
        (4, "analysis: {max_cards: 2}\n", "analysis.max_cards: unknown key"),
        (4, "compilation: {validation_dimension_cap: 4, active_skill_budget: 6}\n", "must not exceed"),
        (
            4,
            "compilation: {validation_dimension_cap: 17}\n",
            "compilation.validation_dimension_cap: Input should be less than or equal to 16",
        ),
        (5, "", "4 episodes, but exactly 5 are expected"),
        (4, "analysis: {max_failure_steps: 1}\n", "analysis.max_failure_steps: Input should be greater than or equal to 2"),
    ],
)
def test_bad_configs_and_inputs_exit_2_naming_the_problem(tmp_path: Path, expected: int, extra: str, message: str) -> None:
    write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(2), numbered(3), numbered(4, success=False)])
    config = write_config(tmp_path, "http://127.0.0.1:1/v1", expected, extra)
    result = CliRunner().invoke(app, ["skills", "build", str(config)], prog_name="shopsimrl")
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
