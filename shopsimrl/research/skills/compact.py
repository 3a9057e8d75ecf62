"""What an analyst sees of a trace: ``compact_trace``, with every identifier redacted.

Per step: the observation the model answered, its reasoning and action, the protocol error and
the environment's feedback, and the page it was looking at (page type, product title, brand,
category, attributes and price, the options, the missing option axes, the selected price). The
persona without the fields that identify the user; the outcome with the public part of the
purchase. The gold (the private goal) only with ``include_gold`` (the failure analyst's
privileged section), and even then without the product id.

Identifiers are redacted in every string: ``ASIN…`` becomes ``product id: <redacted>``, a run of
10 or more digits ``<product_id>``, ``task-N`` ``<task_id>``, and every product id the trace's
pages show (ShopSimulator's ids may be shorter than 10 digits) ``<product_id>``: a card must
teach what to do, never which product to pick.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from shopsimrl.records import EpisodeTrace
from shopsimrl.research.redaction import persona_of, public_persona

__all__ = ["COMPACT_TRACE_VERSION", "PUBLIC_PURCHASE_KEYS", "compact_trace", "product_ids", "redact_text"]

COMPACT_TRACE_VERSION = "shopsimrl-compact-trace-v1"
PUBLIC_PURCHASE_KEYS = ("name", "title", "brand", "category", "product_category", "attributes", "price", "options")
"""What the outcome shows of the purchase: what the pages showed too. Not its id, nor the
``instruction_text`` the product was generated for (another task's goal)."""
_GOLD_KEYS = ("instruction_text", "attributes", "goal_options", "price_upper", "price_lower")

_ASIN = re.compile(r"ASIN\s*[:：=]?\s*[A-Za-z0-9]*", re.IGNORECASE)
_LONG_NUMBER = re.compile(r"\d{10,}")
_TASK_ID = re.compile(r"task[-_]\d+", re.IGNORECASE)
_MIN_KNOWN_ID = 4
"""Known product ids shorter than this are not replaced (they would match ordinary numbers)."""


def product_ids(trace: EpisodeTrace) -> set[str]:
    """Every product id the trace's pages, purchase and goal name."""
    found: set[str] = set()

    def add(value: Any) -> None:
        if isinstance(value, str | int) and not isinstance(value, bool) and len(str(value)) >= _MIN_KNOWN_ID:
            found.add(str(value))

    for state in _states(trace):
        for product in state.get("products") or []:
            if isinstance(product, dict):
                add(product.get("asin"))
        product = state.get("product")
        if isinstance(product, dict):
            add(product.get("asin"))
    final = trace.final.as_dict() if trace.final is not None else {}
    for key in ("purchase", "goal"):
        item = final.get(key)
        if isinstance(item, dict):
            add(item.get("asin"))
    return found


def redact_text(text: str, known_ids: Iterable[str] = ()) -> str:
    """``text`` with product ids, long identifiers and task ids replaced (module docstring)."""
    text = _ASIN.sub("product id: <redacted>", text)
    for known in sorted(set(known_ids), key=len, reverse=True):
        text = text.replace(known, "<product_id>")
    text = _LONG_NUMBER.sub("<product_id>", text)
    return _TASK_ID.sub("<task_id>", text)


def _redact(value: Any, known: frozenset[str]) -> Any:
    if isinstance(value, str):
        return redact_text(value, known)
    if isinstance(value, dict):
        return {redact_text(str(key), known): _redact(item, known) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(item, known) for item in value]
    return value


def _states(trace: EpisodeTrace) -> list[dict[str, Any]]:
    states = []
    reset_state = (trace.reset or {}).get("observation_state")
    if isinstance(reset_state, dict):
        states.append(reset_state)
    for step in trace.steps:
        state = step.environment.observation_state if step.environment is not None else None
        if isinstance(state, dict):
            states.append(state)
    return states


def _product(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    keys = {"title": "title", "brand": "brand", "category": "category", "price": "price"}
    out = {name: value[key] for name, key in keys.items() if value.get(key) is not None}
    attributes = value.get("key_attributes", value.get("attributes"))
    if attributes:
        out["attributes"] = attributes
    return out


def _page(state: dict[str, Any] | None) -> dict[str, Any]:
    """The page the model was looking at, as the compact trace shows it."""
    if not state:
        return {}
    page: dict[str, Any] = {"page_type": state.get("page_type")}
    products = [_product(item) for item in state.get("products") or []]
    if any(products):
        page["products"] = [item for item in products if item]
    product = _product(state.get("product"))
    if product:
        page["product"] = product
    if state.get("available_options") or state.get("selected_options"):
        page["options"] = {"available": state.get("available_options") or {}, "selected": state.get("selected_options") or {}}
    if state.get("missing_option_axes"):
        page["missing_option_axes"] = state["missing_option_axes"]
    if state.get("selected_price") is not None:
        page["selected_price"] = state["selected_price"]
    return page


def _feedback(step: Any) -> Any:
    if step.environment is not None:
        feedback = step.environment.action_feedback
        if feedback is not None:
            return {key: value for key, value in feedback.as_dict().items() if key in ("valid", "reason", "message")}
    return step.protocol_feedback


def compact_trace(trace: EpisodeTrace, include_gold: bool = False) -> dict[str, Any]:
    """The analyst's view of one trace (module docstring); JSON-ready, ids redacted."""
    known = frozenset(product_ids(trace))
    reset = trace.reset or {}
    state = reset.get("observation_state") if isinstance(reset.get("observation_state"), dict) else None
    steps = []
    for step in trace.steps:
        error = step.effective_protocol_error
        item: dict[str, Any] = {
            "step": step.step_index,
            "observation": step.observation,
            "reasoning": step.model.reasoning,
            "action": step.action,
            "protocol_error": {"code": error.code, "message": error.message} if error is not None else None,
            "feedback": _feedback(step),
            **_page(state),
        }
        steps.append({key: value for key, value in item.items() if value is not None})
        after = step.environment.observation_state if step.environment is not None else None
        if isinstance(after, dict):
            state = after
    final = trace.final.as_dict() if trace.final is not None else {}
    purchase = final.get("purchase")
    detail = final.get("reward_detail")
    detail = detail if isinstance(detail, dict) else {}
    outcome = {
        "status": trace.status,
        "termination_reason": final.get("termination_reason"),
        "reward": final.get("reward"),
        "r_success": detail.get("r_success"),
        "steps": len(trace.steps),
        "purchase": {key: purchase[key] for key in PUBLIC_PURCHASE_KEYS if key in purchase}
        if isinstance(purchase, dict)
        else None,
    }
    compact: dict[str, Any] = {
        "compact_trace_version": COMPACT_TRACE_VERSION,
        "instruction": reset.get("task_instruction"),
        "persona": public_persona(persona_of(trace))[0] or None,
        "steps": steps,
        "outcome": outcome,
    }
    goal = final.get("goal")
    if include_gold and isinstance(goal, dict):
        compact["gold"] = {key: goal[key] for key in _GOLD_KEYS if key in goal}
    redacted: dict[str, Any] = _redact(compact, known)
    return redacted
