"""Deterministic generator of the synthetic ShopSimulator catalog used by the testbed.

One product per task, in the record format of the cleaned ShopSimulator catalog. Every task id
of the project's persona split file is a persona task; the remaining ids in ``0..TOTAL_TASKS-1``
are standard tasks. Products of one leaf category are near-duplicates of each other, and each
task's goal attributes are picked so that few siblings satisfy all of them. The full instruction
names every goal; a persona task's short instruction names one or two, and its profile states some
of the others verbatim, hints at some indirectly and leaves the rest out.

Everything is derived from string-seeded ``random.Random`` instances and ordered lists, and
the gzip header carries ``mtime=0`` and a fixed name, so a re-run reproduces the committed
bytes (given the same zlib build).

    python -m shopsimrl.testbed.catalog_gen --out PATH [--splits PATH] [--check]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import math
import random
import re
import sys
from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

from .catalog_vocab import (
    BRANDS,
    HABITS,
    INTERESTS,
    LEAVES,
    PAST_ITEMS,
    PERSONA,
    SHOP_SUFFIXES,
    VALUE_HINTS,
    Axis,
    Leaf,
    size_hint,
)

__all__ = [
    "CATALOG_VERSION",
    "DEFAULT_OUT",
    "TOTAL_TASKS",
    "build_catalog",
    "catalog_bytes",
    "default_splits_path",
    "load_persona_ids",
    "main",
    "read_catalog",
]

CATALOG_VERSION = "shopsim-synthetic-catalog-v1"
TOTAL_TASKS = 6000
_SEED = "shopsimrl-testbed-catalog-v1"
_GZIP_NAME = "catalog.v1.json"
_BRANDS_PER_LEAF = 14
_MATCH_THRESHOLD = 85  # the reward's fuzzy attribute threshold (strictly greater than)
DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "catalog.v1.json.gz"

_OPENERS = ("我想买一{u}{n}", "帮我找一{u}{n}", "想入手一{u}{n}", "请帮我挑一{u}{n}", "打算买一{u}{n}", "在找一{u}{n}")
_SIMPLE_OPENERS = ("想买一{u}{n}", "找一{u}{n}", "求推荐一{u}{n}", "想入手一{u}{n}", "帮忙挑一{u}{n}")
_ATTR_LEADS = ("，要求", "，希望", "，最好", "，条件是", "，需要")
_CONTEXTS = (
    "平时自己用",
    "准备送人",
    "家里旧的该换了",
    "想趁活动入手",
    "朋友推荐过这类",
    "之前那款用坏了",
    "给家里人准备的",
    "第一次买这类东西",
)
_CLOSINGS = ("麻烦帮我挑一款合适的", "请帮我选一下", "尽量找靠谱的店铺", "谢谢", "急用，尽快下单", "直接帮我下单就好")
_LONG_CLOSINGS = (
    "平时用得比较多，质量一定要靠谱",
    "看了好几家还没决定，麻烦帮我挑一款",
    "对这类东西不太懂，请按上面的条件选",
    "之前买过的不太满意，这次想选好一点的",
)
_SIMPLE_TAILS = ("自己用", "送人用", "急用", "家里用", "帮忙挑下")
_FILLERS = (
    "做工细致，细节经得起推敲",
    "品质稳定，售后有保障",
    "适合多种场景，满足日常所需",
    "出厂前逐件检验",
    "用料扎实，手感出色",
    "设计简洁，容易上手",
    "口碑回购款，好评不断",
    "支持七天无理由退换",
    "库存充足，当天发货",
)
_TITLE_EXTRAS = ("2025新款", "2024新款", "官方正品", "爆款", "热卖", "限时特惠", "品质款")


def _digest(*parts: object) -> str:
    return hashlib.sha256(":".join(str(p) for p in (_SEED, *parts)).encode()).hexdigest()


# -- the reward's attribute matcher (token-set ratio over \W+-split, casefolded tokens) --


def _token_set_ratio(a: str, b: str) -> int:
    ta = set(re.sub(r"\W+", " ", a.casefold()).split())
    tb = set(re.sub(r"\W+", " ", b.casefold()).split())
    if not ta or not tb:
        return 0
    sect = " ".join(sorted(ta & tb))
    c1 = (sect + " " + " ".join(sorted(ta - tb))).strip()
    c2 = (sect + " " + " ".join(sorted(tb - ta))).strip()

    def ratio(x: str, y: str) -> int:
        return round(100 * SequenceMatcher(None, x, y).ratio()) if x and y else 0

    return max(ratio(sect, c1), ratio(sect, c2), ratio(c1, c2))


# -- prices --


def _nice(x: float) -> float:
    """A shop-like price at or just below ``x``: 19.9, 299.0, 1999.0."""
    if x < 30:
        return math.floor(x) + 0.9
    if x < 1000:
        return float(math.floor(x / 10) * 10 + 9)
    return float(math.floor(x / 100) * 100 + 99)


def _budget_step(price: float) -> int:
    return 5 if price < 50 else 10 if price < 100 else 50 if price < 500 else 100 if price < 2000 else 500


_CN_DIGITS = "零一二三四五六七八九"


def _cn_amount(n: int) -> str | None:
    """Colloquial Chinese amount (三百, 一千八, 两万 is avoided); None when not expressible."""
    if 20 <= n < 100 and n % 10 == 0:
        return _CN_DIGITS[n // 10] + "十"
    if 100 <= n < 1000 and n % 100 == 0:
        return _CN_DIGITS[n // 100] + "百"
    if 1000 <= n < 10000 and n % 100 == 0:
        head, rest = divmod(n, 1000)
        return _CN_DIGITS[head] + "千" + (_CN_DIGITS[rest // 100] if rest else "")
    return None


# -- products --


@dataclass
class _Draft:
    task_id: int
    leaf: Leaf
    brand: str
    shop_name: str
    title: str
    attrs: list[str]
    options: dict[str, list[tuple[str, float | None]]]
    price_axis: str | None
    base_price: float
    bullets: list[str]
    description: str
    product_category: str

    def text(self) -> str:
        # What the reward's substring test reads: title, bullets and description.
        return " ".join([self.title, *self.bullets, self.description]).casefold()


def _validate_leaf(leaf: Leaf) -> None:
    values = {v for _, vs in leaf.slots for v in vs}
    clash = sorted(values & set(leaf.tags))
    if clash:  # a plain tag equal to a slot value would fuzzy-match "键：值" at 100
        raise ValueError(f"leaf {leaf.path}: tags equal slot values: {clash}")
    if not all(a.values and len(set(a.values)) == len(a.values) for a in leaf.axes):
        raise ValueError(f"leaf {leaf.path}: empty or repeated option values")


def _validate_hints() -> None:
    # A hint that contains its value would make the indirect route a plain string match.
    for leaf in LEAVES:
        values = [v for _, vs in leaf.slots for v in vs] + list(leaf.tags) + [v for a in leaf.axes for v in a.values]
        for value in values:
            for hint in (VALUE_HINTS.get(value), size_hint(leaf.noun, value)):
                if hint and value.casefold() in hint.casefold():
                    raise ValueError(f"leaf {leaf.path}: hint {hint!r} contains its value {value!r}")


def _title_words(leaf: Leaf) -> list[str]:
    # Generic title words must not contain any attribute text, or every sibling would "have" it.
    vocab = [v for _, vs in leaf.slots for v in vs] + list(leaf.tags)
    return [w for w in leaf.words if not any(w in v or v in w for v in vocab)]


def _options(leaf: Leaf, rng: random.Random, base: float) -> tuple[dict[str, list[tuple[str, float | None]]], str | None]:
    priced = [a for a in leaf.axes if a.priced]
    mode = rng.choices(("none", "flat", "priced"), weights=(10, 30, 60))[0]
    if mode == "priced" and not priced:
        mode = "flat"
    if mode == "none":
        return {}, None
    price_axis: Axis | None = rng.choice(priced) if mode == "priced" else None
    axes = [a for a in leaf.axes if a is price_axis or rng.random() < 0.7]
    if not axes:
        axes = [rng.choice(leaf.axes)]
    flat_all = rng.random() < 0.7  # flat products: every axis at the one price, or one axis priced
    out: dict[str, list[tuple[str, float | None]]] = {}
    for i, axis in enumerate(axes):
        count = rng.randint(2, min(5, len(axis.values)))
        values = [axis.values[j] for j in sorted(rng.sample(range(len(axis.values)), count))]
        if axis is price_axis:
            prices, step = [base], base * rng.uniform(0.1, 0.35)
            for _ in values[1:]:
                p = _nice(prices[-1] + step * rng.uniform(0.8, 1.25))
                while p <= prices[-1]:
                    p = _nice(p + (1 if p < 30 else 10 if p < 1000 else 100))
                prices.append(p)
            out[axis.name] = list(zip(values, prices, strict=True))
        elif price_axis is not None:
            same: float | None = base if rng.random() < 0.3 else None
            out[axis.name] = [(v, same) for v in values]
        else:
            same = base if (flat_all or i == 0) else None
            out[axis.name] = [(v, same) for v in values]
    return out, (price_axis.name if price_axis else None)


def _draft(leaf: Leaf, task_id: int, rng: random.Random, brands: list[str], words: list[str]) -> _Draft:
    brand = rng.choice(brands)
    slot_attrs = [f"{key}：{rng.choice(values)}" for key, values in leaf.slots]
    tags = rng.sample(leaf.tags, rng.randint(2, 5))
    base = _nice(rng.uniform(*leaf.price))
    options, price_axis = _options(leaf, rng, base)

    model = f"{rng.choice('ABCDEFGHKMNPRSTXZ')}{rng.randint(1, 99)}" if rng.random() < 0.5 else ""
    chunks = [*tags[:2], slot_attrs[rng.randrange(len(slot_attrs))].split("：")[1]]
    chunks += rng.sample(words, min(len(words), rng.randint(1, 2)))
    rng.shuffle(chunks)
    extra = [rng.choice(_TITLE_EXTRAS)] if rng.random() < 0.6 else []
    title = " ".join([f"{brand}{model}{leaf.noun}", *chunks, *extra])

    bullet_src = rng.sample(slot_attrs + tags, rng.randint(3, min(5, len(slot_attrs) + len(tags))))
    bullets = []
    for item in bullet_src:
        key, _, value = item.partition("：")
        head = f"【{key}】{value}，" if value else f"【{item}】"
        bullets.append(head + rng.choice(_FILLERS))
    description = (
        f"{brand}{leaf.noun}，{'、'.join(tags)}。规格参数：{'；'.join(slot_attrs)}。" + "，".join(rng.sample(_FILLERS, 2)) + "。"
    )
    product_category = leaf.path if rng.random() < 0.3 else leaf.path.split("›")[-1]
    return _Draft(
        task_id,
        leaf,
        brand,
        brand + rng.choice(SHOP_SUFFIXES),
        title,
        slot_attrs + tags,
        options,
        price_axis,
        base,
        bullets,
        description,
        product_category,
    )


class _LeafIndex:
    """Which products of one leaf satisfy a goal attribute under the reward's rule."""

    def __init__(self, drafts: list[_Draft]) -> None:
        self._owners: dict[str, set[int]] = {}
        for i, d in enumerate(drafts):
            for a in d.attrs:
                self._owners.setdefault(a, set()).add(i)
        self._texts = [d.text() for d in drafts]
        self._cache: dict[str, frozenset[int]] = {}

    def matching(self, goal: str) -> frozenset[int]:
        if goal not in self._cache:
            hits: set[int] = set()
            for attr, owners in self._owners.items():
                if _token_set_ratio(goal, attr) > _MATCH_THRESHOLD:
                    hits |= owners
            needle = goal.casefold()
            hits.update(i for i, t in enumerate(self._texts) if needle in t)
            self._cache[goal] = frozenset(hits)
        return self._cache[goal]


