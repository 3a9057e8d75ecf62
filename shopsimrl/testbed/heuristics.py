"""Rule-based shopping decisions over the ShopSimulator text observation.

The heuristic "model" of the testbed sees exactly what a served LLM sees: the chat messages the
runtime builds (system prompt with the user profile, task instruction + rendered Chinese page
text, then one observation per tool call) and the function tools offered for the current page.
:func:`decide` turns that into one tool call. It is a pure function: the same messages, tools,
seed and temperature always give the same decision, and no module-level random state is touched.

Strategy (a plain rule baseline): collect what the user wants from the instruction and from the
profile's preference block (wanted attributes, option choices, budget); search with the product
kind and those terms; on a results page open the unvisited listing that shows every wanted
attribute within budget, paging or re-querying when none does; on a product page go back when
the product lacks a wanted attribute or option value, otherwise select the closest value per
axis (the same fuzzy token-set similarity the reward uses), check the price against the budget,
and buy. From ``URGENT_STEP`` on it stops exploring and buys the best it has.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Any

from shopsimrl.schemas import fingerprint
from shopsimrl.testbed.heuristics_pages import (
    ASIN,
    BACK,
    BUTTONS,
    BUY,
    NEXT,
    PREV,
    History,
    Observation,
    Product,
    contains_term,
    extract_keywords,
    fuzzy_ratio,
    history,
    norm,
    offered,
    parse_budget,
    parse_observation,
    parse_preferences,
    price_low,
    tokens,
)
from shopsimrl.testbed.heuristics_skills import SkillMarkers, skill_markers

__all__ = ["Decision", "Observation", "Product", "decide", "extract_keywords", "parse_budget", "parse_observation"]

# The runtime allows 30 turns by default; from URGENT_STEP on the policy stops exploring and commits.
URGENT_STEP = 20
MAX_SEARCHES = 4
MAX_PAGES_PER_QUERY = 2
MAX_PRODUCTS = 6
MAX_PRICE_TRIES = 3
GOOD_MATCH = 0.3
# The reward counts a fuzzy token-set ratio above 85 as a match; the policy uses the same bar.
FUZZY_MATCH = 85
_ATTRIBUTE_SEPARATOR = re.compile(r"[；;]")
# "轴体为红轴" / "适用人数要五到八人" name an attribute key and value; listings print "键：值".
_KEY_VALUE = re.compile(r"^(.{2,6}?)(?:要|为|是|选)(.{1,12})$")


@dataclass(frozen=True, slots=True)
class Decision:
    """One tool call plus a short Chinese explanation (served as ``reasoning_content``)."""

    tool: str
    arguments: dict[str, str]
    reasoning: str


@dataclass(frozen=True, slots=True)
class _Wants:
    kind: str
    terms: tuple[str, ...]  # distinctive instruction terms (soft: the text is informal)
    attributes: tuple[str, ...]  # profile attributes: a product must show every one
    options: tuple[tuple[str, str], ...]  # profile option choices (axis, value)
    pairs: tuple[tuple[str, str], ...]  # "key is value" instruction terms: an attribute or an option
    budget: float | None
    instruction: str  # normalised instruction text


def _wants(hist: History) -> _Wants:
    prefs = parse_preferences(hist.system)
    kind, terms = extract_keywords(hist.instruction)
    budget = parse_budget(hist.instruction)
    return _Wants(
        kind=kind,
        terms=tuple(terms),
        attributes=prefs.attributes,
        options=prefs.options,
        pairs=tuple((m.group(1), m.group(2)) for m in map(_KEY_VALUE.match, terms) if m),
        budget=budget if budget is not None else prefs.budget,
        instruction=norm(hist.instruction),
    )


# --------------------------------------------------------------------------- matching


def _attribute_list(product: Product) -> tuple[str, ...]:
    return _split_attributes(product.attributes)


@functools.lru_cache(maxsize=1 << 14)
def _split_attributes(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in _ATTRIBUTE_SEPARATOR.split(text) if a.strip())


def _has_attribute(product: Product, wanted: str) -> bool:
    """The reward's attribute test on what the page shows: a fuzzy match with a listed attribute,
    or a substring of the visible text (title and key attributes stand in for the description)."""
    if any(fuzzy_ratio(wanted, attribute) > FUZZY_MATCH for attribute in _attribute_list(product)):
        return True
    return norm(wanted) in norm(f"{product.title} {product.attributes}")


def _term_forms(term: str) -> list[str]:
    found = _KEY_VALUE.match(term)
    return [term, f"{found.group(1)}：{found.group(2)}", found.group(2)] if found else [term]


def _term_score(product: Product, term: str) -> float:
    """1.0 when an informal instruction term is clearly shown, else its share of shared bigrams."""
    forms = _term_forms(term)
    if any(_has_attribute(product, form) for form in forms):
        return 1.0
    wanted = tokens(forms[-1])
    shown = tokens(f"{product.title} {product.attributes}")
    return 0.7 * len(wanted & shown) / len(wanted) if wanted else 0.0


def _kind_score(product: Product, kind: str) -> float:
    wanted = tokens(kind)
    if not wanted:
        return 1.0
    return len(wanted & tokens(f"{product.title} {product.category}")) / len(wanted)


def _relevance(wants: _Wants, product: Product) -> float:
    """Bag-of-bigrams overlap with the instruction, the product kind weighing most."""
    # Sorted: the float sums below depend on the order of their terms, and a set's order depends
    # on the string hash seed; near-tied listings then swapped places between processes.
    wanted: dict[str, float] = {}
    for token in sorted(tokens(" ".join(wants.terms)) | tokens(wants.instruction)):
        wanted[token] = 1.0
    for token in sorted(tokens(wants.kind)):
        wanted[token] = 3.0
    if not wanted:
        return 0.0
    title = tokens(product.title)
    rest = tokens(" ".join((product.category, product.attributes, product.brand)))
    score = sum(w * (1.0 if t in title else 0.6 if t in rest else 0.0) for t, w in wanted.items())
    return score / sum(wanted.values())


def _contradicted(wants: _Wants, product: Product) -> list[str]:
    """Instruction pairs whose key the product lists with a different value (``适用年龄：幼童``)."""
    shown = [a.partition("：") for a in _attribute_list(product)]
    keys = {norm(k) for k, sep, _ in shown if sep}
    return [f"{k}：{v}" for k, v in wants.pairs if norm(k) in keys and not _has_attribute(product, f"{k}：{v}")]


def _missing_attributes(wants: _Wants, product: Product) -> list[str]:
    return [a for a in wants.attributes if not _has_attribute(product, a)] + _contradicted(wants, product)


def _in_budget(wants: _Wants, price: str) -> bool:
    low = price_low(price)
    return wants.budget is None or low is None or low <= wants.budget


def _assess(ctx: _Context, product: Product) -> tuple[float, bool]:
    """(score, acceptable) of a listing: acceptable means worth opening without looking further."""
    wants = ctx.wants
    kind = _kind_score(product, wants.kind)
    in_budget = _in_budget(wants, product.price)
    missing = _missing_attributes(wants, product)  # profile attributes not shown + contradicted pairs
    if wants.attributes:
        terms = [_term_score(product, t) for t in wants.terms]
        soft = sum(terms) / len(terms) if terms else 0.0
        score = max(0.0, 1.0 - len(missing) / len(wants.attributes)) + 0.5 * kind + 0.2 * soft
        acceptable = not missing and kind >= 0.5
    else:
        score = _relevance(wants, product) + 0.1 * (len(wants.pairs) - len(missing))
        acceptable = score >= GOOD_MATCH and not missing
    if not in_budget:
        score, acceptable = score * 0.3, False
    if ctx.rng is not None:
        score += ctx.rng.uniform(0.0, 0.05)
    return score, acceptable


# --------------------------------------------------------------------------- decisions


@dataclass(slots=True)
class _Context:
    hist: History
    obs: Observation
    clicks: list[str]
    can_search: bool
    wants: _Wants
    rng: random.Random | None
    skills: SkillMarkers

    @property
    def urgent(self) -> bool:
        return self.hist.turns + 1 >= URGENT_STEP

    @property
    def can_leave(self) -> bool:
        """Whether rejecting the open product still leaves time to find a better one."""
        return PREV in self.clicks and not self.urgent and len(set(self.hist.visited())) < MAX_PRODUCTS


def decide(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    seed: int | None = None,
    temperature: float = 0.0,
    options_need_skill: bool = False,
) -> Decision | None:
    """The next tool call for this conversation, or None when no tool is offered.

    The result always names an offered tool, and a click value is always one of the enum
    values offered. ``temperature > 0`` adds seeded noise to tie-breaks so that samples with
    different seeds can differ; at 0 the choice depends on the conversation only.
    ``options_need_skill``: wanted options are chosen only when a skill says so
    (:mod:`shopsimrl.testbed.heuristics_skills`).
    """
    tools_offered = offered(tools)
    if not tools_offered:
        return None
    hist = history(messages)
    clicks = list(tools_offered.get("click") or [])
    rng = None
    if temperature > 0:
        rng = random.Random(fingerprint([seed, hist.instruction, len(hist.calls)]))
    ctx = _Context(
        hist=hist,
        obs=parse_observation(hist.observation),
        clicks=clicks,
        can_search="search" in tools_offered,
        wants=_wants(hist),
        rng=rng,
        skills=skill_markers(hist.system, options_need_skill=options_need_skill),
    )
    if ctx.can_search:
        return _search(ctx)
    if not clicks:
        return Decision(next(iter(tools_offered)), {}, "没有可点击的元素。")  # unknown tool shape
    decision = _results(ctx) if ctx.obs.page == "搜索结果" else None
    if decision is None and ctx.obs.page in ("商品详情", "商品属性页"):
        decision = _product(ctx)
    decision = decision or _fallback(ctx)
    if decision.arguments.get("value") not in clicks:  # a parsed page disagreeing with the enum
        decision = _fallback(ctx)
    return decision


def _click(value: str, why: str) -> Decision:
    return Decision("click", {"value": value}, why)


def _attribute_value(attribute: str) -> str:
    """The searchable part of ``键：值`` (the key is shared by the whole category)."""
    return re.split(r"[：:]", attribute)[-1].strip() or attribute


def query_variants(wants: _Wants, instruction: str) -> list[str]:
    """Search queries from specific to broad; the n-th search of an episode uses the n-th one."""
    kind, terms = wants.kind, list(wants.terms)
    short_terms = [_term_forms(t)[-1] for t in terms]
    profile = [_attribute_value(a) for a in wants.attributes]
    options = [value for _, value in wants.options]
    variants: list[str] = []
    if kind:
        if profile:
            variants += [" ".join(dict.fromkeys([kind, *short_terms, *profile, *options])), " ".join([kind, *profile])]
        variants += [" ".join([kind, *terms[:3]]), " ".join([kind, *terms[:1]]), kind]
        if len(kind) > 4:
            variants.append(kind[-3:])  # Chinese is head-final: 男士运动鞋 -> 运动鞋
    fallback = re.sub(r"[\s，,。；;！!？?、：:]+", " ", instruction).strip()[:20]
    variants.append(fallback or "商品")
    return [v for v in dict.fromkeys(v.strip() for v in variants) if v]


def _search(ctx: _Context) -> Decision:
    if ctx.skills.buy_first and ctx.wants.kind:
        return Decision("search", {"query": ctx.wants.kind}, f"按策略提示只用商品类型「{ctx.wants.kind}」搜索。")
    variants = query_variants(ctx.wants, ctx.hist.instruction)
    query = variants[min(ctx.hist.searches, len(variants) - 1)]
    why = f"当前在搜索首页，根据任务和用户偏好提取关键词「{query}」进行搜索。"
    if ctx.hist.searches:
        why = f"之前的搜索结果不理想，换用关键词「{query}」重新搜索。"
    return Decision("search", {"query": query}, why)


def _results(ctx: _Context) -> Decision | None:
    visited = set(ctx.hist.visited())
    listed = [p for p in ctx.obs.products if p.asin in ctx.clicks]
    if ctx.skills.buy_first and listed:
        first = min(listed, key=lambda p: p.rank)
        return _click(first.asin, f"按策略提示直接打开第一个结果「{first.title[:30]}」。")
    assessed = [(*_assess(ctx, p), -p.rank, p) for p in listed]
    fresh = [a for a in assessed if a[3].asin not in visited]
    good = [a for a in fresh if a[1]]
    if good:
        best = max(good, key=lambda a: (a[0], a[2]))[3]
        return _click(best.asin, f"「{best.title[:30]}」具备所需属性且价格在预算内，打开查看。")
    best_fresh = max(fresh, key=lambda a: (a[0], a[2]))[3] if fresh else None
    paging = [arg for tool, arg in ctx.hist.since_last_search() if tool == "click" and arg in (NEXT, PREV)]
    tired = len(visited) >= MAX_PRODUCTS or ctx.urgent
    if best_fresh is not None and tired:
        return _click(best_fresh.asin, f"时间有限，打开最接近要求的「{best_fresh.title[:30]}」。")
    if NEXT in ctx.clicks and len(paging) < MAX_PAGES_PER_QUERY:
        return _click(NEXT, "本页没有完全符合要求的商品，翻到下一页。")
    if BACK in ctx.clicks and ctx.hist.searches < MAX_SEARCHES:
        return _click(BACK, "当前搜索结果不匹配，返回搜索页换关键词。")
    if best_fresh is not None:
        return _click(best_fresh.asin, f"没有更好的选择，打开最接近的商品「{best_fresh.title[:30]}」。")
    if assessed:
        again = max(assessed, key=lambda a: (a[0], a[2]))[3]
        return _click(again.asin, "所有商品都看过了，重新打开最匹配的一个。")
    return None


def _option_clicks(ctx: _Context) -> dict[str, list[str]]:
    """Enum option entries grouped by axis (page order); axis names may themselves contain '='."""
    axes = sorted(ctx.obs.axes, key=len, reverse=True)
    grouped: dict[str, list[str]] = {axis: [] for axis in ctx.obs.axes}
    for entry in ctx.clicks:
        if entry in BUTTONS or ASIN.match(entry) or "=" not in entry:
            continue
        axis = next((a for a in axes if entry.startswith(a + "=")), entry.partition("=")[0])
        grouped.setdefault(axis, []).append(entry)
    return grouped


def _axis_values(ctx: _Context, axis: str, grouped: dict[str, list[str]]) -> list[str]:
    selected, shown = ctx.obs.axes.get(axis, (None, []))
    values = list(shown) or [e[len(axis) + 1 :] for e in grouped.get(axis, [])]
    return values + ([selected] if selected and selected not in values else [])


def _named_share(wants: _Wants, value: str) -> float:
    """How clearly the instruction names an option value: share of its ``|`` parts it contains."""
    parts = [p.strip() for p in value.split("|") if p.strip()]
    return sum(1 for p in parts if contains_term(wants.instruction, p)) / len(parts) if parts else 0.0


def _same_axis(page_axis: str, wanted_axis: str) -> bool:
    a, b = norm(page_axis), norm(wanted_axis)
    return bool(a and b) and (a == b or a in b or b in a or fuzzy_ratio(a, b) > FUZZY_MATCH)


def _desired_options(ctx: _Context, grouped: dict[str, list[str]]) -> tuple[dict[str, str], list[str]]:
    """(axis -> value to select, wanted values this product does not offer)."""
    desired: dict[str, str] = {}
    lacking: list[str] = []
    axes = list(ctx.obs.axes) or list(grouped)
    for wanted_axis, wanted in ctx.wants.options:
        # The value decides the reward; the axis name only says where to look first.
        ranked = sorted(axes, key=lambda a: not _same_axis(a, wanted_axis))
        best: tuple[int, str, str] | None = None
        for axis in ranked:
            if axis in desired:
                continue
            for value in _axis_values(ctx, axis, grouped):
                score = fuzzy_ratio(wanted, value)
                if best is None or score > best[0]:
                    best = (score, axis, value)
        if best is not None and best[0] > FUZZY_MATCH:
            desired[best[1]] = best[2]
        else:
            lacking.append(wanted)
    for key, wanted in ctx.wants.pairs:
        # A pair names an option only when its key is one of the product's axes.
        named = next((a for a in axes if a not in desired and _same_axis(a, key)), None)
        if named is None:
            continue
        score, value = max(((fuzzy_ratio(wanted, v), v) for v in _axis_values(ctx, named, grouped)), default=(0, ""))
        if score > FUZZY_MATCH:
            desired[named] = value
        else:
            lacking.append(f"{key}：{wanted}")
    for axis in axes:
        if axis in desired:
            continue
        scored = [(_named_share(ctx.wants, v), v) for v in _axis_values(ctx, axis, grouped)]
        share, value = max(scored, key=lambda s: s[0], default=(0.0, ""))
        if share >= 0.5:
            desired[axis] = value
    return desired, lacking


def _product(ctx: _Context) -> Decision | None:
    grouped = _option_clicks(ctx)
    product = ctx.obs.product
    asin = product.asin if product else ""
    tried = ctx.hist.since_opening(asin) if asin else []
    last = ctx.hist.calls[-1][1] if ctx.hist.calls else None
    missing = _missing_attributes(ctx.wants, product) if product else []
    # A buy-first skill commits to the product it opened; without the options skill the policy
    # does not look for the wanted option values, so it cannot miss them either.
    can_leave = ctx.can_leave and not ctx.skills.buy_first
    if missing and can_leave:
        return _click(PREV, f"这个商品缺少用户关注的属性「{'、'.join(missing[:3])}」，返回结果列表。")
    desired, lacking = _desired_options(ctx, grouped) if ctx.skills.choose_options else ({}, [])
    if lacking and can_leave:
        return _click(PREV, f"这个商品没有用户想要的规格「{'、'.join(lacking[:3])}」，返回结果列表。")
    order = {axis: i for i, axis in enumerate(ctx.obs.axes)}
    for axis in sorted(desired, key=lambda a: order.get(a, len(order))):  # top to bottom, as on the page
        value = desired[axis]
        selected = ctx.obs.axes.get(axis, (None, []))[0]
        entry = f"{axis}={value}"
        if (
            (selected is None or norm(selected) != norm(value))
            and entry in ctx.clicks
            and not (ctx.obs.last_invalid and entry == last)
        ):
            return _click(entry, f"用户想要「{value}」，选择规格 {axis}。")
    for axis, (selected, _values) in ctx.obs.axes.items():
        entries = [e for e in grouped.get(axis, []) if e not in tried]
        if selected is None and entries:
            pick = entries[0] if ctx.rng is None else ctx.rng.choice(entries)
            return _click(pick, f"规格「{axis}」尚未选择，任务没有指定，选择「{pick[len(axis) + 1 :]}」。")
    if BUY not in ctx.clicks:
        unselected = [axis for axis, (selected, _) in ctx.obs.axes.items() if selected is None]
        if unselected and any(grouped.get(a) for a in unselected):
            pick = grouped[next(a for a in unselected if grouped.get(a))][0]
            return _click(pick, "还有规格未选择，先完成选择。")
        return _click(PREV, "这个商品无法购买，返回搜索结果。") if PREV in ctx.clicks else None
    price = price_low(product.price) if product else None
    budget = ctx.wants.budget
    if budget is not None and price is not None and price > budget and not ctx.urgent and not ctx.skills.buy_first:
        option_tries = [c for c in tried if "=" in c]
        free = [e for axis, entries in grouped.items() if axis not in desired for e in entries if e not in tried]
        if free and len(option_tries) < MAX_PRICE_TRIES:
            return _click(free[0], f"当前价格 {price:g} 超出预算 {budget:g}，尝试其他规格。")
        if ctx.can_leave:
            return _click(PREV, f"价格 {price:g} 超出预算 {budget:g}，返回结果列表看其他商品。")
    return _click(BUY, "规格已选好，商品符合任务要求，购买。")


def _fallback(ctx: _Context) -> Decision:
    """Any reasonable offered click, in order of usefulness; never invents a value."""
    for value in (BUY, *[c for c in ctx.clicks if ASIN.match(c)], NEXT, BACK, PREV):
        if value in ctx.clicks:
            return _click(value, "页面无法完全解析，选择一个可用的操作。")
    return _click(ctx.clicks[0], "选择第一个可用的操作。")
