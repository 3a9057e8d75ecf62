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


def _tool_name(request: Received) -> str:
    return str(request.json["tools"][0]["function"]["name"])


def answer(request: Received) -> Reply:
    name = _tool_name(request)
    user = orjson.loads(request.json["messages"][1]["content"])
    if name == "submit_success_cards":
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


def write_config(tmp_path: Path, url: str, expected: int = 4, extra: str = "") -> Path:
    path = tmp_path / "skills.yaml"
    path.write_text(
        f"experiment: {{traces: traces.jsonl, output_dir: out, expected_trajectories: {expected}, concurrency: 2}}\n"
        "proposal_checkpoint: qwen35-4b-initial\n"
        f"analyst_model: {{name: stub-model, base_url: '{url}', api_key_env: null, max_retries: 1}}\n" + extra,
        encoding="utf-8",
    )
    return path


@pytest.mark.slow
def test_traces_to_a_gate_a_draft_then_a_rerun_asks_nothing(tmp_path: Path, served: tuple[OpenAIStub, str]) -> None:
    server, url = served
    server.reset()
    server.responder = answer
    write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(2), numbered(3), numbered(4, success=False)])
    config = write_config(tmp_path, url)
    result = CliRunner().invoke(app, ["skills", "build", str(config)], prog_name="shopsimrl")
    assert result.exit_code == 0, result.output
    assert "3 of 3 successful trajectories analysed" in result.stdout and "1 failed trajectories not analysed" in result.stdout
    assert "compilation    complete: 1 chunks (search-with-attributes)" in result.stdout
    assert [_tool_name(r) for r in server.completions] == ["submit_success_cards"] * 3 + [
        "submit_clusters",
        "submit_initial_skill",
    ]
    assert all(r.json["tool_choice"]["function"]["name"] == _tool_name(r) for r in server.completions)

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
    ],
)
def test_bad_configs_and_inputs_exit_2_naming_the_problem(tmp_path: Path, expected: int, extra: str, message: str) -> None:
    write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(2), numbered(3), numbered(4, success=False)])
    config = write_config(tmp_path, "http://127.0.0.1:1/v1", expected, extra)
    result = CliRunner().invoke(app, ["skills", "build", str(config)], prog_name="shopsimrl")
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
