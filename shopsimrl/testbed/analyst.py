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

- ``submit_failure_card`` (``{analysis_contract, failed_trace_and_privileged_gold,
  fresh_live_session}``, the page's tools offered too): it plays the live session from the
  privileged gold and the latest page of the conversation's tool results. It searches with the
  gold's product kind and attribute values, opens a listed product showing every gold attribute
  within the gold price bounds (the next results page, else the closest one, when none does),
  goes back from a product that does not offer every gold option value, selects the gold option
  values (an axis the gold does not name: its first value) and buys. After a trial with
  ``r_success = 1`` it submits ``PROPOSE_ADD`` whose abstraction carries
  ``[[testbed:choose-options]]`` when the failed trace bought without every gold option value,
  else ``NO_PROPOSAL``. After a trial that did not succeed, or on a call that offers only the
  card, it submits ``PROPOSE_ADD`` all the same: without a successful trial the builder's forced
  rule turns it into ``NO_PROPOSAL``. The text is fixed generic Chinese.

Since the testbed policy reacts to the markers (:mod:`shopsimrl.testbed.heuristics_skills`), a
Gate A over the compiled draft has known true effects: with ``options_need_skill`` the options
chunk helps and the first-result chunk hurts.
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

from shopsimrl.testbed.heuristics_pages import BUY, NEXT, PREV, extract_keywords, norm, price_low
from shopsimrl.testbed.heuristics_skills import BUY_FIRST, CHOOSE_OPTIONS

__all__ = [
    "ANALYST_TOOLS",
    "analyst_reply",
    "clusters_of",
    "failure_step_of",
    "initial_skill_of",
    "online_candidates_of",
    "success_cards_of",
]

ANALYST_TOOLS: Final = (
    "submit_success_cards",
    "submit_clusters",
    "submit_initial_skill",
    "submit_failure_card",
    "submit_online_candidates",
)
FAILURE_TOOL: Final = "submit_failure_card"
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


def _group_by_marker(items: list[Any], id_key: str) -> tuple[dict[str, list[str]], list[str]]:
    """``(marker → ids of the items carrying it, ids of the items carrying none)``, in input order:
    an item without a marker is evidence-only."""
    groups: dict[str, list[str]] = {}
    evidence_only: list[str] = []
    for item in items:
        marker = _marker_of(_map(item))
        item_id = str(_map(item).get(id_key))
        if marker is None:
            evidence_only.append(item_id)
        else:
            groups.setdefault(marker, []).append(item_id)
    return groups, evidence_only


def clusters_of(data: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``submit_clusters``: one cluster per marker, every card once."""
    groups, evidence_only = _group_by_marker(_list(data.get("cards")), "card_id")
    clusters = []
    for marker in _ORDER:
        if marker in groups:
            text = _LESSONS[marker]
            keys = ("workflow_stage", "mechanism", "applicable_when", "procedure", "verification", "common_failure")
            clusters.append({key: text[key] for key in keys} | {"evidence_card_ids": groups[marker]})
    return {"clusters": clusters, "evidence_only_card_ids": evidence_only}


def initial_skill_of(data: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``submit_initial_skill``: one chunk per marker, every cluster once."""
    groups, evidence_only = _group_by_marker(_list(data.get("clusters")), "cluster_id")
    chunks = []
    for marker in _ORDER:
        if marker in groups:
            text = _LESSONS[marker]
            keys = ("title", "workflow_stage", "applicable_when", "procedure", "verification", "common_failure")
            chunks.append({key: text[key] for key in keys} | {"evidence_cluster_ids": groups[marker]})
    return {"skill_title": "测试环境购物技能", "chunks": chunks, "evidence_only_cluster_ids": evidence_only}


def online_candidates_of(data: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``submit_online_candidates``: one candidate per marker, every card once."""
    groups, evidence_only = _group_by_marker(_list(data.get("cards")), "card_id")
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


# --------------------------------------------------------------------------- the failure flow

_FAILURE_TEXT: Final = {
    "failure_surface": "下单的商品缺少任务要求的规格取值或属性，奖励判定为失败。",
    "oracle_comparison": "对照目标需求：失败轨迹买下的商品在规格或属性上与要求不一致。",
    "minimal_repair": "打开符合全部属性和预算的商品后，逐项选中要求的规格取值再购买。",
    "mechanism": "规格取值决定买到的具体款式，只有逐项选中要求的取值，下单的商品才与需求一致。",
    "applicable_when": "商品页提供颜色、尺码、规格等可选项，且任务或用户个人文档写明了想要的取值。",
    "trigger": "在商品页看到尚未选择或停在默认值的规格项。",
    "verification": "购买前页面上已选规格与任务要求逐项一致。",
}


def _gold(data: dict[str, Any]) -> dict[str, Any]:
    return _map(_map(data.get("failed_trace_and_privileged_gold")).get("gold"))


def _options_missed(data: dict[str, Any]) -> bool:
    """The failed trace bought without every gold option value selected."""
    wanted = [str(value) for value in _list(_gold(data).get("goal_options"))]
    purchase = _map(_map(_map(data.get("failed_trace_and_privileged_gold")).get("outcome")).get("purchase"))
    chosen = {str(value) for value in _map(purchase.get("options")).values()}
    return any(value not in chosen for value in wanted)


def _failure_card(data: dict[str, Any], propose: bool) -> dict[str, Any]:
    trace = _map(data.get("failed_trace_and_privileged_gold"))
    steps = [_map(step) for step in _list(trace.get("steps"))]
    buys = [int(step["step"]) for step in steps if (_clicked(step) or "").lower() == _BUY and "step" in step]
    divergence = buys[-1] if buys else (int(steps[-1]["step"]) if steps and "step" in steps[-1] else 0)
    text = _FAILURE_TEXT
    card: dict[str, Any] = {
        "status": "PROPOSE_ADD" if propose else "NO_PROPOSAL",
        "privileged_audit": {
            "gold_asins": [],
            "failure_surface": text["failure_surface"],
            "earliest_divergence": {"step": divergence, "description": "在规格或属性未核对一致时直接下单。"},
            "oracle_comparison": text["oracle_comparison"],
            "replay_evidence": ["实时会话中按要求选中规格后重新购买。"],
            "minimal_repair": text["minimal_repair"],
            "repair_validation_result": "见实时试验的奖励。",
        },
    }
    if propose:
        lesson = _LESSONS[CHOOSE_OPTIONS]
        card["deployable_abstraction"] = {
            "mechanism": text["mechanism"],
            "applicable_when": text["applicable_when"],
            "trigger": text["trigger"],
            "corrective_procedure": list(lesson["procedure"]),
            "verification": text["verification"],
            "target": None,
            "proposed_content": lesson["lesson"],
        }
    return card


def _live_view(messages: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[int | None], set[str]]:
    """(the latest page state, r_success of each finished trial, products opened this trial)."""
    user = next((m for m in messages if m.get("role") == "user"), None)
    try:
        data = orjson.loads(str(_map(user).get("content") or ""))
    except orjson.JSONDecodeError:
        data = {}
    state: dict[str, Any] | None = _map(_map(_map(data).get("fresh_live_session")).get("state"))
    trials: list[int | None] = []
    opened: set[str] = set()
    for message in messages:
        if message.get("role") == "assistant":
            for call in _list(message.get("tool_calls")):
                function = _map(_map(call).get("function"))
                try:
                    arguments = _map(orjson.loads(str(function.get("arguments") or "{}")))
                except orjson.JSONDecodeError:
                    arguments = {}
                value = str(arguments.get("value") or "")
                if function.get("name") == "click" and value.isdigit():
                    opened.add(value)
        if message.get("role") != "tool":
            continue
        try:
            result = _map(orjson.loads(str(message.get("content") or "")))
        except orjson.JSONDecodeError:
            continue
        if "state" not in result:
            continue  # a repair message, not a tool result
        state = _map(result.get("state"))
        if result.get("done") is True:
            trials.append(_map(result.get("reward_detail")).get("r_success"))
            opened = set()
            state = _map(_map(result.get("next_trial")).get("state")) or None
    return state, trials, opened


def _matches(product: dict[str, Any], gold: dict[str, Any]) -> int:
    """How many gold attributes the listing shows; -1 when its price is outside the gold bounds."""
    low = price_low(str(product.get("price") or ""))
    upper, lower = gold.get("price_upper"), gold.get("price_lower")
    if low is not None and ((isinstance(upper, int | float) and low > upper) or (isinstance(lower, int | float) and low < lower)):
        return -1
    shown = {norm(str(item)) for item in _list(product.get("key_attributes"))}
    return sum(1 for attribute in _list(gold.get("attributes")) if norm(str(attribute)) in shown)


def _live_action(state: dict[str, Any], gold: dict[str, Any], opened: set[str]) -> tuple[str, dict[str, str]] | None:
    """The next action of the live trial on page ``state``; None when there is none to take."""
    actions = [str(action) for action in _list(state.get("actions"))]
    page = state.get("page_type")
    if state.get("search_available"):
        kind, _terms = extract_keywords(str(gold.get("instruction_text") or ""))
        values = [str(a).partition("：")[2] or str(a) for a in _list(gold.get("attributes"))]
        return "search", {"query": " ".join([kind, *values]).strip() or "商品"}
    if page == "search_results":
        everything = len(_list(gold.get("attributes")))
        ranked = []
        for rank, product in enumerate(_list(state.get("products"))):
            asin = str(_map(product).get("asin") or "")
            if asin and asin.casefold() in actions and asin not in opened:
                ranked.append((_matches(_map(product), gold), -rank, asin.casefold()))
        full = [item for item in ranked if item[0] == everything]
        if full:
            return "click", {"value": max(full)[2]}
        if NEXT in actions:
            return "click", {"value": NEXT}
        usable = [item for item in ranked if item[0] >= 0]
        return ("click", {"value": max(usable)[2]}) if usable else None
    if page == "product_detail":
        available = {str(axis): [str(v) for v in _list(values)] for axis, values in _map(state.get("available_options")).items()}
        selected = _map(state.get("selected_options"))
        wanted = [str(value) for value in _list(gold.get("goal_options"))]
        offered_values = {value for values in available.values() for value in values}
        if any(value not in offered_values for value in wanted) and PREV in actions:
            return "click", {"value": PREV}
        for axis, values in available.items():
            choice = next((value for value in values if value in wanted), values[0] if values else None)
            if choice is not None and selected.get(axis) != choice and f"{axis}={choice}" in actions:
                return "click", {"value": f"{axis}={choice}"}
        if BUY in actions:
            return "click", {"value": BUY}
    return None


def failure_step_of(data: dict[str, Any], messages: list[dict[str, Any]], offered_tools: list[str]) -> tuple[str, dict[str, Any]]:
    """(tool name, arguments) of the failure analyst's next call (module docstring)."""
    state, trials, opened = _live_view(messages)
    if any(r == 1 for r in trials):
        return FAILURE_TOOL, _failure_card(data, propose=_options_missed(data))
    if trials or state is None or offered_tools == [FAILURE_TOOL]:
        return FAILURE_TOOL, _failure_card(data, propose=True)
    action = _live_action(state, _gold(data), opened)
    if action is None or action[0] not in offered_tools:
        return FAILURE_TOOL, _failure_card(data, propose=True)
    return action


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
        return forced if forced in ANALYST_TOOLS else None
    offered = [_map(item.get("function")).get("name") for item in tools]
    known = [name for name in offered if name in ANALYST_TOOLS]
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
    if name == FAILURE_TOOL:
        offered = [str(_map(item.get("function")).get("name")) for item in tools]
        called, arguments = failure_step_of(data, messages, offered)
        return None, called, orjson.dumps(arguments).decode("utf-8")
    return None, name, orjson.dumps(_ANSWERS[name](data)).decode("utf-8")
