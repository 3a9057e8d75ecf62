"""Unit tests of the shop's search: normalization, tokens, field weights, tie-break and paging."""

from __future__ import annotations

import random
from typing import Any

import pytest

from shopsimrl.testbed.shop.catalog import Catalog, product_from_record
from shopsimrl.testbed.shop.pages import Session, build_observation_state, render_observation_state
from shopsimrl.testbed.shop.search import SearchIndex, normalize_query, product_fields, search_tokens


def record(asin: str, title: str, **extra: Any) -> dict[str, Any]:
    return {
        "asin": asin,
        "title": title,
        "shop_name": extra.pop("shop_name", "测试店"),
        "category": extra.pop("category", "家居›杂货"),
        "attribute": extra.pop("attribute", []),
        "images": ["https://img.example.invalid/x.jpg"],
        "instructions": [{"task_id": int(asin[-4:]), "instruction": "x", "attributes": ["x"]}],
        **extra,
    }


def test_normalize_query_example() -> None:
    assert normalize_query("  迷你，冰箱 100 CNY ") == "迷你 冰箱 100元"
    assert normalize_query("ＡＢＣ 200人民币|30块钱")  # noqa: RUF001 - full-width Latin letters are what NFKC folding must undo == "abc 200元 30元"


def test_tokens_are_chinese_bigrams_then_latin_tokens() -> None:
    assert search_tokens("小冰箱") == ("小冰", "冰箱")
    assert search_tokens("灯") == ("灯",)
    assert search_tokens("iPhone-15 小冰箱 冰箱") == ("小冰", "冰箱", "iphone-15")
    assert search_tokens("！！！") == ()


def test_product_fields_keep_options_public_and_find_model_numbers() -> None:
    product = product_from_record(
        record(
            "100000000001",
            "智能恒温电水壶 X200 保温",
            customization_options={"颜色分类": [{"value": "白色", "price": 199.0, "image": "https://img/1.jpg"}]},
            small_description=["304不锈钢", "防干烧"],
        )
    )
    fields = product_fields(product)
    assert fields["model"] == "x200" and fields["options"] == "颜色分类 白色"
    assert fields["brand"] == "测试店" and fields["bullets"] == "304不锈钢 防干烧"


def test_title_outweighs_bullets_and_equal_scores_break_ties_by_asin() -> None:
    products = [
        product_from_record(record("100000000003", "保温杯", small_description="陶瓷")),
        product_from_record(record("100000000002", "普通杯子", small_description="陶瓷 花瓶")),
        product_from_record(record("100000000001", "陶瓷花瓶")),
        product_from_record(record("100000000009", "陶瓷花瓶")),
    ]
    index = SearchIndex(products)
    assert index.search("陶瓷花瓶") == ["100000000001", "100000000009", "100000000002", "100000000003"]
    assert index.search("陶瓷花瓶", k=2) == ["100000000001", "100000000009"]
    assert index.search("！！") == [] and index.search("不存在的词") == []
    index.close()


def test_results_pages_report_global_ranks() -> None:
    products = [product_from_record(record(f"{200000000000 + i}", f"测试水杯 {i}")) for i in range(45)]
    catalog = Catalog(path=None, products=products, by_asin={p.asin: p for p in products}, goals={})  # type: ignore[arg-type]
    session = Session(task_id=0, goal={}, max_actions=30)
    session.search("测试 水杯", SearchIndex(products))
    session.show_results(3)
    state = build_observation_state(session, catalog)
    assert (state["page"], state["total_pages"], state["total_results"]) == (3, 3, 45)
    assert (state["rank_start"], state["rank_end"]) == (41, 45)
    assert [p["rank"] for p in state["products"]] == [41, 42, 43, 44, 45]
    assert state["actions"][:2] == ["back to search", "< prev"]
    assert "结果：第 3/3 页，共 45 项，当前显示排名 41-45" in render_observation_state(state)


@pytest.mark.slow
def test_the_ranking_from_cached_token_terms_equals_fts5s_own_or_query_bit_for_bit() -> None:
    """The shop ranks from per-token bm25 terms (search.py, ``_rank``); FTS5 ranking the whole OR
    query must give the same ASINs in the same order on the real testbed catalog: instructions,
    titles, the policy's own keyword queries, Latin model numbers and random token mixes, with
    many ties (short queries) and long queries (whole instructions, dozens of tokens)."""
    from shopsimrl.testbed.heuristics_pages import extract_keywords
    from shopsimrl.testbed.shop.catalog import load_catalog
    from shopsimrl.testbed.shop.search import FIELD_WEIGHTS, TOP_K
    from shopsimrl.testbed.shop.server import DEFAULT_CATALOG

    products = list(load_catalog(DEFAULT_CATALOG).products)
    index = SearchIndex(products)
    weights = ", ".join(str(w) for w in (0.0, *FIELD_WEIGHTS.values()))
    sql = f"SELECT asin FROM products WHERE products MATCH ? ORDER BY bm25(products, {weights}) ASC, asin ASC LIMIT ?"

    def fts5_ranking(text: str, k: int) -> list[str]:
        query = " OR ".join(f'"{token}"' for token in search_tokens(text))
        return [row[0] for row in index._db.execute(sql, (query, k))] if query else []

    rng = random.Random(20261201)
    sample = rng.sample(products, 400)
    vocabulary = sorted({token for p in sample for token in search_tokens(f"{p.title} {p.attributes}")})
    queries = [p.instruction_text for p in sample[:150]]
    queries += [p.title for p in sample[150:300]]
    queries += [" ".join((kind, *terms)) for kind, terms in (extract_keywords(p.instruction_text) for p in sample[300:])]
    queries += [" ".join(rng.sample(vocabulary, rng.randint(1, 8))) for _ in range(300)]
    queries += [p.title[: rng.randint(1, 4)] for p in sample[:100]]  # one or two tokens: long runs of ties
    compared = 0
    for text in queries:
        k = rng.choice((TOP_K, TOP_K, 20, 1))
        expected = fts5_ranking(text, k)
        assert index.search(text, k=k) == expected, text
        compared += bool(expected)
    assert compared >= 750  # of 800 queries: the comparison was not vacuous
