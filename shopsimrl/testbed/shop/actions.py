"""Agent action handling: ``Action:`` extraction, the one-action parser and the dispatcher.

Every call that reaches a live session counts as an action, valid or not; an invalid action
leaves the page unchanged and explains itself in ``action_feedback``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from shopsimrl.testbed.shop.catalog import Catalog
from shopsimrl.testbed.shop.pages import BUY_NOW, MISROUTED_PAGE, Session, clickables, option_state
from shopsimrl.testbed.shop.reward import purchase_record, purchase_reward, zero_reward_detail
from shopsimrl.testbed.shop.search import SearchIndex, ServerFault

__all__ = [
    "EPISODE_LIMITS",
    "ActionParseError",
    "StepResult",
    "extract_action",
    "parse_action",
    "step",
    "terminate",
]

EPISODE_LIMITS = {"single_turn": 30, "multi_turn": 40}
TERMINATION_REASONS = ("action_limit", "generation_length")

_ACTION_LINE = re.compile(r"(?:^|\n)\s*Action\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_LABELLED = re.compile(r"(?:^|\n)\s*Action\s*:\s*[^\r\n]+", re.IGNORECASE)
_CHAINED = re.compile(r"\]\s*(?:[,;，；]\s*)?(?:search|click)\s*\[", re.IGNORECASE)
_NAME_ARG = re.compile(r"([^\[\]\r\n]+)\[(.*)\]")


class ActionParseError(ValueError):
    """The action string breaks the one-action grammar; ``code`` is the feedback reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def extract_action(response: str) -> str:
    """Turn literal ``\\n`` into newlines; keep only the payload of a single ``Action:`` line."""
    text = response.replace("\\n", "\n")
    matches = _ACTION_LINE.findall(text)
    # Several Action: lines are kept whole so that the parser rejects them explicitly.
    return matches[0].strip() if len(matches) == 1 else text.strip()


def parse_action(action: object) -> tuple[str, str | None]:
    """Split ``name[arg]``; a bracket-free string is a bare name with no argument."""
    if not isinstance(action, str):
        raise ActionParseError("invalid_format", "动作必须是字符串")
    text = action.strip()
    if not text:
        raise ActionParseError("invalid_format", "动作不能为空")
    if len(_LABELLED.findall(text)) > 1 or _CHAINED.search(text):
        raise ActionParseError("multiple_actions_not_allowed", "一次调用只能执行一个 search[...] 或 click[...] 动作")
    if "[" not in text and "]" not in text:
        if "\n" in text or "\r" in text:
            raise ActionParseError("invalid_format", "动作格式无效")
        return text, None
    match = _NAME_ARG.fullmatch(text)
    if match is None:
        raise ActionParseError("invalid_format", "动作必须严格使用 search[...] 或 click[...] 格式")
    name, arg = match.group(1).strip(), match.group(2)
    if not name:
        raise ActionParseError("invalid_format", "动作名称不能为空")
    return name, arg  # the argument is deliberately neither stripped nor casefolded


@dataclass(slots=True)
class StepResult:
    """What one ``interact`` produced; the HTTP layer turns it into a response."""

    feedback: dict[str, Any]
    reward: float | int = 0
    done: bool = False
    reward_detail: dict[str, Any] = field(default_factory=dict)
    purchase: dict[str, Any] = field(default_factory=dict)
    termination_reason: str | None = None


