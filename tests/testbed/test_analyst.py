"""The testbed's deterministic analyst (shopsimrl/testbed/analyst.py): its decisions on compact
traces written here, their validity under the skill builder's own contract (schemas, evidence
steps, every card and cluster accounted for once, the firewall), and its answers through the real
policy server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from shopsimrl.research.skills.cards import (
    CLUSTERS_TOOL,
    INITIAL_SKILL_TOOL,
    SUCCESS_TOOL,
    Clusters,
    InitialSkill,
    SuccessCards,
    validate_arguments,
)
from shopsimrl.research.skills.firewall import card_text, firewall_findings
from shopsimrl.testbed.analyst import analyst_reply, clusters_of, initial_skill_of, success_cards_of
from shopsimrl.testbed.heuristics_skills import BUY_FIRST, CHOOSE_OPTIONS
from shopsimrl.testbed.policy import PolicySettings, create_app
from shopsimrl.testbed.serving import running_server

RESULTS = [{"title": "云岫哑铃 旋钮调重 静音"}, {"title": "鲸落D8哑铃 防滑 可调节"}]
OPTIONS = {"available": {"重量": ["二十斤", "三十斤"], "颜色分类": ["黑色", "灰色"]}, "selected": {}}


def trace(*steps: dict[str, Any], instruction: str = "找一对哑铃，重量选二十斤") -> dict[str, Any]:
    return {"instruction": instruction, "persona": {"偏好": {}}, "steps": list(steps), "outcome": {"r_success": 1}}


def search(n: int) -> dict[str, Any]:
    return {"step": n, "action": "search[哑铃 二十斤]", "page_type": "search_home"}


def open_result(n: int) -> dict[str, Any]:
    return {"step": n, "action": "click[<product_id>]", "page_type": "search_results", "products": RESULTS}


def on_product(n: int, action: str, title: str = RESULTS[0]["title"]) -> dict[str, Any]:
    return {"step": n, "action": action, "page_type": "product_detail", "product": {"title": title}, "options": OPTIONS}


def markers(cards: dict[str, Any]) -> list[str]:
    return [next(m for m in (CHOOSE_OPTIONS, BUY_FIRST) if m in card["generalizable_lesson"]) for card in cards["cards"]]


def test_an_option_the_task_names_gives_a_choose_options_card_citing_its_step() -> None:
    steps = (search(1), open_result(2), on_product(3, "click[重量=二十斤]"), on_product(4, "click[buy now]"))
    cards = success_cards_of({"max_cards": 2, "trace": trace(*steps)})
    assert markers(cards) == [CHOOSE_OPTIONS]
    assert [item["step"] for item in cards["cards"][0]["observed_evidence"]] == [3]
    value, problem = validate_arguments(SuccessCards, cards, cards=2)
    assert value is not None, problem


def test_the_first_result_bought_directly_gives_a_buy_first_card() -> None:
    # The option clicked is not one the task names (the first value of an axis), so it is not a choice by request.
    steps = (search(1), open_result(2), on_product(3, "click[颜色分类=黑色]"), on_product(4, "click[buy now]"))
    cards = success_cards_of({"max_cards": 2, "trace": trace(*steps)})
    assert markers(cards) == [BUY_FIRST]
    assert [item["step"] for item in cards["cards"][0]["observed_evidence"]] == [2, 4]


@pytest.mark.parametrize(
    "steps",
    [
        # opened the second result
        (search(1), open_result(2), on_product(3, "click[buy now]", title=RESULTS[1]["title"])),
        # went back to the results before buying
        (search(1), open_result(2), on_product(3, "click[< prev]"), open_result(4), on_product(5, "click[buy now]")),
        # never bought
        (search(1), open_result(2), on_product(3, "click[颜色分类=黑色]")),
    ],
    ids=["second-result", "went-back", "no-purchase"],
)
def test_no_card_when_neither_behaviour_shows(steps: tuple[dict[str, Any], ...]) -> None:
    assert success_cards_of({"max_cards": 2, "trace": trace(*steps)}) == {"cards": []}


def test_cards_quote_nothing_the_firewall_refuses() -> None:
    # A trace whose title, brand and wanted value the firewall would catch if a card copied them.
    steps = (search(1), open_result(2), on_product(3, "click[重量=二十斤]"), on_product(4, "click[buy now]"))
    for given in (steps, (search(1), open_result(2), on_product(3, "click[buy now]"))):
        for card in success_cards_of({"max_cards": 2, "trace": trace(*given)})["cards"]:
            text = card_text(card)
            assert firewall_findings(text) == []
            assert all(product["title"] not in text for product in RESULTS) and "二十斤" not in text


def test_clusters_group_cards_by_marker_and_account_for_every_card() -> None:
    choose = success_cards_of({"max_cards": 2, "trace": trace(open_result(2), on_product(3, "click[重量=二十斤]"))})
    first = success_cards_of({"max_cards": 2, "trace": trace(open_result(2), on_product(3, "click[buy now]"))})
    shown = [
        {"card_id": "success-e1-01", **first["cards"][0]},
        {"card_id": "success-e2-01", **choose["cards"][0]},
        {"card_id": "success-e3-01", **first["cards"][0]},
        {"card_id": "success-e4-01", "mechanism": "没有标记", "generalizable_lesson": "没有标记"},
    ]
    answer = clusters_of({"channel": "success", "max_clusters": 4, "cards": shown})
    value, problem = validate_arguments(Clusters, answer, clusters=4)
    assert value is not None, problem
    assert [c["evidence_card_ids"] for c in answer["clusters"]] == [["success-e2-01"], ["success-e1-01", "success-e3-01"]]
    assert answer["evidence_only_card_ids"] == ["success-e4-01"]
    assert CHOOSE_OPTIONS in " ".join(answer["clusters"][0]["procedure"])
    assert BUY_FIRST in " ".join(answer["clusters"][1]["procedure"])


def test_the_compiled_skill_has_one_chunk_per_marker_with_ascii_titles() -> None:
    clusters = clusters_of(
        {
            "cards": [
                {"card_id": "a", "generalizable_lesson": BUY_FIRST},
                {"card_id": "b", "generalizable_lesson": CHOOSE_OPTIONS},
            ]
        }
    )["clusters"]
    shown = [{"cluster_id": f"success-batch-00{n}-cluster-01", **c} for n, c in enumerate(clusters + clusters, start=1)]
    shown.append({"cluster_id": "success-batch-005-cluster-01", "mechanism": "没有标记", "procedure": ["看一看"]})
    answer = initial_skill_of({"validation_dimension_cap": 16, "clusters": shown})
    value, problem = validate_arguments(InitialSkill, answer, chunks=16)
    assert value is not None, problem
    assert [(c["title"], c["evidence_cluster_ids"]) for c in answer["chunks"]] == [
        ("Choose requested options", ["success-batch-001-cluster-01", "success-batch-003-cluster-01"]),
        ("Buy first result", ["success-batch-002-cluster-01", "success-batch-004-cluster-01"]),
    ]
    assert answer["evidence_only_cluster_ids"] == ["success-batch-005-cluster-01"]
    assert CHOOSE_OPTIONS in " ".join(answer["chunks"][0]["procedure"])
    assert BUY_FIRST in " ".join(answer["chunks"][1]["procedure"])


def test_the_tool_comes_from_the_forced_choice_or_the_one_offered() -> None:
    user = [{"role": "system", "content": "x"}, {"role": "user", "content": json.dumps({"cards": []})}]
    offered = [{"type": "function", "function": {"name": CLUSTERS_TOOL}}]
    forced = {"type": "function", "function": {"name": INITIAL_SKILL_TOOL}}
    assert analyst_reply(user, offered)[1] == CLUSTERS_TOOL
    assert analyst_reply(user, offered, forced)[1] == INITIAL_SKILL_TOOL
    content, name, arguments = analyst_reply(user, [])
    assert name is None and arguments is None and content and SUCCESS_TOOL in content
    content, name, _ = analyst_reply([{"role": "user", "content": "不是 JSON"}], offered)
    assert name is None and content and "JSON" in content


@pytest.mark.slow
def test_the_policy_server_answers_the_analyst_model() -> None:
    steps = (search(1), open_result(2), on_product(3, "click[重量=二十斤]"), on_product(4, "click[buy now]"))
    body = {
        "model": "shopsim-analyst",
        "messages": [
            {"role": "system", "content": "分析"},
            {"role": "user", "content": json.dumps({"max_cards": 2, "trace": trace(*steps), "current_skill": None})},
        ],
        "tools": [{"type": "function", "function": {"name": SUCCESS_TOOL, "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": SUCCESS_TOOL}},
    }
    settings = PolicySettings(model_id="shopsim-heuristic")
    with running_server(create_app(settings)) as base, httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
        assert "shopsim-analyst" in [m["id"] for m in client.get("/v1/models").json()["data"]]
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and reply.json()["model"] == "shopsim-analyst"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == SUCCESS_TOOL
        assert markers(json.loads(call["function"]["arguments"])) == [CHOOSE_OPTIONS]
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


# --------------------------------------------------------------------------- the failure flow


def _failure_request(tool_results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    data = {
        "analysis_contract": {"current_skill": None, "stage": "cold_start", "max_live_actions": 11},
        "failed_trace_and_privileged_gold": {
            "steps": [{"step": 1, "action": "search[哑铃]"}, {"step": 2, "action": "click[buy now]"}],
            "outcome": {"purchase": {"options": {"重量": "三十斤"}}},
            "gold": {
                "instruction_text": "请帮我挑一对哑铃，重量二十斤",
                "attributes": ["防滑"],
                "goal_options": ["二十斤"],
                "price_upper": 300.0,
            },
        },
        "fresh_live_session": {"trial": 1, "state": {"page_type": "search_home", "search_available": True, "actions": []}},
    }
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": json.dumps(data)}]
    for result in tool_results:
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "click", "arguments": "{}"}}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": "c", "content": json.dumps(result)})
    return messages


def _reply(messages: list[dict[str, Any]], *names: str) -> tuple[str | None, dict[str, Any]]:
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    _content, name, arguments = analyst_reply(messages, tools, "required")
    return name, json.loads(arguments or "{}")


def test_the_failure_flow_searches_opens_the_gold_match_selects_and_proposes() -> None:
    assert _reply(_failure_request([]), "search", "submit_failure_card") == ("search", {"query": "挑一对哑铃 防滑"})
    results = {
        "page_type": "search_results",
        "actions": ["back to search", "11111111", "22222222"],
        "products": [
            {"asin": "11111111", "title": "甲", "price": "99", "key_attributes": ["静音"]},
            {"asin": "22222222", "title": "乙", "price": "99", "key_attributes": ["防滑"]},
        ],
    }
    step = {"state": results, "done": False}
    assert _reply(_failure_request([step]), "click", "submit_failure_card") == ("click", {"value": "22222222"})
    page = {
        "page_type": "product_detail",
        "actions": ["< prev", "重量=二十斤", "重量=三十斤"],
        "available_options": {"重量": ["三十斤", "二十斤"]},
        "selected_options": {},
    }
    assert _reply(_failure_request([step, {"state": page, "done": False}]), "click", "submit_failure_card") == (
        "click",
        {"value": "重量=二十斤"},
    )
    bought = {"state": {}, "done": True, "reward_detail": {"r_success": 1}, "next_trial": {"state": {"page_type": "search_home"}}}
    name, card = _reply(_failure_request([step, bought]), "search", "submit_failure_card")
    assert name == "submit_failure_card" and card["status"] == "PROPOSE_ADD"
    assert CHOOSE_OPTIONS in card["deployable_abstraction"]["proposed_content"]
    assert card["privileged_audit"]["earliest_divergence"]["step"] == 2
    assert firewall_findings(card_text(card["deployable_abstraction"])) == []
    # A failed trial, or a call that offers only the card: a proposal the forced rule will refuse.
    failed = {**bought, "reward_detail": {"r_success": 0}}
    assert _reply(_failure_request([step, failed]), "search", "submit_failure_card")[1]["status"] == "PROPOSE_ADD"
    assert _reply(_failure_request([]), "submit_failure_card")[0] == "submit_failure_card"
