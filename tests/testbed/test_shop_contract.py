"""Black-box HTTP tests of the ShopSimulator stand-in, one per contract point (§8) plus §1.7.

Every test talks to a real uvicorn server on a loopback port over the fixture catalog
(``fixtures/catalog_small.json``): kettles, lamps and dresses with priced option axes.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
from typing import Any

import httpx
import pytest

from .conftest import ShopClient

PAPER_METRICS = {
    "reward_version", "termination_reason", "r_loose", "r_strict", "r_success", "r_type", "r_att",
    "r_option", "r_price", "target_asin_match", "price_verifiable",
}  # fmt: skip
FORBIDDEN = {"goal", "reward", "reward_detail", "target_asin", "answer"}
KETTLE_GOLD, KETTLE_TRAVEL, DRESS = "100000000001", "100000000003", "300000000001"


def open_product(shop: ShopClient, episode: dict[str, Any], query: str, asin: str) -> dict[str, Any]:
    results = shop.act(episode, f"search[{query}]")
    assert asin in results["observation_state"]["actions"], results["observation_state"]["actions"]
    return shop.act(episode, f"click[{asin}]")


def client_checks(kind: str, status: int, result: dict[str, Any], requested_reason: str | None = None) -> None:
    """The checks ShopSimulator's own clients apply to every response (contract point 27)."""
    assert 200 <= status < 300 and not result.get("error")
    assert isinstance(result.get("observation_state"), dict)
    assert isinstance(result["observation_state"].get("observation_version"), str)
    assert isinstance(result.get("observation"), str)
    assert "instruction" not in result
    if kind == "reset":
        assert isinstance(result["task_instruction"], str)
        assert isinstance(result["env_idx"], int) and re.fullmatch(r"[0-9a-f]{32}", result["lease_id"])
    if kind == "terminate":
        assert result["termination_reason"] == requested_reason


def test_cp01_terminal_episode_keeps_its_slot_until_release_one(shop: ShopClient) -> None:
    bought = shop.reset(3)
    open_product(shop, bought, "旅行 电热水壶", KETTLE_TRAVEL)
    assert shop.act(bought, "click[buy now]")["done"] is True
    stopped = shop.reset(1)
    shop.terminate(stopped, "action_limit")
    assert shop.health()["free_slots"] == 2  # both terminal episodes still hold their slots
    # still leased: stepping is refused by the episode (500), not by the lease check (409)
    assert shop.call(action="interact", env_idx=bought["env_idx"], lease_id=bought["lease_id"], response="x")[0] == 500
    assert shop.release(bought) == (200, {"message": f"Environment {bought['env_idx']} has been released"})
    assert shop.release(stopped)[0] == 200
    assert shop.health()["free_slots"] == 4


def test_cp02_second_release_of_a_lease_gets_409(shop: ShopClient) -> None:
    episode = shop.reset(0)
    assert shop.release(episode)[0] == 200
    status, result = shop.release(episode)
    assert status == 409
    assert result == {"error": f"stale or invalid lease for environment {episode['env_idx']}"}


def test_cp03_release_all_frees_every_slot_and_invalidates_leases(shop: ShopClient) -> None:
    first, second = shop.reset(0), shop.reset(1)
    assert shop.health()["free_slots"] == 2
    assert shop.ok(action="release_all") == {"message": "All environments have been initialized"}
    assert shop.health()["free_slots"] == 4
    for old in (first, second):
        status, _ = shop.call(action="interact", env_idx=old["env_idx"], lease_id=old["lease_id"], response="search[x]")
        assert status == 409
        assert shop.release(old)[0] == 409


def test_cp04_every_reset_gets_a_fresh_lease_and_old_leases_are_stale(shop: ShopClient) -> None:
    old = shop.reset(0)
    shop.release(old)
    # Slots go round-robin (as the real server's set.pop()): the old slot comes back after a round.
    for _ in range(3):
        shop.release(shop.reset(0))
    new = shop.reset(0)
    assert new["env_idx"] == old["env_idx"] and new["lease_id"] != old["lease_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", new["lease_id"])
    stale = {"env_idx": old["env_idx"], "lease_id": old["lease_id"]}
    assert shop.call(action="interact", response="search[电水壶]", **stale)[0] == 409
    assert shop.call(action="terminate", termination_reason="action_limit", **stale)[0] == 409
    assert shop.call(action="release_one", **stale)[0] == 409
    assert shop.act(new, "search[电水壶]")["action_feedback"]["valid"] is True
    assert shop.release(new)[0] == 200


def test_slots_are_handed_out_round_robin_like_the_real_server(shop: ShopClient) -> None:
    granted = []
    for _ in range(6):
        episode = shop.reset(0)
        granted.append(episode["env_idx"])
        shop.release(episode)
    assert granted == [0, 1, 2, 3, 0, 1]  # not lowest-free, which would give slot 0 every time
    held = [shop.reset(0), shop.reset(1)]  # slots 2 and 3
    assert [e["env_idx"] for e in held] == [2, 3]
    shop.release(held[0])
    assert shop.reset(2)["env_idx"] == 0  # the round wraps to the next free slot after 3
    shop.ok(action="release_all")
    assert shop.reset(0)["env_idx"] == 0  # release_all starts a fresh round


