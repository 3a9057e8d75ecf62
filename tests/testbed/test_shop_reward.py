"""Unit tests of the shop's reward, SKU price resolution, budget parser, catalog loader and settings."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.testbed.shop import ShopSettings
from shopsimrl.testbed.shop.catalog import CatalogError, build_goal, load_catalog, product_from_record
from shopsimrl.testbed.shop.reward import (
    explicit_budget_from_instruction,
    fuzzy_token_set_ratio,
    option_reward,
    price_affecting_axes,
    purchase_reward,
    resolve_variant_price,
    title_terms,
    type_reward,
)

from .conftest import SMALL_CATALOG


def scrubber(asin: str = "123456789012", price: float = 1999.0) -> dict[str, Any]:
    """A floor scrubber whose colour axis drives the price; its size axis has one price."""
    return {
        "asin": asin,
        "title": "智能热洗白色洗地机",
        "shop_name": "清洁电器店",
        "category": "家电›清洁电器›洗地机",
        "attribute": ["智能", "热洗"],
        "pricing": [price],
        "images": ["https://img.example.invalid/x.jpg"],
        "customization_options": {
            "颜色分类": [{"value": "白色", "price": price}, {"value": "黑色", "price": price + 100}],
            "尺码": [{"value": "标准版", "price": price}, {"value": "大号", "price": price}],
        },
        "instructions": [{"task_id": 1, "instruction": "买一台洗地机", "attributes": ["智能", "热洗"]}],
    }


GOAL = {
    "asin": "123456789012",
    "name": "智能热洗白色洗地机",
    "category": "家电›清洁电器›洗地机",
    "attributes": ["智能", "热洗"],
    "goal_options": ["白色"],
    "price_upper": 2100.0,
}


@pytest.mark.parametrize(
    ("text", "upper"),
    [
        ("预算在1000元以下", 1000.0),
        ("价格在70元左右", 77.0),
        ("价格在130-140元之间", 140.0),
        ("预算1万2以内", 12000.0),
        ("预算不超过一千八", 1800.0),
        ("预算就二十来块钱", 22.0),
        ("五元以内", 5.0),
        ("预算4k+", None),
        ("价格要超过20元", None),
        # further cases of the same parser
        ("价格不超过 2199 元", 2199.0),
        ("价格30元到40元之间", 40.0),
        ("预算在1万元左右", 11000.0),
        ("预期价格在350元和400元之间", 400.0),
        ("价格别超过160元", 160.0),
        ("买一个柔软的枕头", None),
    ],
)
def test_budget_parser_table(text: str, upper: float | None) -> None:
    assert explicit_budget_from_instruction(text) == upper


def _goal(instruction: dict[str, Any], persona: dict[str, Any] | None = None) -> dict[str, Any]:
    record = scrubber()
    record["instructions"] = [{"attributes": ["智能"], **instruction}]
    if persona is not None:
        record["user_persona"] = persona
    goal = build_goal(record, position=0)
    assert goal is not None
    return goal


def test_budget_sources_of_a_goal() -> None:
    # precomputed wins; empty precomputed falls back; simple text first; never the gold price
    assert _goal({"instruction": "预算不超过900元", "price_upper": 100.0})["price_upper"] == 100.0
    assert _goal({"instruction": "预算不超过300元，买一个枕头", "price_upper": ""})["price_upper"] == 300.0
    both = {"instruction": "价格不超过500元", "instruction_simple": "预算200元以内", "price_upper": None}
    assert _goal(both)["price_upper"] == 200.0
    fallback = {"instruction": "价格不超过500元", "instruction_simple": "要一台洗地机"}
    assert _goal(fallback)["price_upper"] == 500.0
    assert _goal({"instruction": "买一台洗地机"})["price_upper"] is None
    with pytest.raises(CatalogError, match="price_upper"):
        _goal({"instruction": "x", "price_upper": -1})


def test_persona_goal_fields() -> None:
    goal = _goal(
        {"task_id": 42, "instruction": "完整指令", "instruction_simple": "", "instruction_options": {"颜色": "白色"}},
        persona={"用户ID": "u", "__reasoning__": "kept in the private goal"},
    )
    assert goal["task_id"] == 42 and goal["instruction_simple"] == "完整指令"
    assert goal["goal_options"] == ["白色"] and goal["user_persona"]["__reasoning__"]
    assert _goal({"instruction": "x"})["user_persona"] == {} and _goal({"instruction": "x"})["reason_key"] is None
    assert build_goal({**scrubber(), "instructions": [{"instruction": "x", "attributes": []}]}, position=0) is None


def test_worked_example_wrong_option_gives_loose_075_strict_0() -> None:
    product = product_from_record(scrubber())
    right = purchase_reward(product, GOAL, {"颜色分类": "白色"})
    assert (right["r_loose"], right["r_strict"], right["r_success"]) == (1.0, 1.0, 1)
    wrong = purchase_reward(product, GOAL, {"颜色分类": "黑色"})
    assert wrong["r_type"] == 1.0 and wrong["r_option"] == 0.0 and wrong["r_price"] == 1.0
    assert wrong["r_loose"] == pytest.approx(0.75) and wrong["r_strict"] == 0.0 and wrong["r_success"] == 0
    assert wrong["target_asin_match"] is True
    other = purchase_reward(product_from_record(scrubber(asin="999999999999")), GOAL, {"颜色分类": "白色"})
    assert other["target_asin_match"] is False and other["r_success"] == 1


def test_type_reward_ladder() -> None:
    terms = {"desired": [f"t{i}" for i in range(20)], "one": ["t0"], "two": ["t0", "t1"], "none": []}
    goal = {"category": "甲›乙", "name": "desired"}

    def fake(value: object) -> list[str]:
        return terms[str(value)]

    assert type_reward("one", "丙›丁", goal, terms=fake)["r_type"] == 0.1
    assert type_reward("two", "丙›丁", goal, terms=fake)["r_type"] == 0.5
    assert type_reward("none", "丙›丁", goal, terms=fake)["r_type"] == 0.0
    assert type_reward("none", "甲›乙", goal, terms=fake)["r_type"] == 1.0
    neutral = type_reward("x", "丙›丁", goal, terms=lambda value: [])
    assert (neutral["title_score"], neutral["r_type"]) == (0.2, 0.5)
    assert type_reward("x", "丙›丁", goal, terms=lambda value: [])["category_match"] is False


def test_lexical_title_terms_and_fuzzy_ratio() -> None:
    assert title_terms("iPhone 15 小冰箱") == ["iphone", "15", "小冰", "冰箱"]
    assert title_terms("灯") == ["灯"]
    assert fuzzy_token_set_ratio("三色调光", "三色调光") == 100
    assert fuzzy_token_set_ratio("white large", "Large, White!") == 100
    # no colour normalization: "blue" inside different Chinese words does not match
    assert option_reward(["深海blue色"], ["天空blue款"]) == (0.0, 0)
    assert option_reward(["m"], []) == (1.0, 0)


def test_price_resolution_cases() -> None:
    product = product_from_record(scrubber())
    assert price_affecting_axes(product) == ["颜色分类"]
    selected = resolve_variant_price(product, {"颜色分类": "白色"})
    assert (selected["status"], selected["price"], selected["method"]) == ("pass", 1999.0, "selected_price_axis")
    assert selected["version"] == "variant-price-paper-v2"
    unselected = resolve_variant_price(product, {"尺码": "大号"})
    assert (unselected["status"], unselected["method"]) == ("unverifiable", "price_axis_unselected")
    alias = resolve_variant_price(product, {"color": "白色"})
    assert alias["method"] == "price_axis_unselected" and alias["evidence"] == {"price_axis": "颜色分类"}
    missing = resolve_variant_price(product, {"颜色分类": "金色"})
    assert missing["method"] == "selected_variant_price_missing"

    two_axes = scrubber()
    two_axes["customization_options"]["尺码"][1]["price"] = 2299.0
    multiple = resolve_variant_price(product_from_record(two_axes), {"颜色分类": "白色", "尺码": "大号"})
    assert (multiple["status"], multiple["method"]) == ("unverifiable", "multiple_price_affecting_axes")

    constant = scrubber()
    constant["customization_options"]["颜色分类"][1]["price"] = 1999.0
    assert resolve_variant_price(product_from_record(constant), {})["method"] == "constant_option_price"
    bare = {**scrubber(), "customization_options": {}, "pricing": [88.0]}
    listing = resolve_variant_price(product_from_record(bare), {})
    assert (listing["status"], listing["price"], listing["method"]) == ("pass", 88.0, "single_listing_price")
    ranged = {**bare, "pricing": [88.0, 99.0]}
    assert resolve_variant_price(product_from_record(ranged), {})["method"] == "price_not_deterministic"


def test_r_price_with_and_without_budget() -> None:
    over = purchase_reward(product_from_record(scrubber(price=2200.0)), GOAL, {"颜色分类": "白色"})
    assert (over["r_price"], over["price_verifiable"]) == (0.0, True)
    unknown = purchase_reward(product_from_record(scrubber()), GOAL, {})
    assert (unknown["r_price"], unknown["price_verifiable"]) == (0.0, False)
    no_budget = purchase_reward(product_from_record(scrubber()), {**GOAL, "price_upper": None}, {})
    assert (no_budget["r_price"], no_budget["price_verifiable"]) == (1.0, False)


def test_catalog_loader_reads_gzip_and_names_bad_fields(tmp_path: Path) -> None:
    records = json.loads(SMALL_CATALOG.read_text(encoding="utf-8"))
    packed = tmp_path / "catalog.json.gz"
    packed.write_bytes(gzip.compress(json.dumps(records, ensure_ascii=False).encode("utf-8")))
    catalog = load_catalog(packed)
    assert len(catalog.products) == 9 and sorted(catalog.goals) == [0, 1, 2, 3, 7, 1460, 1461, 4790]
    assert catalog.by_asin["200000000001"].options["光源"] == ["暖光 | 冷光", "三色调光"]
    assert catalog.by_asin["200000000002"].price_display == "45.0 to 60.0"

    broken = [dict(records[0])]
    del broken[0]["shop_name"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(broken), encoding="utf-8")
    with pytest.raises(CatalogError, match=r"bad\.json: record 0: field 'shop_name' is missing"):
        load_catalog(bad)
    duplicate = tmp_path / "dup.json"
    twin = {**records[1], "asin": "100000000009"}
    duplicate.write_text(json.dumps([records[1], twin]), encoding="utf-8")
    with pytest.raises(CatalogError, match="duplicate task_id 1"):
        load_catalog(duplicate)
    with pytest.raises(CatalogError, match="not found"):
        load_catalog(tmp_path / "missing.json.gz")


def test_settings_from_env() -> None:
    env = {"SHOPSIM_ENV_SLOTS": "1000", "SHOPSIM_FAULT_RATE_5XX": "0.1", "SHOPSIM_CATALOG": "/x.json", "SHOPSIM_SEED": "3"}
    settings = ShopSettings.from_env(env, latency_ms=5.0)
    assert (settings.slots, settings.fault_rate_5xx, settings.seed, settings.latency_ms) == (1000, 0.1, 3, 5.0)
    assert settings.catalog_path() == Path("/x.json")
    assert ShopSettings.from_env({}).slots == 20
    with pytest.raises(ValueError, match="SHOPSIM_ENV_SLOTS"):
        ShopSettings.from_env({"SHOPSIM_ENV_SLOTS": "many"})
    with pytest.raises(ValueError, match="fault_rate_5xx"):
        ShopSettings(fault_rate_5xx=2.0)
