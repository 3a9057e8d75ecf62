"""The paper-aligned purchase reward (``shopsimulator-paper-reward-v2``) and what it depends on.

* the instruction budget parser (``instruction-budget-v1``): a user-stated price ceiling,
  never one derived from the gold product;
* the SKU price resolution (``variant-price-paper-v2``): the price of the selected option on the
  product's single price-affecting axis, or "unverifiable" when it cannot be known;
* r_type / r_att / r_option / r_price and their loose, strict and success combinations.

r_type uses the lexical title tokenizer (Latin/digit tokens plus Chinese bigrams), which is what
the real server falls back to when spaCy's Chinese model is not installed.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from difflib import SequenceMatcher
from typing import Any

from shopsimrl.testbed.shop.product import Product

__all__ = [
    "BUDGET_PARSER_VERSION",
    "REWARD_VERSION",
    "VARIANT_PRICE_VERSION",
    "attribute_reward",
    "explicit_budget_from_instruction",
    "fuzzy_token_set_ratio",
    "normalize_option_text",
    "option_reward",
    "price_affecting_axes",
    "purchase_record",
    "purchase_reward",
    "resolve_variant_price",
    "title_terms",
    "type_reward",
    "zero_reward_detail",
]

REWARD_VERSION = "shopsimulator-paper-reward-v2"
BUDGET_PARSER_VERSION = "instruction-budget-v1"
VARIANT_PRICE_VERSION = "variant-price-paper-v2"
PASS = "pass"
UNVERIFIABLE = "unverifiable"

# --------------------------------------------------------------------------- budget parser

_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6, "七": 7, "八": 8, "九": 9}
_SMALL_UNITS = {"十": 10, "百": 100, "千": 1000}
_LARGE_UNITS = {"万": 10_000, "亿": 100_000_000}
_CN = "零〇一二两三四五六七八九十百千万亿"
_NUM = rf"(?:\d+(?:\.\d+)?|[{_CN}]+)"
_SCALE = r"(?:万|千|[kK])?"
_CUR = r"(?:元|块钱|块)"
_PRICE_WORD = r"(?:预算|价格|价钱|价位|售价|单价|花费|费用|总价|预期价格)"
_LEAD = r"(?:金额)?(?:控制)?(?:在|为|是|要在|大概|约|差不多)?\s*"
_RANGE_SEP = r"(?:-|~|～|—|至|到|和)"
_APPROXIMATE = {"左右", "上下", "大约", "上下浮动", "出头"}
_UPPER_CUES = (
    "不得超过|不能超过|不要超过|不能高于|不要高于|不超过|不高于|不高过|别超过|别超|不超|低于|小于|不到|"
    "最高(?:为|是)?|上限(?:为|是)?|只能给到"
)
_STANDALONE_QUALIFIERS = (
    "以内|以下|之内|左右|上下|大约|上下浮动|内|出头|都不到|拿下|能拿下|帮我搞定|能搞定|搞定|能买|来买|"
    "应该够|基本能买到|这个价|的价格|的价位|价位|的预算|预算"
)


def _chinese_number(text: str) -> float:
    """Chinese numerals such as 二十, 一千八 (=1800), 一万二 (=12000), 三百五 (=350)."""
    if all(ch in _DIGITS for ch in text):  # digit-by-digit spelling: 一二三 -> 123
        return float("".join(str(_DIGITS[ch]) for ch in text))
    # "<digits><unit><digit>" is colloquial: the trailing digit counts one unit lower.
    if len(text) >= 3 and text[-1] in _DIGITS and text[-2] in "十百千万":
        head = text[:-2]
        if all(ch in _DIGITS for ch in head):
            unit = {**_SMALL_UNITS, **_LARGE_UNITS}[text[-2]]
            return _chinese_number(head) * unit + _DIGITS[text[-1]] * unit / 10
    total = section = number = 0
    for ch in text:
        if ch in _DIGITS:
            number = _DIGITS[ch]
        elif ch in _SMALL_UNITS:
            section += (number or 1) * _SMALL_UNITS[ch]
            number = 0
        elif ch in _LARGE_UNITS:
            total = (total + section + number) * _LARGE_UNITS[ch]
            section = number = 0
    return float(total + section + number)


def _amount(number: str, scale: str | None) -> float:
    value = float(number) if re.fullmatch(r"\d+(?:\.\d+)?", number) else _chinese_number(number)
    unit = (scale or "").casefold()
    if unit == "万":
        value *= 10_000
    elif unit in {"千", "k"}:
        value *= 1_000
    return value


def _tolerant(value: float, qualifier: str | None) -> float:
    # An approximate target ("70元左右") allows a frozen +10 %.
    return value * 1.1 if qualifier in _APPROXIMATE else value


def _positive(value: float, qualifier: str | None = None) -> float | None:
    return _tolerant(value, qualifier) if value > 0 else None


_Rule = tuple[re.Pattern[str], Callable[[re.Match[str]], float | None]]


def _range_upper(m: re.Match[str]) -> float | None:
    low, high = _amount(m["n1"], m["s1"]), _amount(m["n2"], m["s2"])
    return high if low > 0 and high >= low else None


def _prefixed(m: re.Match[str]) -> float | None:
    qualifier = m["q"] or ("左右" if m["fuzz"] else None)
    return _positive(_amount(m["n"], m["s"]), qualifier)


# Ordered rules: the first pattern that matches decides (a match may decide "no budget").
# A rule whose handler returns the sentinel _NEXT lets later rules try.
_NEXT = -1.0
_RULES: list[_Rule] = [
    # 预算1万2以内 -> 12000
    (
        re.compile(
            rf"{_PRICE_WORD}(?:金额)?(?:控制)?(?:在|为|是)?\s*(?P<a>\d+)\s*万\s*(?P<b>\d+)\s*(?:千)?\s*"
            r"(?P<q>以内|以下|之内|左右|上下)?"
        ),
        lambda m: _tolerant(float(m["a"]) * 10_000 + float(m["b"]) * 1_000, m["q"]),
    ),
    # 价格在10-20之间 (currency optional, closing word required)
    (
        re.compile(
            rf"{_PRICE_WORD}{_LEAD}(?P<n1>{_NUM})\s*(?P<s1>{_SCALE})\s*(?:{_CUR})?\s*{_RANGE_SEP}\s*"
            rf"(?P<n2>{_NUM})\s*(?P<s2>{_SCALE})\s*(?:{_CUR})?\s*(?:之间|以内|以下|之内)"
        ),
        lambda m: _range_upper(m) or _NEXT,
    ),
    # 30元到40元 (price word optional, currency at the upper end required)
    (
        re.compile(
            rf"(?:{_PRICE_WORD})?{_LEAD}(?P<n1>{_NUM})\s*(?P<s1>{_SCALE})\s*(?:{_CUR})?\s*{_RANGE_SEP}\s*"
            rf"(?P<n2>{_NUM})\s*(?P<s2>{_SCALE})\s*{_CUR}"
        ),
        lambda m: _range_upper(m) or _NEXT,
    ),
    # 不超过 2199 元
    (
        re.compile(
            rf"(?:{_PRICE_WORD})?(?:金额)?[^，。；;]{{0,8}}?(?:{_UPPER_CUES})\s*"
            rf"(?P<n>{_NUM})\s*(?P<s>{_SCALE})\s*{_CUR}"
        ),
        lambda m: _positive(_amount(m["n"], m["s"])),
    ),
    # lower bounds only (超过20元, 4k+): not a ceiling, so no budget
    (
        re.compile(
            rf"{_PRICE_WORD}[^，。；;]{{0,8}}?(?:不低于|至少|(?<!不要)(?<!不能)(?<!不)(?<!别)(?:超过|高于))\s*"
            rf"{_NUM}\s*{_SCALE}\s*(?:{_CUR})?"
        ),
        lambda m: None,
    ),
    (re.compile(rf"{_PRICE_WORD}[^，。；;]{{0,8}}?{_NUM}\s*{_SCALE}\s*\+"), lambda m: None),
    # 预算在1000元以下 / 预算就二十来块钱 / 价格在70元左右
    (
        re.compile(
            rf"{_PRICE_WORD}(?:金额)?[^\d{_CN}，。；;]{{0,12}}?(?P<n>{_NUM})\s*(?P<s>{_SCALE})\s*"
            rf"(?P<fuzz>来|多)?\s*(?:{_CUR})?\s*(?P<q>以内|以下|之内|左右|上下|大约|上下浮动|内)?"
        ),
        lambda m: _prefixed(m) if _prefixed(m) is not None else _NEXT,
    ),
    (
        re.compile(rf"(?:差不多|大约|大概|约)\s*(?P<n>{_NUM})\s*(?P<s>{_SCALE})\s*{_CUR}"),
        lambda m: _positive(_amount(m["n"], m["s"]), "左右"),
    ),
    (
        re.compile(rf"(?P<n>{_NUM})\s*(?P<s>{_SCALE})\s*(?:左右|上下|大约)\s*{_CUR}"),
        lambda m: _positive(_amount(m["n"], m["s"]), "左右"),
    ),
    (
        re.compile(rf"(?P<n>{_NUM})\s*(?P<s>{_SCALE})\s*多\s*{_CUR}"),
        lambda m: _positive(_amount(m["n"], m["s"]), "左右"),
    ),
    (
        re.compile(rf"(?P<n>{_NUM})\s*(?P<q>左右|上下)\s*(?:的)?\s*(?:预算|价位|价格)"),
        lambda m: _tolerant(v, m["q"]) if (v := _amount(m["n"], None)) >= 100 else _NEXT,
    ),
    (
        re.compile(rf"(?P<n>[{_CN}]*[千万][{_CN}]*)\s*(?P<q>左右|上下)"),
        lambda m: _tolerant(v, m["q"]) if (v := _amount(m["n"], None)) >= 1000 else _NEXT,
    ),
    (
        re.compile(rf"(?P<n>{_NUM})\s*(?:以内|以下|内)\s*(?:能)?(?:拿下|搞定)"),
        lambda m: _positive(_amount(m["n"], None)) or _NEXT,
    ),
    (
        re.compile(rf"(?P<n>{_NUM})\s*(?:左右|上下)\s*(?:能)?(?:拿下|搞定)"),
        lambda m: _positive(_amount(m["n"], None), "左右") or _NEXT,
    ),
    (
        re.compile(rf"(?:准备(?:了)?|给到)\s*(?P<n>{_NUM})\s*(?P<s>{_SCALE})\s*{_CUR}"),
        lambda m: _positive(_amount(m["n"], m["s"])) or _NEXT,
    ),
    # a currency amount with a ceiling/approximate word is a price even without 预算/价格
    (
        re.compile(rf"(?P<n>{_NUM})\s*(?P<s>{_SCALE})\s*{_CUR}\s*(?P<q>{_STANDALONE_QUALIFIERS})"),
        lambda m: _positive(_amount(m["n"], m["s"]), m["q"]),
    ),
    # 十几块 -> 19
    (re.compile(rf"(?P<n>[二三四五六七八九]?十)几\s*{_CUR}"), lambda m: _chinese_number(m["n"]) + 9),
    (re.compile("个位数价格"), lambda m: 9.0),
]


def explicit_budget_from_instruction(instruction: object) -> float | None:
    """The price ceiling a Chinese instruction states, or None.

    Ranges give their upper end, approximate targets get +10 %, lower bounds give None.
    """
    text = re.sub(r"[,，]", "", str(instruction or ""))
    for pattern, decide in _RULES:
        match = pattern.search(text)
        if match is None:
            continue
        result = decide(match)
        if result is not None and result == _NEXT:
            continue
        return result
    return None


# --------------------------------------------------------------------------- SKU price


def normalize_option_text(value: object) -> str:
    text = unicodedata.normalize("NFKC", str(value or "")).casefold().replace("/", "|")
    return re.sub(r"\s+", "", text)


def _finite_price(value: object) -> float | None:
    try:
        price = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return price if math.isfinite(price) and price >= 0 else None


def _indexed_axes(product: Product) -> dict[str, dict[str, float | None]]:
    """axis -> normalized option text -> option price (None when absent)."""
    axes: dict[str, dict[str, float | None]] = {}
    for axis, entries in product.customization_options.items():
        values: dict[str, float | None] = {}
        for entry in entries or []:
            if isinstance(entry, dict):
                key = normalize_option_text(entry.get("value"))
                if key:
                    values[key] = _finite_price(entry.get("price"))
        axes[str(axis)] = values
    return axes


def price_affecting_axes(product: Product) -> list[str]:
    """Axes whose options carry more than one distinct price."""
    return [axis for axis, values in _indexed_axes(product).items() if len({p for p in values.values() if p is not None}) > 1]


def _resolution(status: str, price: float | None, method: str, evidence: dict[str, Any]) -> dict[str, Any]:
    return {"status": status, "price": price, "version": VARIANT_PRICE_VERSION, "method": method, "evidence": evidence}


def resolve_variant_price(product: Product, selected_options: object) -> dict[str, Any]:
    """Resolve the purchase price from the selected options without guessing."""
    if not isinstance(selected_options, Mapping):
        return _resolution(UNVERIFIABLE, None, "invalid_selected_options", {"reason": "selected_options_not_object"})
    selected = {str(axis): str(value) for axis, value in selected_options.items()}
    axes = _indexed_axes(product)
    price_axes = price_affecting_axes(product)
    if len(price_axes) >= 2:
        return _resolution(UNVERIFIABLE, None, "multiple_price_affecting_axes", {"price_affecting_axes": price_axes})
    if len(price_axes) == 1:
        axis = price_axes[0]
        # Only the exact source axis name counts: an alias such as "color" is not a selection.
        if axis not in selected:
            return _resolution(UNVERIFIABLE, None, "price_axis_unselected", {"price_axis": axis})
        price = axes[axis].get(normalize_option_text(selected[axis]))
        if price is None:
            return _resolution(UNVERIFIABLE, None, "selected_variant_price_missing", {"price_axis": axis})
        return _resolution(PASS, price, "selected_price_axis", {"price_axis": axis})
    option_prices = {p for values in axes.values() for p in values.values() if p is not None}
    if len(option_prices) == 1:
        return _resolution(PASS, next(iter(option_prices)), "constant_option_price", {})
    listing = [p for p in (_finite_price(v) for v in product.pricing) if p is not None]
    if not axes and len(set(listing)) == 1:
        return _resolution(PASS, listing[0], "single_listing_price", {})
    return _resolution(UNVERIFIABLE, None, "price_not_deterministic", {"candidate_prices": sorted(option_prices)})


# --------------------------------------------------------------------------- reward components

_LATIN = re.compile(r"[a-z0-9]+(?:[._+\-/][a-z0-9]+)*")
_HAN_RUN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]+")


def fuzzy_token_set_ratio(left: object, right: object) -> int:
    """Token-set similarity 0-100 (casefold, split on non-word characters, difflib ratios)."""

    def tokens(value: object) -> set[str]:
        return set(re.sub(r"\W+", " ", str(value).casefold()).split())

    a, b = tokens(left), tokens(right)
    common = " ".join(sorted(a & b))
    with_left = " ".join(sorted(a)).strip()
    with_right = " ".join(sorted(b)).strip()

    def ratio(x: str, y: str) -> int:
        return round(100 * SequenceMatcher(None, x, y).ratio())

    if not common:
        return ratio(with_left, with_right)
    return max(ratio(common, with_left), ratio(common, with_right), ratio(with_left, with_right))


def title_terms(value: object) -> list[str]:
    """Lexical title terms: Latin/digit tokens plus Chinese bigrams (a 1-char run is itself)."""
    text = str(value or "")
    latin = _LATIN.findall(text.casefold())
    han = [run[i : i + 2] for run in _HAN_RUN.findall(text) for i in range(max(1, len(run) - 1))]
    return latin + han


def _category_parts(value: object) -> list[str]:
    return [p.strip().casefold() for p in re.split(r"\s*(?:›|>|/|\\)\s*", str(value or "")) if p.strip()]


def type_reward(
    purchased_title: object,
    purchased_category: object,
    goal: Mapping[str, Any],
    *,
    terms: Callable[[object], list[str]] = title_terms,
) -> dict[str, Any]:
    """r_type ladder 1 / 0.5 / 0.1 / 0 from category overlap and title-term coverage."""
    category_match = len(set(_category_parts(purchased_category)) & set(_category_parts(goal.get("category")))) >= 2
    desired = set(terms(goal.get("name")))
    title_score = len(set(terms(purchased_title)) & desired) / len(desired) if desired else 0.2
    if category_match or title_score > 0.2:
        r_type = 1.0
    elif title_score == 0:
        r_type = 0.0
    elif title_score < 0.1:
        r_type = 0.1
    else:
        r_type = 0.5
    return {"r_type": r_type, "category_match": category_match, "title_score": title_score}


def _values(value: object) -> list[str]:
    if isinstance(value, Mapping):
        return [str(v) for v in value.values()]
    if isinstance(value, (list, tuple, set)):
        return [str(v) for v in value]
    return [str(value)] if value not in (None, "") else []


def attribute_reward(product: Product, goal: Mapping[str, Any]) -> tuple[float, int]:
    required = list(goal.get("attributes") or [])
    if not required:
        return 1.0, 0
    searchable = " ".join([product.title, " ".join(map(str, product.bullet_points)), product.description]).casefold()
    matches = sum(
        1
        for wanted in required
        if any(fuzzy_token_set_ratio(have, wanted) > 85 for have in product.attributes) or str(wanted).casefold() in searchable
    )
    return matches / len(required), matches


def option_reward(selected_values: object, goal_options: object) -> tuple[float, int]:
    """Goal options matched by a selected value; no colour or axis-name normalization."""
    have, wanted = _values(selected_values), _values(goal_options)
    if not wanted:
        return 1.0, 0
    matches = sum(1 for w in wanted if any(fuzzy_token_set_ratio(h, w) > 85 for h in have))
    return matches / len(wanted), matches


def purchase_reward(
    product: Product,
    goal: Mapping[str, Any],
    selected_options: Mapping[str, str],
    price_resolution: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The full purchase ``reward_detail``; the episode reward is its ``r_strict``."""
    resolution = dict(price_resolution) if price_resolution else resolve_variant_price(product, selected_options)
    upper = goal.get("price_upper")
    verifiable = resolution.get("status") == PASS
    if upper is None:
        r_price = 1.0
    elif verifiable and resolution.get("price") is not None:
        price = float(resolution["price"])
        r_price = float(math.isfinite(price) and price <= float(upper))
    else:
        r_price = 0.0
    type_detail = type_reward(product.title, product.category, goal)
    r_att, att_matches = attribute_reward(product, goal)
    r_option, option_matches = option_reward(list(selected_options.values()), goal.get("goal_options"))
    denominator = len(goal.get("attributes") or []) + len(_values(goal.get("goal_options"))) + 1
    r_type = type_detail["r_type"]
    return {
        "reward_version": REWARD_VERSION,
        "termination_reason": "purchase",
        **type_detail,
        "num_attr_matches": att_matches,
        "num_option_matches": option_matches,
        "r_att": r_att,
        "r_option": r_option,
        "r_price": r_price,
        "r_loose": r_type * (att_matches + option_matches + r_price) / denominator,
        "r_strict": r_type * r_att * r_option * r_price,
        "r_success": int(r_type == 1.0 and r_att == 1.0 and r_option == 1.0 and r_price == 1.0),
        "target_asin_match": str(product.asin) == str(goal.get("asin")),
        "price_verifiable": verifiable,
        "price_upper": upper,
        "price_resolution": resolution,
    }


def zero_reward_detail(termination_reason: str) -> dict[str, Any]:
    """Paper metrics of an episode that ended without a purchase (and nothing else)."""
    return {
        "reward_version": REWARD_VERSION,
        "termination_reason": termination_reason,
        "r_loose": 0.0,
        "r_strict": 0.0,
        "r_success": 0,
        "r_type": 0.0,
        "r_att": 0.0,
        "r_option": 0.0,
        "r_price": 0.0,
        "target_asin_match": False,
        "price_verifiable": False,
    }


def purchase_record(product: Product, selected_options: Mapping[str, str], price: float | None) -> dict[str, Any]:
    """The ``purchase`` object of a purchase response."""
    return {
        "asin": product.asin,
        "category": product.category,
        "name": product.title,
        "product_category": product.product_category,
        "instruction_text": product.instruction_text,
        "attributes": list(product.attributes),
        "price": price,
        "options": dict(selected_options),
    }
