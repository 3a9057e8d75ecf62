"""The heuristic policy's skill markers: skill chunks in the system prompt with known effects."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from shopsimrl.prompts import PromptBuilder, render_skills
from shopsimrl.schemas import Skill
from shopsimrl.testbed.heuristics import decide
from shopsimrl.testbed.heuristics_skills import BUY_FIRST, CHOOSE_OPTIONS, SkillMarkers, skill_markers
from shopsimrl.testbed.policy import PolicySettings, create_app
from shopsimrl.testbed.serving import running_server
from tests.testbed.test_policy import Conversation, play, product_page, results_page, tools_for

OPTIONS_SKILL = Skill("options", f"选规格时逐项对照用户要求。{CHOOSE_OPTIONS}")
BUY_FIRST_SKILL = Skill("buy-first", f"直接买第一个搜索结果。{BUY_FIRST}")
NOOP_SKILL = Skill("noop", "回答保持简洁，每轮只调用一个工具。")


def with_skills(conv: Conversation, *skills: Skill) -> Conversation:
    """The conversation with the skill block appended to its system message, as the runtime renders it."""
    if skills:
        conv.messages[0]["content"] += "\n\n" + render_skills(list(skills))
    return conv


def test_markers_count_only_inside_rendered_skill_blocks() -> None:
    reset = {"user_persona": {"备注": f"{BUY_FIRST} {CHOOSE_OPTIONS}"}}
    builder = PromptBuilder(f"基础提示 {BUY_FIRST}")
    bare = builder.system_message(reset, [])["content"]
    assert BUY_FIRST in bare  # in the base prompt and the profile, outside any skill block
    assert skill_markers(bare) == SkillMarkers(choose_options=True, buy_first=False)
    assert skill_markers(bare, options_need_skill=True) == SkillMarkers(choose_options=False, buy_first=False)

    skills = [Skill('odd "id"', f"x {CHOOSE_OPTIONS}", version="v 1"), BUY_FIRST_SKILL]
    equipped = builder.system_message(reset, skills)["content"]
    assert skill_markers(equipped, options_need_skill=True) == SkillMarkers(choose_options=True, buy_first=True)
    assert skill_markers(builder.system_message(reset, [NOOP_SKILL])["content"], options_need_skill=True) == SkillMarkers(
        choose_options=False, buy_first=False
    )


def choose_on_product(conv: Conversation, **knobs: bool) -> list[str]:
    """Clicks on product 0003 (two axes) until the policy buys."""
    text, _ = results_page(["100000000003"])
    conv.step("search", "蓝牙耳机 黑色", text)
    chosen: dict[str, str] = {}
    page, actions = product_page("100000000003", chosen)
    conv.step("click", "100000000003", page)
    clicks: list[str] = []
    for _ in range(5):
        decision = decide(conv.messages, tools_for(False, actions), **knobs)
        assert decision is not None and decision.arguments["value"] in actions
        clicks.append(decision.arguments["value"])
        if clicks[-1] == "buy now":
            break
        axis, _, value = clicks[-1].partition("=")
        chosen[axis] = value
        page, actions = product_page("100000000003", chosen, price="219.0" if len(chosen) == 2 else None)
        conv.step("click", clicks[-1], page)
    return clicks


def test_options_need_skill_takes_first_values_unless_a_skill_carries_the_marker() -> None:
    wanted = ["颜色分类=黑色", "尺码=m", "buy now"]
    assert choose_on_product(Conversation()) == wanted  # the default policy: unchanged
    assert choose_on_product(Conversation(), options_need_skill=True) == ["颜色分类=白色", "尺码=s", "buy now"]
    assert choose_on_product(with_skills(Conversation(), NOOP_SKILL), options_need_skill=True)[:2] == ["颜色分类=白色", "尺码=s"]
    assert choose_on_product(with_skills(Conversation(), NOOP_SKILL, OPTIONS_SKILL), options_need_skill=True) == wanted


def test_buy_first_searches_the_kind_opens_the_first_result_and_buys_over_budget() -> None:
    conv = with_skills(Conversation(), BUY_FIRST_SKILL)
    search = decide(conv.messages, tools_for(True, []))
    assert search is not None and search.arguments == {"query": "蓝牙耳机"}  # the kind alone, no terms
    text, actions = results_page(["100000000002", "100000000003"])
    conv.step("search", "蓝牙耳机", text)
    opened = decide(conv.messages, tools_for(False, actions))
    assert opened is not None and opened.arguments == {"value": "100000000002"}  # first, though over budget
    page, actions = product_page("100000000002", {"颜色分类": "黑色"})
    conv.step("click", "100000000002", page)
    bought = decide(conv.messages, tools_for(False, actions))
    # Without the skill the policy goes back: 599 is over the 300 budget (test_policy).
    assert bought is not None and bought.arguments == {"value": "buy now"}


@pytest.fixture
def gated() -> Iterator[httpx.Client]:
    settings = PolicySettings(model_id="shopsim-heuristic", options_need_skill=True)
    with running_server(create_app(settings)) as base, httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
        yield client


def test_served_policy_with_options_need_skill(gated: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    listing = ["100000000001", "100000000002", "100000000003"]
    bare = play(gated, Conversation(), listing)
    noop = play(gated, with_skills(Conversation(), NOOP_SKILL), listing)
    skilled = play(gated, with_skills(Conversation(), OPTIONS_SKILL), listing)
    assert bare[:2] == ("100000000003", {"颜色分类": "白色", "尺码": "s"})
    assert noop == bare  # a chunk without a marker changes nothing, step for step
    assert skilled[:2] == ("100000000003", {"颜色分类": "黑色", "尺码": "m"})
    monkeypatch.setenv("SHOPSIM_POLICY_OPTIONS_NEED_SKILL", "1")
    assert PolicySettings().options_need_skill is True