def _pick_goal_attrs(draft: _Draft, own: int, index: _LeafIndex, rng: random.Random) -> list[str]:
    """2-5 of the product's attributes, greedily narrowing the set of siblings that have them all."""
    want = min(len(draft.attrs), rng.choices((2, 3, 4, 5), weights=(10, 25, 35, 30))[0])
    pool = list(draft.attrs)
    rng.shuffle(pool)
    chosen = [pool.pop(0)]
    alive = index.matching(chosen[0])
    while len(chosen) < want:
        best = min(pool, key=lambda a: len(alive & index.matching(a)))
        pool.remove(best)
        chosen.append(best)
        alive &= index.matching(best)
    if own not in alive:
        raise RuntimeError(f"task {draft.task_id}: gold product misses its own goal attributes")
    return chosen


# -- instructions and personas --


def _attr_phrase(attr: str, rng: random.Random) -> str:
    key, _, value = attr.partition("：")
    if not value:
        return attr
    return rng.choice(("{k}为{v}", "{k}是{v}", "{k}要{v}")).format(k=key, v=value)


def _budget(gold: float, rng: random.Random, persona: bool) -> tuple[str, str, float]:
    """(phrase for the full text, phrase for the short text, the budget the phrase means)."""
    step = _budget_step(gold)
    top = int(math.ceil(gold / step) * step) + (step if rng.random() < 0.3 else 0)
    cn = _cn_amount(top)
    if persona:
        kind = rng.choice(("within", "about"))
    else:
        kind = rng.choice(("within", "below", "cap", "about", "range", "cn_cap"))
        if kind == "cn_cap" and cn is None:
            kind = "cap"
    if kind == "about":
        upper = round(top * 1.1, 2)  # the parser reads "…左右" as an approximate budget (x1.1)
        return f"价格在{top}元左右", f"{cn or top}左右", upper
    if kind == "range":
        low = max(step, top - step * rng.randint(1, 3))
        return f"价格在{low}-{top}元之间", f"{low}-{top}元", float(top)
    full = {
        "within": f"预算在{top}元以内",
        "below": f"预算{top}元以下",
        "cap": f"价格不超过{top}元",
        "cn_cap": f"预算不超过{cn}",
    }[kind]
    return full, f"{top}元以内", float(top)


