"""The naive strategy of the testbed policy (``SHOPSIM_POLICY_STRATEGY=naive``): a deliberately
weaker agent, so that two testbed runs can differ by a known amount in a known direction.

It searches with the product kind and the first terms of the instruction, opens the first listed
result, and buys it without choosing options: where the shop requires a value on an axis before
it offers ``buy now``, it takes the first value the page offers, whatever the task asked for.
Like :func:`shopsimrl.testbed.heuristics.decide` it reads only what a model sees and is a pure
function of the messages and offered tools.
"""

from __future__ import annotations

import re
from typing import Any

from shopsimrl.testbed.heuristics import Decision
from shopsimrl.testbed.heuristics_pages import (
    ASIN,
    BACK,
    BUTTONS,
    BUY,
    NEXT,
    extract_keywords,
    history,
    offered,
    parse_observation,
)

__all__ = ["decide_naive"]


def _queries(instruction: str) -> list[str]:
    kind, terms = extract_keywords(instruction)
    head = re.sub(r"[\s，,。；;！!？?、：:]+", " ", instruction).strip()[:20]
    queries = [" ".join([kind, *terms[:3]]), kind, head] if kind else [head]
    return [q for q in dict.fromkeys(q.strip() for q in queries) if q] or ["商品"]


def decide_naive(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Decision | None:
    """The next tool call of the naive strategy, or None when no tool is offered. A click value
    is always one of the offered enum values."""
    tools_offered = offered(tools)
    if not tools_offered:
        return None
    hist = history(messages)
    if "search" in tools_offered:
        queries = _queries(hist.instruction)
        query = queries[min(hist.searches, len(queries) - 1)]
        return Decision("search", {"query": query}, f"用关键词「{query}」搜索。")
    clicks = list(tools_offered.get("click") or [])
    if not clicks:
        return Decision(next(iter(tools_offered)), {}, "没有可点击的元素。")
    if BUY in clicks:
        return Decision("click", {"value": BUY}, "直接购买。")
    observation = parse_observation(hist.observation)
    listed = [product.asin for product in observation.products if product.asin in clicks]
    if listed:
        return Decision("click", {"value": listed[0]}, "打开第一个搜索结果。")
    # A product page without "buy now": an axis still needs a value; take the first one offered.
    for axis, (selected, _values) in observation.axes.items():
        entry = next((c for c in clicks if c.startswith(f"{axis}=")), None)
        if selected is None and entry is not None:
            return Decision("click", {"value": entry}, f"规格「{axis}」必须选择，选第一个。")
    options = [c for c in clicks if "=" in c and c not in BUTTONS and not ASIN.match(c)]
    for value in (*options, *[c for c in clicks if ASIN.match(c)], NEXT, BACK):
        if value in clicks:
            return Decision("click", {"value": value}, "选择第一个可用的操作。")
    return Decision("click", {"value": clicks[0]}, "选择第一个可用的操作。")
