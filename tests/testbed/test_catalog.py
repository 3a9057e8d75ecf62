"""The committed synthetic catalog: reproducible, complete over the split, well-formed, solvable."""

from __future__ import annotations

import collections
import functools
import gzip
import json
import math
import re
import unicodedata
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.testbed import catalog_gen, catalog_vocab
from shopsimrl.testbed.catalog_gen import DEFAULT_OUT, build_catalog, catalog_bytes, load_persona_ids, main

_REPO_SPLITS = Path(__file__).resolve().parents[2] / "configs/splits/persona_splits.v1.json"
SPLITS = _REPO_SPLITS if _REPO_SPLITS.is_file() else Path(__file__).resolve().parents[3] / "shared/data/persona_splits.v1.json"
MAX_BYTES = 5 * 1024 * 1024
CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
def committed_bytes() -> bytes:
    return DEFAULT_OUT.read_bytes()


@pytest.fixture(scope="module")
def records(committed_bytes: bytes) -> list[dict[str, Any]]:
    data = json.loads(gzip.decompress(committed_bytes))
    assert isinstance(data, list)
    return data


@pytest.fixture(scope="module")
def split_ids() -> dict[str, list[int]]:
    data = json.loads(SPLITS.read_text(encoding="utf-8"))
    return {name: split["task_ids"] for name, split in data["splits"].items()}


# -- helpers that restate the reward rules of the contract (independently of the generator) --


def _tokens(text: str) -> set[str]:
    return set(re.sub(r"\W+", " ", text.casefold()).split())


@functools.cache
def _fuzzy(a: str, b: str) -> int:
    ta, tb = _tokens(a), _tokens(b)
    sect = " ".join(sorted(ta & tb))
    c1 = (sect + " " + " ".join(sorted(ta - tb))).strip()
    c2 = (sect + " " + " ".join(sorted(tb - ta))).strip()
    scores = [round(100 * SequenceMatcher(None, x, y).ratio()) for x, y in ((sect, c1), (sect, c2), (c1, c2)) if x and y]
    return max(scores, default=0)


def _has_attribute(product: dict[str, Any], goal: str) -> bool:
    text = " ".join([product["title"], *product["small_description"], product["full_description"]]).casefold()
    # The reward's rule: a fuzzy token-set match with an attribute, or a substring of the product text.
    return any(_fuzzy(goal, a) > 85 for a in product["attribute"]) or goal.casefold() in text


def _norm(value: str) -> str:
    return re.sub(r"\s+", "", unicodedata.normalize("NFKC", value).casefold().replace("/", "|"))


def _gold_price(product: dict[str, Any]) -> float:
    """The selected-SKU price of the gold product with the goal options (contract §5.3)."""
    goal_options = {_norm(v) for v in product["instructions"][0]["instruction_options"]}
    axes = product["customization_options"]
    price_axes = [a for a, opts in axes.items() if len({o["price"] for o in opts if o["price"] is not None}) > 1]
    assert len(price_axes) <= 1, f"{product['asin']}: several price-affecting axes {price_axes}"
    if price_axes:
        hits = [o["price"] for o in axes[price_axes[0]] if _norm(o["value"]) in goal_options]
        assert len(hits) == 1 and hits[0] is not None, f"{product['asin']}: goal does not fix the price axis"
        return float(hits[0])
    prices = {o["price"] for opts in axes.values() for o in opts if o["price"] is not None}
    if len(prices) == 1:
        return float(prices.pop())
    assert not axes and len(set(product["pricing"])) == 1, f"{product['asin']}: price not deterministic"
    return float(product["pricing"][0])


_CN = {c: i for i, c in enumerate("零一二三四五六七八九")}


def _cn_amount(text: str) -> float:
    m = re.fullmatch(r"([一二三四五六七八九])([十百千])([一二三四五六七八九]?)", text)
    assert m, text
    unit = {"十": 10, "百": 100, "千": 1000}[m.group(2)]
    tail = _CN[m.group(3)] * unit // 10 if m.group(3) else 0
    return float(_CN[m.group(1)] * unit + tail)