# Disclosure shares of persona goals (tuned so that literal string matching recovers only part
# of a goal, as with the real, LLM-written profiles): a goal left out of the short instruction
# is stated verbatim in a structured preference, hinted at indirectly, or not inferable at all.
_P_LITERAL_ATTR = 0.25
_P_LITERAL_OPTION = 0.45
_P_HINT = 0.9
_P_ASPECT = 0.5  # a key-only mention ("在意续航时长"): says what matters, not which value
_P_BUDGET_IN_SIMPLE = 0.6
_P_BUDGET_LITERAL = 0.7


def _mention(goal: str, rng: random.Random) -> str:
    """A goal as the short instruction words it: the catalog phrase or a looser paraphrase."""
    key, _, value = goal.partition("：")
    if not value:
        return rng.choice(("带{v}的", "要{v}的", "最好{v}", "主打{v}")).format(v=key)
    if rng.random() < 0.4:
        return _attr_phrase(goal, rng)
    return rng.choice(("要{v}的", "{v}的", "最好是{v}", "{k}{v}")).format(k=key, v=value)


def _price_rank_habit(d: _Draft, goal_opts: dict[str, str], upper: float | None) -> str | None:
    """A buying habit that singles out the gold variant of a price axis, when one is true."""
    if not d.price_axis:
        return None
    priced = [(p or 0.0, v) for v, p in d.options[d.price_axis]]
    gold = [v for _, v in priced].index(goal_opts[d.price_axis])
    if gold == 0:
        return "同款有多个规格时一般只买最基础的那档"
    affordable = [i for i, (p, _) in enumerate(priced) if upper is None or p <= upper]
    if gold == affordable[-1]:
        return "习惯在预算内挑配置最高的一档" if upper is not None else "喜欢一步到位买顶配"
    return None


