"""The heuristic policy: pure decisions on rendered pages, and the vLLM-shaped HTTP server."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from shopsimrl.testbed.heuristics import decide, extract_keywords, parse_budget, parse_observation
from shopsimrl.testbed.heuristics_pages import fuzzy_ratio, parse_preferences
from shopsimrl.testbed.policy import PolicySettings, create_app
from shopsimrl.testbed.serving import running_server

INSTRUCTION = "我想买一款黑色的蓝牙耳机，支持主动降噪，尺码选m，价格在300元以下"
HOME = "页面：搜索首页\n\n页面能力：\n- 支持商品搜索\n"

# --------------------------------------------------------------------------- a tiny shop
# Pages rendered exactly as ShopSimulator's render_observation_state lays them out, so the
# policy is exercised on the real format, including a whole episode over HTTP below.

CATALOG: dict[str, dict[str, Any]] = {
    "100000000001": {
        "title": "有线入耳式耳机 白色 重低音",
        "price": "39.0",
        "brand": "声浪旗舰店",
        "category": "数码›影音›耳机",
        "attrs": ["有线", "入耳式"],
        "options": {},
    },
    "100000000002": {
        "title": "主动降噪蓝牙耳机 头戴式 黑色",
        "price": "599.0",
        "brand": "静音坊",
        "category": "数码›影音›耳机",
        "attrs": ["主动降噪", "蓝牙5.3"],
        "options": {"颜色分类": ["黑色", "白色"]},
    },
    "100000000003": {
        "title": "主动降噪蓝牙耳机 入耳式 长续航",
        "price": "199.0 to 259.0",
        "brand": "听风数码",
        "category": "数码›影音›耳机",
        "attrs": ["主动降噪", "蓝牙"],
        "options": {"颜色分类": ["白色", "黑色"], "尺码": ["s", "m", "l"]},
    },
    # Dash cams for the persona tests: only 0203 has every wanted attribute and the wanted card.
    "200000000201": {
        "title": "鲸落行车记录仪 高清夜视 前后双录",
        "price": "109.0 to 249.0",
        "brand": "鲸落企业店",
        "category": "汽车用品›车载电器›行车记录仪",
        "attrs": ["清晰度：四K", "安装方式：后视镜式", "高清夜视"],
        "options": {"存储卡": ["无卡", "三十二g"]},
    },
    "200000000202": {
        "title": "云麓行车记录仪 四K 碰撞锁存",
        "price": "529.0 to 709.0",
        "brand": "云麓优选店",
        "category": "汽车用品›车载电器›行车记录仪",
        "attrs": ["清晰度：四K", "安装方式：免走线", "高清夜视", "碰撞锁存"],
        "options": {"存储卡": ["六十四g", "一百二十八g"]},
    },
    "200000000203": {
        "title": "曦禾M28行车记录仪 循环录像 四K",
        "price": "619.0 to 1299.0",
        "brand": "曦禾旗舰店",
        "category": "汽车用品›车载电器›行车记录仪",
        "attrs": ["清晰度：四K", "安装方式：免走线", "高清夜视", "碰撞锁存", "广角"],
        "options": {"存储卡": ["无卡", "三十二g", "六十四g"]},
    },
    "200000000204": {
        "title": "半夏行车记录仪 四K 免走线 碰撞锁存 广角",
        "price": "979.0 to 1199.0",
        "brand": "半夏专营店",
        "category": "汽车用品›车载电器›行车记录仪",
        "attrs": ["清晰度：四K", "安装方式：免走线", "高清夜视", "碰撞锁存", "广角"],
        "options": {"存储卡": ["三十二g"]},
    },
    "200000000205": {  # not listed: opened directly to test a missing option value
        "title": "松间行车记录仪 四K 广角",
        "price": "439.0 to 729.0",
        "brand": "松间旗舰店",
        "category": "汽车用品›车载电器›行车记录仪",
        "attrs": ["清晰度：四K", "安装方式：免走线", "高清夜视", "碰撞锁存", "广角"],
        "options": {"存储卡": ["六十四g", "一百二十八g"]},
    },
}
CATALOG.update(
    {
        "300000000301": {
            "title": "清屿儿童运动鞋 轻便 系带",
            "price": "209.0",
            "brand": "清屿旗舰店",
            "category": "鞋靴›童鞋›儿童运动鞋",
            "attrs": ["适用年龄：幼童", "鞋底：防滑大底", "闭合方式：系带"],
            "options": {"尺码": ["27", "33"]},
        },
        "300000000302": {
            "title": "苇岸儿童运动鞋 防撞 防滑大底",
            "price": "219.0",
            "brand": "苇岸优选店",
            "category": "鞋靴›童鞋›儿童运动鞋",
            "attrs": ["适用年龄：中大童", "鞋底：防滑大底", "闭合方式：系带"],
            "options": {"尺码": ["27", "30", "31"]},
        },
    }
)
DASHCAMS = ["200000000201", "200000000202", "200000000204", "200000000203"]  # listing order: the match is last
DASHCAM_TASK = "帮忙挑一台行车记录仪，高清夜视，预算900元以内"
DASHCAM_PROFILE: dict[str, Any] = {
    "用户ID": "U1",
    "性别": "女",
    "交易特征": {"客单价区间": "100-300元"},
    "偏好": {
        "关注属性": ["高清夜视", "碰撞锁存", "安装方式：免走线", "广角", "清晰度：四K"],
        "规格偏好": {"存储卡": "三十二G"},
        "购买动机": "囤货",
        "风格倾向": "颜值优先",
    },
    "行为特征": {"常逛类目": ["汽车用品", "家居"]},
}


def results_page(asins: list[str], *, page: int = 1, pages: int = 1, query: str = "蓝牙耳机") -> tuple[str, list[str]]:
    lines = [
        "页面：搜索结果",
        f"搜索词：{query}",
        f"结果：第 {page}/{pages} 页，共 {len(asins)} 项，当前显示排名 1-{len(asins)}",
        "",
        "商品列表：",
    ]
    for rank, asin in enumerate(asins, 1):
        item = CATALOG[asin]
        lines += [
            f"{rank}. {item['title']}",
            f"   ASIN：{asin}",
            f"   价格：{item['price']}",
            f"   品牌：{item['brand']}",
            f"   类别：{item['category']}",
            f"   关键属性：{'；'.join(item['attrs'])}",
        ]
    if not asins:
        lines.append("（本页没有商品）")
    lines += ["", "上次交互结果：", "- 结果：成功", "- 说明：搜索已执行", "", "可点击元素：", "- back to search"]
    actions = ["back to search"] + (["< prev"] if page > 1 else []) + (["next >"] if page < pages else []) + asins
    lines += [f"- {a}" for a in actions[1:]]
    return "\n".join(lines) + "\n", actions


def product_page(asin: str, selected: dict[str, str], *, price: str | None = None) -> tuple[str, list[str]]:
    item = CATALOG[asin]
    options: dict[str, list[str]] = item["options"]
    missing = [axis for axis in options if axis not in selected]
    lines = [
        "页面：商品详情",
        "商品：",
        f"- 标题：{item['title']}",
        f"- ASIN：{asin}",
        f"- 价格：{price or item['price']}",
        f"- 品牌：{item['brand']}",
        f"- 类别：{item['category']}",
        f"- 关键属性：{'；'.join(item['attrs'])}",
        "",
        "规格选择：",
    ]
    for axis, values in options.items():
        state = f"已选择 {selected[axis]}" if axis in selected else "尚未选择"
        lines += [f"- {axis}：{state}", f"  可选值：{' / '.join(values)}"]
    if not options:
        lines.append("- 此商品没有规格选项")
    lines.append(f"仍需选择：{'、'.join(missing)}" if missing else "规格状态：已选择全部规格，可以购买")
    lines += ["", "上次交互结果：", "- 结果：成功", "- 说明：点击已执行", ""]
    actions = ["back to search", "< prev"] + ([] if missing else ["buy now"])
    actions += [f"{axis}={v}" for axis, values in options.items() for v in values if selected.get(axis) != v]
    lines += ["可点击元素："] + [f"- {a}" for a in actions]
    return "\n".join(lines) + "\n", actions


def tools_for(search: bool, actions: list[str]) -> list[dict[str, Any]]:
    """The dynamic tools the runtime offers for a page."""
    tools: list[dict[str, Any]] = []
    if search:
        params = {
            "type": "object",
            "properties": {"query": {"type": "string", "minLength": 1}},
            "required": ["query"],
            "additionalProperties": False,
        }
        tools.append({"type": "function", "function": {"name": "search", "description": "搜索商品", "parameters": params}})
    if actions:
        params = {
            "type": "object",
            "properties": {"value": {"type": "string", "enum": list(actions)}},
            "required": ["value"],
            "additionalProperties": False,
        }
        tools.append({"type": "function", "function": {"name": "click", "description": "点击", "parameters": params}})
    return tools


class Conversation:
    """Builds the messages exactly as the runtime does: system, task+page, then call/observation pairs."""

    def __init__(self, instruction: str = INSTRUCTION, observation: str = HOME, profile: dict[str, Any] | None = None) -> None:
        document = json.dumps(profile if profile is not None else {"用户ID": "u1"}, ensure_ascii=False)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"你在一个在线购物模拟环境中。\n\n用户个人文档：\n{document}"},
            {"role": "user", "content": f"购物任务：\n{instruction}\n\n{observation}"},
        ]
        self.calls = 0

    def step(self, tool: str, argument: str, observation: str) -> None:
        self.calls += 1
        key = "query" if tool == "search" else "value"
        call = {
            "id": f"call-{self.calls}",
            "type": "function",
            "function": {"name": tool, "arguments": json.dumps({key: argument}, ensure_ascii=False)},
        }
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        self.messages.append({"role": "tool", "tool_call_id": f"call-{self.calls}", "content": observation})


# --------------------------------------------------------------------------- pure policy


def test_search_home_searches_with_kind_and_distinctive_terms() -> None:
    conv = Conversation()
    decision = decide(conv.messages, tools_for(True, []))
    assert decision is not None and decision.tool == "search"
    query = decision.arguments["query"]
    assert query.startswith("蓝牙耳机") and "黑色" in query and "主动降噪" in query
    assert "300" not in query and "元" not in query  # the budget is enforced separately, not searched


def test_results_page_opens_the_matching_in_budget_product() -> None:
    conv = Conversation()
    text, actions = results_page(["100000000001", "100000000002", "100000000003"])
    conv.step("search", "蓝牙耳机 黑色", text)
    decision = decide(conv.messages, tools_for(False, actions))
    # 0001 is not a Bluetooth/ANC headset; 0002 matches but costs 599 > 300.
    assert decision.arguments == {"value": "100000000003"}


def test_results_page_skips_visited_then_pages_then_requeries_with_fewer_words() -> None:
    conv = Conversation()
    text, actions = results_page(["100000000003"], pages=2)
    conv.step("search", "蓝牙耳机 黑色 主动降噪", text)
    conv.step("click", "100000000003", product_page("100000000003", {})[0])
    conv.step("click", "< prev", text)
    assert decide(conv.messages, tools_for(False, actions)).arguments == {"value": "next >"}  # type: ignore[union-attr]
    text2, actions2 = results_page(["100000000001"], page=2, pages=2)
    conv.step("click", "next >", text2)
    assert decide(conv.messages, tools_for(False, actions2)).arguments == {"value": "back to search"}  # type: ignore[union-attr]
    conv.step("click", "back to search", HOME)
    second = decide(conv.messages, tools_for(True, []))
    assert second is not None and second.tool == "search"
    assert second.arguments["query"] != "蓝牙耳机 黑色 主动降噪"
    assert len(second.arguments["query"]) < len("蓝牙耳机 黑色 主动降噪") and "蓝牙耳机" in second.arguments["query"]


def test_product_page_selects_named_options_then_missing_axes_then_buys() -> None:
    conv = Conversation()
    text, _ = results_page(["100000000003"])
    conv.step("search", "蓝牙耳机 黑色", text)
    chosen: dict[str, str] = {}
    page, actions = product_page("100000000003", chosen)
    conv.step("click", "100000000003", page)
    clicks = []
    for _ in range(5):
        decision = decide(conv.messages, tools_for(False, actions))
        assert decision is not None and decision.arguments["value"] in actions
        clicks.append(decision.arguments["value"])
        if decision.arguments["value"] == "buy now":
            break
        axis, _, value = decision.arguments["value"].partition("=")
        chosen[axis] = value
        page, actions = product_page("100000000003", chosen, price="219.0" if len(chosen) == 2 else None)
        conv.step("click", decision.arguments["value"], page)
    assert clicks == ["颜色分类=黑色", "尺码=m", "buy now"]


def test_product_page_over_budget_goes_back_to_the_results() -> None:
    conv = Conversation()
    text, _ = results_page(["100000000002"])
    conv.step("search", "蓝牙耳机", text)
    page, actions = product_page("100000000002", {"颜色分类": "黑色"})
    conv.step("click", "100000000002", page)
    decision = decide(conv.messages, tools_for(False, actions))
    assert decision is not None and decision.arguments == {"value": "< prev"}
    assert "预算" in decision.reasoning


def test_unnamed_axis_takes_its_first_value_and_a_product_without_options_is_bought() -> None:
    conv = Conversation("帮我找一副入耳式耳机")
    page, actions = product_page("100000000003", {})
    conv.step("click", "100000000003", page)
    assert decide(conv.messages, tools_for(False, actions)).arguments == {"value": "颜色分类=白色"}  # type: ignore[union-attr]
    page, actions = product_page("100000000001", {})
    conv.step("click", "100000000001", page)
    assert decide(conv.messages, tools_for(False, actions)).arguments == {"value": "buy now"}  # type: ignore[union-attr]


def test_protocol_error_feedback_keeps_deciding_on_the_last_page() -> None:
    conv = Conversation()
    text, actions = results_page(["100000000001", "100000000003"])
    conv.step("search", "蓝牙耳机", text)
    conv.messages.append({"role": "assistant", "content": "我想想"})
    feedback = {
        "type": "tool_protocol_error",
        "code": "tool_call_count",
        "message": "需要一个工具调用",
        "instruction": "未执行任何环境动作，请在同一页面重新调用。",
        "available_tools": ["click"],
    }
    conv.messages.append({"role": "user", "content": json.dumps(feedback, ensure_ascii=False)})
    decision = decide(conv.messages, tools_for(False, actions))
    assert decision is not None and decision.arguments == {"value": "100000000003"}


def test_never_leaves_the_offered_enum_or_searches_when_not_offered() -> None:
    rng = random.Random(7)
    pages = [
        results_page(["100000000001", "100000000002", "100000000003"], page=2, pages=3),
        product_page("100000000003", {"颜色分类": "黑色"}),
        product_page("100000000002", {}),
        (HOME, []),
    ]
    pool = ["back to search", "< prev", "next >", "buy now", "100000000002", "999999999999", "颜色分类=白色", "尺码=l"]
    for trial in range(60):
        text, actions = pages[trial % len(pages)]
        # The enum offered need not match the page text (a stale or unusual page): the enum wins.
        enum = actions if (trial % 2 and actions) else rng.sample(pool, rng.randint(1, len(pool)))
        conv = Conversation(observation=text)
        decision = decide(conv.messages, tools_for(False, enum), seed=trial, temperature=trial % 3 * 0.7)
        assert decision is not None and decision.tool == "click", trial
        assert decision.arguments["value"] in enum, (trial, enum, decision)
    assert decide(Conversation().messages, []) is None


def test_decisions_are_deterministic_per_conversation_and_seed() -> None:
    conv = Conversation()
    text, actions = results_page(["100000000001", "100000000002", "100000000003"])
    conv.step("search", "蓝牙耳机", text)
    tools = tools_for(False, actions)
    assert decide(conv.messages, tools) == decide(conv.messages, tools)
    assert decide(conv.messages, tools, seed=3, temperature=1.0) == decide(conv.messages, tools, seed=3, temperature=1.0)


def test_observation_parser_reads_listing_and_option_blocks() -> None:
    text, _ = results_page(["100000000002", "100000000003"])
    obs = parse_observation(text)
    assert obs.page == "搜索结果"
    assert [(p.rank, p.asin, p.price) for p in obs.products] == [
        (1, "100000000002", "599.0"),
        (2, "100000000003", "199.0 to 259.0"),
    ]
    assert obs.products[1].attributes == "主动降噪；蓝牙"
    page, _ = product_page("100000000003", {"颜色分类": "黑色"})
    obs = parse_observation(page)
    assert obs.product is not None and obs.product.asin == "100000000003"
    assert obs.axes == {"颜色分类": ("黑色", ["白色", "黑色"]), "尺码": (None, ["s", "m", "l"])}


@pytest.mark.parametrize(
    ("text", "upper"),
    [
        ("预算在1000元以下", 1000),
        ("价格在70元左右", 77),
        ("价格在130-140元之间", 140),
        ("预算1万2以内", 12000),
        ("预算不超过一千八", 1800),
        ("预算就二十来块钱", 22),
        ("五元以内", 5),
        ("预算4k+", None),
        ("价格要超过20元", None),
        ("买一双42码的鞋", None),
        ("价格实惠的一款包", None),
    ],
)
def test_budget_parser(text: str, upper: float | None) -> None:
    assert parse_budget(text) == upper


def test_keywords_drop_fillers_and_price_phrases() -> None:
    assert extract_keywords("找一盏价格在200元以内的台灯") == ("台灯", [])
    kind, terms = extract_keywords("我需要一双男士运动鞋，尺码42，白色")
    assert kind == "男士运动鞋" and terms == ["白色", "尺码42"]


# --------------------------------------------------------------------------- persona profile and reward-like matching


def test_preferences_come_from_the_profile_json_in_the_system_message() -> None:
    system = "购物助手规则……\n\n用户个人文档：\n" + json.dumps(
        {**DASHCAM_PROFILE, "偏好": {**DASHCAM_PROFILE["偏好"], "预算": "三百左右"}}, ensure_ascii=False
    )
    prefs = parse_preferences(system)
    assert prefs.attributes == ("高清夜视", "碰撞锁存", "安装方式：免走线", "广角", "清晰度：四K")
    assert prefs.options == (("存储卡", "三十二G"),) and prefs.budget == 330
    # Traits that are no product property (motive, style, habits outside 偏好) are not wanted terms.
    assert "囤货" not in prefs.attributes and "汽车用品" not in prefs.attributes
    assert parse_preferences("用户个人文档：\n{not json").attributes == ()
    assert parse_preferences("用户个人文档：[1, 2]") == parse_preferences("没有文档")


def test_fuzzy_ratio_is_the_rewards_token_set_similarity() -> None:
    assert fuzzy_ratio("三十二G", "三十二g") == 100  # casefolded
    assert fuzzy_ratio("衣长：长款", "衣长：中长款") == 57  # a different value is no match (needs > 85)
    assert fuzzy_ratio("安装方式：免走线", "安装方式：后视镜式") == 67
    assert fuzzy_ratio("pbt 键帽", "键帽 PBT") == 100  # token order does not matter


def test_persona_search_adds_the_profile_attributes_and_options() -> None:
    decision = decide(Conversation(DASHCAM_TASK, profile=DASHCAM_PROFILE).messages, tools_for(True, []))
    assert decision is not None and decision.tool == "search"
    query = decision.arguments["query"]
    assert query.startswith("行车记录仪 ") and "忙" not in query  # 帮忙挑一台 is not part of the kind
    for term in ("高清夜视", "碰撞锁存", "免走线", "广角", "四K", "三十二G"):
        assert term in query
    assert "安装方式" not in query and "900" not in query  # keys are shared by the category; budget is not searched


def test_persona_results_page_opens_the_listing_showing_every_wanted_attribute() -> None:
    conv = Conversation(DASHCAM_TASK, profile=DASHCAM_PROFILE)
    text, actions = results_page(DASHCAMS, query="行车记录仪")
    conv.step("search", "行车记录仪", text)
    decision = decide(conv.messages, tools_for(False, actions))
    # 0201 ranks first but lacks three attributes; 0204 has them all but starts above the budget.
    assert decision is not None and decision.arguments == {"value": "200000000203"}


def test_persona_product_page_rejects_missing_attributes_or_option_values() -> None:
    conv = Conversation(DASHCAM_TASK, profile=DASHCAM_PROFILE)
    text, _ = results_page(DASHCAMS, query="行车记录仪")
    conv.step("search", "行车记录仪", text)
    page, actions = product_page("200000000201", {})
    conv.step("click", "200000000201", page)
    lacks_attributes = decide(conv.messages, tools_for(False, actions))
    assert lacks_attributes is not None and lacks_attributes.arguments == {"value": "< prev"}
    assert "碰撞锁存" in lacks_attributes.reasoning
    conv.step("click", "< prev", text)
    page, actions = product_page("200000000205", {})
    conv.step("click", "200000000205", page)
    lacks_card = decide(conv.messages, tools_for(False, actions))
    assert lacks_card is not None and lacks_card.arguments == {"value": "< prev"} and "三十二G" in lacks_card.reasoning
    conv.step("click", "< prev", text)
    # Back on the results, the next unvisited listing with every attribute within budget is opened.
    assert decide(conv.messages, tools_for(False, results_page(DASHCAMS)[1])).arguments == {"value": "200000000203"}  # type: ignore[union-attr]


def test_persona_option_is_chosen_by_value_similarity_whatever_the_axis_name() -> None:
    profile = {**DASHCAM_PROFILE, "偏好": {**DASHCAM_PROFILE["偏好"], "规格偏好": {"内存卡容量": "三十二G"}}}
    conv = Conversation(DASHCAM_TASK, profile=profile)
    page, actions = product_page("200000000203", {"存储卡": "无卡"})
    conv.step("click", "200000000203", page)
    decision = decide(conv.messages, tools_for(False, actions))
    assert decision is not None and decision.arguments == {"value": "存储卡=三十二g"}  # replaces a wrong preselection
    page, actions = product_page("200000000203", {"存储卡": "三十二g"}, price="759.0")
    conv.step("click", "存储卡=三十二g", page)
    assert decide(conv.messages, tools_for(False, actions)).arguments == {"value": "buy now"}  # type: ignore[union-attr]


def test_late_in_the_episode_the_policy_buys_instead_of_going_back() -> None:
    conv = Conversation(DASHCAM_TASK, profile=DASHCAM_PROFILE)
    text, _ = results_page(DASHCAMS, query="行车记录仪")
    for _ in range(10):  # twenty turns of wandering between the listing and the results
        conv.step("search", "行车记录仪", text)
        conv.step("click", "next >", text)
    page, actions = product_page("200000000201", {"存储卡": "三十二g"})
    conv.step("click", "200000000201", page)
    decision = decide(conv.messages, tools_for(False, actions))
    assert decision is not None and decision.arguments == {"value": "buy now"}  # partial beats no purchase


def test_instruction_key_value_terms_filter_listings_and_options_without_a_profile() -> None:
    conv = Conversation("打算买一双儿童运动鞋，适用年龄要中大童、尺码选33")
    text, actions = results_page(["300000000301", "300000000302"], query="儿童运动鞋")
    conv.step("search", "儿童运动鞋", text)
    # 0301 lists 适用年龄：幼童, which contradicts 适用年龄要中大童 although it ranks first.
    assert decide(conv.messages, tools_for(False, actions)).arguments == {"value": "300000000302"}  # type: ignore[union-attr]
    page, actions = product_page("300000000302", {})
    conv.step("click", "300000000302", page)
    decision = decide(conv.messages, tools_for(False, actions))
    assert decision is not None and decision.arguments == {"value": "< prev"} and "33" in decision.reasoning


# --------------------------------------------------------------------------- over HTTP


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    settings = getattr(request, "param", None) or PolicySettings(model_id="shopsim-heuristic")
    with running_server(create_app(settings)) as base, httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
        yield client


def body_for(conv: Conversation, tools: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "model": "shopsim-heuristic",
        "messages": conv.messages,
        "tools": tools,
        "tool_choice": "auto",
        "temperature": 0.0,
        "max_tokens": 512,
        "seed": 11,
        **extra,
    }


def settings(**knobs: Any) -> PolicySettings:
    return PolicySettings(**knobs)


def test_chat_completion_has_the_vllm_shape(served: httpx.Client) -> None:
    response = served.post("/v1/chat/completions", json=body_for(Conversation(), tools_for(True, [])))
    assert response.status_code == 200
    data = response.json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert data["model"] == "shopsim-heuristic" and isinstance(data["created"], int)
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None and "reasoning_content" not in message
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"])["query"].startswith("蓝牙耳机")
    usage = data["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_models_health_and_request_errors(served: httpx.Client) -> None:
    models = served.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [
        "shopsim-heuristic",
        "shopsim-judge",
        "shopsim-analyst",
    ]
    assert served.get("/health").status_code == 200
    wrong = served.post("/v1/chat/completions", json={**body_for(Conversation(), []), "model": "gpt-x"})
    assert wrong.status_code == 404 and "gpt-x" in wrong.json()["error"]["message"]
    unnamed = {k: v for k, v in body_for(Conversation(), tools_for(True, [])).items() if k != "model"}
    assert served.post("/v1/chat/completions", json=unnamed).json()["model"] == "shopsim-heuristic"
    bad = served.post("/v1/chat/completions", json={"model": "shopsim-heuristic", "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    garbled = served.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert garbled.status_code == 400 and "JSON" in garbled.json()["error"]["message"]


@pytest.mark.parametrize("served", [settings(reasoning=True)], indirect=True)
def test_stream_assembles_to_the_same_tool_call_with_usage_and_done(served: httpx.Client) -> None:
    conv = Conversation()
    text, actions = results_page(["100000000001", "100000000003"])
    conv.step("search", "蓝牙耳机", text)
    body = body_for(conv, tools_for(False, actions))
    plain = served.post("/v1/chat/completions", json=body).json()
    events: list[str] = []
    with served.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    reasoning, name, arguments, call_id, finish = "", "", "", None, None
    for chunk in chunks[:-1]:
        delta = chunk["choices"][0]["delta"]
        reasoning += delta.get("reasoning_content") or ""
        for fragment in delta.get("tool_calls") or []:
            assert fragment["index"] == 0
            call_id = fragment.get("id") or call_id
            name += fragment.get("function", {}).get("name") or ""
            arguments += fragment.get("function", {}).get("arguments") or ""
        finish = chunk["choices"][0]["finish_reason"] or finish
    assert sum(1 for c in chunks[:-1] if c["choices"][0]["delta"].get("tool_calls")) > 2  # really fragmented
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
    expected = plain["choices"][0]["message"]
    assert finish == "tool_calls" and call_id
    assert (name, json.loads(arguments)) == ("click", {"value": "100000000003"})
    assert json.loads(expected["tool_calls"][0]["function"]["arguments"]) == {"value": "100000000003"}
    assert reasoning == expected["reasoning_content"] and reasoning


@pytest.mark.parametrize("served", [settings(rate_429=1.0, retry_after_s=3)], indirect=True)
def test_fault_429_carries_retry_after(served: httpx.Client) -> None:
    response = served.post("/v1/chat/completions", json=body_for(Conversation(), tools_for(True, [])))
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert response.json()["error"]["code"] == 429


@pytest.mark.parametrize("served", [settings(rate_500=1.0)], indirect=True)
def test_fault_500(served: httpx.Client) -> None:
    response = served.post("/v1/chat/completions", json=body_for(Conversation(), tools_for(True, [])))
    assert response.status_code == 500 and response.json()["error"]["type"] == "InternalServerError"


@pytest.mark.parametrize("served", [settings(rate_non_json=1.0)], indirect=True)
def test_fault_non_json_body_and_stream_chunk(served: httpx.Client) -> None:
    body = body_for(Conversation(), tools_for(True, []))
    response = served.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(response.text)
    streamed = served.post("/v1/chat/completions", json={**body, "stream": True})
    data = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    with pytest.raises(json.JSONDecodeError):
        for item in data[:-1]:
            json.loads(item)


@pytest.mark.parametrize("served", [settings(rate_no_tool_call=1.0)], indirect=True)
def test_fault_no_tool_call_answers_text_only(served: httpx.Client) -> None:
    data = served.post("/v1/chat/completions", json=body_for(Conversation(), tools_for(True, []))).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop" and not choice["message"]["tool_calls"]
    assert choice["message"]["content"].strip()


@pytest.mark.parametrize("served", [settings(rate_length=1.0)], indirect=True)
def test_fault_length_truncates_the_arguments(served: httpx.Client) -> None:
    data = served.post("/v1/chat/completions", json=body_for(Conversation(), tools_for(True, []))).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length"
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


def test_a_small_max_tokens_really_truncates(served: httpx.Client) -> None:
    data = served.post("/v1/chat/completions", json=body_for(Conversation(), tools_for(True, []), max_tokens=4)).json()
    assert data["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
@pytest.mark.parametrize("served", [settings(rate_timeout=1.0, timeout_sleep_s=1.0)], indirect=True)
def test_fault_timeout_outlasts_a_short_client_timeout(served: httpx.Client) -> None:
    with pytest.raises(httpx.ReadTimeout):
        served.post("/v1/chat/completions", json=body_for(Conversation(), tools_for(True, [])), timeout=0.1)


@pytest.mark.slow
def test_fault_draws_are_seeded_per_request_body_and_retries_draw_again() -> None:
    knobs = settings(rate_500=0.5, fault_seed=5)
    bodies = [
        body_for(Conversation(f"我想买一款{kind}"), tools_for(True, []))
        for kind in ("台灯", "水杯", "键盘", "鼠标", "耳机", "背包")
    ]

    def statuses() -> list[int]:
        with running_server(create_app(knobs)) as base, httpx.Client(base_url=base, trust_env=False) as client:
            return [client.post("/v1/chat/completions", json=b).status_code for b in bodies]

    first = statuses()
    assert first == statuses() and set(first) <= {200, 500}
    with running_server(create_app(knobs)) as base, httpx.Client(base_url=base, trust_env=False) as client:
        retries = [client.post("/v1/chat/completions", json=bodies[0]).status_code for _ in range(12)]
    assert 200 in retries and 500 in retries  # each retry of the same body is a fresh draw


def test_settings_reject_bad_rates_and_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="rate_500"):
        PolicySettings(rate_500=1.5)
    monkeypatch.setenv("SHOPSIM_POLICY_MODEL_ID", "heuristic-x")
    monkeypatch.setenv("SHOPSIM_POLICY_RATE_LENGTH", "0.25")
    loaded = PolicySettings()
    assert loaded.model_id == "heuristic-x" and loaded.rate_length == 0.25


def play(
    served: httpx.Client,
    conv: Conversation,
    listing_asins: list[str],
    prices: dict[tuple[str, str], str] | None = None,
) -> tuple[str | None, dict[str, str], int]:
    """Play the tiny shop against the served policy until it buys: (asin, options, steps)."""
    page, actions, search, chosen, current = HOME, [], True, {}, None
    listing: tuple[str, list[str]] = (HOME, [])
    for step in range(30):
        body = body_for(conv, tools_for(search, actions), seed=100 + step)
        call = served.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"][0]
        name, argument = call["function"]["name"], next(iter(json.loads(call["function"]["arguments"]).values()))
        assert name == "search" or argument in actions, (name, argument, actions)
        if name == "search":
            page, actions = results_page(listing_asins, query=argument)
            search, listing = False, (page, actions)
        elif argument == "buy now":
            return current, dict(chosen), step + 1
        elif argument in CATALOG:
            current, chosen = argument, {}
            page, actions = product_page(current, chosen)
        elif argument == "< prev":
            page, actions = listing
        elif argument == "back to search":
            page, actions, search = HOME, [], True
        else:
            axis, _, value = argument.partition("=")
            chosen[axis] = value
            price = (prices or {}).get((current or "", value))
            if price is None and current == "100000000003" and len(chosen) == 2:
                price = "219.0"
            page, actions = product_page(current or "", chosen, price=price)
        conv.step(name, argument, page)
    return None, chosen, 30


def test_a_whole_episode_over_http_buys_the_matching_option(served: httpx.Client) -> None:
    bought = play(served, Conversation(), ["100000000001", "100000000002", "100000000003"])
    assert bought[:2] == ("100000000003", {"颜色分类": "黑色", "尺码": "m"})


def test_a_persona_episode_over_http_uses_the_profile(served: httpx.Client) -> None:
    """The short task names one attribute; the profile names the rest and the memory card."""
    prices = {("200000000203", "三十二g"): "759.0", ("200000000204", "三十二g"): "979.0"}
    asin, options, steps = play(served, Conversation(DASHCAM_TASK, profile=DASHCAM_PROFILE), DASHCAMS, prices)
    # 0201/0202 lack wanted attributes; 0204 has everything but starts at 979, over the 900 budget.
    assert (asin, options) == ("200000000203", {"存储卡": "三十二g"})
    assert steps <= 5  # search, open, select, buy: no detour needed when the listing shows everything


@pytest.mark.parametrize("served", [PolicySettings(strategy="naive")], indirect=True)
def test_the_naive_strategy_buys_the_first_result_with_the_first_option_values(served: httpx.Client) -> None:
    """The same shop and task as the heuristic's episode above: the matching product is listed
    second, and the task names black and size m; the naive strategy takes neither."""
    bought = play(served, Conversation(), ["100000000002", "100000000003", "100000000001"])
    assert bought == ("100000000002", {"颜色分类": "黑色"}, 4)  # search, open, the only axis's first value, buy
    bought = play(served, Conversation(), ["100000000003", "100000000001"])
    assert bought[:2] == ("100000000003", {"颜色分类": "白色", "尺码": "s"})


def test_the_strategy_knob_reads_the_environment_and_names_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert PolicySettings().strategy == "heuristic"
    monkeypatch.setenv("SHOPSIM_POLICY_STRATEGY", "naive")
    assert PolicySettings().strategy == "naive"
    monkeypatch.setenv("SHOPSIM_POLICY_STRATEGY", "random")
    with pytest.raises(ValidationError, match="strategy"):
        PolicySettings()
