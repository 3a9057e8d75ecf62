"""Reading what the shopping model sees: page text, conversation, task text and user profile.

Everything here is a pure function of the chat messages and offered tools; the decisions built on
it live in :mod:`shopsimrl.testbed.heuristics`.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

__all__ = [
    "ASIN",
    "BACK",
    "BUTTONS",
    "BUY",
    "NEXT",
    "PREV",
    "PROFILE_LABEL",
    "History",
    "Observation",
    "Preferences",
    "Product",
    "contains_term",
    "extract_keywords",
    "fuzzy_ratio",
    "history",
    "norm",
    "offered",
    "parse_budget",
    "parse_observation",
    "parse_preferences",
    "parse_profile",
    "price_low",
    "tokens",
]

BACK = "back to search"
PREV = "< prev"
NEXT = "next >"
BUY = "buy now"
BUTTONS = frozenset({BACK, PREV, NEXT, BUY})
ASIN = re.compile(r"^\d{8,12}$")


@dataclass(slots=True)
class Product:
    asin: str
    title: str = ""
    price: str = ""
    brand: str = ""
    category: str = ""
    attributes: str = ""
    rank: int = 0


@dataclass(slots=True)
class Observation:
    """The parts of one rendered page the policy uses; unknown pages keep ``page=""``."""

    page: str = ""
    products: list[Product] = field(default_factory=list)
    product: Product | None = None
    # axis -> (selected value or None, displayed values), in page order
    axes: dict[str, tuple[str | None, list[str]]] = field(default_factory=dict)
    clickable: list[str] = field(default_factory=list)
    last_invalid: bool = False


# --------------------------------------------------------------------------- text utilities


_HAN_RUN = re.compile(r"[\u4e00-\u9fff]+")
_LATIN_WORD = re.compile(r"[a-z0-9]+(?:[._+\-/][a-z0-9]+)*")


# norm and tokens are cached: every results page brings back the titles and attributes of
# listings seen before, and these two were a third of the policy server's CPU.
@functools.lru_cache(maxsize=1 << 16)
def norm(text: str) -> str:
    """NFKC, casefolded, whitespace runs to one space, trimmed (str.split's whitespace is re's \\s)."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


@functools.lru_cache(maxsize=1 << 16)
def tokens(text: str) -> frozenset[str]:
    """Chinese bigrams (a lone character stands for itself) plus Latin/digit words."""
    text = norm(text)
    out: set[str] = set()
    for run in _HAN_RUN.findall(text):
        out.update([run] if len(run) == 1 else (run[i : i + 2] for i in range(len(run) - 1)))
    out.update(_LATIN_WORD.findall(text))
    return frozenset(out)


def contains_term(haystack: str, term: str) -> bool:
    """Substring test; a Latin/digit term must not sit inside a longer word (``xl`` vs ``xxl``)."""
    term = norm(term)
    if not term:
        return False
    if re.fullmatch(r"[a-z0-9 ._+\-]+", term):
        return re.search(rf"(?<![a-z0-9]){re.escape(term)}(?![a-z0-9])", haystack) is not None
    return term in haystack


@functools.lru_cache(maxsize=1 << 16)
def fuzzy_ratio(left: str, right: str) -> int:
    """Token-set similarity 0-100, computed the way the shop's reward compares attributes.

    Cached: the same attributes and listings come back on every page of every episode, and
    difflib was most of the policy server's CPU (docs/benchmarks.md, "Throughput").

    Text is casefolded and split on non-word characters; the score is the best difflib ratio
    among the shared tokens and each side's sorted token set. Chinese without spaces is one
    token, so a high score needs (nearly) the same phrase.
    """

    def split(value: str) -> set[str]:
        return set(re.sub(r"\W+", " ", value.casefold()).split())

    a, b = split(left), split(right)
    common = " ".join(sorted(a & b))
    # Each side's whole token set, sorted: the contract's "two unions" (intersection + own rest).
    with_left, with_right = " ".join(sorted(a)), " ".join(sorted(b))

    def ratio(x: str, y: str) -> int:
        return round(100 * SequenceMatcher(None, x, y).ratio())

    if not common:
        return ratio(with_left, with_right)
    return max(ratio(common, with_left), ratio(common, with_right), ratio(with_left, with_right))


# --------------------------------------------------------------------------- budget


_CN_DIGITS = {"零": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6, "七": 7, "八": 8, "九": 9}
_CN_UNITS = {"十": 10, "百": 100, "千": 1000}
_NUMBER = re.compile(
    r"(?P<ar>\d+(?:\.\d+)?)(?:\s*(?P<mag>[万千kw])(?P<tail>\d(?!\d))?)?"
    r"|(?P<cn>[零一二两三四五六七八九十百千万]+)"
)
_RANGE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:-|~|～|到|至)\s*(\d+(?:\.\d+)?)\s*元?")
_MONEY_BEFORE = ("预算", "价格", "价位", "售价", "价钱", "不超过", "不高于", "低于", "少于", "控制在")
_UPPER_AFTER = ("以内", "以下", "之内", "内", "左右", "上下", "来")
_APPROX = ("左右", "上下", "来")