def _budget_in_text(text: str) -> float | None:
    """Budget of the phrase forms the catalog writes (the parse rules of contract §5.4)."""
    if m := re.search(r"(\d+)-(\d+)元之间", text):
        return float(m.group(2))
    if m := re.search(r"(\d+)元左右", text):
        return round(float(m.group(1)) * 1.1, 2)
    if m := re.search(r"(\d+)元(?:以内|以下)|不超过(\d+)元", text):
        return float(m.group(1) or m.group(2))
    if m := re.search(r"不超过([一二三四五六七八九十百千]+)", text):
        return _cn_amount(m.group(1))
    return None


# -- determinism and the command line --


@pytest.mark.slow
def test_regeneration_reproduces_committed_bytes(committed_bytes: bytes) -> None:
    rebuilt = catalog_bytes(build_catalog(load_persona_ids(SPLITS)))
    assert rebuilt == committed_bytes, "run: python -m shopsimrl.testbed.catalog_gen"
    # Fixed gzip header: mtime 0 and a constant file name, so the bytes do not depend on when or where.
    assert committed_bytes[4:8] == b"\0\0\0\0"
    assert committed_bytes[10:26] == b"catalog.v1.json\0"


@pytest.mark.slow
def test_cli_writes_then_check_detects_tampering(
    tmp_path: Path, committed_bytes: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "catalog.json.gz"
    assert main(["--out", str(out), "--splits", str(SPLITS)]) == 0
    assert out.read_bytes() == committed_bytes
    data = json.loads(gzip.decompress(committed_bytes))
    data[0]["title"] += "改"
    out.write_bytes(gzip.compress(json.dumps(data, ensure_ascii=False).encode()))
    assert main(["--out", str(out), "--splits", str(SPLITS), "--check"]) == 1
    assert "out of date: content differs" in capsys.readouterr().err


def test_cli_check_of_missing_file_and_bad_split_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "splits.json"
    bad.write_text(json.dumps({"splits": {"val": {"task_ids": [1, "2"]}}}))
    assert main(["--out", str(tmp_path / "x.json.gz"), "--splits", str(bad), "--check"]) == 2
    assert "splits.val.task_ids" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot read split file"):
        load_persona_ids(tmp_path / "absent.json")


def test_committed_file_size_limit(committed_bytes: bytes) -> None:
    assert len(committed_bytes) <= MAX_BYTES


# -- coverage of the real split --


def test_every_split_task_is_a_persona_task(records: list[dict[str, Any]], split_ids: dict[str, list[int]]) -> None:
    by_task = {r["instructions"][0]["task_id"]: r for r in records}
    assert len(by_task) == len(records), "task ids must be unique"
    wanted = {t for ids in split_ids.values() for t in ids}
    assert len(wanted) == 4526
    assert wanted <= set(by_task)
    persona = {t for t, r in by_task.items() if "user_persona" in r}
    assert persona == wanted
    standard = set(by_task) - persona
    assert standard == set(range(catalog_gen.TOTAL_TASKS)) - wanted
    for t in wanted:
        assert by_task[t]["instructions"][0]["instruction_simple"], t
    for t in standard:
        assert by_task[t]["instructions"][0]["instruction_simple"] == "", t
    assert [r["source_product_index"] for r in records] == sorted(by_task)


# -- record format --

_INSTRUCTION_KEYS = {
    "task_id",
    "task_uid",
    "instruction_index",
    "instruction",
    "instruction_simple",
    "attributes",
    "instruction_options",
    "price_upper",
}
_PERSONA_KEYS = {"用户ID", "性别", "年龄段", "城市等级", "行为特征", "交易特征", "偏好", "__reasoning__"}


def _check_record(r: dict[str, Any]) -> None:
    where = r.get("asin")
    assert re.fullmatch(r"[1-9]\d{11}", r["asin"]), where
    assert CJK.search(r["title"]) and r["shop_name"] and isinstance(r["shop_name"], str), where
    parts = r["category"].split("›")
    assert len(parts) == 3 and all(parts), where
    assert r["product_category"] in (r["category"], parts[-1]), where
    pricing = r["pricing"]
    assert len(pricing) in (1, 2) and all(isinstance(p, float) and p > 0 for p in pricing) and pricing == sorted(pricing)
    opts = r["customization_options"]
    assert isinstance(opts, dict)
    seen_values: set[str] = set()
    for axis, values in opts.items():
        assert CJK.search(axis) and len(values) >= 2, (where, axis)
        for o in values:
            assert set(o) == {"value", "price"} and isinstance(o["value"], str) and o["value"], (where, axis)
            assert o["price"] is None or isinstance(o["price"], float), (where, axis)
            assert o["value"].lower() not in seen_values, (where, "value repeated across axes")
            seen_values.add(o["value"].lower())
    assert r["attribute"] and all(isinstance(a, str) and CJK.search(a) for a in r["attribute"]), where
    assert isinstance(r["full_description"], str) and CJK.search(r["full_description"])
    assert isinstance(r["small_description"], list) and all(isinstance(b, str) for b in r["small_description"])
    assert len(r["images"]) == 1 and r["images"][0].startswith("https://"), where
    assert r["reason_key"] is None
    (ins,) = r["instructions"]
    assert set(ins) == _INSTRUCTION_KEYS, where
    assert ins["task_id"] == r["source_product_index"] and ins["instruction_index"] == 0
    assert re.fullmatch(r"shopsim-[0-9a-f]{24}", ins["task_uid"]), where
    assert 40 <= len(ins["instruction"]) <= 100 and parts[-1] in ins["instruction"], where
    assert 2 <= len(ins["attributes"]) <= 5, where
    for goal in ins["attributes"]:
        text = " ".join([r["title"], *r["small_description"], r["full_description"]])
        assert goal in r["attribute"] or goal in text, (where, goal)
    assert all(v == v.lower() and v in seen_values for v in ins["instruction_options"]), where
    if "user_persona" in r:
        persona = r["user_persona"]
        assert set(persona) >= _PERSONA_KEYS and isinstance(persona["__reasoning__"], str), where
        assert all(isinstance(persona[k], dict) for k in ("行为特征", "交易特征", "偏好")), where
        assert 10 <= len(ins["instruction_simple"]) <= 40, where
    else:
        assert ins["price_upper"] is None, where


def test_every_record_has_the_real_fields_and_types(records: list[dict[str, Any]]) -> None:
    assert len({r["asin"] for r in records}) == len(records)
    assert len({r["instructions"][0]["task_uid"] for r in records}) == len(records)
    for r in records:
        _check_record(r)


def test_full_instruction_names_every_goal(records: list[dict[str, Any]]) -> None:
    # Standard mode shows the full text: it alone must name every goal attribute and option.
    for r in records:
        ins = r["instructions"][0]
        text = ins["instruction"].casefold()
        for goal in ins["attributes"]:
            assert goal.split("：")[-1].casefold() in text, (ins["task_id"], goal)
        for value in ins["instruction_options"]:
            assert value in text, (ins["task_id"], value)


# -- persona tasks: partial, indirect disclosure --


def _persona_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "user_persona" in r]


