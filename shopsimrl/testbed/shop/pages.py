"""Page state machine, the canonical ``observation_state`` (v7) and its Chinese text rendering.

The state is built from the session alone; no goal is ever passed in, so it cannot leak the
answer. The renderer additionally refuses states that carry answer-like keys.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shopsimrl.testbed.shop.catalog import Catalog
from shopsimrl.testbed.shop.product import Product
from shopsimrl.testbed.shop.reward import resolve_variant_price
from shopsimrl.testbed.shop.search import PAGE_SIZE, SearchIndex, ServerFault, normalize_query

__all__ = [
    "BACK_TO_SEARCH",
    "BUY_NOW",
    "MISROUTED_PAGE",
    "NEXT_PAGE",
    "OBSERVATION_VERSION",
    "PREV_PAGE",
    "ObservationError",
    "Session",
    "build_observation_state",
    "clickables",
    "option_state",
    "render_observation_state",
]

OBSERVATION_VERSION = "shopping-observation-v7"
BACK_TO_SEARCH = "back to search"
PREV_PAGE = "< prev"
NEXT_PAGE = "next >"
BUY_NOW = "buy now"
FORBIDDEN_KEYS = frozenset({"goal", "reward", "reward_detail", "target_asin", "answer"})
_ASIN = re.compile(r"^\d{8,12}$")

SEARCH_HOME, SEARCH_RESULTS, PRODUCT_DETAIL, TERMINAL = "search_home", "search_results", "product_detail", "terminal"
# The real server's error when it renders a misrouted product page (Session.misrouted) as a results
# page: the results page's product ASINs are not among the product page's actions.
MISROUTED_PAGE = "model-visible search ASINs differ from environment-actionable ASINs"


class ObservationError(ValueError):
    """The public state is malformed or would leak private information."""


@dataclass(slots=True)
class Session:
    """The mutable state of one episode on one slot."""

    task_id: int
    goal: dict[str, Any]
    max_actions: int
    page: str = SEARCH_HOME
    keywords: list[str] | None = None
    normalized_query: str | None = None
    result_asins: list[str] = field(default_factory=list)
    results_page: int | None = None
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    selected_price: float | None = None
    price_resolution: dict[str, Any] | None = None
    last_action: dict[str, Any] | None = None
    action_count: int = 0
    search_count: int = 0
    done: bool = False
    termination_reason: str | None = None

    # ----------------------------------------------------------------- transitions

    @property
    def total_pages(self) -> int:
        return max(1, (len(self.result_asins) + PAGE_SIZE - 1) // PAGE_SIZE)

    def page_asins(self) -> list[str]:
        page = self.results_page or 1
        return self.result_asins[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]

    def search(self, arg: str, index: SearchIndex) -> None:
        """A new query every time; shows page 1. A search the real server fails in its engine (a
        legacy prefix, ServerFault) changes nothing here; one it fails while rendering the results
        (a lone surrogate, see :func:`_unrenderable`) has stored its state, but the page stays."""
        keywords = arg.split(" ")
        self.result_asins = index.results(keywords)
        self.keywords = keywords
        self.normalized_query = normalize_query(" ".join(keywords))
        self.search_count += 1
        failure = _unrenderable(keywords) if self.result_asins else None
        if failure is not None:
            raise ServerFault(failure)
        self.show_results(1)

    @property
    def misrouted(self) -> bool:
        """The real server would take this product page for a results page (see MISROUTED_PAGE).

        It names its pages by URL, tests ``"search_results" in url`` first, and a product page's
        URL embeds the search keywords and the selected options (as ASCII-escaped JSON).
        """
        if self.page != PRODUCT_DETAIL:
            return False
        url_parts = "+".join(self.keywords or []) + json.dumps(self.options)
        return SEARCH_RESULTS in url_parts

    def previous_results(self) -> None:
        """``< prev`` on a product page: back to its results page, or, misrouted, the one before."""
        page = self.results_page or 1
        if self.misrouted:
            # The real server handles the click as "< prev" on a results page: page - 1.
            page -= 1
            if page < 1:
                raise ServerFault("search result page must be positive")
        self.show_results(page)

    def show_results(self, page: int) -> None:
        """Show a page of the cached results; leaving a product forgets its options."""
        self.page, self.results_page = SEARCH_RESULTS, page
        self.asin, self.options = None, {}
        self.selected_price = self.price_resolution = None

    def back_to_search(self) -> None:
        self.page, self.results_page = SEARCH_HOME, None
        self.asin, self.options = None, {}
        self.selected_price = self.price_resolution = None

    def open_product(self, asin: str, catalog: Catalog) -> None:
        self.page, self.asin, self.options = PRODUCT_DETAIL, asin, {}
        self._resolve_price(catalog)

    def select_option(self, axis: str, value: str, catalog: Catalog) -> None:
        self.options[axis] = value
        self._resolve_price(catalog)

    def _resolve_price(self, catalog: Catalog) -> None:
        resolution = resolve_variant_price(catalog.by_asin[self.asin or ""], self.options)
        self.price_resolution = resolution
        self.selected_price = resolution["price"] if resolution["status"] == "pass" else None

    def purchase(self) -> None:
        self.page = TERMINAL


def _unrenderable(keywords: list[str]) -> str | None:
    """The real server's error for a results page it cannot render, or None.

    Each product link (and a "next" link) of its results page carries the keywords in its URL,
    percent-encoded as UTF-8 one keyword at a time; a keyword holding a lone surrogate (valid JSON,
    ``"\\ud800"``, but not valid Unicode) makes that fail with Python's UnicodeEncodeError, whose
    text is the answer: ``'utf-8' codec can't encode character '\\ud800' in position 0: …``. A
    page without results has no such link and renders.
    """
    for keyword in keywords:
        try:
            keyword.encode("utf-8")
        except UnicodeEncodeError as exc:
            return str(exc)
    return None


def option_state(product: Product, options: Mapping[str, str]) -> dict[str, Any]:
    valid: dict[str, str] = {}
    invalid: list[dict[str, str]] = []
    for axis, value in options.items():
        if axis not in product.options:
            invalid.append({"axis": axis, "value": value, "reason": "unknown_axis"})
        elif value not in product.options[axis]:
            invalid.append({"axis": axis, "value": value, "reason": "unknown_value"})
        else:
            valid[axis] = value
    missing = [axis for axis in product.options if axis not in valid]
    return {
        "selected_options": valid,
        "missing_option_axes": missing,
        "invalid_selected_options": invalid,
        "options_complete": not missing and not invalid,
    }


def clickables(session: Session, catalog: Catalog) -> dict[str, tuple[str, ...]]:
    """Click labels available now, in page order, each mapped to what it does."""
    actions: dict[str, tuple[str, ...]] = {}
    if session.page == SEARCH_RESULTS:
        actions[BACK_TO_SEARCH] = ("back",)
        page = session.results_page or 1
        if page > 1:
            actions[PREV_PAGE] = ("page", str(page - 1))
        if page < session.total_pages:
            actions[NEXT_PAGE] = ("page", str(page + 1))
        for asin in session.page_asins():
            actions.setdefault(asin.casefold(), ("open", asin))
    elif session.page == PRODUCT_DETAIL and session.asin is not None:
        product = catalog.by_asin[session.asin]
        actions[BACK_TO_SEARCH] = ("back",)
        actions[PREV_PAGE] = ("results",)
        if option_state(product, session.options)["options_complete"]:
            actions[BUY_NOW] = ("buy",)
        for axis, values in product.options.items():
            for value in values:
                if axis and value and session.options.get(axis) != value:
                    actions.setdefault(f"{axis}={value}", ("option", axis, value))
    return actions


def _compact(values: object, limit: int = 10) -> list[str]:
    if values is None:
        return []
    items = values if isinstance(values, (list, tuple)) else [values]
    return [str(v) for v in items[:limit] if str(v).strip()]


def _summary(product: Product, rank: int | None = None) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "asin": product.asin,
        "title": product.title,
        "brand": product.shop_name,
        "category": product.category,
        "price": product.price_display,
        "key_attributes": _compact(product.attributes),
    }
    if rank is not None:
        summary["rank"] = rank
    return summary


def build_observation_state(session: Session, catalog: Catalog) -> dict[str, Any]:
    """The public page state; it is derived from the session only."""
    if session.misrouted:
        raise ServerFault(MISROUTED_PAGE)
    state: dict[str, Any] = {
        "observation_version": OBSERVATION_VERSION,
        "page_type": session.page,
        "search_available": session.page == SEARCH_HOME,
        "actions": list(clickables(session, catalog)),
    }
    if session.last_action is not None:
        state["last_action"] = dict(session.last_action)
    if session.page == SEARCH_RESULTS:
        asins = session.page_asins()
        start = ((session.results_page or 1) - 1) * PAGE_SIZE
        state.update(
            search_text=" ".join(session.keywords or []),
            normalized_search_text=session.normalized_query or "",
            page=session.results_page or 1,
            total_pages=session.total_pages,
            total_results=len(session.result_asins),
            rank_start=start + 1 if asins else 0,
            rank_end=start + len(asins) if asins else 0,
            products=[_summary(catalog.by_asin[a], rank=start + i) for i, a in enumerate(asins, start=1)],
        )
    elif session.page == PRODUCT_DETAIL and session.asin is not None:
        product = catalog.by_asin[session.asin]
        selection = option_state(product, session.options)
        state["product"] = _summary(product)
        state["selected_options"] = selection["selected_options"]
        state["available_options"] = {axis: _compact(values, limit=100) for axis, values in product.options.items()}
        state["missing_option_axes"] = selection["missing_option_axes"]
        state["options_complete"] = selection["options_complete"]
        if selection["invalid_selected_options"]:
            state["invalid_selected_options"] = selection["invalid_selected_options"]
        if session.selected_price is not None:
            state["selected_price"] = session.selected_price
    return state


# --------------------------------------------------------------------------- rendering


def _text(value: object) -> str:
    # Whitespace runs to one space, trimmed: str.split's whitespace is re's \s, at a fraction of the cost.
    return " ".join(str(value or "").split())


def _texts(value: object) -> list[str]:
    return [_text(v) for v in value if _text(v)] if isinstance(value, list) else []


def _display(value: object) -> str:
    if value is None or value == "":
        return "未提供"
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    return _text(value)


def _mapping(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ObservationError(f"{what} must be an object")
    return value


def _render_results(state: Mapping[str, Any]) -> list[str]:
    products = state.get("products")
    if not isinstance(products, list):
        raise ObservationError("search results must contain a products list")
    lines = [
        "页面：搜索结果",
        f"搜索词：{_text(state.get('search_text')) or '未提供'}",
        f"结果：第 {int(state.get('page', 1))}/{int(state.get('total_pages', 1))} 页，"
        f"共 {int(state.get('total_results', 0))} 项，"
        f"当前显示排名 {int(state.get('rank_start', 0))}-{int(state.get('rank_end', 0))}",
        "",
        "商品列表：",
    ]
    shown: list[str] = []
    for entry in products:
        item = _mapping(entry, "each search product")
        asin = _text(item.get("asin"))
        if not _ASIN.match(asin):
            raise ObservationError(f"invalid search-result ASIN: {asin!r}")
        shown.append(asin)
        lines += [
            f"{int(item.get('rank', 0))}. {_text(item.get('title')) or '未命名商品'}",
            f"   ASIN：{asin}",
            f"   价格：{_display(item.get('price'))}",
            f"   品牌：{_text(item.get('brand')) or '未提供'}",
            f"   类别：{_text(item.get('category')) or '未提供'}",
        ]
        attributes = _texts(item.get("key_attributes"))
        if attributes:
            lines.append("   关键属性：" + "；".join(attributes))
    clickable_asins = {a for a in _texts(state.get("actions")) if _ASIN.match(a)}
    if set(shown) != clickable_asins:
        raise ObservationError("model-visible search ASINs differ from environment-actionable ASINs")
    if len(shown) > PAGE_SIZE:
        raise ObservationError(f"search page exceeds the frozen page size of {PAGE_SIZE}")
    if not shown:
        lines.append("（本页没有商品）")
    return lines


def _render_product(state: Mapping[str, Any]) -> list[str]:
    product = _mapping(state.get("product"), "product")
    asin = _text(product.get("asin"))
    if not _ASIN.match(asin):
        raise ObservationError(f"invalid product ASIN: {asin!r}")
    selected = _mapping(state.get("selected_options") or {}, "selected_options")
    available = _mapping(state.get("available_options") or {}, "available_options")
    missing = _texts(state.get("missing_option_axes"))
    subpage = state.get("page_type") == "information_subpage"
    lines = [
        f"页面：{'商品属性页' if subpage else '商品详情'}",
        "商品：",
        f"- 标题：{_text(product.get('title')) or '未命名商品'}",
        f"- ASIN：{asin}",
        f"- 价格：{_display(state.get('selected_price', product.get('price')))}",
        f"- 品牌：{_text(product.get('brand')) or '未提供'}",
        f"- 类别：{_text(product.get('category')) or '未提供'}",
    ]
    attributes = _texts(product.get("key_attributes"))
    if attributes:
        lines.append("- 关键属性：" + "；".join(attributes))
    lines += ["", "规格选择："]
    if available:
        for axis, values in available.items():
            chosen = _text(selected.get(axis))
            lines.append(f"- {_text(axis)}：{f'已选择 {chosen}' if chosen else '尚未选择'}")
            public = _texts(values)
            if public:
                lines.append("  可选值：" + " / ".join(public))
    else:
        lines.append("- 此商品没有规格选项")
    if missing:
        lines.append("仍需选择：" + "、".join(missing))
    elif state.get("options_complete"):
        lines.append("规格状态：已选择全部规格，可以购买")
    if subpage:
        lines += ["", f"子页面：{_text(state.get('subpage')) or 'attributes'}", "内容：" + _display(state.get("content"))]
    return lines


def render_observation_state(state: Mapping[str, Any]) -> str:
    """The only page text the model sees: deterministic Chinese, one trailing newline."""
    if not isinstance(state, Mapping):
        raise ObservationError("observation_state must be an object")
    if state.get("observation_version") != OBSERVATION_VERSION:
        raise ObservationError("unsupported observation_state version")
    leaked = FORBIDDEN_KEYS.intersection(state)
    if leaked:
        raise ObservationError("observation_state contains forbidden fields: " + ", ".join(sorted(leaked)))
    page_type = str(state.get("page_type") or "unknown")
    if page_type == SEARCH_HOME:
        lines = ["页面：搜索首页"]
    elif page_type == SEARCH_RESULTS:
        lines = _render_results(state)
    elif page_type in {PRODUCT_DETAIL, "information_subpage"}:
        lines = _render_product(state)
    elif page_type == TERMINAL:
        lines = ["页面：任务已终止", "不能再执行操作。"]
    else:
        raise ObservationError(f"unsupported page_type: {page_type!r}")

    feedback = state.get("last_action")
    if isinstance(feedback, Mapping):
        lines += ["", "上次交互结果：", f"- 结果：{'成功' if feedback.get('valid') else '无效'}"]
        message, reason = _text(feedback.get("message")), _text(feedback.get("reason"))
        if message:
            lines.append(f"- 说明：{message}")
        if reason and reason != "executed":
            lines.append(f"- 原因代码：{reason}")

    interactions: list[str] = []
    if state.get("search_available"):
        interactions += ["页面能力：", "- 支持商品搜索"]
    actions = _texts(state.get("actions"))
    if actions:
        if interactions:
            interactions.append("")
        interactions += ["可点击元素：", *(f"- {a}" for a in actions)]
    lines += ["", *(interactions or ["当前页面没有可交互元素。"])]
    return "\n".join(lines).strip() + "\n"