def _cn_number(text: str) -> float | None:
    total, section, num, last_unit = 0, 0, 0, 1
    for ch in text:
        if ch == "零":
            num, last_unit = 0, 10  # "三百零五": the digit after 零 is a unit digit
        elif ch in _CN_DIGITS:
            num = _CN_DIGITS[ch]
        elif ch in _CN_UNITS:
            unit = _CN_UNITS[ch]
            section += (num or 1) * unit
            num, last_unit = 0, unit
        elif ch == "万":
            total += (section + num) * 10000
            section, num, last_unit = 0, 0, 10000
    # A trailing digit after a unit is shorthand for the next unit down: 一千八 = 1800.
    value = total + section + (num * (last_unit // 10) if last_unit >= 10 else num)
    return float(value) if value > 0 else None


def _number_value(match: re.Match[str]) -> float | None:
    if match.group("cn"):
        return _cn_number(match.group("cn"))
    value = float(match.group("ar"))
    mag = match.group("mag")
    if mag:
        unit = 10000 if mag in "万w" else 1000
        value *= unit
        if match.group("tail"):
            value += int(match.group("tail")) * unit / 10
    return value


def parse_budget(instruction: str) -> float | None:
    """Upper price limit stated in the instruction (``预算1000元以内`` → 1000), or None.

    Ranges give their upper end, approximate amounts (``左右``, ``来``) are widened by 10 %,
    and lower bounds (``4k+``, ``超过20元``) are ignored.
    """
    text = norm(instruction)
    for word in ("人民币", "块钱", "块", "rmb", "cny", "yuan"):
        text = text.replace(word, "元")
    range_match = _RANGE.search(text)
    if range_match and ("元" in text[range_match.end() - 1 : range_match.end() + 1] or "价" in text):
        return float(range_match.group(2))
    for match in _NUMBER.finditer(text):
        value = _number_value(match)
        if value is None:
            continue
        before = text[max(0, match.start() - 8) : match.start()]
        after = text[match.end() : match.end() + 4]
        if after.startswith(("+", "起")) or "以上" in after:
            continue
        if re.search(r"(?<!不)(?<!不要)(超过|高于|大于)$", before):
            continue
        # Money: a yuan unit right after the number, a price word right before it, or an
        # upper-bound word right after it ("300以内"); "一款" or "15寸" are not amounts.
        tight = before.rstrip("在就是为约大概只要 ")
        if not (
            after.startswith(("元", *_UPPER_AFTER[:-1]))
            or tight.endswith(_MONEY_BEFORE)
            or (match.group("cn") is None and any(word in before for word in _MONEY_BEFORE))
        ):
            continue
        if any(after.lstrip("元").startswith(word) or after.startswith(word) for word in _APPROX):
            value = round(value * 1.1, 2)
        return value
    return None


def price_low(price: str) -> float | None:
    """Lowest number of a displayed price (``"12.5"`` or ``"10.0 to 20.0"``)."""
    numbers = re.findall(r"\d+(?:\.\d+)?", price or "")
    return min(float(n) for n in numbers) if numbers else None


# --------------------------------------------------------------------------- keywords

_SPLIT = re.compile(r"[，,。；;！!？?、\n：:（）()“”\"'「」《》【】]+")
_LEADING_FILLERS = tuple(
    sorted(
        "我想买 我想要 我要买 我需要 我想找 帮我找 帮我买 请帮我 给我找 给我买 "
        "帮忙挑 帮忙找 帮忙选 帮忙买 想入手 求推荐 打算买 打算入手 打算 "
        "想买 想要 想找 需要 购买 寻找 推荐 入手 挑选 "
        "要求是 要求 希望是 希望 最好是 最好 而且 并且 同时 另外 还要 还有 能够 可以 支持 具有 带有 适合 用于 "
        "是 有 我 请 帮 找 买 要 个 还 能 并".split(),
        key=len,
        reverse=True,  # longest first, so 我想买 is stripped whole rather than as 我
    )
)
_MEASURE = re.compile(r"^[一两几][款个台件双套把条只些瓶盏部张副份支块本盒袋包辆对顶罐桶箱片根枚]")
_BUDGET_WORDS = re.compile(r"预算|价格|价位|售价|价钱|\d\s*元|块钱|以内|以下|之内|不超过|左右|便宜|实惠|性价比")
_GENERIC = frozenset({"东西", "商品", "产品", "质量好", "好用", "不错", "的", "一下", "用", "使用"})
# Closing remarks about who the purchase is for or how urgent it is name no product property.
_REMARK = re.compile(
    r"^(?:帮忙|帮我)?挑?下$"  # 帮忙挑下 after 帮忙挑 is stripped
    r"|^(?:送人|自己|家里|自|急|平时|日常)用$|^送(?:人|礼|朋友|家人)$"
)


def _strip_fillers(segment: str) -> str:
    changed = True
    while changed and segment:
        changed = False
        measure = _MEASURE.match(segment)
        if measure:
            segment, changed = segment[measure.end() :], True
            continue
        for filler in _LEADING_FILLERS:
            if segment.startswith(filler) and len(segment) > len(filler):
                segment, changed = segment[len(filler) :], True
                break
    return segment.strip()


def extract_keywords(instruction: str) -> tuple[str, list[str]]:
    """``(product kind, distinctive terms)`` of a Chinese shopping instruction.

    Without a word segmenter this leans on Chinese being head-final: in ``适合跑步的蓝牙耳机``
    the last ``的``-segment of the purchase clause names the kind; other short segments
    (``黑色``, ``主动降噪``) are the distinctive terms. Price phrases are dropped: the search
    engine cannot use them and the budget is enforced separately.
    """
    clauses = [c.strip() for c in _SPLIT.split(unicodedata.normalize("NFKC", instruction)) if c.strip()]
    kind = ""
    terms: list[str] = []
    for clause in clauses:
        segments = [_strip_fillers(s) for s in re.split(r"的|得", clause)]
        segments = [s for s in segments if s and s not in _GENERIC and not _BUDGET_WORDS.search(s) and not _REMARK.match(s)]
        if not segments:
            continue
        if not kind:
            kind = segments[-1]
            terms.extend(segments[:-1])
        else:
            terms.extend(segments)
    # Short terms first: colours, sizes and features are the most specific words.
    unique = sorted(dict.fromkeys(t for t in terms if t != kind), key=len)
    if len(kind) > 12:
        kind = kind[-8:]
    return kind, [t for t in unique if len(t) <= 10]


# --------------------------------------------------------------------------- observation parsing


def parse_observation(text: str) -> Observation:
    """Parse the page text rendered by ShopSimulator (``render_observation_state`` layout)."""
    obs = Observation()
    lines = text.splitlines()
    if lines and lines[0].startswith("页面："):
        obs.page = lines[0][len("页面：") :].strip()
    section = ""
    current: Product | None = None
    axis: str | None = None
    for raw in lines[1:]:
        line = raw.rstrip()
        stripped = line.strip()
        if not stripped:
            continue
        if not line.startswith((" ", "-")) and stripped.endswith("：") and not re.match(r"^\d+\. ", line):
            section = stripped[:-1]
            continue
        if section == "商品列表":
            head = re.match(r"^(\d+)\. (.*)$", line)
            if head:
                current = Product(asin="", title=head.group(2).strip(), rank=int(head.group(1)))
                obs.products.append(current)
            elif current is not None:
                _fill_field(current, stripped)
        elif section == "商品":
            obs.product = obs.product or Product(asin="")
            _fill_field(obs.product, stripped.removeprefix("- "))
        elif section == "规格选择":
            head = re.match(r"^- (.+?)：(?:已选择 (.*)|尚未选择)$", line)
            if head:
                axis = head.group(1)
                obs.axes[axis] = (head.group(2).strip() if head.group(2) is not None else None, [])
            elif stripped.startswith("可选值：") and axis is not None:
                values = [v.strip() for v in stripped[len("可选值：") :].split(" / ") if v.strip()]
                obs.axes[axis] = (obs.axes[axis][0], values)
        elif section == "上次交互结果":
            if stripped == "- 结果：无效":
                obs.last_invalid = True
        elif section == "可点击元素" and line.startswith("- "):
            obs.clickable.append(line[2:].strip())
    obs.products = [p for p in obs.products if p.asin]
    return obs


_FIELDS = {"ASIN": "asin", "标题": "title", "价格": "price", "品牌": "brand", "类别": "category", "关键属性": "attributes"}


def _fill_field(product: Product, line: str) -> None:
    label, sep, value = line.partition("：")
    if sep and label in _FIELDS:
        setattr(product, _FIELDS[label], value.strip())


# --------------------------------------------------------------------------- conversation


@dataclass(slots=True)
class History:
    instruction: str = ""
    system: str = ""  # system messages joined: the user profile travels there
    observation: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (tool, argument) in order
    turns: int = 0  # assistant turns, protocol errors included: they use up runtime steps too

    @property
    def searches(self) -> int:
        return sum(1 for tool, _ in self.calls if tool == "search")

    def since_last_search(self) -> list[tuple[str, str]]:
        for index in range(len(self.calls) - 1, -1, -1):
            if self.calls[index][0] == "search":
                return self.calls[index + 1 :]
        return list(self.calls)

    def visited(self) -> list[str]:
        return [arg for tool, arg in self.calls if tool == "click" and ASIN.match(arg)]

    def since_opening(self, asin: str) -> list[str]:
        clicks: list[str] = []
        for tool, arg in reversed(self.calls):
            if tool == "click" and arg == asin:
                break
            clicks.append(arg)
        return clicks[::-1]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _is_protocol_feedback(text: str) -> bool:
    if not text.lstrip().startswith("{"):
        return False
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("type") == "tool_protocol_error"


def history(messages: list[Any]) -> History:
    hist = History()
    seen_task = False
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        text = _text_of(message.get("content"))
        if role == "system":
            hist.system += text + "\n"
        elif role == "user" and not seen_task:
            seen_task = True
            body = text.removeprefix("购物任务：").lstrip("\n")
            instruction, sep, page = body.partition("\n\n页面：")
            hist.instruction = instruction.strip()
            hist.observation = "页面：" + page if sep else ""
        elif role in ("user", "tool") and text.lstrip().startswith("页面：") and not _is_protocol_feedback(text):
            hist.observation = text
        elif role == "assistant":
            hist.turns += 1
            calls = message.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict):
                    continue
                arguments = function.get("arguments")
                try:
                    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                except ValueError:
                    continue
                if isinstance(arguments, dict):
                    arg = arguments.get("query", arguments.get("value", ""))
                    hist.calls.append((str(function.get("name", "")), str(arg).strip()))
    return hist


def offered(tools: list[dict[str, Any]] | None) -> dict[str, list[str] | None]:
    """Tool name -> the ``enum`` of its single string parameter (None when unrestricted)."""
    out: dict[str, list[str] | None] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        enum: list[str] | None = None
        for spec in props.values() if isinstance(props, dict) else []:
            if isinstance(spec, dict) and isinstance(spec.get("enum"), list):
                enum = [v for v in spec["enum"] if isinstance(v, str)]
        out[function["name"]] = enum
    return out


# --------------------------------------------------------------------------- user profile

PROFILE_LABEL = "用户个人文档："
_ATTRIBUTE_KEYS = ("属性", "特点", "功能", "需求", "关注", "卖点")
_OPTION_KEYS = ("规格", "选项", "款式", "尺码", "颜色", "型号", "套餐")
_BUDGET_KEYS = ("预算", "价格", "价位")


@dataclass(frozen=True, slots=True)
class Preferences:
    """What the user profile says the user wants; empty when there is no (readable) profile."""

    attributes: tuple[str, ...] = ()
    options: tuple[tuple[str, str], ...] = ()  # (axis, value); the axis may be ""
    budget: float | None = None


def _scalar(value: object) -> str:
    """A string or number as stripped text; anything nested is no single preference ("")."""
    return str(value).strip() if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""


def parse_profile(system_text: str) -> dict[str, Any] | None:
    """The JSON object printed after ``用户个人文档：``, or None when absent or not an object."""
    at = system_text.find(PROFILE_LABEL)
    if at < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(system_text[at + len(PROFILE_LABEL) :].lstrip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_preferences(system_text: str) -> Preferences:
    """Wanted attributes, option values and budget from the profile's preference block.

    Lists of strings are taken as wanted attributes, string-to-string mappings as option choices
    (axis -> value), and a string under a budget-like key as the budget. Free-text traits
    (purchase motive, style) are not product properties and are left out.
    """
    profile = parse_profile(system_text)
    if profile is None:
        return Preferences()
    blocks = [v for k, v in profile.items() if "偏好" in str(k) and isinstance(v, dict)]
    attributes: list[str] = []
    options: list[tuple[str, str]] = []
    budget: float | None = None
    for block in blocks:
        for key, value in block.items():
            key = str(key)
            if isinstance(value, list):
                attributes += [text for text in map(_scalar, value) if text]
            elif isinstance(value, dict):
                options += [
                    (str(axis).strip(), text) for axis, text in zip(value, map(_scalar, value.values()), strict=True) if text
                ]
            elif text := _scalar(value):
                if any(word in key for word in _BUDGET_KEYS):
                    budget = parse_budget(text if any(w in text for w in _BUDGET_KEYS) else "预算" + text)
                elif any(word in key for word in _OPTION_KEYS):
                    options.append((key, text))
                elif any(word in key for word in _ATTRIBUTE_KEYS):
                    attributes.append(text)
    return Preferences(tuple(dict.fromkeys(attributes)), tuple(dict.fromkeys(options)), budget)