def _next_after_last(free: set[int], last: int | None, size: int) -> int:
    """The testbed's earlier rule: the first free slot after the last one granted, wrapping."""
    start = 0 if last is None else (last + 1) % size
    return min((slot for slot in free if slot >= start), default=min(free))


@pytest.mark.slow
def test_slot_numbers_follow_the_real_pools_set_pop_under_out_of_order_releases(make_shop) -> None:
    """The real pool keeps its free slots in a Python set: ``set(range(n))``, ``pop()`` per reset,
    ``add()`` per release (contract §2). The same operations on a set here must predict every slot
    the testbed grants; out-of-order releases make that differ from "next free after the last"."""
    size, resets = 8, 325
    rng = random.Random(20261203)
    model: set[int] = set(range(size))  # the real pool's free set, driven by the same operations
    held: list[dict[str, Any]] = []
    differs, last = 0, None
    with make_shop(slots=size) as shop:
        for number in range(resets):
            while held and (not model or rng.random() < 0.45):
                episode = held.pop(rng.randrange(len(held)))  # any held lease, not the oldest
                assert shop.release(episode)[0] == 200
                model.add(episode["env_idx"])
            earlier_rule = _next_after_last(model, last, size)
            expected = model.pop()
            episode = shop.reset((0, 1, 3)[number % 3])
            assert episode["env_idx"] == expected, number
            differs += expected != earlier_rule
            held.append(episode)
            last = expected
        for episode in held:
            shop.release(episode)
        shop.ok(action="release_all")
        model = set(range(size))
        assert [shop.reset(0)["env_idx"] for _ in range(3)] == [model.pop() for _ in range(3)]
    assert differs > resets // 5, differs  # the scenario tells the two rules apart (~40 % of grants)


@pytest.mark.slow
def test_cp05_reset_blocks_while_the_pool_is_exhausted(make_shop) -> None:
    with make_shop(slots=1) as shop:
        holder = shop.reset(0)
        done = threading.Event()
        waiter: dict[str, Any] = {}

        def queued_reset() -> None:
            # No read timeout, exactly like the real clients' reset call.
            with httpx.Client(base_url=shop.base_url, timeout=httpx.Timeout(10.0, read=None), trust_env=False) as http:
                reply = http.post("/api/shop_agent", json={"action": "reset", "idx": 1})
                waiter.update(status=reply.status_code, result=reply.json()["result"])
            done.set()

        thread = threading.Thread(target=queued_reset, daemon=True)
        thread.start()
        assert not done.wait(0.5)  # queued: no error, no answer while the only slot is leased
        assert shop.health()["free_slots"] == 0
        assert shop.release(holder)[0] == 200
        assert done.wait(10)
        thread.join(5)
        assert waiter["status"] == 200
        assert waiter["result"]["env_idx"] == holder["env_idx"]
        assert waiter["result"]["lease_id"] != holder["lease_id"]