def _visible_profile(r: dict[str, Any]) -> str:
    """The profile as the agent sees it (the server strips ``__reasoning__``)."""
    return json.dumps({k: v for k, v in r["user_persona"].items() if k != "__reasoning__"}, ensure_ascii=False)


def _option_values(r: dict[str, Any]) -> dict[str, str]:
    """Goal option (lowercased) -> its catalog spelling."""
    spelled = {o["value"].lower(): o["value"] for opts in r["customization_options"].values() for o in opts}
    return {v: spelled[v] for v in r["instructions"][0]["instruction_options"]}


def _goal_values(r: dict[str, Any]) -> list[str]:
    ins = r["instructions"][0]
    return [g.split("：")[-1] for g in ins["attributes"]] + list(_option_values(r).values())


def test_short_instruction_names_the_kind_and_one_or_two_goals(records: list[dict[str, Any]]) -> None:
    leaf_noun = {leaf.path: leaf.noun for leaf in catalog_vocab.LEAVES}
    named_counts: collections.Counter[int] = collections.Counter()
    for r in _persona_records(records):
        simple = r["instructions"][0]["instruction_simple"]
        noun = leaf_noun[r["category"]]
        assert noun in simple, simple
        rest = simple.replace(noun, "", 1)  # "类型：纸尿裤" is a goal that the kind itself spells
        named = [v for v in _goal_values(r) if v in rest]
        assert 1 <= len(named) <= 2, (r["instructions"][0]["task_id"], simple, named)
        named_counts[len(named)] += 1
    assert named_counts[1] > 0 and named_counts[2] > 0


