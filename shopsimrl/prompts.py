"""What the model sees: the system and first user messages, the per-page tools, repair feedback.

Everything here is versioned: ``PromptBuilder.identity()`` names the prompt, renderer and tool
versions and hashes the system prompt, so two runs that show the model different text never
share a plan fingerprint.

The tools follow the page: ``search`` only where the page has a search box
(``observation_state.search_available is True``), ``click`` only where there is something to
click, with the clickable values as its ``enum``. Tool calls become the environment's
canonical action strings, ``search[...]`` and ``click[...]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from shopsimrl.schemas import Skill, fingerprint, read_utf8_file

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "PROMPT_SOURCES",
    "PROMPT_VERSION",
    "SKILL_RENDERER_VERSION",
    "TOOL_VERSION",
    "InvalidToolArguments",
    "NoActionToolsError",
    "ObservationStateError",
    "PromptBuilder",
    "PromptConfigError",
    "PromptError",
    "action_tools",
    "canonical_action",
    "persona_section",
    "protocol_feedback",
    "render_skills",
]

PROMPT_VERSION: Final = "shopsim-shopping-agent-tools-v2"
SKILL_RENDERER_VERSION: Final = "plain-skill-context-v1"
TOOL_VERSION: Final = "shopsimrl-page-tools-v1"
"""Version of the tool names, descriptions and parameter schemas built by :func:`action_tools`."""

PROMPT_SOURCES: Final = ("default", "file", "inline")

DEFAULT_SYSTEM_PROMPT: Final = """\
你是网上购物模拟环境中的购物助手，要替用户完成一次购买。商品库里有大量相似商品，你需要找到并买下最符合购物任务要求和用户个人文档的那一件。

每一轮只调用一个当前提供的函数工具：
- search：只有当工具列表里有它时才能调用，参数写简短的商品关键词；
- click：参数必须从当前页面列出的可点击值中逐字复制，不得编造或改写。

规则：
1. 购买前，商品的每个规格项都必须选定取值。
2. 通过搜索、比较商品、选择规格、购买来完成任务；商品只部分符合要求时不要购买。
3. 每次调用工具后都会返回新的页面，下一次调用要以最新页面为准。
4. 只输出一个标准的工具调用，不要输出 Thought、Action、JSON、XML 或任何说明文字。
5. 分析与比较放在思考阶段完成。"""

_PERSONA_LABEL = "用户个人文档："
_TASK_LABEL = "购物任务："
_SKILL_HEADER = "[可选策略提示]"
_SKILL_CAVEAT = "以下是通用经验，未必适用于本次任务；使用前请对照当前任务和页面核实。"
_REPAIR_INSTRUCTION = "本轮未执行任何环境操作。请针对同一页面重新回答：只调用一个当前提供的工具，不要输出可见文字。"

_SEARCH_TOOL_DESCRIPTION = "按关键词搜索商品。只有在当前工具列表中提供时才能调用。"
_QUERY_DESCRIPTION = "简短的商品检索关键词"
_CLICK_TOOL_DESCRIPTION = "点击当前页面上的一个可用按钮、商品或规格选项。"
_VALUE_DESCRIPTION = "必须逐字等于当前页面的某个可点击值"

_ARGUMENT_OF = {"search": "query", "click": "value"}


class PromptError(ValueError):
    """Base of the errors raised while building prompts and tools."""


class PromptConfigError(PromptError):
    """The configured system prompt (inline text or file) cannot be used."""


class ObservationStateError(PromptError):
    """``observation_state`` does not describe a page the tools can be built from."""


class NoActionToolsError(ObservationStateError):
    """A non-terminal page offers neither search nor anything to click."""


class InvalidToolArguments(PromptError):
    """A tool call whose name or arguments do not map to an environment action."""

    code: Final = "invalid_tool_arguments"


# --------------------------------------------------------------------------- builder


class PromptBuilder:
    """Assembles the opening messages of an episode from the reset payload and selected skills."""

    def __init__(self, system_prompt: str = DEFAULT_SYSTEM_PROMPT, *, source: str = "default") -> None:
        if not isinstance(system_prompt, str) or not system_prompt.strip():
            raise PromptConfigError("system prompt must be a non-empty string")
        if source not in PROMPT_SOURCES:
            raise PromptConfigError(f"prompt source must be one of {list(PROMPT_SOURCES)}, got {source!r}")
        self.system_prompt = system_prompt
        self.source = source

    @classmethod
    def from_config(cls, *, system_prompt: str | None, system_prompt_file: Path | str | None) -> PromptBuilder:
        """Inline text, a UTF-8 file read verbatim, or the default prompt when both are None."""
        if system_prompt is not None and system_prompt_file is not None:
            raise PromptConfigError("system_prompt and system_prompt_file are mutually exclusive; set only one")
        if system_prompt_file is not None:
            path = Path(system_prompt_file)
            text = read_utf8_file(path, "system_prompt_file", PromptConfigError)
            if not text.strip():
                raise PromptConfigError(f"system_prompt_file {path} is empty")
            return cls(text, source="file")
        if system_prompt is not None:
            if not isinstance(system_prompt, str) or not system_prompt.strip():
                raise PromptConfigError("system_prompt must be a non-empty string")
            return cls(system_prompt, source="inline")
        return cls()

    def identity(self) -> dict[str, Any]:
        """``provenance.prompt``. The hash covers the base prompt only (persona and skills vary per task)."""
        return {
            "prompt_version": PROMPT_VERSION,
            "system_prompt_sha256": fingerprint(self.system_prompt),
            "skill_renderer_version": SKILL_RENDERER_VERSION,
            "tool_version": TOOL_VERSION,
        }

    def system_message(self, reset: Mapping[str, Any], skills: Sequence[Skill]) -> dict[str, Any]:
        sections = [self.system_prompt.rstrip()]
        persona = reset.get("user_persona")
        if isinstance(persona, dict) and persona:
            sections.append(persona_section(persona))
        if skills:
            sections.append(render_skills(skills))
        return {"role": "system", "content": "\n\n".join(sections)}

    def initial_user_message(self, reset: Mapping[str, Any]) -> dict[str, Any]:
        instruction, observation = reset.get("task_instruction"), reset.get("observation")
        if not isinstance(instruction, str):
            raise ValueError(f"reset payload needs a string 'task_instruction', got {instruction!r}")
        if not isinstance(observation, str):
            raise ValueError(f"reset payload needs a string 'observation', got {type(observation).__name__}")
        return {"role": "user", "content": f"{_TASK_LABEL}\n{instruction}\n\n{observation}"}


def persona_section(persona: Mapping[str, Any]) -> str:
    """The persona's section of the system message (the exporters find and remove it by this text)."""
    return _PERSONA_LABEL + "\n" + json.dumps(persona, ensure_ascii=False, sort_keys=True)


