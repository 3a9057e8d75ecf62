"""The testbed's deterministic judge: the policy server answers the model id ``judge_model_id``
(``shopsim-judge`` by default) as a judge instead of a shopper.

It expects what the judge stage sends (docs/analysis.md §6): a system message with the rubric's
instructions, a user message holding the judge input as JSON, and the tool ``submit_verdict``.
The verdict is computed from that input alone, never from the shop or the reward:

- no purchase (an episode that failed or ended without buying): ``failure``, ``no_purchase``;
- with the goal in the input (``include: [goal]``): the bought product's category against the
  goal's (``wrong_product`` when they differ), each goal attribute's value found on the pages
  the agent saw after opening the bought product (its name when it never opened it;
  ``wrong_product`` when one is missing), the goal's options among the chosen
  ones (``wrong_options``), the price against ``price_upper`` (``over_budget``). All met:
  ``success``; otherwise ``partial`` when the score (the mean of the three checks' fractions)
  is at least 0.5, else ``failure``. The reward compares the product itself with the goal
  (its type, its attribute list), the judge only what the transcript shows, so they agree
  often, never by construction;
- without the goal: ``success`` when the leaf of the bought product's category is named in the
  task instruction, else ``failure`` with ``wrong_product``;
- rejected actions in the transcript add ``invalid_actions`` whatever the verdict.

Fault knob ``SHOPSIM_POLICY_JUDGE_FAULT_RATE`` (``judge_fault_rate``): a deterministic subset of
episodes, chosen by the sha256 of the episode id, answers badly. The first half of the rate never
calls the tool (text only: unparseable after every repair); the second half sends arguments that
are not JSON on the first attempt and a valid verdict once a repair message follows (a repaired
verdict).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson

__all__ = ["judge_reply"]

_NO_CALL_TEXT = "这个任务的结果我需要再想一想。"


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _fraction(hits: int, total: int) -> float:
    return 1.0 if total == 0 else hits / total


def _product_pages(data: dict[str, Any], asin: str) -> str:
    """The pages the agent saw from opening the bought product on (its page, then the option
    clicks): where the product's attributes are shown."""
    text, opened = [], False
    for step in data.get("transcript") or []:
        if not isinstance(step, dict):
            continue
        if opened:
            text.append(str(step.get("observation") or ""))
        opened = opened or step.get("action") == f"click[{asin}]"
    return "\n".join(text)


def verdict_of(data: dict[str, Any]) -> dict[str, Any]:
    """The deterministic verdict on one judge input (see the module docstring)."""
    outcome = _map(data.get("outcome"))
    purchase = _map(outcome.get("purchase"))
    invalid = any(
        _map(step.get("feedback")).get("valid") is False for step in data.get("transcript") or [] if isinstance(step, dict)
    )
    extra = ["invalid_actions"] if invalid else []
    if not outcome.get("completed") or not purchase:
        return {
            "verdict": "failure",
            "score": 0.0,
            "failure_categories": ["no_purchase", *extra],
            "rationale": "没有完成购买。",
        }
    name = str(purchase.get("name") or "")
    page = _product_pages(data, str(purchase.get("asin") or "")) or name
    goal = data.get("goal")
    if not isinstance(goal, dict):
        leaf = str(purchase.get("category") or "").split("›")[-1]
        ok = bool(leaf) and leaf in str(data.get("task_instruction") or "")
        return {
            "verdict": "success" if ok else "failure",
            "score": 1.0 if ok else 0.0,
            "failure_categories": ([] if ok else ["wrong_product"]) + extra,
            "rationale": f"购买了{leaf or '未知品类'}，{'符合' if ok else '不符合'}任务所说的品类。",
        }
    categories: list[str] = []
    same_category = purchase.get("category") == goal.get("category")
    values = [str(item).split("：")[-1] for item in goal.get("attributes") or []]
    attributes = _fraction(sum(value in page for value in values), len(values)) if same_category else 0.0
    chosen = {str(value) for value in _map(purchase.get("options")).values()}
    wanted = [str(item) for item in goal.get("goal_options") or []]
    options = _fraction(sum(value in chosen for value in wanted), len(wanted))
    upper, price = goal.get("price_upper"), purchase.get("price")
    within = not (isinstance(upper, (int, float)) and isinstance(price, (int, float)) and price > upper)
    if attributes < 1:
        categories.append("wrong_product")
    if options < 1:
        categories.append("wrong_options")
    if not within:
        categories.append("over_budget")
    score = round((attributes + options + (1.0 if within else 0.0)) / 3, 4)
    verdict = "success" if not categories else ("partial" if score >= 0.5 else "failure")
    rationale = f"属性命中{attributes:.0%}，选项命中{options:.0%}，价格{'未超' if within else '超出'}预算。"
    return {"verdict": verdict, "score": score, "failure_categories": categories + extra, "rationale": rationale}


def _fault(episode_id: str, rate: float) -> str | None:
    draw = int.from_bytes(hashlib.sha256(episode_id.encode("utf-8")).digest()[:8], "big") / 2**64
    if draw < rate / 2:
        return "no_tool_call"
    if draw < rate:
        return "bad_arguments"
    return None


def judge_reply(messages: list[dict[str, Any]], fault_rate: float) -> tuple[str | None, str | None, str]:
    """``(content, arguments, finish_reason)`` of the judge's answer; ``arguments`` None: no call."""
    user = next((m for m in messages if m.get("role") == "user"), None)
    try:
        data = orjson.loads(str(_map(user).get("content") or ""))
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return "没有找到要评判的回合（用户消息应是 JSON）。", None, "stop"
    fault = _fault(str(data.get("episode_id") or ""), fault_rate)
    repairing = len(messages) > 2  # the stage appends the error and asks again
    if fault == "no_tool_call":
        return _NO_CALL_TEXT, None, "stop"
    verdict = orjson.dumps(verdict_of(data)).decode("utf-8")
    if fault == "bad_arguments" and not repairing:
        return None, re.sub(r"\}$", "", verdict).replace('"verdict":', "verdict:"), "tool_calls"
    return None, verdict, "tool_calls"