def _persona(
    d: _Draft, goal_attrs: list[str], goal_opts: dict[str, str], short_budget: str, upper: float | None, rng: random.Random
) -> tuple[str, dict[str, Any]]:
    """(instruction_simple, user_persona): the short text names the kind and one or two goals; the
    profile describes the person, from which only some of the remaining goals can be inferred."""
    noun = d.leaf.noun
    simple = rng.choice(_SIMPLE_OPENERS).format(u=d.leaf.unit, n=noun)
    named = [rng.choice(goal_attrs)]
    simple += "，" + _mention(named[0], rng)
    budget_in_simple = bool(short_budget) and rng.random() < _P_BUDGET_IN_SIMPLE
    extra = [a for a in goal_attrs if a not in named] + [f"{a}：{v}" for a, v in goal_opts.items()]
    if budget_in_simple:
        simple += "，预算" + short_budget
    elif extra and rng.random() < 0.5:
        second = rng.choice(extra)
        named.append(second)
        axis, _, value = second.partition("：")
        simple += "，" + (
            rng.choice(("要{v}的", "{a}选{v}")).format(a=axis, v=value) if axis in goal_opts else _mention(second, rng)
        )
    if len(simple) < 20:
        simple += "，" + rng.choice(_SIMPLE_TAILS)

    pick = {key: rng.choice(values) for key, values in PERSONA.items()}
    for word, gender in (("女装", "女"), ("女鞋", "女"), ("彩妆", "女"), ("男装", "男"), ("男鞋", "男")):
        if word in d.leaf.path:  # whoever wears it: the body and taste hints describe that person
            pick["性别"] = gender
    pick["年龄段"] = {"学生": "18-24岁", "退休人员": "50岁以上"}.get(pick["职业"], pick["年龄段"])
    life: list[str] = []  # free-text facts about the person (needs, body, home)
    taste: list[str] = []  # free-text aesthetic taste
    literal_attrs: list[str] = []
    aspects: list[str] = []
    literal_opts: dict[str, str] = {}
    for goal in goal_attrs:
        if goal in named:
            continue
        key, _, value = goal.partition("：")
        value = value or key
        roll = rng.random()
        if roll < _P_LITERAL_ATTR:
            literal_attrs.append(value)
        elif value in VALUE_HINTS and rng.random() < _P_HINT:
            life.append(VALUE_HINTS[value])
        elif goal != value and rng.random() < _P_ASPECT:
            aspects.append(key)
    habit = None
    for axis, value in goal_opts.items():
        if f"{axis}：{value}" in named:
            continue
        hint = size_hint(noun, value) or VALUE_HINTS.get(value)
        rank_habit = _price_rank_habit(d, goal_opts, upper) if axis == d.price_axis else None
        if rng.random() < _P_LITERAL_OPTION:
            literal_opts[axis] = value
        elif rank_habit and rng.random() < _P_HINT:
            habit = rank_habit
        elif hint and rng.random() < _P_HINT:
            (life if size_hint(noun, value) else taste).append(hint)

    domain = d.leaf.path.split("›")[0]
    others = sorted({leaf.path.split("›")[0] for leaf in LEAVES} - {domain})
    spend_lo = _budget_step(d.base_price) * rng.randint(1, 4)
    trade: dict[str, Any] = {
        "近一年订单数": rng.randint(2, 120),
        "客单价区间": f"{spend_lo}-{spend_lo * 3}元",
        "价格敏感度": pick["价格敏感度"],
        "常用支付方式": pick["支付方式"],
        "优惠偏好": pick["优惠偏好"],
        "近期购买": rng.sample(PAST_ITEMS, rng.randint(2, 4)),
    }
    prefs: dict[str, Any] = {"风格倾向": pick["风格倾向"], "购买动机": pick["购买动机"]}
    if taste:
        prefs["审美偏好"] = "；".join(taste)
    if aspects:
        prefs["关注方面"] = aspects
    if literal_attrs:
        prefs["常买卖点"] = literal_attrs
    if literal_opts:
        prefs["规格偏好"] = literal_opts
    if short_budget and not budget_in_simple:
        if rng.random() < _P_BUDGET_LITERAL:
            prefs["预算"] = short_budget
        else:
            habit = "；".join(filter(None, (habit, f"这类东西一般花{short_budget}")))
    if habit:
        trade["消费习惯"] = habit
    profile: dict[str, Any] = {
        "用户ID": "U" + _digest("user", d.task_id)[:10].upper(),
        "性别": pick["性别"],
        "年龄段": pick["年龄段"],
        "城市等级": pick["城市等级"],
        "职业": pick["职业"],
        "会员等级": pick["会员等级"],
        "兴趣标签": rng.sample(INTERESTS, 3),
    }
    if life:
        profile["生活情况"] = "；".join(life)
    profile["行为特征"] = {
        "活跃时段": pick["活跃时段"],
        "浏览习惯": pick["浏览习惯"],
        "近30天访问次数": rng.randint(3, 80),
        "常逛类目": [domain, *rng.sample(others, 2)],
        "购物习惯": rng.sample(HABITS, 2),
    }
    profile["交易特征"] = trade
    profile["偏好"] = prefs
    wanted = goal_attrs + [f"{a}={v}" for a, v in goal_opts.items()]
    profile["__reasoning__"] = (
        f"该用户近期多次浏览{noun}，购买动机为{pick['购买动机']}；本次目标：{'、'.join(wanted)}"
        + (f"；心理价位{short_budget}" if short_budget else "")
        + "。"
    )
    return simple, profile