def render_skills(skills: Sequence[Skill]) -> str:
    """The skill block of the system message; empty when no skill was selected."""
    if not skills:
        return ""
    lines = [_SKILL_HEADER, _SKILL_CAVEAT]
    for skill in skills:
        # JSON-quoting keeps an id or version with spaces or quotes unambiguous inside the tag.
        skill_id = json.dumps(skill.skill_id, ensure_ascii=False)
        version = json.dumps(skill.version, ensure_ascii=False)
        lines += [f"<skill id={skill_id} version={version}>", skill.content.strip(), "</skill>"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- tools


def action_tools(observation_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The OpenAI function tools the current page allows, ``search`` before ``click``."""
    if not isinstance(observation_state, Mapping):
        raise ObservationStateError(f"observation_state must be an object, got {type(observation_state).__name__}")
    page = observation_state.get("page_type")
    search_available = observation_state.get("search_available", False)
    if not isinstance(search_available, bool):
        raise ObservationStateError(f"observation_state.search_available must be a boolean on page {page!r}")
    actions = observation_state.get("actions", [])
    if not isinstance(actions, list) or not all(isinstance(a, str) and a.strip() for a in actions):
        raise ObservationStateError(
            f"observation_state.actions must be a list of non-empty strings on page {page!r}, got {actions!r}"
        )
    tools: list[dict[str, Any]] = []
    if search_available:
        tools.append(_function_tool("search", _SEARCH_TOOL_DESCRIPTION, "query", {"minLength": 1}, _QUERY_DESCRIPTION))
    if actions:
        tools.append(_function_tool("click", _CLICK_TOOL_DESCRIPTION, "value", {"enum": list(actions)}, _VALUE_DESCRIPTION))
    if not tools:
        raise NoActionToolsError(f"page {page!r} exposes no callable action tools (no search box, nothing to click)")
    return tools


def _function_tool(name: str, description: str, argument: str, constraint: dict[str, Any], about: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string", **constraint, "description": about}},
                "required": [argument],
                "additionalProperties": False,
            },
        },
    }


def canonical_action(tool_name: str, arguments: Mapping[str, Any] | None) -> str:
    """``search[<query>]`` or ``click[<value>]`` (stripped); anything else is ``invalid_tool_arguments``.

    A click value outside the page's enum is *not* rejected here: the environment judges it.
    """
    key = _ARGUMENT_OF.get(tool_name)
    if key is None:
        raise InvalidToolArguments(f"unknown tool {tool_name!r}; the tools are search and click")
    if not isinstance(arguments, Mapping) or set(arguments) != {key}:
        got = sorted(arguments) if isinstance(arguments, Mapping) else arguments
        raise InvalidToolArguments(f"{tool_name} takes exactly one argument {key!r}, got {got!r}")
    value = arguments[key]
    if not isinstance(value, str) or not value.strip():
        raise InvalidToolArguments(f"{tool_name}.{key} must be a non-blank string, got {value!r}")
    return f"{tool_name}[{value.strip()}]"


def protocol_feedback(code: str, message: str, available_tools: Sequence[str]) -> str:
    """The compact JSON sent back to the model after an unusable reply (nothing reached the environment)."""
    return json.dumps(
        {
            "type": "tool_protocol_error",
            "code": code,
            "message": message,
            "instruction": _REPAIR_INSTRUCTION,
            "available_tools": list(available_tools),
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )
