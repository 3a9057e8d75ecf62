"""The testbed's deterministic analyst: the policy server answers the model id
``analyst_model_id`` (``shopsim-analyst`` by default) as the skill builder's analyst, consolidator
and compiler instead of a shopper.

It answers the tool the request offers (the skill builder forces one per call; see
:mod:`shopsimrl.research.skills`) from the user message, which is JSON, and from nothing else:

- ``submit_success_cards`` (``{max_cards, trace, current_skill}``): at most one card per
  behaviour the compact trace shows. **Options**: a click on an option value the page offered
  whose text the task instruction or the persona names; its lesson carries
  ``[[testbed:choose-options]]``. **First result**: a click from a search results page onto the
  product listed first (its title on the next page), then buying it with no option chosen by
  request; its lesson carries ``[[testbed:buy-first]]``. Evidence cites the trace's own step
  numbers; the text is generic Chinese and never quotes a title, brand, id or option value, so
  the firewall has nothing to refuse. Nothing seen: no card (the builder keeps a placeholder).
- ``submit_clusters`` (``{channel, max_clusters, cards}``): one cluster per marker the cards'
  lessons carry, in the markers' fixed order; a card without a marker is evidence-only. Every
  card id exactly once.
- ``submit_initial_skill`` (``{validation_dimension_cap, clusters}``): one chunk per marker (the
  clusters carrying it, e.g. one per batch, together), its procedure carrying the marker so the
  rendered chunk does, with an ASCII title so the chunk id reads well; a cluster without a
  marker is evidence-only.
- ``submit_online_candidates`` (``{max_candidates, current_skills, historical_candidates,
  cards}``): one candidate per marker the failure cards' deployable parts carry: a REWRITE of
  the current chunk whose content carries the marker, else an ADD; a marker some historical
  candidate of the same operation and target already carried gives no candidate (its cards are
  evidence-only, as is a card without a marker).

Since the testbed policy reacts to the markers (:mod:`shopsimrl.testbed.heuristics_skills`), a
Gate A over the compiled draft has known true effects: with ``options_need_skill`` the options
chunk helps and the first-result chunk hurts.
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

from shopsimrl.testbed.heuristics_skills import BUY_FIRST, CHOOSE_OPTIONS

__all__ = ["ANALYST_TOOLS", "analyst_reply", "clusters_of", "initial_skill_of", "online_candidates_of", "success_cards_of"]

ANALYST_TOOLS: Final = ("submit_success_cards", "submit_clusters", "submit_initial_skill", "submit_online_candidates")
_CLICK = re.compile(r"^\s*click\[(.*)\]\s*$", re.S)
_BUY = "buy now"

# What each marker's card, cluster and chunk say (fixed text: the answers are deterministic).
_LESSONS: Final[dict[str, dict[str, Any]]] = {
    CHOOSE_OPTIONS: {
        "title": "Choose requested options",
        "workflow_stage": "商品页：选择规格",
        "mechanism": "用户要的规格取值被逐项选中，买到的商品与需求一致。",
        "applicable_when": "商品页提供颜色、尺码等可选规格，且任务或用户个人文档写明了想要的取值。",
        "decisive_behavior": "下单前在商品页逐项选中任务里写明的规格取值。",
        "lesson": f"在商品页逐项对照任务和用户个人文档里的规格偏好，选中用户想要的取值后再购买。{CHOOSE_OPTIONS}",
        "procedure": [
            "打开商品页后，列出任务和用户个人文档里提到的每个规格要求。",
            f"逐项点击与要求一致的规格取值，全部选中后再点击购买。{CHOOSE_OPTIONS}",
        ],
        "verification": "购买前页面上已选规格与任务要求逐项一致。",
        "common_failure": "不看要求直接使用默认的第一个取值。",
    },
    BUY_FIRST: {
        "title": "Buy first result",
        "workflow_stage": "搜索结果：选择商品",
        "mechanism": "直接打开第一个搜索结果并购买，用很少的步数完成了下单。",
        "applicable_when": "搜索结果页已经列出商品，希望尽快完成购买时。",
        "decisive_behavior": "打开搜索结果中的第一个商品后不再比较，直接购买。",
        "lesson": f"为了节省步数，只用商品类型搜索，直接打开第一个结果并尽快下单。{BUY_FIRST}",
        "procedure": [
            "只用商品类型搜索。",
            f"直接打开第一个搜索结果，不再返回比较，尽快下单。{BUY_FIRST}",
        ],
        "verification": "下单时的商品是搜索结果中的第一个。",
        "common_failure": "在多个结果之间反复比较，浪费步数。",
    },
}
_ORDER: Final = (CHOOSE_OPTIONS, BUY_FIRST)


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _clicked(step: dict[str, Any]) -> str | None:
    match = _CLICK.match(str(step.get("action") or ""))
    return match.group(1).strip() if match else None


def _option_value(step: dict[str, Any]) -> str | None:
    """The value an option click (``click[axis=value]``, or ``click[value]``) picks among those the
    page offered; None for any other action."""
    clicked = _clicked(step)
    if clicked is None:
        return None
    available = _map(_map(step.get("options")).get("available"))
    for axis, values in available.items():
        offered = {str(value) for value in _list(values)}
        for candidate in (clicked.partition("=")[2] if clicked.startswith(f"{axis}=") else None, clicked):
            if candidate in offered:
                return candidate
    return None


def _requested_option_steps(trace: dict[str, Any]) -> list[int]:
    """Steps that click an offered option value the instruction or the persona names."""
    asked = str(trace.get("instruction") or "") + orjson.dumps(trace.get("persona")).decode("utf-8")
    out = []
    for step in _list(trace.get("steps")):
        value = _option_value(_map(step))
        if value and value in asked:
            out.append(int(step["step"]))
    return out


def _first_result_steps(trace: dict[str, Any]) -> list[int]:
    """(the click on the first listed result, the purchase) when the agent bought the first result
    it opened from a search results page without choosing an option by request; else []."""
    steps = [_map(step) for step in _list(trace.get("steps"))]
    for index, step in enumerate(steps[:-1]):
        products = _list(step.get("products"))
        if not products or _clicked(step) is None:
            continue
        opened = _map(steps[index + 1].get("product")).get("title")
        first = _map(products[0]).get("title")
        if opened is None or opened != first:
            return []
        for later in steps[index + 1 :]:
            if (_clicked(later) or "").lower() == _BUY:
                return [int(step["step"]), int(later["step"])]
            if _map(later).get("products"):
                return []  # went back to a result list: not a direct purchase
        return []
    return []


def _card(marker: str, evidence: list[tuple[int, str]]) -> dict[str, Any]:
    text = _LESSONS[marker]
    return {
        "mechanism": text["mechanism"],
        "applicable_when": text["applicable_when"],
        "observed_evidence": [{"step": step, "evidence": note} for step, note in evidence],
        "decisive_behavior": text["decisive_behavior"],
        "generalizable_lesson": text["lesson"],
        "related_chunk_ids": [],
        "confidence": 0.8,
    }


def success_cards_of(data: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``submit_success_cards`` for one analyst input (module docstring)."""
    trace = _map(data.get("trace"))
    cards = []
    options = _requested_option_steps(trace)
    if options:
        cards.append(_card(CHOOSE_OPTIONS, [(step, "在商品页选中了任务要求的规格取值。") for step in options]))
    first = [] if options else _first_result_steps(trace)
    if first:
        cards.append(_card(BUY_FIRST, [(first[0], "打开了搜索结果中的第一个商品。"), (first[1], "没有比较其他结果就直接购买。")]))
    limit = data.get("max_cards")
    return {"cards": cards[: limit if isinstance(limit, int) and limit >= 0 else len(cards)]}


def _marker_of(item: dict[str, Any]) -> str | None:
    text = orjson.dumps(item).decode("utf-8")
    return next((marker for marker in _ORDER if marker in text), None)


def clusters_of(data: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``submit_clusters``: one cluster per marker, every card once."""
    groups: dict[str, list[str]] = {}
    evidence_only = []
    for card in _list(data.get("cards")):
        marker = _marker_of(_map(card))
        card_id = str(_map(card).get("card_id"))
        if marker is None:
            evidence_only.append(card_id)
        else:
            groups.setdefault(marker, []).append(card_id)
    clusters = []
    for marker in _ORDER:
        if marker in groups:
            text = _LESSONS[marker]
            keys = ("workflow_stage", "mechanism", "applicable_when", "procedure", "verification", "common_failure")
            clusters.append({key: text[key] for key in keys} | {"evidence_card_ids": groups[marker]})
    return {"clusters": clusters, "evidence_only_card_ids": evidence_only}


def initial_skill_of(data: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``submit_initial_skill``: one chunk per marker, every cluster once."""
    groups: dict[str, list[str]] = {}
    evidence_only = []
    for cluster in _list(data.get("clusters")):
        marker = _marker_of(_map(cluster))
        cluster_id = str(_map(cluster).get("cluster_id"))
        if marker is None:
            evidence_only.append(cluster_id)
        else:
            groups.setdefault(marker, []).append(cluster_id)
    chunks = []
    for marker in _ORDER:
        if marker in groups:
            text = _LESSONS[marker]
            keys = ("title", "workflow_stage", "applicable_when", "procedure", "verification", "common_failure")
            chunks.append({key: text[key] for key in keys} | {"evidence_cluster_ids": groups[marker]})
    return {"skill_title": "测试环境购物技能", "chunks": chunks, "evidence_only_cluster_ids": evidence_only}


def online_candidates_of(data: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``submit_online_candidates``: one candidate per marker, every card once."""
    groups: dict[str, list[str]] = {}
    evidence_only = []
    for card in _list(data.get("cards")):
        marker = _marker_of(_map(card))
        card_id = str(_map(card).get("card_id"))
        if marker is None:
            evidence_only.append(card_id)
        else:
            groups.setdefault(marker, []).append(card_id)
    current = [_map(skill) for skill in _list(data.get("current_skills"))]
    history = [_map(item) for item in _list(data.get("historical_candidates"))]
    limit = data.get("max_candidates")
    candidates: list[dict[str, Any]] = []
    for marker in _ORDER:
        if marker not in groups:
            continue
        active = next((str(s.get("skill_id")) for s in current if marker in str(s.get("content") or "")), None)
        operation = "ADD" if active is None else "REWRITE"
        proposed = any(
            marker in str(h.get("content") or "") and h.get("operation") == operation and h.get("target_chunk_id") == active
            for h in history
        )
        if proposed or (isinstance(limit, int) and len(candidates) >= limit):
            evidence_only.extend(groups[marker])
            continue
        text = _LESSONS[marker]
        keys = ("workflow_stage", "applicable_when", "procedure", "verification", "common_failure")
        title = text["title"] if active is None else f"{text['title']} (revised)"
        candidates.append(
            {"operation": operation, "target_chunk_id": active, "title": title}
            | {key: text[key] for key in keys}
            | {"failure_mechanism": text["common_failure"], "evidence_card_ids": groups[marker]}
        )
    return {"candidates": candidates, "evidence_only_card_ids": evidence_only}


_ANSWERS: Final = {
    "submit_success_cards": success_cards_of,
    "submit_clusters": clusters_of,
    "submit_initial_skill": initial_skill_of,
    "submit_online_candidates": online_candidates_of,
}


def _requested_tool(tools: list[dict[str, Any]], tool_choice: Any) -> str | None:
    """The forced function's name, else the one analyst tool offered."""
    forced = _map(_map(tool_choice).get("function")).get("name")
    if isinstance(forced, str):
        return forced if forced in _ANSWERS else None
    offered = [_map(item.get("function")).get("name") for item in tools]
    known = [name for name in offered if name in _ANSWERS]
    return known[0] if len(known) == 1 else None


def analyst_reply(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_choice: Any = None
) -> tuple[str | None, str | None, str | None]:
    """``(content, tool name, arguments)`` of the analyst's answer; no tool name: a text answer."""
    name = _requested_tool(tools, tool_choice)
    if name is None:
        return f"没有可回答的工具（需要 {', '.join(ANALYST_TOOLS)} 之一）。", None, None
    user = next((m for m in messages if m.get("role") == "user"), None)
    try:
        data = orjson.loads(str(_map(user).get("content") or ""))
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return "没有找到要分析的内容（用户消息应是 JSON）。", None, None
    return None, name, orjson.dumps(_ANSWERS[name](data)).decode("utf-8")
