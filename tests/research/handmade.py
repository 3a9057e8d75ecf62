"""Hand-made v4 traces for the label, exporter and converter tests: each built step by step the way
the runtime builds one (the real prompt builder, tools, model-output and trace shapes), with
pages and outcomes chosen by the test."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

from shopsimrl.episode import new_trace
from shopsimrl.prompts import PromptBuilder, action_tools, protocol_feedback
from shopsimrl.records import to_plain
from shopsimrl.schemas import EpisodeJob, ModelOutput, ToolCall

GOAL_ASIN = "100000000001"
CATEGORY = "家居›照明›台灯"
PERSONA = {"用户ID": "U0000SENTINEL", "偏好": {"风格倾向": "极简北欧风格"}, "消费偏好": "性价比"}
GOAL = {
    "asin": GOAL_ASIN,
    "category": CATEGORY,
    "instruction_text": "找一盏护眼台灯，白色，预算200元以内（私有目标全文）",
    "attributes": ["护眼"],
    "goal_options": ["白色"],
    "price_upper": 200.0,
    "user_persona": {**PERSONA, "__reasoning__": "私有推理：该用户想要白色台灯"},
}
INSTRUCTION = "找一盏护眼台灯，预算200元以内"
_ids = itertools.count(1)


def search_home() -> dict[str, Any]:
    return {"observation_version": "shopping-observation-v7", "page_type": "search_home", "search_available": True, "actions": []}


def results(*products: tuple[str, str], query: str = "台灯") -> dict[str, Any]:
    """A results page listing (asin, category) pairs."""
    return {
        "observation_version": "shopping-observation-v7",
        "page_type": "search_results",
        "search_available": False,
        "actions": ["back to search", *[asin for asin, _ in products]],
        "search_text": query,
        "total_results": len(products),
        "products": [
            {"asin": asin, "title": f"台灯{asin[-3:]}", "category": category, "price": "99.0"} for asin, category in products
        ],
    }


def product(asin: str, category: str = CATEGORY, options: tuple[str, ...] = ("颜色分类=白色", "颜色分类=黑色")) -> dict[str, Any]:
    return {
        "observation_version": "shopping-observation-v7",
        "page_type": "product_detail",
        "search_available": False,
        "actions": ["< prev", *options, "buy now"],
        "product": {"asin": asin, "title": f"台灯{asin[-3:]}", "category": category, "price": "99.0"},
    }


def terminal() -> dict[str, Any]:
    return {"observation_version": "shopping-observation-v7", "page_type": "terminal", "search_available": False, "actions": []}


def render(state: dict[str, Any], note: str = "") -> str:
    """A page as text: what it lists, so different pages read differently."""
    items = [item["asin"] for item in state.get("products", [])] + ([state["product"]["asin"]] if "product" in state else [])
    return f"页面：{state['page_type']}\n{' '.join(items)}\n可点击：{'、'.join(state['actions'])}\n{note}"


class Episode:
    """Builds one trace. ``act`` sends an action; ``protocol_error`` / ``policy_failure`` record
    unusable replies; ``purchase`` / ``terminate`` / ``fail`` end it."""

    def __init__(
        self,
        task_id: int = 1,
        sample_id: int = 0,
        *,
        split: str = "val",
        persona: dict[str, Any] | None = None,
        goal: dict[str, Any] | None = None,
        max_steps: int = 30,
    ) -> None:
        self.record = to_plain(new_trace(EpisodeJob(task_id, sample_id, 1000 + task_id, split)))
        self.persona = PERSONA if persona is None else persona
        self.goal = copy.deepcopy(GOAL if goal is None else goal)
        self.state = search_home()
        self.observation = render(self.state)
        reset = {
            "task_instruction": INSTRUCTION,
            "observation": self.observation,
            "observation_state": self.state,
            "task_mode": "persona",
            "user_persona": dict(self.persona),
        }
        builder = PromptBuilder()
        first = builder.initial_user_message(reset)
        self.record.update(
            reset=reset,
            conversation=[builder.system_message(reset, []), first],
            started_at="2026-01-01T00:00:00+00:00",
            provenance={"runtime": {"max_steps": max_steps}},
        )
        self.observation = first["content"]
        self.actions = 0

    @property
    def steps(self) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = self.record["steps"]
        return steps

    def _step(self, output: ModelOutput) -> dict[str, Any]:
        step = {
            "step_index": len(self.steps) + 1,
            "observation": self.observation,
            "tools": action_tools(self.state),
            "model": output.to_dict(),
            "action": None,
            "environment": None,
        }
        self.steps.append(step)
        return step

    def act(
        self,
        tool: str,
        value: str,
        page: dict[str, Any] | None = None,
        *,
        reason: str = "executed",
        reasoning: str | None = None,
        done: bool = False,
    ) -> Episode:
        """Send ``tool[value]``; the shop answers with ``page`` (an invalid action: same page)."""
        key = "query" if tool == "search" else "value"
        raw = json.dumps({key: value}, ensure_ascii=False)
        call = ToolCall(f"call-{next(_ids)}", tool, {key: value}, raw)
        step = self._step(ModelOutput(reasoning=reasoning, tool_calls=[call], finish_reason="tool_calls"))
        valid = reason == "executed"
        self.state = page if valid and page is not None else self.state
        self.actions += 1
        action = f"{tool}[{value}]"
        text = render(self.state, f"上次交互结果：{action} {reason}")  # the shop shows the last action's outcome
        step["action"] = action
        step["environment"] = {
            "done": done,
            "reward": 0.0,
            "observation": text,
            "observation_state": self.state,
            "action_feedback": {"action": action, "valid": valid, "reason": reason, "message": reason},
            "reward_detail": {},
            "purchase": {},
            "goal": {},
        }
        conversation = self.record["conversation"]
        conversation.append({"role": "assistant", "content": None, "tool_calls": [_wire(call)]})
        conversation.append({"role": "tool", "tool_call_id": call.call_id, "content": text})
        self.observation = text
        return self

    def protocol_error(self, code: str = "tool_call_count", *, content: str | None = None, with_call: bool = False) -> Episode:
        calls = [ToolCall(f"call-{next(_ids)}", "ask", None, '{"q": 1')] if with_call else []
        output = ModelOutput(
            content=content, tool_calls=calls, finish_reason="stop", protocol_error={"code": code, "message": code}
        )
        step = self._step(output)
        feedback = protocol_feedback(code, code, [tool["function"]["name"] for tool in step["tools"]])
        step["protocol_error"] = {"code": code, "message": code}
        step["protocol_feedback"] = feedback
        conversation = self.record["conversation"]
        if calls:
            conversation.append({"role": "assistant", "content": content, "tool_calls": [_wire(call) for call in calls]})
            conversation += [{"role": "tool", "tool_call_id": call.call_id, "content": feedback} for call in calls]
        else:
            if content and content.strip():
                conversation.append({"role": "assistant", "content": content})
            conversation.append({"role": "user", "content": feedback})
        return self

    def policy_failure(self, code: str = "generation_length") -> Episode:
        call = ToolCall(f"call-{next(_ids)}", "search", None, '{"query": "台')
        cut_off = code == "generation_length"  # a refused prompt (context_length) generates nothing
        output = ModelOutput(
            tool_calls=[call] if cut_off else [],
            finish_reason="length" if cut_off else None,
            policy_failure={"code": code, "message": code},
        )
        step = self._step(output)
        step["policy_failure"] = {"code": code, "message": code}
        return self._final("generation_length", zero=True)

    def purchase(self, asin: str, **components: float) -> Episode:
        """Buy ``asin`` from its product page; ``components`` override the reward detail."""
        detail = {"r_type": 1.0, "r_att": 1.0, "r_option": 1.0, "r_price": 1.0}
        detail |= components
        self.act("click", "buy now", terminal(), done=True)
        self.steps[-1]["environment"]["termination_reason"] = "purchase"
        success = int(all(detail[key] == 1.0 for key in ("r_type", "r_att", "r_option", "r_price")))
        reward = detail["r_type"] * detail["r_att"] * detail["r_option"] * detail["r_price"]
        price = 250.0 if detail["r_price"] < 1 else 99.0
        detail |= {
            "r_strict": reward,
            "r_success": success,
            "price_upper": 200.0,
            "price_resolution": {"status": "pass", "price": price, "method": "selected_price_axis"},
            "target_asin_match": asin == GOAL_ASIN,
            "termination_reason": "purchase",
        }
        purchase = {"asin": asin, "name": f"台灯{asin[-3:]}", "category": CATEGORY, "price": price, "options": self.options()}
        purchase["instruction_text"] = GOAL["instruction_text"] if asin == GOAL_ASIN else "另一件商品的任务"
        final = dict(self.steps[-1]["environment"])
        final |= {"reward": reward, "reward_detail": detail, "purchase": purchase, "goal": self.goal, "over": True}
        self.steps[-1]["environment"] = copy.deepcopy(final)
        self.record.update(status="completed", final=final)
        return self

    def options(self) -> dict[str, str]:
        chosen = {}
        for step in self.steps:
            action = step.get("action") or ""
            feedback = (step.get("environment") or {}).get("action_feedback") or {}
            if action.startswith("click[") and "=" in action and feedback.get("valid"):
                axis, _, value = action[len("click[") : -1].partition("=")
                chosen[axis] = value
        return chosen

    def _final(self, reason: str, *, zero: bool) -> Episode:
        detail = {
            "r_type": 0.0,
            "r_att": 0.0,
            "r_option": 0.0,
            "r_price": 0.0,
            "r_strict": 0.0,
            "r_success": 0,
            "termination_reason": reason,
        }
        final = {
            "done": True,
            "reward": 0.0,
            "observation": self.observation,
            "observation_state": self.state,
            "reward_detail": detail,
            "purchase": {},
            "goal": self.goal,
            "termination_reason": reason,
        }
        self.record.update(status="completed", final=final)
        return self

    def action_limit(self, *, by_environment: bool) -> Episode:
        if by_environment:
            self.steps[-1]["environment"] |= {"done": True, "termination_reason": "action_limit"}
        return self._final("action_limit", zero=True)

    def fail(self, stage: str, error_type: str, message: str, failure_class: str | None) -> Episode:
        self.record.update(
            status="failed", error={"stage": stage, "type": error_type, "message": message}, failure_class=failure_class
        )
        return self

    def done(self) -> dict[str, Any]:
        self.record["ended_at"] = "2026-01-01T00:00:05+00:00"
        self.record["failure_class"] = self.record.get("failure_class")
        return copy.deepcopy(self.record)


def _wire(call: ToolCall) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.raw_arguments}}


def good_episode(
    task_id: int = 1, sample_id: int = 0, *, reasoning: str | None = "先搜索护眼台灯。", **kwargs: Any
) -> dict[str, Any]:
    """Search, open the goal's product, choose its colour, buy: a success."""
    episode = Episode(task_id, sample_id, **kwargs)
    episode.act("search", "护眼台灯", results((GOAL_ASIN, CATEGORY), ("100000000002", CATEGORY)), reasoning=reasoning)
    episode.act("click", GOAL_ASIN, product(GOAL_ASIN), reasoning=reasoning)
    episode.act("click", "颜色分类=白色", product(GOAL_ASIN, options=("颜色分类=黑色",)), reasoning=reasoning)
    return episode.purchase(GOAL_ASIN).done()