def test_profile_names_goals_verbatim_only_for_a_bounded_share(records: list[dict[str, Any]]) -> None:
    verbatim = total = 0
    for r in _persona_records(records):
        profile = _visible_profile(r)
        for goal in r["instructions"][0]["attributes"]:
            total += 1
            if "：" in goal:  # the catalog's "键：值" string itself never appears
                assert goal not in profile, (r["instructions"][0]["task_id"], goal)
            verbatim += goal.split("：")[-1] in profile
    assert 0.05 * total <= verbatim <= 0.3 * total, verbatim / total


def test_some_goals_are_hinted_indirectly_and_some_not_at_all(records: list[dict[str, Any]]) -> None:
    leaf_noun = {leaf.path: leaf.noun for leaf in catalog_vocab.LEAVES}
    kinds: collections.Counter[str] = collections.Counter()
    fully_visible = 0
    persona = _persona_records(records)
    for r in persona:
        visible = r["instructions"][0]["instruction_simple"] + _visible_profile(r)
        hidden = 0
        for value in _goal_values(r):
            hint = catalog_vocab.size_hint(leaf_noun[r["category"]], value) or catalog_vocab.VALUE_HINTS.get(value)
            if value in visible:
                kinds["verbatim"] += 1
            elif hint and hint in visible:
                kinds["hinted"] += 1
            else:
                kinds["other"] += 1
                hidden += 1
        fully_visible += hidden == 0
    total = sum(kinds.values())
    assert kinds["hinted"] >= 0.1 * total, kinds
    assert kinds["other"] >= 0.15 * total, kinds  # real profiles leave goals out
    assert fully_visible <= 0.25 * len(persona), fully_visible  # no string reader gets every goal for free


def test_hints_never_contain_the_value_they_point_to() -> None:
    for leaf in catalog_vocab.LEAVES:
        values = [v for _, vs in leaf.slots for v in vs] + list(leaf.tags) + [v for a in leaf.axes for v in a.values]
        for value in values:
            for hint in (catalog_vocab.VALUE_HINTS.get(value), catalog_vocab.size_hint(leaf.noun, value)):
                assert not hint or value.casefold() not in hint.casefold(), (leaf.path, value, hint)
    assert catalog_vocab.size_hint("跑步鞋", "42") == "脚长约260毫米"
    assert catalog_vocab.size_hint("跑步鞋", "黑色") is None


def test_price_rank_habits_are_true_of_the_gold_variant(records: list[dict[str, Any]]) -> None:
    checked = 0
    for r in _persona_records(records):
        habit = r["user_persona"]["交易特征"].get("消费习惯", "")
        axes = r["customization_options"]
        priced = [a for a, o in axes.items() if len({x["price"] for x in o if x["price"] is not None}) > 1]
        if not priced or not any(w in habit for w in ("最基础", "最高", "顶配")):
            continue
        ins = r["instructions"][0]
        ladder = [(o["price"], o["value"].lower()) for o in axes[priced[0]]]
        (gold,) = [i for i, (_, v) in enumerate(ladder) if v in ins["instruction_options"]]
        upper = ins["price_upper"] if ins["price_upper"] is not None else math.inf
        if "最基础" in habit:
            assert gold == 0, ins["task_id"]
        else:
            assert gold == max(i for i, (p, _) in enumerate(ladder) if p <= upper), ins["task_id"]
        checked += 1
    assert checked >= 200