def _dispatch(session: Session, text: str, catalog: Catalog, index: SearchIndex) -> StepResult:
    feedback: dict[str, Any] = {"action": text, "valid": False, "reason": "invalid_format", "message": "动作格式无效"}
    result = StepResult(feedback=feedback)
    try:
        name, arg = parse_action(text)
    except ActionParseError as exc:
        feedback.update(reason=exc.code, message=str(exc))
        return result
    name = name.casefold()
    actions = clickables(session, catalog)
    selected_keys = {f"{axis}={value}" for axis, value in session.options.items()}

    if name == "search" and not (arg or "").strip():
        feedback.update(reason="empty_argument", message="search[...] 的关键词不能为空")
    elif name == "search" and session.page != "search_home":
        feedback.update(reason="search_unavailable", message="当前页面不提供搜索操作")
    elif name == "search":
        session.search(arg or "", index)
        feedback.update(valid=True, reason="executed", message="搜索已执行")
        result.reward = 0.0
    elif name == "click" and not (arg or "").strip():
        feedback.update(reason="empty_argument", message="click[...] 的点击值不能为空")
    elif name == "click" and arg in selected_keys:
        feedback.update(reason="already_selected", message=f"该规格已经选中：{arg}")
    elif name == "click" and arg == BUY_NOW and session.asin is not None:
        product = catalog.by_asin[session.asin]
        selection = option_state(product, session.options)
        if selection["options_complete"] and BUY_NOW in actions:
            feedback.update(valid=True, reason="executed", message="购买已执行")
            return _purchase(session, catalog, feedback)
        if selection["options_complete"]:
            feedback.update(reason="unavailable_action", message="当前页面没有可用的购买按钮")
        else:
            missing = selection["missing_option_axes"]
            feedback.update(
                reason="incomplete_options",
                message="购买前还需选择规格轴：" + "、".join(missing),
                missing_option_axes=missing,
            )
    elif name == "click" and arg in actions and arg != "search":
        _click(session, actions[arg or ""], catalog)
        feedback.update(valid=True, reason="executed", message="点击已执行")
        result.reward = 0.0
    elif name == "click":
        feedback.update(reason="unavailable_action", message=f"当前页面不存在可点击项：{arg}")
    else:
        feedback.update(reason="invalid_format", message="动作必须使用 search[...] 或 click[...] 格式")
    return result


def _click(session: Session, target: tuple[str, ...], catalog: Catalog) -> None:
    kind = target[0]
    if kind == "back":
        session.back_to_search()
    elif kind == "page":
        session.show_results(int(target[1]))
    elif kind == "results":
        session.previous_results()
    elif kind == "open":
        session.open_product(target[1], catalog)
    elif kind == "option":
        session.select_option(target[1], target[2], catalog)


def _purchase(session: Session, catalog: Catalog, feedback: dict[str, Any]) -> StepResult:
    product = catalog.by_asin[session.asin or ""]
    detail = purchase_reward(product, session.goal, session.options, session.price_resolution)
    session.purchase()
    session.done, session.termination_reason = True, "purchase"
    return StepResult(
        feedback=feedback,
        reward=detail["r_strict"],
        done=True,
        reward_detail=detail,
        purchase=purchase_record(product, session.options, session.selected_price),
        termination_reason="purchase",
    )


def step(session: Session, response: str, catalog: Catalog, index: SearchIndex) -> StepResult:
    """Run one Agent response on a live (not yet terminal) session.

    Raises :class:`ServerFault` where the real server answers 500. The action still counts and
    the page does not move; a failing search stores at most its search state (keywords, results,
    the search count: a lone surrogate in a search that finds products fails only when the page is
    rendered) and ``< prev`` nothing, while an action that leaves a misrouted product page in
    place has taken effect (option selected, feedback stored) before the 500.
    """
    session.action_count += 1
    result = _dispatch(session, extract_action(response), catalog, index)
    session.last_action = result.feedback
    if session.misrouted:
        # The real server renders the page before its action-limit check, so a misrouted page
        # fails first and the limit is applied by the first action that leaves the page.
        raise ServerFault(MISROUTED_PAGE)
    if not result.done and session.action_count >= session.max_actions:
        # The limit-hitting action still reports its own feedback; the episode ends with zeros.
        session.done, session.termination_reason = True, "action_limit"
        result.done, result.reward = True, 0.0
        result.reward_detail = zero_reward_detail("action_limit")
        result.purchase, result.termination_reason = {}, "action_limit"
    return result


def terminate(session: Session, reason: str) -> dict[str, Any]:
    """End an unpurchased episode with zero reward; the page is left where it was."""
    if reason not in TERMINATION_REASONS:
        raise ValueError(f"unsupported termination reason: {reason}")
    if session.done:
        raise RuntimeError("episode is already terminated")
    session.done, session.termination_reason = True, reason
    return zero_reward_detail(reason)
