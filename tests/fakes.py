"""In-process implementations of the ChatModel and ShopEnvironment protocols for runtime tests.

They script exact replies, so the runtime's state machine can be pinned step by step (the
adapters themselves are tested against real HTTP servers elsewhere).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

from shopsimrl.records import EpisodeTrace, dump_line
from shopsimrl.schemas import ModelOutput, ToolCall


def call(name: str, arguments: dict[str, Any] | str, call_id: str = "call-1") -> ToolCall:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        parsed = None
    return ToolCall(call_id=call_id, name=name, arguments=parsed if isinstance(parsed, dict) else None, raw_arguments=raw)


def tool_output(name: str, arguments: dict[str, Any], **kwargs: Any) -> ModelOutput:
    return ModelOutput(tool_calls=[call(name, arguments)], finish_reason="tool_calls", latency_ms=1.0, **kwargs)


class FakeModel:
    def __init__(
        self, outputs: list[ModelOutput | Exception] | Callable[[list[dict[str, Any]], list[dict[str, Any]]], ModelOutput]
    ) -> None:
        self.outputs = outputs
        self.calls: list[dict[str, Any]] = []
        self.closed = False

    def identity(self) -> dict[str, Any]:
        return {"provider": "fake", "model": "fake-model"}

    async def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], seed: int | None = None) -> ModelOutput:
        self.calls.append({"messages": [dict(m) for m in messages], "tools": tools, "seed": seed})
        if callable(self.outputs):
            return self.outputs(messages, tools)
        item = self.outputs[len(self.calls) - 1] if len(self.calls) <= len(self.outputs) else self.outputs[-1]
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


HOME_STATE = {
    "observation_version": "shopping-observation-v7",
    "page_type": "search_home",
    "search_available": True,
    "actions": [],
}


def results_state(actions: list[str]) -> dict[str, Any]:
    return {
        "observation_version": "shopping-observation-v7",
        "page_type": "search_results",
        "search_available": False,
        "actions": actions,
    }


def env_result(state: dict[str, Any], *, done: bool = False, reward: float = 0.0, **extra: Any) -> dict[str, Any]:
    result = {
        "done": done,
        "over": done,
        "reward": reward,
        "observation": f"page:{state['page_type']}",
        "observation_state": state,
        "message": "Continue interaction",
        "env_idx": 3,
        "idx": "slot-3-7",
        "reward_detail": {},
        "purchase": {},
        "goal": {},
        "lease_id": "a" * 32,
        "action_feedback": {"valid": True, "reason": "executed"},
    }
    result.update(extra)
    return result


def purchase_result(reward: float = 1.0) -> dict[str, Any]:
    detail = {"r_strict": reward, "r_success": int(reward == 1.0), "r_type": 1.0, "termination_reason": "purchase"}
    return env_result(
        {**HOME_STATE, "page_type": "terminal", "search_available": False},
        done=True,
        reward=reward,
        reward_detail=detail,
        termination_reason="purchase",
        goal={"asin": "000000000001"},
    )


class FakeEpisode:
    def __init__(self, env: FakeEnvironment) -> None:
        self.env = env
        self.environment_version: str | None = None
        self.observation_version: str | None = None
        self.leased = False

    async def reset(self, task_id: int) -> dict[str, Any]:
        if self.env.reset_error:
            raise self.env.reset_error
        self.leased = True
        self.env.resets.append(task_id)
        self.environment_version = "shopsimulator-paper-aligned-v8"
        self.observation_version = "shopping-observation-v7"
        return {
            "task_instruction": "买一个蓝牙耳机",
            "observation": "页面：搜索首页\n",
            "observation_state": dict(self.env.reset_state),
            "message": f"Task {task_id} started",
            "env_idx": 3,
            "idx": task_id,
            "task_mode": "persona",
            "interaction_mode": "single_turn",
            "environment_version": "shopsimulator-paper-aligned-v8",
            "user_persona": {"用户ID": "u1", "__reasoning__": "secret"},
            "lease_id": "a" * 32,
            "private_task_instruction": "PRIVATE",
            "goal_options": ["黑色"],
            "reason_key": None,
        }

    async def step(self, action: str) -> dict[str, Any]:
        self.env.actions.append(action)
        script = self.env.steps
        item = script[min(len(self.env.actions) - 1, len(script) - 1)]
        if isinstance(item, Exception):
            raise item
        return item

    async def terminate(self, reason: str) -> dict[str, Any]:
        self.env.terminations.append(reason)
        detail = {"r_strict": 0.0, "r_success": 0, "termination_reason": reason}
        return env_result(
            HOME_STATE,
            done=True,
            reward=0.0,
            reward_detail=detail,
            termination_reason=reason,
            message=f"Episode terminated: {reason}",
        )

    async def close(self) -> None:
        self.env.closes += 1
        if self.env.close_error:
            raise self.env.close_error
        self.leased = False


class FakeEnvironment:
    def __init__(self, steps: list[dict[str, Any] | Exception] | None = None, reset_state: dict[str, Any] | None = None) -> None:
        self.steps = steps or [env_result(results_state(["buy now"])), purchase_result()]
        self.reset_state = reset_state or HOME_STATE
        self.actions: list[str] = []
        self.resets: list[int] = []
        self.terminations: list[str] = []
        self.closes = 0
        self.reset_error: Exception | None = None
        self.close_error: Exception | None = None

    def identity(self) -> dict[str, Any]:
        return {"adapter": "fake", "persona": True, "interaction_mode": "single_turn"}

    def semantic_identity(self) -> dict[str, Any]:
        return self.identity()

    def open_episode(self) -> FakeEpisode:
        return FakeEpisode(self)

    async def healthz(self) -> dict[str, Any]:
        return {"ready": True}

    async def aclose(self) -> None:
        pass


def written(trace: EpisodeTrace) -> dict[str, Any]:
    """A trace as the stores write it (the JSON object of its line)."""
    return dict(orjson.loads(dump_line(trace)))