def _record(d: _Draft, goal_attrs: list[str], rng: random.Random, is_persona: bool) -> dict[str, Any]:
    goal_opts: dict[str, str] = {}
    if d.options:
        others = [a for a in d.options if a != d.price_axis]
        axes = ([d.price_axis] if d.price_axis else []) + [a for a in others if rng.random() < (0.45 if d.price_axis else 0.6)]
        for axis in axes or [rng.choice(list(d.options))]:
            goal_opts[axis] = rng.choice(d.options[axis])[0]
    gold_price = d.base_price
    if d.price_axis:
        gold_price = float(dict(d.options[d.price_axis])[goal_opts[d.price_axis]] or 0.0)

    has_budget = rng.random() < (0.85 if is_persona else 0.4)
    full_budget, short_budget, upper = _budget(gold_price, rng, is_persona) if has_budget else ("", "", 0.0)
    u = d.leaf.unit
    text = rng.choice(_OPENERS).format(u=u, n=d.leaf.noun)
    text += "，" + rng.choice(_CONTEXTS)
    text += rng.choice(_ATTR_LEADS) + "、".join(_attr_phrase(a, rng) for a in goal_attrs)
    for axis, value in goal_opts.items():
        text += "，" + rng.choice(("{a}选{v}", "{a}要{v}", "{a}挑{v}")).format(a=axis, v=value)
    if full_budget:
        text += "，" + full_budget
    if len(text) < 50:
        text += "，" + rng.choice(_LONG_CLOSINGS)
    elif len(text) < 75 and rng.random() < 0.6:
        text += "，" + rng.choice(_CLOSINGS)
    text += "。"

    simple = ""
    persona: dict[str, Any] | None = None
    if is_persona:
        # Persona text has its own generator so that its wording never shifts the goals of later tasks.
        simple, persona = _persona(
            d, goal_attrs, goal_opts, short_budget, upper if has_budget else None, random.Random(f"{_SEED}:persona:{d.task_id}")
        )

    rec: dict[str, Any] = {
        "asin": "",
        "title": d.title,
        "shop_name": d.shop_name,
        "category": d.leaf.path,
        "product_category": d.product_category,
        "pricing": _pricing(d),
        "customization_options": {axis: [{"value": v, "price": p} for v, p in vals] for axis, vals in d.options.items()},
        "attribute": d.attrs,
        "full_description": d.description,
        "small_description": d.bullets,
        "images": [],
        "instructions": [
            {
                "task_id": d.task_id,
                "task_uid": "shopsim-" + _digest("task", d.task_id)[:24],
                "instruction_index": 0,
                "instruction": text,
                "instruction_simple": simple,
                "attributes": goal_attrs,
                "instruction_options": [v.lower() for v in goal_opts.values()],
                "price_upper": upper if (is_persona and has_budget) else None,
            }
        ],
    }
    if persona is not None:
        rec["user_persona"] = persona
    rec["reason_key"] = None
    rec["source_product_index"] = d.task_id
    return rec


