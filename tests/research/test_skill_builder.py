"""The skill builder's foundation: compact_trace's redaction, the firewall's six rules, the
forced NO_PROPOSAL rules, the cards' schemas and validation, and, against the real HTTP
OpenAI-compatible stub with scripted replies, the structured call (one tool call, repair turns
quoting only the latest invalid arguments, attempts exhausted) and the success analyst (error
records, placeholder cards, resume by fingerprint, kill -9 mid-run then resume)."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.model import OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.records import EpisodeTrace
from shopsimrl.records.io import dump_line, read_trace
from shopsimrl.research.skills.analyst import (
    ANALYSES_NAME,
    CARDS_NAME,
    ERRORS_NAME,
    SUMMARY_NAME,
    AnalystConfig,
    SkillInputError,
    latest_traces,
    run_success_analysis,
)
from shopsimrl.research.skills.cards import (
    FAILURE_TOOL,
    SUCCESS_TOOL,
    FailureCard,
    SuccessCards,
    tool,
    validate_arguments,
)
from shopsimrl.research.skills.compact import compact_trace
from shopsimrl.research.skills.firewall import (
    FIREWALL_RULES,
    enforce_no_proposal,
    firewall_findings,
    forced_no_proposal_reasons,
)
from shopsimrl.research.skills.structured import structured_call
from tests.openai_stub import OpenAIStub, Received, Reply, completion, tool_call

from .conftest import hold_at, stopped_while_held

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "legacy_v4_traces.jsonl"


def _fixture(index: int) -> dict[str, Any]:
    return orjson.loads(FIXTURE.read_bytes().splitlines()[index])


def train_trace(task_id: int, *, success: bool = True) -> dict[str, Any]:
    """A completed train trace (the fixture's successful or failed lamp episode) as a dict."""
    record = copy.deepcopy(_fixture(0 if success else 1))
    record["episode_id"] = f"task-{task_id:06d}__sample-000"
    record["job"].update(task_id=task_id, sample_id=0, split="train")
    return record


def leaky_trace() -> EpisodeTrace:
    """The successful trace with identifiers planted where compact_trace must redact them."""
    record = train_trace(3)
    record["reset"]["user_persona"] = {
        "用户ID": "U-99887766",
        "注册时间": "2024-01-01",
        "最后更新时间": "2025-02-02",
        "消费偏好": "性价比",
    }
    record["steps"][0]["observation"] += "\nASIN: B0ABCDEFGH 编号 12345678901"
    record["steps"][0]["model"]["reasoning"] = "这是 task-3 的第一步"
    record["final"]["goal"]["goal_options"] = {"颜色分类": "象牙白磨砂款"}
    return read_trace(record)


# --------------------------------------------------------------------------- compact_trace


def test_compact_trace_redacts_identifiers_and_keeps_the_pages() -> None:
    compact = compact_trace(leaky_trace())
    text = orjson.dumps(compact).decode()
    assert "B0ABCDEFGH" not in text and "product id: <redacted>" in text
    assert "12345678901" not in text and "<product_id>" in text
    assert "task-3" not in text and "<task_id>" in text
    assert "10000001" not in text  # the page's product id, 8 digits: known from the trace, redacted
    assert compact["steps"][1]["action"] == "click[<product_id>]"
    assert compact["persona"] == {"消费偏好": "性价比"}
    assert "U-99887766" not in text and "2024-01-01" not in text
    detail = compact["steps"][2]
    assert detail["page_type"] == "product_detail" and detail["missing_option_axes"] == ["颜色分类"]
    assert detail["product"] == {
        "title": "护眼LED台灯",
        "brand": "光明店",
        "category": "家居",
        "price": "199.0",
        "attributes": ["护眼"],
    }
    assert detail["options"]["available"] == {"颜色分类": ["白色", "黑色"]}
    assert compact["steps"][0]["feedback"]["reason"] == "executed"
    outcome = compact["outcome"]
    assert outcome["r_success"] == 1 and outcome["termination_reason"] == "purchase"
    assert outcome["purchase"] == {"name": "护眼LED台灯", "category": "家居", "price": 199.0, "options": {"颜色分类": "白色"}}
    assert "gold" not in compact and "象牙白磨砂款" not in text
    gold = compact_trace(leaky_trace(), include_gold=True)["gold"]
    assert gold["goal_options"] == {"颜色分类": "象牙白磨砂款"} and "asin" not in gold


# --------------------------------------------------------------------------- firewall


@pytest.mark.parametrize(
    ("rule", "text"),
    [
        ("mentions_asin", "先看 ASIN 再决定"),
        ("mentions_asin", "直接点 B0ABCDEFGH"),
        ("mentions_asin", "直接点 10000001"),  # a product id of the trace's pages
        ("contains_long_identifier", "订单 12345678901 的做法"),
        ("contains_task_id", "像 task-42 那样"),
        ("copies_instance_product_title", "购买 护眼 LED台灯 即可"),
        ("copies_instance_brand", "优先选光明店"),
        ("copies_gold_option", "选择象牙白磨砂款"),
    ],
)
def test_each_firewall_rule_fires_alone(rule: str, text: str) -> None:
    assert [finding["rule"] for finding in firewall_findings(text, leaky_trace())] == [rule]


def test_clean_text_and_short_instance_facts_pass_the_firewall() -> None:
    trace = leaky_trace()
    assert firewall_findings("先确认颜色分类等选项，再核对价格是否在预算内，最后购买", trace) == []
    assert firewall_findings("选白色的", trace) == []  # 白色 is a gold option under 6 characters
    # Without the trace only the identifier rules apply.
    assert [f["rule"] for f in firewall_findings("光明店 task-1", None)] == ["contains_task_id"]
    assert set(FIREWALL_RULES) >= {f["rule"] for f in firewall_findings("ASIN 12345678901 task-1 光明店", trace)}


# --------------------------------------------------------------------------- cards and forced NO_PROPOSAL


def failure_card(status: str = "PROPOSE_ADD", *, target: str | None = None, content: str = "先补全所有规格再购买") -> FailureCard:
    arguments = {
        "status": status,
        "privileged_audit": {
            "gold_asins": ["10000001"],
            "failure_surface": "规格未选",
            "earliest_divergence": {"step": 3, "description": "未选颜色就购买"},
            "oracle_comparison": "金标要求白色",
            "replay_evidence": ["选白色后购买成功"],
            "minimal_repair": "购买前补全颜色",
            "repair_validation_result": "r_success=1",
        },
        "deployable_abstraction": {
            "mechanism": "缺规格的购买不满足要求",
            "applicable_when": "详情页有未选规格",
            "trigger": "看到 missing_option_axes 非空",
            "corrective_procedure": ["逐个选择规格", "确认后购买"],
            "verification": "规格全部已选",
            "target": target,
            "proposed_content": content,
        },
    }
    card, problem = validate_arguments(FailureCard, arguments)
    assert problem is None and card is not None
    return card


GROUNDED = {"valid_live_actions": 3, "successful_trials": 1}


@pytest.mark.parametrize(
    ("card", "facts", "reason"),
    [
        (failure_card(), {"valid_live_actions": 0, "successful_trials": 1}, "proposal_without_grounded_live_action"),
        (failure_card(), {"valid_live_actions": 2, "successful_trials": 0}, "proposal_without_successful_counterfactual"),
        (failure_card("PROPOSE_REWRITE", target="check-options"), {**GROUNDED, "stage": "cold_start"}, "rewrite_at_cold_start"),
        (failure_card("PROPOSE_REWRITE", target="no-such-chunk"), {**GROUNDED, "stage": "online"}, "invalid_rewrite_target"),
        (failure_card(content="购买光明店的台灯"), GROUNDED, "firewall_finding"),
    ],
)
def test_each_forced_no_proposal_rule(card: FailureCard, facts: dict[str, Any], reason: str) -> None:
    facts = {"stage": "cold_start", **facts}
    reasons = forced_no_proposal_reasons(card, **facts, active_skill_ids=["check-options"], trace=leaky_trace())
    assert reasons == [reason]
    forced, why = enforce_no_proposal(card, reasons)
    assert forced.status == "NO_PROPOSAL" and why == [reason]
    assert forced.deployable_abstraction == card.deployable_abstraction  # the analysis is kept


def test_a_grounded_proposal_and_a_no_proposal_are_left_alone() -> None:
    card = failure_card("PROPOSE_REWRITE", target="check-options")
    assert forced_no_proposal_reasons(card, stage="online", **GROUNDED, active_skill_ids=["check-options"]) == []
    quiet = failure_card("NO_PROPOSAL")
    assert forced_no_proposal_reasons(quiet, stage="cold_start", valid_live_actions=0, successful_trials=0) == []
    assert enforce_no_proposal(card, [])[0] is card


def test_tool_schemas_are_self_contained_and_validation_names_the_field() -> None:
    success = tool(SUCCESS_TOOL, "d", SuccessCards, cards=2)
    assert success["function"]["parameters"]["properties"]["cards"]["maxItems"] == 2
    assert "$ref" not in orjson.dumps(tool(FAILURE_TOOL, "d", FailureCard)).decode()
    card = {
        "mechanism": "m",
        "applicable_when": "a",
        "observed_evidence": [{"step": 1, "evidence": "e"}],
        "decisive_behavior": "d",
        "generalizable_lesson": "g",
        "related_chunk_ids": [],
        "confidence": "0.9",
    }
    assert validate_arguments(SuccessCards, {"cards": [card]})[1] == "$.cards[0].confidence: Input should be a valid number"
    card["confidence"] = 1.5
    assert "$.cards[0].confidence" in str(validate_arguments(SuccessCards, {"cards": [card]})[1])
    card["confidence"] = 0.5
    assert validate_arguments(SuccessCards, {"cards": [card] * 3}, cards=2)[1] == "$.cards: 3 items, at most 2 allowed"
    assert "unexpected" in str(validate_arguments(SuccessCards, {"cards": [], "extra": 1})[1]).lower() or "extra" in str(
        validate_arguments(SuccessCards, {"cards": [], "extra": 1})[1]
    )
    proposal = orjson.loads(orjson.dumps(failure_card().model_dump()))
    proposal["deployable_abstraction"] = None
    assert "deployable_abstraction is required" in str(validate_arguments(FailureCard, proposal)[1])


# --------------------------------------------------------------------------- against the HTTP stub


def settings(url: str) -> OpenAICompatibleSettings:
    return OpenAICompatibleSettings(
        model="stub-model", base_url=url, api_key_env=None, max_retries=1, retry_backoff_seconds=0.0, max_tokens=1024,
        tool_choice={"type": "function", "function": {"name": SUCCESS_TOOL}},
    )  # fmt: skip


def good_card(step: int = 1, lesson: str = "先用核心品类词加关键属性搜索，再逐项核对") -> dict[str, Any]:
    return {
        "mechanism": "关键词包含核心属性，结果更集中",
        "applicable_when": "任务给出明确属性和预算时",
        "observed_evidence": [{"step": step, "evidence": "搜索词包含属性词"}],
        "decisive_behavior": "搜索时加入属性词",
        "generalizable_lesson": lesson,
        "related_chunk_ids": [],
        "confidence": 0.7,
    }


def cards_reply(*cards: dict[str, Any], raw: str | None = None) -> Reply:
    arguments = raw if raw is not None else orjson.dumps({"cards": list(cards)}).decode()
    return Reply(json=completion(tool_calls=[tool_call(SUCCESS_TOOL, arguments)]))


def _call(url: str, *, attempts: int = 3, seed: int | None = 7) -> Any:
    async def go() -> Any:
        model = OpenAICompatibleChatModel(settings(url))
        try:
            return await structured_call(
                model,
                system="sys",
                user={"trace": "t"},
                tool=tool(SUCCESS_TOOL, "d", SuccessCards, cards=2),
                validate=lambda args: validate_arguments(SuccessCards, args, cards=2),
                attempts=attempts,
                seed=seed,
            )
        finally:
            await model.aclose()

    return asyncio.run(go())


@pytest.mark.slow
def test_one_valid_tool_call_is_one_request_with_the_tool_forced(stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    server.queue(cards_reply(good_card()))
    result = _call(url)
    assert result.status == "ok" and len(result.value.cards) == 1 and len(result.attempts) == 1
    (request,) = server.completions
    body = request.json
    assert body["tool_choice"] == {"type": "function", "function": {"name": SUCCESS_TOOL}}
    assert [t["function"]["name"] for t in body["tools"]] == [SUCCESS_TOOL]
    assert body["seed"] == 7


@pytest.mark.slow
def test_repair_turns_quote_the_error_and_only_the_latest_invalid_arguments(stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    first = '{"cards": [{"mechanism": "FIRST-INVALID"}]}'
    second = '{"cards": "SECOND-INVALID"}'
    server.queue(cards_reply(raw=first), cards_reply(raw=second), cards_reply(good_card()))
    result = _call(url)
    assert result.status == "ok" and len(result.attempts) == 3
    requests = [r.json for r in server.completions]
    assert [r["seed"] for r in requests] == [7, 8, 9]
    assert len(requests[0]["messages"]) == 2
    repair1 = requests[1]["messages"][-1]["content"]
    assert "FIRST-INVALID" in repair1 and "$.cards[0].applicable_when: Field required" in repair1
    repair2 = requests[2]["messages"]
    assert len(repair2) == 3  # system, task, one repair turn: the conversation does not grow
    assert "SECOND-INVALID" in repair2[-1]["content"] and "FIRST-INVALID" not in orjson.dumps(repair2).decode()
    assert "$.cards: Input should be a valid list" in repair2[-1]["content"]


@pytest.mark.slow
def test_no_tool_call_or_two_calls_are_contract_errors_and_attempts_run_out(stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    valid = orjson.dumps({"cards": []}).decode()
    server.queue(
        Reply(json=completion(content="我觉得没有", finish_reason="stop")),
        Reply(json=completion(tool_calls=[tool_call(SUCCESS_TOOL, valid, "a"), tool_call(SUCCESS_TOOL, valid, "b")])),
        cards_reply(raw="not json"),
    )
    result = _call(url)
    assert result.status == "invalid" and len(result.attempts) == 3
    errors = [attempt["error"] for attempt in result.attempts]
    assert errors[0].startswith(f"no call to {SUCCESS_TOOL}")
    assert "exactly once" in errors[1]
    assert "not valid JSON" in errors[2] or "not a JSON object" in errors[2] or "no call" in errors[2]
    assert "3 attempts" in result.error["message"]


def write_traces(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(dump_line(read_trace(record)) for record in records))
    return path


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def request_episode(request: Received) -> int:
    """The task id whose trace a request carries (its instruction is unique per test trace)."""
    user = orjson.loads(request.json["messages"][1]["content"])
    return int(user["trace"]["instruction"].split("#")[-1])


def numbered(task_id: int, *, success: bool = True) -> dict[str, Any]:
    record = train_trace(task_id, success=success)
    record["reset"]["task_instruction"] += f" #{task_id}"
    return record


def test_latest_traces_refuses_what_it_cannot_build_from(tmp_path: Path) -> None:
    bad = numbered(1)
    bad["job"]["split"] = "val"
    with pytest.raises(SkillInputError, match=r"task-000001__sample-000: job.split is 'val'"):
        latest_traces(write_traces(tmp_path / "a.jsonl", [bad]))
    with pytest.raises(SkillInputError, match="2 episodes, but exactly 3 are expected"):
        latest_traces(write_traces(tmp_path / "b.jsonl", [numbered(1), numbered(2), numbered(1)]), expected=3)
    assert len(latest_traces(tmp_path / "b.jsonl", expected=2)) == 2


@pytest.mark.slow
def test_analyst_writes_cards_errors_placeholders_and_resumes_by_fingerprint(
    tmp_path: Path, stub: tuple[OpenAIStub, str]
) -> None:
    server, url = stub
    traces = latest_traces(
        write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(2), numbered(3), numbered(4, success=False)])
    )
    config = AnalystConfig(model=settings(url), concurrency=1)

    def first_run(request: Received) -> Reply:
        episode = request_episode(request)
        if episode == 1:
            return cards_reply(good_card(), good_card(2, lesson="购买光明店的台灯"))  # the 2nd breaks the firewall
        if episode == 2:
            return cards_reply()  # nothing non-trivial: a placeholder
        return cards_reply(good_card(step=99))  # a step the trace does not have, every attempt

    server.responder = first_run
    out = tmp_path / "out"
    summary = run_success_analysis(traces, out, config)
    assert len(server.completions) == 1 + 1 + 3
    assert summary["status"] == "incomplete"
    assert summary["episodes"] | {"missing_episode_ids": None} == {
        "total": 4, "success": 3, "failure_pending": 1, "analysed": 2, "analysed_now": 2, "reused": 0,
        "errors_now": 1, "missing": 1, "missing_episode_ids": None,
    }  # fmt: skip
    assert summary["cards"] == {"total": 3, "eligible": 1, "placeholders": 1}
    assert summary["firewall_findings"] == {"copies_instance_brand": 1}
    cards = _lines(out / CARDS_NAME)
    assert [c["card_id"] for c in cards] == [
        "success-task-000001__sample-000-01",
        "success-task-000001__sample-000-02",
        "success-task-000002__sample-000-00",
    ]
    assert cards[0]["evidence_refs"] == [{"episode_id": "task-000001__sample-000", "step": 1}]
    assert cards[1]["eligible"] is False and cards[2]["placeholder"] is True
    (error,) = _lines(out / ERRORS_NAME)
    assert error["episode_id"] == "task-000003__sample-000" and error["status"] == "invalid"
    assert "$.cards[0].observed_evidence[0].step: 99 is not a step" in error["attempts"][-1]["error"]

    # Resume: the two analysed episodes are reused; only the failed one is asked again.
    server.reset()
    server.responder = lambda request: cards_reply(good_card())
    summary = run_success_analysis(traces, out, config)
    assert [request_episode(r) for r in server.completions] == [3]
    assert summary["episodes"]["reused"] == 2 and summary["episodes"]["missing"] == 0
    assert summary["incomplete_reasons"] == ["1 failed trajectories wait for the failure analyst, which did not run"]

    # A changed limit changes every input fingerprint: everything is analysed again.
    server.reset()
    server.responder = lambda request: cards_reply(good_card())
    summary = run_success_analysis(traces, out, AnalystConfig(model=settings(url), concurrency=1, max_cards=1))
    assert sorted(request_episode(r) for r in server.completions) == [1, 2, 3]
    assert summary["cards"] == {"total": 3, "eligible": 3, "placeholders": 0}
    latest = {}
    for record in _lines(out / ANALYSES_NAME):
        latest[record["episode_id"]] = record
    assert len(latest) == 3 and len(_lines(out / ANALYSES_NAME)) == 6  # appended; the latest wins
    assert orjson.loads((out / SUMMARY_NAME).read_bytes())["limits"]["max_cards"] == 1


CHILD = """
import sys
from pathlib import Path
from shopsimrl.model import OpenAICompatibleSettings
from shopsimrl.research.skills.analyst import AnalystConfig, latest_traces, run_success_analysis
settings = OpenAICompatibleSettings(model="stub-model", base_url=sys.argv[1], api_key_env=None, max_retries=1,
    retry_backoff_seconds=0.0, max_tokens=1024, timeout=600,
    tool_choice={"type": "function", "function": {"name": "submit_success_cards"}})
traces = latest_traces(Path(sys.argv[2]))
run_success_analysis(traces, Path(sys.argv[3]), AnalystConfig(model=settings, concurrency=1))
"""


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_loses_nothing_and_redoes_nothing(tmp_path: Path, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    path = write_traces(tmp_path / "traces.jsonl", [numbered(n) for n in range(1, 6)])
    out = tmp_path / "out"
    third_asked, killed = threading.Event(), threading.Event()
    # The child is killed while it waits for the third answer.
    server.responder = hold_at(server, 3, third_asked, killed, lambda: cards_reply(good_card()))
    child = subprocess.Popen([sys.executable, "-c", CHILD, url, str(path), str(out)], cwd=REPO, stderr=subprocess.PIPE)
    with stopped_while_held(child, third_asked, killed, "no 3rd request"):
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    before = _lines(out / ANALYSES_NAME)
    assert [r["episode_id"] for r in before] == ["task-000001__sample-000", "task-000002__sample-000"]
    # A torn write on top (the kill landing mid-line): cut off before the next append.
    with (out / ANALYSES_NAME).open("ab") as handle:
        handle.write(b'{"analysis_version": "shopsimrl-traj')

    server.reset()
    server.responder = lambda request: cards_reply(good_card())
    summary = run_success_analysis(latest_traces(path), out, AnalystConfig(model=settings(url), concurrency=1))
    assert sorted(request_episode(r) for r in server.completions) == [3, 4, 5]  # nothing redone
    after = _lines(out / ANALYSES_NAME)
    assert after[:2] == before  # nothing lost
    assert sorted(r["episode_id"] for r in after) == [f"task-{n:06d}__sample-000" for n in range(1, 6)]
    assert summary["status"] == "complete" and summary["cards"]["eligible"] == 5


# --------------------------------------------------------------------------- consolidator


def evidence_card(n: int, *, eligible: bool = True, episode: int = 1) -> dict[str, Any]:
    return {
        "card_id": f"success-task-{episode:06d}__sample-000-{n:02d}",
        "channel": "success",
        "episode_id": f"task-{episode:06d}__sample-000",
        "placeholder": False,
        "eligible": eligible,
        "card": good_card(),
    }


def cluster(*card_ids: str, procedure: str = "先补全规格再购买") -> dict[str, Any]:
    return {
        "workflow_stage": "变体与价格",
        "mechanism": "规格补全后才满足要求",
        "applicable_when": "详情页有未选规格",
        "procedure": [procedure],
        "verification": "规格全部已选",
        "common_failure": "漏选规格",
        "evidence_card_ids": list(card_ids),
    }


def clusters_reply(clusters: list[dict[str, Any]], evidence_only: list[str]) -> Reply:
    arguments = orjson.dumps({"clusters": clusters, "evidence_only_card_ids": evidence_only}).decode()
    return Reply(json=completion(tool_calls=[tool_call("submit_clusters", arguments)]))


def batch_card_ids(request: Received) -> list[str]:
    return [card["card_id"] for card in orjson.loads(request.json["messages"][1]["content"])["cards"]]


def all_but_last_clustered(request: Received) -> Reply:
    ids = batch_card_ids(request)
    return clusters_reply([cluster(*ids[:-1])], ids[-1:])


@pytest.mark.slow
def test_consolidator_batches_eligible_cards_and_resumes_by_fingerprint(tmp_path: Path, stub: tuple[OpenAIStub, str]) -> None:
    from shopsimrl.research.skills.consolidate import BATCHES_NAME, ConsolidatorConfig, run_consolidation

    server, url = stub
    cards = [evidence_card(n, episode=n // 10 + 1) for n in range(45)] + [evidence_card(90, eligible=False)]
    config = ConsolidatorConfig(model=settings(url), concurrency=1)
    server.responder = all_but_last_clustered
    summary = run_consolidation(cards, tmp_path, config)
    assert [len(batch_card_ids(r)) for r in server.completions] == [40, 5]  # the ineligible card is left out
    assert summary["status"] == "complete"
    assert summary["batches"]["total"] == 2 and summary["clusters"] == 2 and summary["evidence_only_cards"] == 2
    records = _lines(tmp_path / BATCHES_NAME)
    assert [r["batch_id"] for r in records] == ["success-batch-001", "success-batch-002"]
    assert records[1]["clusters"][0]["cluster_id"] == "success-batch-002-cluster-01"
    assert server.completions[0].json["messages"][1]["content"].count('"max_clusters":12') == 1
    assert '"max_clusters":5' in server.completions[1].json["messages"][1]["content"]  # min(12, cards)

    server.reset()
    server.responder = all_but_last_clustered
    assert run_consolidation(cards, tmp_path, config)["batches"]["consolidated_now"] == 0
    assert server.completions == []


@pytest.mark.slow
def test_consolidator_contract_every_card_once_and_the_firewall(tmp_path: Path, stub: tuple[OpenAIStub, str]) -> None:
    from shopsimrl.research.skills.consolidate import ConsolidatorConfig, run_consolidation

    server, url = stub
    cards = [evidence_card(n) for n in range(1, 4)]
    a, b, c = (card["card_id"] for card in cards)
    traces = {"task-000001__sample-000": leaky_trace()}
    server.queue(
        clusters_reply([cluster(a, b)], []),  # c is missing
        clusters_reply([cluster(a, b)], [b, c]),  # b twice
        clusters_reply([cluster(a, b, procedure="直接买光明店的")], [c]),  # copies a brand
        clusters_reply([cluster(a, "success-other-01")], [b, c]),  # a card of no batch
        clusters_reply([cluster(a, b)], [c]),
    )
    config = ConsolidatorConfig(model=settings(url), concurrency=1, attempts=5)
    summary = run_consolidation(cards, tmp_path, config, traces)
    assert summary["status"] == "complete" and summary["clusters"] == 1
    repairs = [r.json["messages"][-1]["content"] for r in server.completions[1:]]
    assert f"card ids in no cluster and not evidence-only: {c}" in repairs[0]
    assert f"card ids given more than once: {b}" in repairs[1]
    assert "$.clusters[0]: the firewall refuses it (copies_instance_brand)" in repairs[2]
    assert "card ids not among those given: success-other-01" in repairs[3]

    # Attempts exhausted: the batch is recorded as invalid and tried again by the next run.
    server.reset()
    server.responder = lambda request: clusters_reply([], [])
    out = tmp_path / "again"
    failed = run_consolidation(cards, out, ConsolidatorConfig(model=settings(url), concurrency=1))
    assert failed["status"] == "incomplete" and failed["batches"]["failed_batch_ids"] == ["success-batch-001"]
    assert len(server.completions) == 3
    server.reset()
    server.responder = lambda request: clusters_reply([cluster(a, b, c)], [])
    assert run_consolidation(cards, out, ConsolidatorConfig(model=settings(url), concurrency=1))["status"] == "complete"
    assert len(server.completions) == 1
