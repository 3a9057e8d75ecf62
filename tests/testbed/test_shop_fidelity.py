"""Black-box HTTP tests of the real server's outcome-changing quirks that the testbed mirrors.

The contract addendum (``shared/reference/shopsimulator_contract.md``) lists where the real
ShopSimulator answered differently from the testbed in a request-by-request comparison; each test
here pins one of those answers, with the texts of the real server's code path.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from shopsimrl.testbed.shop.actions import step
from shopsimrl.testbed.shop.catalog import load_catalog
from shopsimrl.testbed.shop.pages import Session
from shopsimrl.testbed.shop.search import SearchIndex, ServerFault

from .conftest import SMALL_CATALOG as CATALOG
from .conftest import ShopClient

KETTLE_GOLD = "100000000001"  # options 颜色分类 (白色 / 黑色) and 容量 (1.7l / 1.5l)
KETTLES = ["100000000001", "100000000002", "100000000003", "100000000004"]  # catalog order
MISROUTED = "model-visible search ASINs differ from environment-actionable ASINs"
JSON = {"content-type": "application/json"}


def lease(episode: dict[str, Any]) -> dict[str, Any]:
    return {"env_idx": episode["env_idx"], "lease_id": episode["lease_id"]}


def interact(shop: ShopClient, episode: dict[str, Any], response: str) -> tuple[int, dict[str, Any]]:
    return shop.call(action="interact", response=response, **lease(episode))


def all_result_asins(shop: ShopClient, episode: dict[str, Any], first: dict[str, Any]) -> list[str]:
    """Every ASIN of the current result list, walking ``next >`` from page 1."""
    state = first["observation_state"]
    asins = [product["asin"] for product in state["products"]]
    while "next >" in state["actions"]:
        state = shop.act(episode, "click[next >]")["observation_state"]
        asins += [product["asin"] for product in state["products"]]
    return asins


# ------------------------------------------------------------------ the old WebShop search prefixes


def test_random_prefix_samples_150_products_anew_on_every_search(bulk_shop: ShopClient) -> None:
    bulk_shop.ok(action="release_all")
    catalog = {f"{500000000000 + i:012d}" for i in range(160)}

    def listing(query: str, episodes: int = 1) -> list[list[str]]:
        lists = []
        for _ in range(episodes):  # one episode per listing: walking 8 pages costs 8 of its 30 actions
            episode = bulk_shop.reset(10_000)
            first = bulk_shop.act(episode, f"search[{query}]")
            lists.append(all_result_asins(bulk_shop, episode, first))
            if query.startswith("<r>"):
                state = first["observation_state"]
                assert (state["total_results"], state["total_pages"], state["search_text"]) == (150, 8, query)
                # paging back shows the same sample: the list is drawn once per search
                back = bulk_shop.act(episode, "click[< prev]")["observation_state"]["products"]
                assert [p["asin"] for p in back] == lists[-1][120:140]
            assert bulk_shop.release(episode)[0] == 200
        return lists

    sample, again = listing("<r>", episodes=2)
    assert len(sample) == len(set(sample)) == 150 and set(sample) <= catalog
    # each search draws anew (two equal ordered draws of 150 from 160: probability ~1e-280); the
    # text after <r> is ignored
    (other,) = listing("<r> 测试水杯")
    assert sample != again and sample != other and len(set(other)) == 150
    # without the prefix the same text is an ordinary ranked search: the same list every time
    ranked, ranked_again = listing("测试水杯", episodes=2)
    assert ranked == ranked_again and len(ranked) == 150


def test_random_prefix_on_a_catalog_under_150_products_answers_500(shop: ShopClient) -> None:
    episode = shop.reset(0)
    assert interact(shop, episode, "search[<r>]") == (500, {"error": "Sample larger than population or is negative"})
    assert shop.act(episode, "search[电水壶]")["done"] is False  # the lease is still usable


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("<a> 不锈钢", "'NoneType' object is not subscriptable"),
        ("<a>", "'NoneType' object is not subscriptable"),
        ("<c>", "list index out of range"),
    ],
)
def test_attribute_prefix_and_bare_category_prefix_answer_500(shop: ShopClient, query: str, error: str) -> None:
    episode = shop.reset(0)
    shop.act(episode, "search[电水壶]")
    back = shop.act(episode, "click[back to search]")
    assert interact(shop, episode, f"search[{query}]") == (500, {"error": error})
    # nothing moved: same page, the stored feedback is still the one of the previous action
    ended = shop.terminate(episode)
    assert ended["observation_state"]["page_type"] == "search_home"
    assert ended["observation_state"]["last_action"] == back["action_feedback"]
    assert shop.health()["free_slots"] == 3  # the 500 kept the lease; terminate does not free it
    assert shop.release(episode)[0] == 200


def test_a_failing_prefix_search_still_counts_as_an_action(shop: ShopClient) -> None:
    episode = shop.reset(0)
    assert interact(shop, episode, "search[<c>]")[0] == 500  # action 1 of 30
    for number in range(2, 30):
        reply = shop.act(episode, "search[电水壶]" if number % 2 == 0 else "click[back to search]")
        assert reply["done"] is False, number
    last = shop.act(episode, "search[电水壶]")  # action 30
    assert (last["done"], last["termination_reason"]) == (True, "action_limit")


def test_category_prefix_lists_one_exact_category_in_catalog_order(shop: ShopClient) -> None:
    episode = shop.reset(0)
    state = shop.act(episode, "search[<c> 家电›厨房电器›电水壶]")["observation_state"]
    assert [p["asin"] for p in state["products"]] == KETTLES
    assert (state["total_results"], state["search_text"]) == (4, "<c> 家电›厨房电器›电水壶")
    shop.act(episode, "click[back to search]")
    # only the second keyword names the category; the rest is ignored
    state = shop.act(episode, "search[<c> 家居›灯具›台灯 电水壶]")["observation_state"]
    assert [p["asin"] for p in state["products"]] == ["200000000001", "200000000002", "200000000003"]
    shop.act(episode, "click[back to search]")
    # an exact match: a part of the category path finds nothing (the action is still valid)
    reply = shop.act(episode, "search[<c> 电水壶]")
    assert reply["action_feedback"]["valid"] is True and reply["observation_state"]["total_results"] == 0
    shop.act(episode, "click[back to search]")
    # prefixes are exact and case-sensitive, and only count as the first keyword: these are
    # ordinary ranked searches (lamps and kettles), not the 3 lamps of a category listing
    for query in ("<C> 家居›灯具›台灯 电水壶", " <c> 家居›灯具›台灯 电水壶", "电水壶 <c> 家居›灯具›台灯"):
        assert shop.act(episode, f"search[{query}]")["observation_state"]["total_results"] == 7, query
        shop.act(episode, "click[back to search]")


def test_category_prefix_has_no_top_150_cut(bulk_shop: ShopClient) -> None:
    bulk_shop.ok(action="release_all")
    episode = bulk_shop.reset(10_000)
    first = bulk_shop.act(episode, "search[<c> 家居›杯具›水杯]")
    assert (first["observation_state"]["total_results"], first["observation_state"]["total_pages"]) == (160, 8)
    assert all_result_asins(bulk_shop, episode, first) == [f"{500000000000 + i:012d}" for i in range(160)]
    assert bulk_shop.release(episode)[0] == 200


# ------------------------------------------------------------------ "search_results" in the query


def misrouted_kettle(shop: ShopClient) -> dict[str, Any]:
    """An episode whose search text contains "search_results", then the gold kettle opened (500)."""
    episode = shop.reset(0)
    results = shop.act(episode, "search[search_results 电水壶]")  # the results page itself is fine
    assert KETTLE_GOLD in results["observation_state"]["actions"]
    assert interact(shop, episode, f"click[{KETTLE_GOLD}]") == (500, {"error": MISROUTED})
    return episode


def test_search_results_in_the_query_breaks_the_product_page_and_terminate(shop: ShopClient) -> None:
    episode = misrouted_kettle(shop)
    for action in ("click[颜色分类=白色]", "search[电水壶]", "click[nothing]", "click[buy now]"):
        assert interact(shop, episode, action) == (500, {"error": MISROUTED}), action
    terminate = {"action": "terminate", "termination_reason": "generation_length", **lease(episode)}
    assert shop.call(**terminate) == (500, {"error": MISROUTED})
    # the failed terminate has ended the episode all the same
    assert shop.call(**terminate) == (500, {"error": "episode is already terminated"})
    assert interact(shop, episode, "click[back to search]") == (
        500,
        {"error": "episode is already terminated; reset before stepping"},
    )
    assert shop.health()["free_slots"] == 3  # the lease is still held …
    assert shop.release(episode) == (200, {"message": f"Environment {episode['env_idx']} has been released"})
    assert shop.health()["free_slots"] == 4  # … until release_one


def test_actions_on_a_misrouted_page_take_effect_before_the_500(shop: ShopClient) -> None:
    episode = misrouted_kettle(shop)
    assert interact(shop, episode, "click[颜色分类=黑色]") == (500, {"error": MISROUTED})
    assert interact(shop, episode, "click[容量=1.5l]") == (500, {"error": MISROUTED})
    # buy now leaves the misrouted page, so it answers normally, with the options chosen above
    bought = shop.act(episode, "click[buy now]")
    assert (bought["done"], bought["termination_reason"]) == (True, "purchase")
    assert bought["purchase"]["options"] == {"颜色分类": "黑色", "容量": "1.5l"}
    assert bought["purchase"]["price"] == 129.0 and bought["observation_state"]["page_type"] == "terminal"


def test_back_to_search_leaves_a_misrouted_page(shop: ShopClient) -> None:
    episode = misrouted_kettle(shop)
    assert interact(shop, episode, "click[< prev]") == (500, {"error": "search result page must be positive"})
    home = shop.act(episode, "click[back to search]")
    assert home["observation_state"]["page_type"] == "search_home"
    assert home["action_feedback"]["reason"] == "executed"
    # a query without the literal text opens products normally again
    shop.act(episode, "search[电水壶]")
    assert shop.act(episode, f"click[{KETTLE_GOLD}]")["observation_state"]["page_type"] == "product_detail"


def test_prev_on_a_misrouted_page_goes_one_results_page_further_back(bulk_shop: ShopClient) -> None:
    bulk_shop.ok(action="release_all")
    episode = bulk_shop.reset(10_000)
    bulk_shop.act(episode, "search[search_results 测试水杯]")
    page_two = bulk_shop.act(episode, "click[next >]")["observation_state"]
    assert page_two["page"] == 2
    assert interact(bulk_shop, episode, f"click[{page_two['products'][0]['asin']}]") == (500, {"error": MISROUTED})
    # the real server handles this "< prev" as the results page's own: page 2 - 1, not page 2
    state = bulk_shop.act(episode, "click[< prev]")["observation_state"]
    assert (state["page_type"], state["page"], state["rank_start"]) == ("search_results", 1, 1)
    assert bulk_shop.release(episode)[0] == 200


def test_the_action_limit_waits_until_an_action_leaves_the_misrouted_page(shop: ShopClient) -> None:
    episode = misrouted_kettle(shop)  # actions 1 (search) and 2 (the click that failed)
    for number in range(3, 32):  # past the limit of 30: every page render fails first
        assert interact(shop, episode, "click[nothing]") == (500, {"error": MISROUTED}), number
    home = shop.act(episode, "click[back to search]")  # action 32 renders, then the limit applies
    assert (home["done"], home["termination_reason"], home["reward"]) == (True, "action_limit", 0.0)
    assert home["observation_state"]["page_type"] == "search_home"


# ------------------------------------------------------------------ text that is not valid Unicode


def interact_raw(shop: ShopClient, episode: dict[str, Any], body: bytes) -> tuple[int, dict[str, Any]]:
    """``interact`` with a body made by hand: JSON can hold a lone surrogate, UTF-8 cannot (so
    httpx's own ``json=`` refuses to send one)."""
    head = json.dumps({"action": "interact", **lease(episode)})[:-1].encode()
    reply = shop.http.post("/api/shop_agent", content=head + b', "response": ' + body + b"}", headers=JSON)
    return reply.status_code, reply.json()["result"]


def escaped(text: str) -> bytes:
    return json.dumps(text).encode("ascii")  # a lone surrogate as its \uXXXX escape, as Python clients send it


@pytest.mark.parametrize(
    ("body", "position"),
    [
        (escaped("search[电水壶 \ud800]"), "character '\\ud800' in position 0"),  # its own keyword
        (escaped("search[电水壶\udfff 不锈钢]"), "character '\\udfff' in position 3"),
        (escaped("search[电水壶 a\ud800\udbff]"), "characters in position 1-2"),  # two high surrogates
        ('"search[电水壶 \ud800]"'.encode("utf-8", "surrogatepass"), "character '\\ud800' in position 0"),  # raw bytes
    ],
    ids=["own-keyword", "inside-a-keyword", "two-in-a-row", "raw-bytes"],
)
def test_a_search_holding_a_lone_surrogate_answers_500_when_it_finds_products(
    shop: ShopClient, body: bytes, position: str
) -> None:
    """The real server percent-encodes each keyword into the links of its results page; a lone
    surrogate cannot be UTF-8, and the page fails to render: HTTP 500 with Python's text. The
    action counts, the page does not move, and the lease stays usable."""
    episode = shop.reset(0)
    shop.act(episode, "search[电水壶]")
    back = shop.act(episode, "click[back to search]")  # actions 1 and 2
    status, result = interact_raw(shop, episode, body)  # action 3
    assert (status, result) == (500, {"error": f"'utf-8' codec can't encode {position}: surrogates not allowed"})
    for number in range(4, 30):  # the failed search was action 3 of 30
        reply = shop.act(episode, "click[back to search]")
        assert reply["done"] is False and reply["observation_state"]["page_type"] == "search_home", number
        assert number > 4 or reply["action_feedback"]["reason"] == "unavailable_action"  # still on the home page
    last = shop.act(episode, "search[电水壶]")  # action 30
    assert (last["done"], last["termination_reason"]) == (True, "action_limit")
    assert back["observation_state"]["page_type"] == "search_home"
    assert shop.release(episode)[0] == 200


def test_a_search_holding_a_lone_surrogate_that_finds_nothing_renders(shop: ShopClient) -> None:
    """Without results the page has no link that carries the keywords: HTTP 200, the text echoed
    as JSON escapes (which every JSON reader gives back)."""
    episode = shop.reset(0)
    status, result = interact_raw(shop, episode, escaped("search[\ud800 \udc80x]"))
    assert status == 200 and result["action_feedback"]["valid"] is True
    state = result["observation_state"]
    assert (state["page_type"], state["total_results"], state["search_text"]) == ("search_results", 0, "\ud800 \udc80x")
    assert shop.act(episode, "click[back to search]")["observation_state"]["page_type"] == "search_home"
    assert shop.release(episode)[0] == 200


def test_a_failed_surrogate_search_stores_its_search_state_but_shows_the_same_page() -> None:
    """As the real server, which fails after storing the search (keywords, results, counter)."""
    catalog = load_catalog(CATALOG)
    index = SearchIndex(catalog.products)
    session = Session(task_id=0, goal=dict(catalog.goals[0]), max_actions=30)
    with pytest.raises(ServerFault, match="in position 0: surrogates not allowed"):
        step(session, "search[电水壶 \ud800]", catalog, index)
    assert (session.action_count, session.search_count, session.page) == (1, 1, "search_home")
    assert session.keywords == ["电水壶", "\ud800"] and set(session.result_asins) >= set(KETTLES)
    assert session.last_action is None  # no feedback stored: the request failed before that


# ------------------------------------------------------------------ request bodies


@pytest.mark.parametrize("body", [b"[]", b'[{"action": "release_all"}]', b'"reset"', b"5", b"true"])
def test_json_that_is_not_an_object_gets_the_html_500_page(shop: ShopClient, body: bytes) -> None:
    reply = shop.http.post("/api/shop_agent", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 500
    assert reply.headers["content-type"].startswith("text/html")
    assert "<title>500 Internal Server Error</title>" in reply.text
    assert shop.health()["free_slots"] == 4


def test_json_null_is_no_json_data(shop: ShopClient) -> None:
    reply = shop.http.post("/api/shop_agent", content=b"null", headers={"content-type": "application/json"})
    assert (reply.status_code, reply.json()) == (200, {"result": {"error": "No JSON data provided"}})