def _pricing(d: _Draft) -> list[float]:
    if d.price_axis:
        prices = [p for _, p in d.options[d.price_axis] if p is not None]
        return [min(prices), max(prices)]
    return [d.base_price]


def _build_leaf(leaf: Leaf, task_ids: list[int], persona_ids: frozenset[int]) -> list[dict[str, Any]]:
    _validate_leaf(leaf)
    rng = random.Random(f"{_SEED}:leaf:{leaf.path}")
    brands = rng.sample(BRANDS, _BRANDS_PER_LEAF)
    words = _title_words(leaf)
    drafts = [_draft(leaf, tid, rng, brands, words) for tid in task_ids]
    index = _LeafIndex(drafts)
    out = []
    for i, d in enumerate(drafts):
        goal_attrs = _pick_goal_attrs(d, i, index, rng)
        out.append(_record(d, goal_attrs, rng, d.task_id in persona_ids))
    return out


# -- catalog --


def load_persona_ids(path: Path) -> list[int]:
    """All task ids of the ``splits`` of a persona split file, ascending; ValueError names the problem."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read split file: {exc}") from exc
    splits = data.get("splits") if isinstance(data, dict) else None
    if not isinstance(splits, dict) or not splits:
        raise ValueError(f"{path}: field 'splits' must be a non-empty object")
    ids: set[int] = set()
    for name in sorted(splits):
        task_ids = splits[name].get("task_ids") if isinstance(splits[name], dict) else None
        if not isinstance(task_ids, list) or not all(isinstance(t, int) and t >= 0 for t in task_ids):
            raise ValueError(f"{path}: splits.{name}.task_ids must be a list of non-negative ints")
        ids.update(task_ids)
    return sorted(ids)


def default_splits_path() -> Path:
    root = Path(__file__).resolve().parents[2]
    for candidate in (root / "configs/splits/persona_splits.v1.json", root.parent / "shared/data/persona_splits.v1.json"):
        if candidate.is_file():
            return candidate
    raise ValueError(f"no persona split file under {root / 'configs/splits'}; pass --splits")


def build_catalog(persona_ids: list[int], total: int = TOTAL_TASKS) -> list[dict[str, Any]]:
    """Product records sorted by task id: persona tasks for ``persona_ids``, standard tasks for the rest of ``0..total-1``."""
    _validate_hints()
    persona = frozenset(persona_ids)
    order = sorted(set(range(total)) | persona)
    random.Random(f"{_SEED}:assign").shuffle(order)
    records: list[dict[str, Any]] = []
    for k, leaf in enumerate(LEAVES):
        records.extend(_build_leaf(leaf, sorted(order[k :: len(LEAVES)]), persona))
    records.sort(key=lambda r: r["source_product_index"])
    seen: set[str] = set()
    for rec in records:  # ASINs are assigned globally so that uniqueness is checked across leaves
        salt = 0
        while True:
            asin = str(10**11 + int(_digest("asin", rec["source_product_index"], salt), 16) % (9 * 10**11))
            if asin not in seen:
                break
            salt += 1
        seen.add(asin)
        rec["asin"] = asin
        rec["images"] = [f"https://img.shopsim.invalid/{asin}.jpg"]
    return records


def catalog_bytes(records: list[dict[str, Any]]) -> bytes:
    """The gzip file: a JSON list, one product per line, with a fixed header (name, mtime 0)."""
    body = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in records) + "\n]\n"
    buf = io.BytesIO()
    with gzip.GzipFile(filename=_GZIP_NAME, mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(body.encode("utf-8"))
    return buf.getvalue()


def read_catalog(path: Path = DEFAULT_OUT) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, list):
        raise ValueError(f"{path}: catalog must be a JSON list of products")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shopsimrl.testbed.catalog_gen", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="catalog path (.json.gz)")
    parser.add_argument("--splits", type=Path, default=None, help="persona split file (default: configs/splits)")
    parser.add_argument("--check", action="store_true", help="verify --out byte for byte instead of writing it")
    args = parser.parse_args(argv)
    try:
        records = build_catalog(load_persona_ids(args.splits or default_splits_path()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data = catalog_bytes(records)
    if args.check:
        if not args.out.is_file():
            print(f"{args.out}: missing; regenerate it with --out {args.out}", file=sys.stderr)
            return 1
        current = args.out.read_bytes()
        if current != data:
            same_json = gzip.decompress(current) == gzip.decompress(data)
            why = "compressed bytes differ (another zlib build?) but content is equal" if same_json else "content differs"
            print(f"{args.out}: out of date: {why}", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date ({len(records)} products, {len(data)} bytes)")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(args.out)
    persona = sum("user_persona" in r for r in records)
    print(f"wrote {args.out}: {len(records)} products ({persona} persona, {len(records) - persona} standard), {len(data)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
