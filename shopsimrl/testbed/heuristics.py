"""Rule-based shopping decisions over the ShopSimulator text observation.

The heuristic "model" of the testbed sees exactly what a served LLM sees: the chat messages the
runtime builds (task instruction + rendered Chinese page text, then one observation per tool
call) and the function tools offered for the current page. :func:`decide` turns that into one
tool call. It is a pure function: the same messages, tools, seed and temperature always give the
same decision, and no module-level random state is touched.

Strategy (a plain baseline, not a strong agent): search with the product kind and a few
distinctive terms of the instruction; open the best-matching unvisited listing within budget;
page or re-query with fewer words when nothing fits; select the option values the instruction
names, then any missing axis; buy.
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from shopsimrl.schemas import fingerprint

__all__ = ["Decision", "Observation", "Product", "decide", "extract_keywords", "parse_budget", "parse_observation"]

BACK = "back to search"
PREV = "< prev"
NEXT = "next >"
BUY = "buy now"
_BUTTONS = frozenset({BACK, PREV, NEXT, BUY})
_ASIN = re.compile(r"^\d{8,12}$")

# The runtime allows 30 turns by default; from URGENT_STEP on the policy stops exploring and commits.
URGENT_STEP = 20
MAX_SEARCHES = 4
MAX_PAGES_PER_QUERY = 2
MAX_PRODUCTS = 5
MAX_PRICE_TRIES = 3
GOOD_MATCH = 0.3


@dataclass(frozen=True, slots=True)
class Decision:
    """One tool call plus a short Chinese explanation (served as ``reasoning_content``)."""

    tool: str
    arguments: dict[str, str]
    reasoning: str


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


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()


def _tokens(text: str) -> set[str]:
    """Chinese bigrams (a lone character stands for itself) plus Latin/digit words."""
    text = _norm(text)
    out: set[str] = set()
    for run in re.findall(r"[\u4e00-\u9fff]+", text):
        out.update([run] if len(run) == 1 else (run[i : i + 2] for i in range(len(run) - 1)))
    out.update(re.findall(r"[a-z0-9]+(?:[._+\-/][a-z0-9]+)*", text))
    return out


def _contains_term(haystack: str, term: str) -> bool:
    """Substring test; a Latin/digit term must not sit inside a longer word (``xl`` vs ``xxl``)."""
    term = _norm(term)
    if not term:
        return False
    if re.fullmatch(r"[a-z0-9 ._+\-]+", term):
        return re.search(rf"(?<![a-z0-9]){re.escape(term)}(?![a-z0-9])", haystack) is not None
    return term in haystack


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
    text = _norm(instruction)
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
        if after.startswith("+") or "以上" in after or after.startswith("起"):
            continue
        if re.search(r"(?<!不)(?<!不要)(超过|高于|大于)$", before):
            continue
        # Money: a yuan unit right after the number, a price word right before it, or an
        # upper-bound word right after it ("300以内"); "一款" or "15寸" are not amounts.
        tight = before.rstrip("在就是为约大概只要 ")
        if not (
            after.startswith("元")
            or tight.endswith(_MONEY_BEFORE)
            or after.startswith(_UPPER_AFTER[:-1])
            or (match.group("cn") is None and any(word in before for word in _MONEY_BEFORE))
        ):
            continue
        if any(after.lstrip("元").startswith(word) or after.startswith(word) for word in _APPROX):
            value = round(value * 1.1, 2)
        return value
    return None


def _price_low(price: str) -> float | None:
    """Lowest number of a displayed price (``"12.5"`` or ``"10.0 to 20.0"``)."""
    numbers = re.findall(r"\d+(?:\.\d+)?", price or "")
    return min(float(n) for n in numbers) if numbers else None


# --------------------------------------------------------------------------- keywords

_SPLIT = re.compile(r"[，,。；;！!？?、\n：:（）()“”\"'「」《》【】]+")
_LEADING_FILLERS = tuple(
    sorted(
        "我想买 我想要 我要买 我需要 我想找 帮我找 帮我买 请帮我 给我找 给我买 想买 想要 想找 需要 购买 寻找 推荐 "
        "要求是 要求 希望是 希望 最好是 最好 而且 并且 同时 另外 还要 还有 能够 可以 支持 具有 带有 适合 用于 "
        "是 有 我 请 帮 找 买 要 个 款 还 能 并".split(),
        key=len,
        reverse=True,  # longest first, so 我想买 is stripped whole rather than as 我
    )
)
_MEASURE = re.compile(r"^[一两几][款个台件双套把条只些瓶盏部张副份支块本盒袋包辆对]")
_BUDGET_WORDS = re.compile(r"预算|价格|价位|售价|价钱|\d\s*元|块钱|以内|以下|之内|不超过|左右|便宜|实惠|性价比")
_GENERIC = frozenset({"东西", "商品", "产品", "质量好", "好用", "不错", "的", "一下", "用", "使用"})


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
        segments = [s for s in segments if s and s not in _GENERIC and not _BUDGET_WORDS.search(s)]
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


def query_variants(instruction: str) -> list[str]:
    """Search queries from specific to broad; the n-th search of an episode uses the n-th one."""
    kind, terms = extract_keywords(instruction)
    variants: list[str] = []
    if kind:
        variants += [" ".join([kind, *terms[:3]]), " ".join([kind, *terms[:1]]), kind]
        if len(kind) > 4:
            variants.append(kind[-3:])  # Chinese is head-final: 男士运动鞋 -> 运动鞋
    fallback = re.sub(r"\s+", " ", _SPLIT.sub(" ", instruction)).strip()[:20]
    variants.append(fallback or "商品")
    out: list[str] = []
    for variant in variants:
        if variant.strip() and variant not in out:
            out.append(variant.strip())
    return out


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
class _History:
    instruction: str = ""
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
        return [arg for tool, arg in self.calls if tool == "click" and _ASIN.match(arg)]

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


def _history(messages: list[dict[str, Any]]) -> _History:
    hist = _History()
    seen_task = False
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        text = _text_of(message.get("content"))
        if role == "user" and not seen_task:
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


def _offered(tools: list[dict[str, Any]] | None) -> dict[str, list[str] | None]:
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


# --------------------------------------------------------------------------- decisions


@dataclass(slots=True)
class _Context:
    hist: _History
    obs: Observation
    clicks: list[str]
    can_search: bool
    budget: float | None
    instruction: str
    rng: random.Random | None

    @property
    def urgent(self) -> bool:
        return self.hist.turns + 1 >= URGENT_STEP


def decide(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    seed: int | None = None,
    temperature: float = 0.0,
) -> Decision | None:
    """The next tool call for this conversation, or None when no tool is offered.

    The result always names an offered tool, and a click value is always one of the enum
    values offered. ``temperature > 0`` adds seeded noise to tie-breaks so that samples with
    different seeds can differ; at 0 the choice depends on the conversation only.
    """
    offered = _offered(tools)
    if not offered:
        return None
    hist = _history(messages)
    clicks = list(offered.get("click") or [])
    rng = None
    if temperature > 0:
        rng = random.Random(fingerprint([seed, hist.instruction, len(hist.calls)]))
    ctx = _Context(
        hist=hist,
        obs=parse_observation(hist.observation),
        clicks=clicks,
        can_search="search" in offered,
        budget=parse_budget(hist.instruction),
        instruction=_norm(hist.instruction),
        rng=rng,
    )
    if ctx.can_search:
        return _search(ctx)
    if not clicks:
        return Decision(next(iter(offered)), {}, "没有可点击的元素。")  # unknown tool shape
    decision = _results(ctx) if ctx.obs.page == "搜索结果" else None
    if decision is None and ctx.obs.page in ("商品详情", "商品属性页"):
        decision = _product(ctx)
    decision = decision or _fallback(ctx)
    if decision.arguments.get("value") not in clicks:  # a parsed page disagreeing with the enum
        decision = _fallback(ctx)
    return decision


def _click(value: str, why: str) -> Decision:
    return Decision("click", {"value": value}, why)


def _search(ctx: _Context) -> Decision:
    variants = query_variants(ctx.hist.instruction)
    query = variants[min(ctx.hist.searches, len(variants) - 1)]
    why = f"当前在搜索首页，根据任务提取关键词「{query}」进行搜索。"
    if ctx.hist.searches:
        why = f"之前的搜索结果不理想，换用更宽泛的关键词「{query}」重新搜索。"
    return Decision("search", {"query": query}, why)


def _relevance(ctx: _Context, product: Product) -> float:
    kind, terms = extract_keywords(ctx.hist.instruction)
    wanted: dict[str, float] = {}
    for token in _tokens(" ".join(terms)) | _tokens(ctx.hist.instruction):
        wanted[token] = 1.0
    for token in _tokens(kind):
        wanted[token] = 3.0  # the product kind matters most
    if not wanted:
        return 0.0
    title = _tokens(product.title)
    rest = _tokens(" ".join((product.category, product.attributes, product.brand)))
    score = sum(w * (1.0 if t in title else 0.6 if t in rest else 0.0) for t, w in wanted.items())
    score /= sum(wanted.values())
    low = _price_low(product.price)
    if ctx.budget is not None and low is not None and low > ctx.budget:
        score *= 0.3
    if ctx.rng is not None:
        score += ctx.rng.uniform(0.0, 0.05)
    return score


def _results(ctx: _Context) -> Decision | None:
    visited = set(ctx.hist.visited())
    listed = [p for p in ctx.obs.products if p.asin in ctx.clicks]
    scored = sorted(((_relevance(ctx, p), -p.rank, p) for p in listed if p.asin not in visited), key=lambda x: x[:2])
    best = scored[-1] if scored else None
    paging = [arg for tool, arg in ctx.hist.since_last_search() if tool == "click" and arg in (NEXT, PREV)]
    tired = len(visited) >= MAX_PRODUCTS or ctx.urgent
    if best is not None and (best[0] >= GOOD_MATCH or tired):
        return _click(best[2].asin, f"搜索结果中「{best[2].title[:30]}」与任务最匹配（得分 {best[0]:.2f}），打开查看。")
    if NEXT in ctx.clicks and len(paging) < MAX_PAGES_PER_QUERY and not ctx.urgent:
        return _click(NEXT, "本页没有足够匹配的商品，翻到下一页。")
    if BACK in ctx.clicks and ctx.hist.searches < MAX_SEARCHES and not ctx.urgent:
        return _click(BACK, "当前搜索结果不匹配，返回搜索页换关键词。")
    if best is not None:
        return _click(best[2].asin, f"没有更好的选择，打开最接近的商品「{best[2].title[:30]}」。")
    if listed:
        again = max(listed, key=lambda p: (_relevance(ctx, p), -p.rank))
        return _click(again.asin, "所有商品都看过了，重新打开最匹配的一个。")
    return None


def _value_match(ctx: _Context, value: str) -> float:
    """How clearly the instruction names an option value: share of its ``|`` parts it contains."""
    parts = [p.strip() for p in value.split("|") if p.strip()]
    if not parts:
        return 0.0
    return sum(1 for p in parts if _contains_term(ctx.instruction, p)) / len(parts)


def _option_clicks(ctx: _Context) -> dict[str, list[str]]:
    """Enum option entries grouped by axis (page order); axis names may themselves contain '='."""
    axes = sorted(ctx.obs.axes, key=len, reverse=True)
    grouped: dict[str, list[str]] = {axis: [] for axis in ctx.obs.axes}
    for entry in ctx.clicks:
        if entry in _BUTTONS or _ASIN.match(entry) or "=" not in entry:
            continue
        axis = next((a for a in axes if entry.startswith(a + "=")), entry.partition("=")[0])
        grouped.setdefault(axis, []).append(entry)
    return grouped


def _product(ctx: _Context) -> Decision | None:
    grouped = _option_clicks(ctx)
    asin = ctx.obs.product.asin if ctx.obs.product else ""
    tried = ctx.hist.since_opening(asin) if asin else []
    last = ctx.hist.calls[-1][1] if ctx.hist.calls else None
    named_axes: set[str] = set()
    for axis, entries in grouped.items():
        selected = ctx.obs.axes.get(axis, (None, []))[0]
        best_score = _value_match(ctx, selected) if selected else 0.0
        choice = None
        for entry in entries:
            score = _value_match(ctx, entry[len(axis) + 1 :])
            if score >= 0.5 and score > best_score and not (ctx.obs.last_invalid and entry == last):
                best_score, choice = score, entry
        if best_score >= 0.5:
            named_axes.add(axis)
        if choice is not None:
            return _click(choice, f"任务中提到了「{choice[len(axis) + 1:]}」，选择规格 {axis}。")
    for axis, (selected, _values) in ctx.obs.axes.items():
        entries = [e for e in grouped.get(axis, []) if e not in tried]
        if selected is None and entries:
            pick = entries[0] if ctx.rng is None else ctx.rng.choice(entries)
            return _click(pick, f"规格「{axis}」尚未选择，任务没有指定，选择「{pick[len(axis) + 1:]}」。")
    if BUY not in ctx.clicks:
        missing = [axis for axis, (selected, _) in ctx.obs.axes.items() if selected is None]
        if missing and any(grouped.get(a) for a in missing):
            pick = grouped[next(a for a in missing if grouped.get(a))][0]
            return _click(pick, "还有规格未选择，先完成选择。")
        return _click(PREV, "这个商品无法购买，返回搜索结果。") if PREV in ctx.clicks else None
    price = _price_low(ctx.obs.product.price) if ctx.obs.product else None
    if ctx.budget is not None and price is not None and price > ctx.budget and not ctx.urgent:
        option_tries = [c for c in tried if "=" in c]
        free = [e for axis, entries in grouped.items() if axis not in named_axes for e in entries if e not in tried]
        if free and len(option_tries) < MAX_PRICE_TRIES:
            return _click(free[0], f"当前价格 {price:g} 超出预算 {ctx.budget:g}，尝试其他规格。")
        if PREV in ctx.clicks and len(set(ctx.hist.visited())) < MAX_PRODUCTS:
            return _click(PREV, f"价格 {price:g} 超出预算 {ctx.budget:g}，返回结果列表看其他商品。")
    return _click(BUY, "规格已选好，商品符合任务要求，购买。")


def _fallback(ctx: _Context) -> Decision:
    """Any reasonable offered click, in order of usefulness; never invents a value."""
    for value in (BUY, *[c for c in ctx.clicks if _ASIN.match(c)], NEXT, BACK, PREV):
        if value in ctx.clicks:
            return _click(value, "页面无法完全解析，选择一个可用的操作。")
    return _click(ctx.clicks[0], "选择第一个可用的操作。")
