"""Prompt assembly, the per-page tools, repair feedback and canonical actions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from shopsimrl.prompts import (
    DEFAULT_SYSTEM_PROMPT,
    PROMPT_VERSION,
    SKILL_RENDERER_VERSION,
    TOOL_VERSION,
    InvalidToolArguments,
    NoActionToolsError,
    ObservationStateError,
    PromptBuilder,
    PromptConfigError,
    PromptError,
    action_tools,
    canonical_action,
    protocol_feedback,
    render_skills,
)
from shopsimrl.schemas import Skill

REPO = Path(__file__).resolve().parents[1]

HOME = {
    "observation_version": "shopping-observation-v7",
    "page_type": "search_home",
    "search_available": True,
    "actions": [],
}
PRODUCT = {
    "observation_version": "shopping-observation-v7",
    "page_type": "product_detail",
    "search_available": False,
    "actions": ["back to search", "< prev", "buy now", "颜色分类=白色"],
}
RESET = {
    "task_instruction": "给妈妈买一条 200 元以内的羊毛围巾",
    "observation": "页面：搜索首页\n\n页面能力：\n- 支持商品搜索\n",
    "user_persona": {"用户ID": "u-1", "偏好": ["保暖", "素色"]},
}


def _names(tools: list[dict]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


# --------------------------------------------------------------------------- tools


def test_home_page_offers_only_search() -> None:
    tools = action_tools(HOME)
    assert _names(tools) == ["search"]
    search = tools[0]
    assert search["type"] == "function" and search["function"]["description"].strip()
    parameters = search["function"]["parameters"]
    query = parameters["properties"]["query"]
    assert (query["type"], query["minLength"]) == ("string", 1) and query["description"].strip()
    assert list(parameters["properties"]) == ["query"]
    assert parameters["required"] == ["query"] and parameters["additionalProperties"] is False


def test_product_page_offers_click_with_the_actions_as_enum() -> None:
    tools = action_tools(PRODUCT)
    assert _names(tools) == ["click"]  # no search box on a product page
    parameters = tools[0]["function"]["parameters"]
    assert parameters["properties"]["value"]["enum"] == PRODUCT["actions"]
    assert parameters["required"] == ["value"] and parameters["additionalProperties"] is False


def test_search_and_click_together_in_that_order() -> None:
    tools = action_tools({**HOME, "actions": ["buy now"]})
    assert _names(tools) == ["search", "click"]
    assert tools[1]["function"]["parameters"]["properties"]["value"]["enum"] == ["buy now"]


def test_page_without_tools_names_the_page() -> None:
    state = {**PRODUCT, "page_type": "search_results", "actions": []}
    with pytest.raises(NoActionToolsError, match="'search_results'"):
        action_tools(state)
    with pytest.raises(NoActionToolsError, match="'terminal'"):
        action_tools({"page_type": "terminal", "search_available": False, "actions": []})


@pytest.mark.parametrize(
    "state",
    [
        {**PRODUCT, "actions": "buy now"},
        {**PRODUCT, "actions": ["buy now", ""]},
        {**PRODUCT, "actions": ["buy now", 3]},
        {**PRODUCT, "search_available": "yes"},
    ],
)
def test_malformed_state_is_an_error(state: dict) -> None:
    with pytest.raises(ObservationStateError, match="product_detail"):
        action_tools(state)


# --------------------------------------------------------------------------- canonical actions


def test_canonical_actions() -> None:
    assert canonical_action("search", {"query": "  羊毛 围巾 "}) == "search[羊毛 围巾]"
    assert canonical_action("click", {"value": "buy now "}) == "click[buy now]"
    # A value outside the page's enum still maps to an action; the environment judges it.
    assert canonical_action("click", {"value": "92"}) == "click[92]"


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("search", {"wrong": "x"}, "'query'"),
        ("search", {"query": "x", "page": 2}, "exactly one argument"),
        ("search", {"query": "   "}, "non-blank"),
        ("click", {"value": 3}, "non-blank string"),
        ("click", None, "'value'"),
        ("buy", {"value": "x"}, "unknown tool 'buy'"),
    ],
)
def test_invalid_tool_arguments(name: str, arguments: dict | None, message: str) -> None:
    with pytest.raises(InvalidToolArguments, match=message) as caught:
        canonical_action(name, arguments)
    assert caught.value.code == "invalid_tool_arguments"


def test_protocol_feedback_shape() -> None:
    text = protocol_feedback("tool_call_count", "expected exactly one tool call", ["search", "click"])
    assert "\n" not in text and ", " not in text and ": " not in text  # compact separators
    assert "工具" in text  # Chinese is kept, not \u-escaped
    feedback = json.loads(text)
    assert list(feedback) == ["type", "code", "message", "instruction", "available_tools"]
    assert feedback["type"] == "tool_protocol_error"
    assert feedback["code"] == "tool_call_count"
    assert feedback["available_tools"] == ["search", "click"]
    assert feedback["instruction"].strip()


# --------------------------------------------------------------------------- messages


def test_system_message_with_persona_and_skills() -> None:
    skills = [
        Skill(skill_id="global", content="  先按品类搜索，再比较价格。\n", version="2"),
        Skill(skill_id="task 4", content="围巾要先选颜色。"),
    ]
    message = PromptBuilder().system_message(RESET, skills)
    assert message["role"] == "system"
    persona = "用户个人文档：\n" + json.dumps(RESET["user_persona"], ensure_ascii=False, sort_keys=True)
    assert persona == '用户个人文档：\n{"偏好": ["保暖", "素色"], "用户ID": "u-1"}'
    skill_block = render_skills(skills)
    assert message["content"] == "\n\n".join([DEFAULT_SYSTEM_PROMPT.rstrip(), persona, skill_block])
    lines = skill_block.split("\n")
    assert lines[0] == "[可选策略提示]" and lines[1].strip()
    assert lines[2:] == [
        '<skill id="global" version="2">',
        "先按品类搜索，再比较价格。",
        "</skill>",
        '<skill id="task 4" version="1">',
        "围巾要先选颜色。",
        "</skill>",
    ]


def test_system_message_without_persona_or_skills_is_the_prompt() -> None:
    builder = PromptBuilder("你是购物助手。\n\n")
    assert builder.system_message({"user_persona": {}}, [])["content"] == "你是购物助手。"
    assert builder.system_message({}, [])["content"] == "你是购物助手。"
    assert render_skills([]) == ""


def test_initial_user_message() -> None:
    message = PromptBuilder().initial_user_message(RESET)
    assert message == {"role": "user", "content": f"购物任务：\n{RESET['task_instruction']}\n\n{RESET['observation']}"}
    with pytest.raises(ValueError, match="task_instruction"):
        PromptBuilder().initial_user_message({"observation": "x"})


# --------------------------------------------------------------------------- identity and configuration


def test_prompt_hash_is_the_fingerprint_of_the_json_string() -> None:
    identity = PromptBuilder("abc\n").identity()
    assert identity == {
        "prompt_version": PROMPT_VERSION,
        "system_prompt_sha256": hashlib.sha256(b'"abc\\n"').hexdigest(),
        "skill_renderer_version": SKILL_RENDERER_VERSION,
        "tool_version": TOOL_VERSION,
    }
    assert PROMPT_VERSION == "shopsim-shopping-agent-tools-v2"
    assert SKILL_RENDERER_VERSION == "plain-skill-context-v1"
    assert PromptBuilder("abc").identity()["system_prompt_sha256"] != identity["system_prompt_sha256"]


def test_default_inline_and_file_prompts(tmp_path: Path) -> None:
    default = PromptBuilder.from_config(system_prompt=None, system_prompt_file=None)
    assert (default.source, default.system_prompt) == ("default", DEFAULT_SYSTEM_PROMPT)

    inline = PromptBuilder.from_config(system_prompt="只用工具。", system_prompt_file=None)
    assert (inline.source, inline.system_prompt) == ("inline", "只用工具。")

    path = tmp_path / "prompt.txt"
    path.write_bytes("文件提示词\n".encode())
    from_file = PromptBuilder.from_config(system_prompt=None, system_prompt_file=path)
    assert (from_file.source, from_file.system_prompt) == ("file", "文件提示词\n")  # verbatim, newline kept
    assert from_file.identity() != PromptBuilder("文件提示词").identity()

    with pytest.raises(PromptError, match="mutually exclusive"):
        PromptBuilder.from_config(system_prompt="x", system_prompt_file=path)


def test_bad_prompt_files_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    with pytest.raises(PromptConfigError, match=r"missing\.txt"):
        PromptBuilder.from_config(system_prompt=None, system_prompt_file=missing)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(PromptConfigError, match=r"latin1\.txt.*UTF-8"):
        PromptBuilder.from_config(system_prompt=None, system_prompt_file=latin)
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n")
    with pytest.raises(PromptConfigError, match=r"blank\.txt.*empty"):
        PromptBuilder.from_config(system_prompt=None, system_prompt_file=blank)
    with pytest.raises(PromptConfigError):
        PromptBuilder("   ")
    with pytest.raises(PromptConfigError, match="source"):
        PromptBuilder("x", source="yaml")


def test_shipped_prompt_file_matches_the_default() -> None:
    shipped = (REPO / "configs" / "prompts" / "persona_single_turn.txt").read_text(encoding="utf-8")
    assert shipped.strip() == DEFAULT_SYSTEM_PROMPT.strip()
    assert shipped == DEFAULT_SYSTEM_PROMPT + "\n"