def test_persona_budget_is_visible_and_reasoning_names_every_goal(records: list[dict[str, Any]]) -> None:
    lengths = []
    for r in _persona_records(records):
        ins, persona = r["instructions"][0], r["user_persona"]
        visible = ins["instruction_simple"] + _visible_profile(r)
        lengths.append(len(_visible_profile(r)))
        if ins["price_upper"] is not None:
            assert _short_budget(visible) == ins["price_upper"], ins["task_id"]
        reasoning = persona["__reasoning__"]
        assert all(g in reasoning for g in ins["attributes"]), ins["task_id"]
        assert all(v in reasoning for v in _option_values(r).values()), ins["task_id"]
    assert 350 <= sum(lengths) / len(lengths) <= 1200


def _short_budget(text: str) -> float | None:
    """Budget of the short phrase forms a persona task shows (``300元以内``, ``三百左右``)."""
    if m := re.search(r"(\d+)元以内", text):
        return float(m.group(1))
    if m := re.search(r"(\d+|[一二三四五六七八九十百千]+)左右", text):
        amount = float(m.group(1)) if m.group(1).isdigit() else _cn_amount(m.group(1))
        return round(amount * 1.1, 2)
    return None


def test_option_price_kinds_and_single_price_axis(records: list[dict[str, Any]]) -> None:
    kinds: collections.Counter[str] = collections.Counter()
    for r in records:
        axes = r["customization_options"]
        priced = [a for a, o in axes.items() if len({x["price"] for x in o if x["price"] is not None}) > 1]
        assert len(priced) <= 1, r["asin"]
        kinds["none" if not axes else "one_price_axis" if priced else "constant"] += 1
        _gold_price(r)  # resolves for every gold product with its goal options
        if priced:
            assert r["pricing"] == [min(x["price"] for x in axes[priced[0]]), max(x["price"] for x in axes[priced[0]])]
    assert all(kinds[k] >= 0.05 * len(records) for k in ("none", "one_price_axis", "constant")), kinds


# -- content: domains, near-duplicates, solvability --


@pytest.mark.slow
def test_domains_and_near_duplicate_density(records: list[dict[str, Any]]) -> None:
    by_leaf: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        by_leaf[r["category"]].append(r)
    domains = collections.Counter(c.split("›")[0] for c in by_leaf)
    assert len(domains) == 12 and min(domains.values()) >= 4
    for leaf, items in by_leaf.items():
        assert len(items) >= 80, leaf
        assert len({r["shop_name"] for r in items}) >= 8, leaf
        assert len({r["title"] for r in items}) == len(items), leaf
    # On a fixed sample: the gold product satisfies all goal attributes (under the reward's fuzzy rule),
    # few siblings satisfy them all, and many share some of them.
    full, partial = [], []
    for r in records[::11]:
        goals = r["instructions"][0]["attributes"]
        assert all(_has_attribute(r, g) for g in goals), r["asin"]
        counts = [sum(_has_attribute(s, g) for g in goals) for s in by_leaf[r["category"]] if s is not r]
        full.append(sum(c == len(goals) for c in counts))
        partial.append(sum(0 < c < len(goals) for c in counts))
    assert sum(full) / len(full) <= 4.0
    assert sum(f == 0 for f in full) >= 0.35 * len(full)
    assert sum(partial) / len(partial) >= 30


def test_budgets_are_consistent_with_the_gold_variant(records: list[dict[str, Any]]) -> None:
    persona_budget = standard_budget = persona = 0
    for r in records:
        ins = r["instructions"][0]
        gold = _gold_price(r)
        parsed = _budget_in_text(ins["instruction"])
        if "user_persona" in r:
            persona += 1
            if ins["price_upper"] is None:
                assert parsed is None and _budget_in_text(ins["instruction_simple"]) is None, ins["task_id"]
                continue
            persona_budget += 1
            assert isinstance(ins["price_upper"], float) and math.isfinite(ins["price_upper"])
            assert gold <= ins["price_upper"], ins["task_id"]
            assert parsed == ins["price_upper"], ins["task_id"]  # the text states the same budget
        elif parsed is not None:
            standard_budget += 1
            assert gold <= parsed, ins["task_id"]
    assert persona_budget >= 0.7 * persona
    standard = len(records) - persona
    assert 0.2 * standard <= standard_budget <= 0.6 * standard