@pytest.mark.parametrize("keep_orphans", [False, True])
def test_a_queued_reset_whose_client_hung_up(keep_orphans: bool) -> None:
    """Default: the testbed drops it (no phantom lease). SHOPSIM_KEEP_ORPHAN_RESETS=1: it takes
    the next free slot for nobody, as the real threaded server does, so clients are tested
    against that behaviour."""
    import socket
    import time

    from shopsimrl.testbed.serving import running_server
    from shopsimrl.testbed.shop import ShopSettings, create_app

    from .conftest import SMALL_CATALOG

    app = create_app(ShopSettings(slots=1, keep_orphan_resets=keep_orphans), catalog_path=SMALL_CATALOG)
    pool = app.state.shop.pool
    with running_server(app) as url:
        shop = ShopClient(url)
        holder = shop.reset(0)
        host, port = url.removeprefix("http://").split(":")
        body = b'{"action": "reset", "idx": 1}'
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(
                b"POST /api/shop_agent HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            deadline = time.monotonic() + 10
            while pool._waiting == 0:  # the server has the reset and queued it
                assert time.monotonic() < deadline
                time.sleep(0.01)
        if not keep_orphans:  # the server notices the hang-up and drops the queued reset
            deadline = time.monotonic() + 10
            while pool._waiting:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert shop.release(holder)[0] == 200
        deadline = time.monotonic() + 10
        while pool._waiting:  # with keep_orphans, the orphan takes the freed slot
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert shop.health()["free_slots"] == (0 if keep_orphans else 1)
        shop.close()


@pytest.mark.slow
def test_cp05b_release_all_wakes_queued_resets(make_shop) -> None:
    with make_shop(slots=1) as shop:
        shop.reset(0)
        done = threading.Event()

        def queued_reset() -> None:
            with httpx.Client(base_url=shop.base_url, timeout=httpx.Timeout(10.0, read=None), trust_env=False) as http:
                assert http.post("/api/shop_agent", json={"action": "reset", "idx": 1}).status_code == 200
            done.set()

        threading.Thread(target=queued_reset, daemon=True).start()
        assert not done.wait(0.3)
        shop.ok(action="release_all")
        assert done.wait(10)
        assert shop.health()["free_slots"] == 0  # the woken reset now holds the slot


def test_cp06_search_home_offers_search_and_no_click(shop: ShopClient) -> None:
    episode = shop.reset(0)
    state = episode["observation_state"]
    assert state == {
        "observation_version": "shopping-observation-v7",
        "page_type": "search_home",
        "search_available": True,
        "actions": [],
    }
    shop.act(episode, "search[电水壶]")
    back = shop.act(episode, "click[back to search]")["observation_state"]
    assert back["page_type"] == "search_home" and back["search_available"] is True and back["actions"] == []
    assert shop.act(episode, "click[search]")["action_feedback"]["reason"] == "unavailable_action"


def test_cp07_search_results_pages_have_global_ranks(bulk_shop: ShopClient) -> None:
    episode = bulk_shop.reset(10_000)
    try:
        page1 = bulk_shop.act(episode, "search[测试水杯！]")["observation_state"]
        assert page1["search_text"] == "测试水杯！" and page1["normalized_search_text"] == "测试水杯"
        assert "query" not in page1
        assert (page1["page"], page1["total_results"], page1["rank_start"], page1["rank_end"]) == (1, 150, 1, 20)
        assert page1["actions"][:2] == ["back to search", "next >"]
        page2 = bulk_shop.act(episode, "click[next >]")["observation_state"]
        assert (page2["page"], page2["rank_start"], page2["rank_end"]) == (2, 21, 40)
        assert page2["actions"][:3] == ["back to search", "< prev", "next >"]
        assert [p["rank"] for p in page2["products"]] == list(range(21, 41))
        asins = [p["asin"] for p in page2["products"]]
        assert asins == [a for a in page2["actions"] if a.isdigit()]
        assert not set(asins) & {p["asin"] for p in page1["products"]}
        # results are ranked by BM25 and then by ascending ASIN, so equal scores keep ASIN order
        assert all(len(p["key_attributes"]) <= 10 for p in page2["products"])
        back = bulk_shop.act(episode, "click[< prev]")["observation_state"]
        assert back["products"] == page1["products"]
    finally:
        bulk_shop.release(episode)


def test_cp08_observation_state_never_holds_the_answer(shop: ShopClient) -> None:
    episode = shop.reset(0)
    states = [episode["observation_state"]]
    open_product(shop, episode, "不锈钢 电水壶", KETTLE_GOLD)
    for action in ("click[颜色分类=白色]", "click[容量=1.7l]", "click[buy now]"):
        states.append(shop.act(episode, action)["observation_state"])
    for state in states:
        assert not FORBIDDEN & set(state)
        assert state["observation_version"] == "shopping-observation-v7"
    assert states[-1]["page_type"] == "terminal" and states[-1]["actions"] == []


def test_cp09_no_description_features_reviews_or_attributes_actions(shop: ShopClient) -> None:
    episode = shop.reset(2)
    product = open_product(shop, episode, "护眼 台灯", "200000000001")["observation_state"]
    assert product["page_type"] == "product_detail"
    labels = {a.casefold() for a in product["actions"]}
    assert not labels & {"description", "features", "reviews", "attributes"}
    for hidden in ("Attributes", "attributes", "description"):
        reply = shop.act(episode, f"click[{hidden}]")
        assert reply["action_feedback"]["reason"] == "unavailable_action"
        assert reply["observation_state"]["page_type"] == "product_detail"


def test_cp10_product_state_reports_the_options(shop: ShopClient) -> None:
    episode = shop.reset(0)
    state = open_product(shop, episode, "不锈钢 电水壶", KETTLE_GOLD)["observation_state"]
    assert state["selected_options"] == {} and state["missing_option_axes"] == ["颜色分类", "容量"]
    assert state["options_complete"] is False and "selected_price" not in state
    assert state["available_options"] == {"颜色分类": ["白色", "黑色"], "容量": ["1.7l", "1.5l"]}
    assert state["product"] == {
        "asin": KETTLE_GOLD, "title": "不锈钢电水壶 1.7L大容量 快速烧水", "brand": "美厨旗舰店",
        "category": "家电›厨房电器›电水壶", "price": "99.0 to 129.0", "key_attributes": ["不锈钢", "快速烧水", "自动断电"],
    }  # fmt: skip
    reply = shop.act(episode, "click[颜色分类=黑色]")
    state = reply["observation_state"]
    assert state["selected_options"] == {"颜色分类": "黑色"} and state["missing_option_axes"] == ["容量"]
    assert state["selected_price"] == 129.0
    assert state["last_action"] == reply["action_feedback"] == {
        "action": "click[颜色分类=黑色]", "valid": True, "reason": "executed", "message": "点击已执行",
    }  # fmt: skip
    state = shop.act(episode, "click[容量=1.5l]")["observation_state"]
    assert state["options_complete"] is True and state["missing_option_axes"] == []


def test_cp11_option_actions_use_axis_equals_value(shop: ShopClient) -> None:
    episode = shop.reset(4790)
    state = open_product(shop, episode, "碎花 连衣裙", DRESS)["observation_state"]
    assert state["actions"] == [
        "back to search", "< prev", "主色=蓝色", "主色=白色", "辅色=蓝色", "辅色=黑色", "尺码=s", "尺码=m", "尺码=l",
    ]  # fmt: skip
    state = shop.act(episode, "click[主色=蓝色]")["observation_state"]
    assert "主色=蓝色" not in state["actions"] and "辅色=蓝色" in state["actions"]
    assert state["selected_options"] == {"主色": "蓝色"}
    lamp = shop.reset(2)
    values = open_product(shop, lamp, "护眼 台灯", "200000000001")["observation_state"]
    assert "光源=暖光 | 冷光" in values["actions"]  # "/" in source values is shown as " | "


def test_cp12_buy_now_requires_complete_options(shop: ShopClient) -> None:
    episode = shop.reset(0)
    state = open_product(shop, episode, "不锈钢 电水壶", KETTLE_GOLD)["observation_state"]
    assert "buy now" not in state["actions"]
    reply = shop.act(episode, "click[buy now]")
    assert reply["message"] == "Invalid action" and reply["done"] is False
    assert reply["action_feedback"] == {
        "action": "click[buy now]", "valid": False, "reason": "incomplete_options",
        "message": "购买前还需选择规格轴：颜色分类、容量", "missing_option_axes": ["颜色分类", "容量"],
    }  # fmt: skip
    shop.act(episode, "click[颜色分类=白色]")
    again = shop.act(episode, "click[颜色分类=白色]")["action_feedback"]
    assert (again["reason"], again["message"]) == ("already_selected", "该规格已经选中：颜色分类=白色")
    before = shop.act(episode, "click[容量=1.7l]")["observation_state"]
    assert before["actions"][:3] == ["back to search", "< prev", "buy now"]
    searched = shop.act(episode, "search[台灯]")
    assert searched["action_feedback"]["reason"] == "search_unavailable"
    assert searched["action_feedback"]["message"] == "当前页面不提供搜索操作"
    after = searched["observation_state"]
    assert {k: v for k, v in after.items() if k != "last_action"} == {k: v for k, v in before.items() if k != "last_action"}
    for label in ("click[Buy Now]", "click[ buy now]"):
        assert shop.act(episode, label)["action_feedback"]["reason"] == "unavailable_action"


def test_cp13_text_observation(shop: ShopClient) -> None:
    episode = shop.reset(0)
    assert episode["observation"] == "页面：搜索首页\n\n页面能力：\n- 支持商品搜索\n"
    results = shop.act(episode, "search[不锈钢 电水壶]")
    text = results["observation"]
    assert text.startswith("页面：搜索结果\n搜索词：不锈钢 电水壶\n结果：第 1/1 页，共 ")
    assert re.search(
        r"\n\d\. 不锈钢电水壶 1\.7L大容量 快速烧水\n   ASIN：100000000001\n   价格：99\.0 to 129\.0\n"
        r"   品牌：美厨旗舰店\n   类别：家电›厨房电器›电水壶\n   关键属性：不锈钢；快速烧水；自动断电\n",
        text,
    )
    assert "上次交互结果：\n- 结果：成功\n- 说明：搜索已执行\n\n可点击元素：\n- back to search\n- 1000000000" in text
    assert "- 100000000001\n" in text
    product = shop.act(episode, f"click[{KETTLE_GOLD}]")
    shop.act(episode, "click[颜色分类=白色]")
    text = shop.act(episode, "click[buy now]")["observation"]
    assert text.startswith(
        "页面：商品详情\n商品：\n- 标题：不锈钢电水壶 1.7L大容量 快速烧水\n- ASIN：100000000001\n- 价格：99.0\n"
    )
    assert "- 颜色分类：已选择 白色\n  可选值：白色 / 黑色\n- 容量：尚未选择\n  可选值：1.7l / 1.5l\n仍需选择：容量\n" in text
    assert "- 结果：无效\n- 说明：购买前还需选择规格轴：容量\n- 原因代码：incomplete_options\n" in text
    assert text.endswith("可点击元素：\n- back to search\n- < prev\n- 颜色分类=黑色\n- 容量=1.7l\n- 容量=1.5l\n")
    empty = shop.reset(1)
    no_hits = shop.act(empty, "search[!!!]")
    assert no_hits["observation_state"]["total_pages"] == 1 and "（本页没有商品）" in no_hits["observation"]
    shop.act(empty, "click[back to search]")
    plain = open_product(shop, empty, "迷你 便携 电热水壶", "100000000002")["observation"]
    assert "- 此商品没有规格选项\n规格状态：已选择全部规格，可以购买\n" in plain
    for page in (episode["observation"], results["observation"], product["observation"], text, plain):
        assert page.endswith("\n") and not page.endswith("\n\n")
        for marker in ("search[", "click[", "[SEP]", "[SHOPPING_OBSERVATION", "normalized", "shopping-observation"):
            assert marker not in page


def test_cp14_action_limit_terminal(shop: ShopClient) -> None:
    episode = shop.reset(0)
    for _ in range(29):
        assert shop.act(episode, "click[nothing]")["done"] is False
    last = shop.act(episode, "search[电水壶]")
    assert last["done"] is True and last["over"] is True and last["reward"] == 0.0
    assert last["termination_reason"] == "action_limit" and last["purchase"] == {}
    assert last["reward_detail"]["termination_reason"] == "action_limit"
    assert last["reward_detail"]["r_success"] == 0 and set(last["reward_detail"]) == PAPER_METRICS
    assert last["action_feedback"]["reason"] == "executed"  # feedback of the limit-hitting action
    assert last["observation_state"]["page_type"] == "search_results"  # the page is not moved
    assert last["goal"]["task_id"] == 0
    multi = shop.reset(0, interaction_mode="multi_turn")
    for _ in range(39):
        assert shop.act(multi, "click[nothing]")["done"] is False
    assert shop.act(multi, "click[nothing]")["termination_reason"] == "action_limit"


def test_cp15_generation_length_terminal(shop: ShopClient) -> None:
    episode = shop.reset(0)
    shop.act(episode, "search[电水壶]")
    status, result = shop.call(
        action="terminate", env_idx=episode["env_idx"], lease_id=episode["lease_id"], termination_reason="generation_length"
    )
    client_checks("terminate", status, result, "generation_length")
    assert result["done"] is result["over"] is True and result["reward"] == 0.0
    assert result["message"] == "Episode terminated: generation_length" and result["purchase"] == {}
    assert result["reward_detail"]["termination_reason"] == "generation_length"
    assert set(result["reward_detail"]) == PAPER_METRICS and "action_feedback" not in result
    assert result["idx"] == f"slot-{episode['env_idx']}-0" and result["goal"]["asin"] == KETTLE_GOLD
    assert result["observation_state"]["page_type"] == "search_results"


def test_cp16_terminal_episodes_refuse_terminate_and_interact(shop: ShopClient) -> None:
    episode = shop.reset(3)
    open_product(shop, episode, "旅行 电热水壶", KETTLE_TRAVEL)
    shop.act(episode, "click[buy now]")
    lease = {"env_idx": episode["env_idx"], "lease_id": episode["lease_id"]}
    assert shop.call(action="terminate", termination_reason="action_limit", **lease) == (
        500,
        {"error": "episode is already terminated"},
    )
    assert shop.call(action="interact", response="search[x]", **lease) == (
        500,
        {"error": "episode is already terminated; reset before stepping"},
    )


def test_cp17_zero_reward_detail_holds_only_paper_metrics(shop: ShopClient) -> None:
    detail = shop.terminate(shop.reset(1), "action_limit")["reward_detail"]
    assert detail == {
        "reward_version": "shopsimulator-paper-reward-v2", "termination_reason": "action_limit",
        "r_loose": 0.0, "r_strict": 0.0, "r_success": 0, "r_type": 0.0, "r_att": 0.0, "r_option": 0.0,
        "r_price": 0.0, "target_asin_match": False, "price_verifiable": False,
    }  # fmt: skip


def _buy(shop: ShopClient, task: int, query: str, asin: str, options: list[str]) -> dict[str, Any]:
    episode = shop.reset(task)
    open_product(shop, episode, query, asin)
    for option in options:
        shop.act(episode, f"click[{option}]")
    bought = shop.act(episode, "click[buy now]")
    shop.release(episode)
    return bought


def test_cp18_reward_formula(shop: ShopClient) -> None:
    right = _buy(shop, 0, "不锈钢 电水壶", KETTLE_GOLD, ["颜色分类=白色", "容量=1.7l"])
    detail = right["reward_detail"]
    assert right["reward"] == detail["r_strict"] == 1.0 and detail["r_success"] == 1
    assert right["termination_reason"] == "purchase" and right["observation_state"]["page_type"] == "terminal"
    assert not {"query_match", "reward_type", "weighted_score"} & set(detail)
    wrong = _buy(shop, 0, "不锈钢 电水壶", KETTLE_GOLD, ["颜色分类=黑色", "容量=1.7l"])["reward_detail"]
    assert wrong["target_asin_match"] is True and wrong["r_option"] == 0.0 and wrong["r_strict"] == 0.0
    assert wrong["r_loose"] == pytest.approx(0.75) and wrong["r_success"] == 0
    other = _buy(shop, 1, "迷你 便携 电热水壶", KETTLE_TRAVEL, [])
    assert other["reward_detail"]["target_asin_match"] is False and other["reward_detail"]["r_success"] == 1
    assert other["purchase"] == {
        "asin": KETTLE_TRAVEL, "category": "家电›厨房电器›电水壶", "name": "迷你便携电热水壶 旅行款 折叠",
        "product_category": "电水壶", "instruction_text": "出差用的可折叠旅行电热水壶",
        "attributes": ["旅行", "折叠"], "price": 69.0, "options": {},
    }  # fmt: skip


def test_cp19_price_is_resolved_from_the_selected_price_axis(shop: ShopClient) -> None:
    white = _buy(shop, 0, "不锈钢 电水壶", KETTLE_GOLD, ["颜色分类=白色", "容量=1.7l"])["reward_detail"]
    assert white["price_resolution"] == {
        "status": "pass", "price": 99.0, "version": "variant-price-paper-v2",
        "method": "selected_price_axis", "evidence": {"price_axis": "颜色分类"},
    }  # fmt: skip
    assert white["price_verifiable"] is True and white["price_upper"] == 140.0
    # options without prices on a product with axes: unverifiable, so a budget gives r_price 0
    unpriced = _buy(shop, 7, "充电 台灯", "200000000003", ["颜色=黑色"])["reward_detail"]
    assert unpriced["price_resolution"]["status"] == "unverifiable"
    assert (unpriced["r_price"], unpriced["price_verifiable"], unpriced["r_strict"]) == (0.0, False, 0.0)
    # no budget: r_price is 1 whatever the price
    lamp = _buy(shop, 2, "护眼 台灯", "200000000001", ["光源=三色调光", "款式=底座款"])["reward_detail"]
    assert lamp["price_upper"] is None and lamp["r_price"] == 1.0 and lamp["r_strict"] == 1.0
    # over budget (129 > 80): the price is verifiable but r_price is 0
    over = _buy(shop, 1, "不锈钢 电水壶", KETTLE_GOLD, ["颜色分类=黑色", "容量=1.5l"])["reward_detail"]
    assert over["price_resolution"]["price"] == 129.0 and over["price_upper"] == 80.0
    assert (over["r_price"], over["price_verifiable"], over["r_strict"]) == (0.0, True, 0.0)
    # the price axis of the dress is 尺码; its price decides, the colour axes do not
    dress = _buy(shop, 4790, "碎花 连衣裙", DRESS, ["主色=蓝色", "辅色=黑色", "尺码=l"])["reward_detail"]
    assert dress["price_resolution"]["evidence"] == {"price_axis": "尺码"} and dress["price_resolution"]["price"] == 169.0
    assert dress["r_price"] == 1.0 and dress["r_option"] == 0.5  # "m" was wanted, "l" selected


def test_cp20_budget_sources(shop: ShopClient) -> None:
    def goal_of(task: int) -> dict[str, Any]:
        episode = shop.reset(task)
        goal = shop.terminate(episode)["goal"]
        assert shop.release(episode)[0] == 200
        return goal

    assert goal_of(1460)["price_upper"] == 250.0  # precomputed wins over "200元左右" (parser: 220)
    assert goal_of(1461)["price_upper"] == 150.0  # empty precomputed value: parsed range upper end
    assert goal_of(4790)["price_upper"] == 180.0  # instruction_simple is parsed before the full text
    assert goal_of(0)["price_upper"] == 140.0
    assert goal_of(2)["price_upper"] is None  # never the gold price


def test_cp21_persona_goals(shop: ShopClient) -> None:
    persona = shop.terminate(shop.reset(1460, if_persona=True))["goal"]
    assert persona["instruction_text"].startswith("这位用户喜欢智能家电")
    assert persona["instruction_simple"] == "帮我挑个能保温的电水壶"
    assert persona["user_persona"]["用户ID"] == "u-1460"
    standard = shop.terminate(shop.reset(0))["goal"]
    assert standard["instruction_simple"] == standard["instruction_text"]
    assert standard["user_persona"] == {} and standard["reason_key"] is None
    assert set(standard) == {
        "task_id", "task_uid", "source_product_index", "asin", "category", "name", "instruction_text",
        "instruction_simple", "attributes", "price_upper", "price_constraint", "goal_options", "user_persona",
        "reason_key", "weight",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("response", "reason", "action"),
    [
        ("Thought: 先搜索\nAction: search[电水壶]", "executed", "search[电水壶]"),
        ("  action :   search[电水壶]   ", "executed", "search[电水壶]"),
        ("Thought: 搜索\\nAction: search[电水壶]", "executed", "search[电水壶]"),
        ("Action: search[a]\nAction: search[b]", "multiple_actions_not_allowed", None),
        ("click[a], click[b]", "multiple_actions_not_allowed", None),
        ("search[电水壶] 谢谢", "invalid_format", None),
        ("search", "empty_argument", None),
        ("finish", "invalid_format", None),
        ("buy[电水壶]", "invalid_format", None),
        ("search[   ]", "empty_argument", None),
    ],
)
def test_cp22_action_extraction(shop: ShopClient, response: str, reason: str, action: str | None) -> None:
    feedback = shop.act(shop.reset(0), response)["action_feedback"]
    assert feedback["reason"] == reason
    if action is not None:
        assert feedback["action"] == action
    if response == "search[电水壶] 谢谢":
        assert feedback["message"] == "动作必须严格使用 search[...] 或 click[...] 格式"
    if response == "finish":
        assert feedback["message"] == "动作必须使用 search[...] 或 click[...] 格式"


def test_cp23_private_fields_of_the_reset_response(shop: ShopClient) -> None:
    status, default = shop.call(action="reset", idx=1460, if_persona=True, include_private_goal=False)
    client_checks("reset", status, default)
    assert not {"private_task_instruction", "goal_options", "reason_key", "instruction", "instruction_simple"} & set(default)
    assert default["task_instruction"] == "帮我挑个能保温的电水壶" and default["task_mode"] == "persona"
    assert default["user_persona"] == {"用户ID": "u-1460", "行为特征": {"购物频率": "每周", "偏好": "智能家电"}}
    assert default["observation"].startswith("页面：搜索首页")
    assert (default["message"], default["idx"], default["interaction_mode"]) == ("Task 1460 started", 1460, "single_turn")
    assert default["environment_version"] == "shopsimulator-paper-aligned-v8"
    private = shop.reset(1460, include_private_goal=True)
    assert private["task_instruction"] == private["private_task_instruction"]
    assert private["private_task_instruction"].startswith("这位用户喜欢智能家电")
    assert private["goal_options"] == ["粉色"] and private["reason_key"] is None
    assert private["task_mode"] == "standard"
    plain = shop.reset(7, if_persona=True)  # a task without persona shows the full text
    assert plain["task_instruction"] == "想要一个可以充电的小台灯，黑色的，五十元以内" and plain["user_persona"] == {}


def test_cp24_every_catalog_task_is_served_and_counted(shop: ShopClient) -> None:
    active = [0, 1, 2, 3, 7, 1460, 1461, 4790]
    assert shop.health()["tasks"] == len(active)
    for task in active:
        episode = shop.reset(task)
        assert episode["idx"] == task
        shop.release(episode)
    # a task whose instruction has no attributes is inactive, as in the real server
    assert shop.call(action="reset", idx=5) == (500, {"error": "'unknown or inactive task_id 5'"})
    assert shop.health()["free_slots"] == 4  # the failed reset gave its slot back


def test_cp25_healthz(shop: ShopClient) -> None:
    assert shop.health() == {
        "ready": True, "environment_slots": 4, "free_slots": 4, "tasks": 8,
        "environment_version": "shopsimulator-paper-aligned-v8", "primary_reward": "r_strict",
        "observation_version": "shopping-observation-v7", "debug_ui": "/debug-ui", "replay_ui": "/replay-ui",
    }  # fmt: skip
    for path in ("/debug-ui", "/replay-ui"):
        assert shop.http.get(path).status_code == 200


def test_cp26_frozen_config_values(bulk_shop: ShopClient) -> None:
    episode = bulk_shop.reset(10_001)
    try:
        state = bulk_shop.act(episode, "search[测试水杯]")["observation_state"]
        assert (state["total_results"], state["total_pages"], len(state["products"])) == (150, 8, 20)
        for _ in range(7):
            state = bulk_shop.act(episode, "click[next >]")["observation_state"]
        assert (state["page"], state["rank_start"], state["rank_end"]) == (8, 141, 150)
        assert "next >" not in state["actions"]
    finally:
        bulk_shop.release(episode)
    from shopsimrl.testbed.shop.actions import EPISODE_LIMITS
    from shopsimrl.testbed.shop.search import FIELD_WEIGHTS, PAGE_SIZE, TOP_K

    assert EPISODE_LIMITS == {"single_turn": 30, "multi_turn": 40} and (TOP_K, PAGE_SIZE) == (150, 20)
    assert FIELD_WEIGHTS == {
        "title": 3.0, "brand": 2.0, "category": 2.0, "model": 2.5, "attributes": 1.5, "options": 1.2, "bullets": 0.8,
    }  # fmt: skip


def test_cp27_every_response_passes_the_client_checks(shop: ShopClient) -> None:
    status, reset = shop.call(action="reset", idx=0, if_persona=False, include_private_goal=False)
    client_checks("reset", status, reset)
    lease = {"env_idx": reset["env_idx"], "lease_id": reset["lease_id"]}
    for response in ("search[不锈钢 电水壶]", f"click[{KETTLE_GOLD}]", "click[buy now]", "click[颜色分类=白色]"):
        status, result = shop.call(action="interact", response=response, **lease)
        client_checks("interact", status, result)
        assert result["lease_id"] == reset["lease_id"] and "environment_version" not in result
    for reason in ("action_limit", "generation_length"):
        episode = shop.reset(1)
        status, result = shop.call(
            action="terminate", env_idx=episode["env_idx"], lease_id=episode["lease_id"], termination_reason=reason
        )
        client_checks("terminate", status, result, reason)
    raw = shop.http.post("/api/shop_agent", json={"action": "release_all"})
    assert raw.headers["content-type"].startswith("application/json")


def test_cp28_every_live_page_offers_search_or_a_click(shop: ShopClient) -> None:
    episode = shop.reset(4790)
    pages = [episode["observation_state"]]
    for action in ("search[zzzz]", "click[back to search]", "search[碎花 连衣裙]", f"click[{DRESS}]",
                   "click[主色=蓝色]", "click[辅色=黑色]", "click[尺码=m]", "click[< prev]"):  # fmt: skip
        reply = shop.act(episode, action)
        assert reply["action_feedback"]["valid"] is True, reply["action_feedback"]
        pages.append(reply["observation_state"])
    for state in pages:
        assert state["search_available"] or state["actions"], state
        assert "search" not in state["actions"]
    assert pages[-1]["page_type"] == "search_results"  # "< prev" from a product returns to its results


@pytest.mark.parametrize(
    ("payload", "status", "error"),
    [
        ({"action": "xyz"}, 400, "unsupported action: 'xyz'"),
        ({}, 400, "unsupported action: None"),
        ({"action": "reset", "idx": 0, "env_idx": 1}, 400, "reset must not include env_idx; the server assigns a slot"),
        ({"action": "interact", "env_idx": True, "lease_id": "x"}, 400, "interact requires a valid env_idx and lease_id"),
        ({"action": "terminate", "env_idx": 0}, 400, "terminate requires a valid env_idx and lease_id"),
        ({"action": "release_one", "env_idx": "0", "lease_id": "x"}, 400, "release_one requires a valid env_idx and lease_id"),
        ({"action": "interact", "env_idx": 99, "lease_id": "x", "response": "s"}, 409, "stale or invalid lease for environment 99"),
        ({"action": "reset"}, 500, "reset action requires idx parameter"),
        ({"action": "reset", "idx": "0"}, 500, "task idx must be an integer"),
        ({"action": "reset", "idx": 0.0}, 500, "task idx must be an integer"),
        ({"action": "reset", "idx": 12345}, 500, "'unknown or inactive task_id 12345'"),
        (
            {"action": "reset", "idx": 0, "interaction_mode": "x"},
            500,
            "unsupported interaction_mode 'x'; choose one of ['multi_turn', 'single_turn']",
        ),
    ],
)  # fmt: skip
def test_error_table_of_section_1_7(shop: ShopClient, payload: dict[str, Any], status: int, error: str) -> None:
    assert shop.call(**payload) == (status, {"error": error})
    assert shop.health()["free_slots"] == 4  # no failed call keeps a slot


def test_error_table_episode_errors(shop: ShopClient) -> None:
    episode = shop.reset(0)
    lease = {"env_idx": episode["env_idx"], "lease_id": episode["lease_id"]}
    assert shop.call(action="interact", **lease) == (500, {"error": "interact action requires response parameter"})
    assert shop.call(action="interact", response=5, **lease) == (500, {"error": "'int' object has no attribute 'replace'"})
    assert shop.call(action="terminate", termination_reason="finish", **lease) == (
        500,
        {"error": "unsupported termination reason: finish"},
    )
    # none of these errors released the lease or counted as an action
    assert shop.act(episode, "search[电水壶]")["done"] is False
    for body, headers in ((b"not json", {"content-type": "application/json"}), (b'{"action": "release_all"}', {})):
        reply = shop.http.post("/api/shop_agent", content=body, headers=headers)
        assert (reply.status_code, reply.json()) == (200, {"result": {"error": "No JSON data provided"}})


def test_injected_faults_never_take_a_slot(make_shop) -> None:
    with make_shop(slots=16, fault_rate_5xx=0.5, seed=7) as shop:
        outcomes = [shop.call(action="reset", idx=0) for _ in range(12)]
        succeeded = [result for status, result in outcomes if status == 200]
        failed = [result for status, result in outcomes if status == 500]
        assert succeeded and failed and len(succeeded) + len(failed) == 12
        assert shop.health()["free_slots"] == 16 - len(succeeded)
        assert all("injected fault" in result["error"] and result["state_unchanged"] is True for result in failed)


@pytest.mark.slow
async def test_many_concurrent_leases_are_distinct(make_shop) -> None:
    with make_shop(slots=200) as shop:
        async with httpx.AsyncClient(base_url=shop.base_url, timeout=httpx.Timeout(30.0, read=None), trust_env=False) as http:
            replies = await asyncio.gather(
                *(http.post("/api/shop_agent", json={"action": "reset", "idx": i % 2}) for i in range(200))
            )
            episodes = [reply.json()["result"] for reply in replies]
            assert {reply.status_code for reply in replies} == {200}
            assert sorted(e["env_idx"] for e in episodes) == list(range(200))
            assert len({e["lease_id"] for e in episodes}) == 200
            assert (await http.get("/healthz")).json()["free_slots"] == 0
            steps = await asyncio.gather(
                *(
                    http.post(
                        "/api/shop_agent",
                        json={
                            "action": "interact",
                            "env_idx": e["env_idx"],
                            "lease_id": e["lease_id"],
                            "response": "search[电水壶]",
                        },
                    )
                    for e in episodes
                )
            )
            assert all(
                s.json()["result"]["idx"] == f"slot-{e['env_idx']}-{e['idx']}" for s, e in zip(steps, episodes, strict=True)
            )


@pytest.mark.slow
def test_packaged_catalog_serves_its_tasks() -> None:
    from shopsimrl.testbed.serving import running_server
    from shopsimrl.testbed.shop import ShopSettings, create_app
    from shopsimrl.testbed.shop.server import DEFAULT_CATALOG

    if not DEFAULT_CATALOG.is_file():
        pytest.skip(f"packaged catalog not built: {DEFAULT_CATALOG}")
    app = create_app(ShopSettings(slots=2))
    task_ids = sorted(app.state.shop.catalog.goals)
    with running_server(app) as url:
        shop = ShopClient(url)
        try:
            assert shop.health()["tasks"] == len(task_ids) > 0
            for task in (task_ids[0], task_ids[len(task_ids) // 2], task_ids[-1]):
                status, episode = shop.call(action="reset", idx=task, if_persona=True)
                client_checks("reset", status, episode)
                reply = shop.act(episode, f"search[{episode['task_instruction'][:20]}]")
                assert reply["observation_state"]["page_type"] == "search_results"
                assert shop.release(episode)[0] == 200
        finally:
            shop.close()
