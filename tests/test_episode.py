"""The one-episode state machine (reference R1–R6 plus the fixed weak points 4, 5 and 6)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shopsimrl.environment import (
    EnvironmentResponseError,
    EnvironmentUnavailableError,
    EnvironmentVersionError,
    LeaseError,
)
from shopsimrl.episode import AgentRuntime
from shopsimrl.model import ModelConfigError, ModelRequestError
from shopsimrl.prompts import PromptBuilder
from shopsimrl.records import read_trace
from shopsimrl.schemas import TRACE_SCHEMA_VERSION, EpisodeJob, ModelOutput, Skill
from shopsimrl.skills import NoSkills
from tests.fakes import FakeEnvironment, FakeModel, call, env_result, purchase_result, results_state, tool_output, written

JOB = EpisodeJob(task_id=7, sample_id=0, seed=50, split="val")


class OneSkill:
    def select(self, context):
        assert "private_task_instruction" not in context and "goal_options" not in context
        return [Skill(skill_id="s1", content="先看规格再购买", version="2")]

    def identity(self):
        return {"provider": "test"}


def runtime(model, env, *, max_steps: int = 30, skills=None) -> AgentRuntime:
    return AgentRuntime(model=model, environment=env, prompts=PromptBuilder(), skills=skills or NoSkills(), max_steps=max_steps)


async def test_r1_happy_path() -> None:
    model = FakeModel(
        [tool_output("search", {"query": "蓝牙耳机"}, reasoning="先搜索"), tool_output("click", {"value": "buy now"})]
    )
    env = FakeEnvironment()
    trace = written(await runtime(model, env, skills=OneSkill()).run(JOB))
    assert trace["schema_version"] == TRACE_SCHEMA_VERSION and trace["status"] == "completed" and read_trace(trace).completed
    assert trace["final"]["reward"] == 1.0 and trace["error"] is None and trace["failure_class"] is None
    assert [c["seed"] for c in model.calls] == [50, 51]
    assert env.actions == ["search[蓝牙耳机]", "click[buy now]"] and env.terminations == []
    assert trace["steps"][0]["model"]["reasoning"] == "先搜索" and len(trace["steps"]) == 2
    assert [t["function"]["name"] for t in trace["steps"][0]["tools"]] == ["search"]
    click_tool = trace["steps"][1]["tools"][-1]["function"]
    assert click_tool["name"] == "click" and click_tool["parameters"]["properties"]["value"]["enum"] == ["buy now"]
    assert [m["role"] for m in trace["conversation"]] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert "lease_id" not in trace["reset"] and "env_idx" not in trace["reset"]
    assert "private_task_instruction" not in trace["reset"] and "goal_options" not in trace["reset"]
    assert "__reasoning__" not in trace["reset"]["user_persona"]
    assert "env_idx" not in trace["steps"][0]["environment"] and "lease_id" not in trace["final"]
    assert "<skill" in trace["conversation"][0]["content"] and trace["selected_skills"][0]["skill_id"] == "s1"
    assert env.closes == 1
    assert set(trace["provenance"]) == {"model", "environment", "prompt", "skills", "runtime"}
    assert trace["provenance"]["environment"]["environment_version"] == "shopsimulator-paper-aligned-v8"
    # reasoning is never sent back to the model
    assert all("reasoning" not in m and "reasoning_content" not in m for m in model.calls[1]["messages"])


async def test_r2_action_limit_terminates_once() -> None:
    model = FakeModel([tool_output("search", {"query": "x"})])
    env = FakeEnvironment(
        steps=[env_result({"observation_version": "v", "page_type": "search_home", "search_available": True, "actions": []})]
    )
    trace = written(await runtime(model, env, max_steps=2).run(JOB))
    assert env.terminations == ["action_limit"] and trace["status"] == "completed"
    assert trace["final"]["termination_reason"] == "action_limit" and len(trace["steps"]) == 2


async def test_r3_generation_length_is_a_scored_policy_failure() -> None:
    cut = ModelOutput(
        reasoning="思考被截断", finish_reason="length", policy_failure={"code": "generation_length", "message": "cut"}
    )
    env = FakeEnvironment()
    trace = written(await runtime(FakeModel([cut]), env).run(JOB))
    assert trace["status"] == "completed" and trace["final"]["reward"] == 0.0
    assert trace["final"]["termination_reason"] == "generation_length"
    assert env.terminations == ["generation_length"] and env.actions == []
    (step,) = trace["steps"]
    assert step["policy_failure"]["code"] == "generation_length" and step["model"]["reasoning"] == "思考被截断"
    assert step["action"] is None and step["environment"] is None and "protocol_feedback" not in step


async def test_r4_text_reply_gets_a_user_repair_turn() -> None:
    text = ModelOutput(
        content="Action: search[耳机]", finish_reason="stop", protocol_error={"code": "tool_call_count", "message": "no call"}
    )
    model = FakeModel([text, tool_output("search", {"query": "耳机"}), tool_output("click", {"value": "buy now"})])
    env = FakeEnvironment()
    trace = written(await runtime(model, env).run(JOB))
    assert [c["seed"] for c in model.calls] == [50, 51, 52] and len(trace["steps"]) == 3 and len(env.actions) == 2
    first = trace["steps"][0]
    assert first["protocol_error"]["code"] == "tool_call_count" and first["model"]["content"] == "Action: search[耳机]"
    assert first["action"] is None and first["environment"] is None
    assert trace["conversation"][2] == {"role": "assistant", "content": "Action: search[耳机]"}
    repair = trace["conversation"][3]
    assert repair["role"] == "user"
    feedback = json.loads(repair["content"])
    assert feedback["type"] == "tool_protocol_error" and "search" in feedback["available_tools"]
    assert trace["steps"][1]["observation"] == first["observation"]


async def test_r5_wrong_argument_keys_get_a_tool_repair_turn() -> None:
    model = FakeModel(
        [
            tool_output("search", {"wrong": "x"}),
            tool_output("search", {"query": "耳机"}),
            tool_output("click", {"value": "buy now"}),
        ]
    )
    trace = written(await runtime(model, FakeEnvironment()).run(JOB))
    assert trace["steps"][0]["protocol_error"]["code"] == "invalid_tool_arguments"
    assert trace["conversation"][2]["role"] == "assistant" and trace["conversation"][2]["tool_calls"]
    assert trace["conversation"][3]["role"] == "tool" and trace["conversation"][3]["tool_call_id"] == "call-1"
    assert trace["status"] == "completed"


async def test_r6_out_of_enum_click_reaches_the_environment() -> None:
    invalid = env_result(results_state(["buy now"]), action_feedback={"valid": False, "reason": "unavailable_action"})
    model = FakeModel(
        [tool_output("search", {"query": "x"}), tool_output("click", {"value": "92"}), tool_output("click", {"value": "buy now"})]
    )
    env = FakeEnvironment(steps=[env_result(results_state(["buy now"])), invalid, purchase_result()])
    trace = written(await runtime(model, env).run(JOB))
    assert env.actions[1] == "click[92]" and "protocol_error" not in trace["steps"][1]


async def test_truncated_tool_call_is_generation_length_not_a_repair() -> None:
    # What the adapter returns for finish_reason=length with broken argument JSON (weak point 4).
    cut = ModelOutput(
        tool_calls=[call("search", '{"query": "耳')],
        finish_reason="length",
        policy_failure={"code": "generation_length", "message": "cut"},
    )
    env = FakeEnvironment()
    trace = written(await runtime(FakeModel([cut]), env).run(JOB))
    assert env.terminations == ["generation_length"] and "protocol_error" not in trace["steps"][0]


async def test_cleanup_failure_makes_the_episode_failed() -> None:
    env = FakeEnvironment()
    env.close_error = EnvironmentUnavailableError("release_one timed out", action="release_one")
    model = FakeModel([tool_output("search", {"query": "x"}), tool_output("click", {"value": "buy now"})])
    trace = written(await runtime(model, env).run(JOB))
    assert trace["status"] == "failed" and trace["final"]["done"] is True and not read_trace(trace).completed
    assert trace["error"]["stage"] == "cleanup" and trace["failure_class"] == "infrastructure"


SERVER_500 = EnvironmentResponseError("'NoneType' object is not subscriptable", action="interact", status=500)


def _model_4xx(status: int, **kwargs: Any) -> ModelRequestError:
    return ModelRequestError(f"non-retryable model HTTP {status}", status_code=status, attempts=[], **kwargs)


@pytest.mark.parametrize(
    ("case", "outputs", "env", "stage", "expected"),
    [
        # Before the agent acted, nothing the environment does is the agent's.
        ("reset 500", [], FakeEnvironment(), "reset", "infrastructure"),
        ("version", [], FakeEnvironment(), "reset", "infrastructure"),
        # The shop fails on the agent's action: the agent's outcome.
        (
            "interact 500",
            [tool_output("search", {"query": "x"})],
            FakeEnvironment(steps=[SERVER_500]),
            "environment_step_1",
            "environment_error",
        ),
        (
            "interact 409",
            [tool_output("search", {"query": "x"})],
            FakeEnvironment(steps=[LeaseError("stale", action="interact", status=409)]),
            "environment_step_1",
            "infrastructure",
        ),
        (
            "interact unavailable",
            [tool_output("search", {"query": "x"})],
            FakeEnvironment(steps=[EnvironmentUnavailableError("HTTP 500", action="interact", status=500, state_unchanged=True)]),
            "environment_step_1",
            "infrastructure",
        ),
        (
            "model 503",
            [ModelRequestError("after 3 attempts: 503", status_code=503, attempts=[])],
            FakeEnvironment(),
            "model_step_1",
            "infrastructure",
        ),
        # The first prompt is the run's own: a 4xx there is its configuration.
        ("model 400 first prompt", [_model_4xx(400)], FakeEnvironment(), "model_step_1", "configuration_error"),
        (
            "model 400 later turn",
            [tool_output("search", {"query": "x"}), _model_4xx(400)],
            FakeEnvironment(),
            "model_step_2",
            "model_error",
        ),
        (
            "model 401 later turn",
            [tool_output("search", {"query": "x"}), _model_4xx(401)],
            FakeEnvironment(),
            "model_step_2",
            "configuration_error",
        ),
        (
            "max_tokens >= window",
            [tool_output("search", {"query": "x"}), _model_4xx(400, configuration=True)],
            FakeEnvironment(),
            "model_step_2",
            "configuration_error",
        ),
        (
            "missing key",
            [ModelConfigError("model API key variable 'K' is not set")],
            FakeEnvironment(),
            "model_step_1",
            "configuration_error",
        ),
    ],
)
async def test_failures_are_charged_to_whoever_caused_them(
    case: str, outputs: list[Any], env: FakeEnvironment, stage: str, expected: str
) -> None:
    if case == "reset 500":
        env.reset_error = EnvironmentResponseError("'unknown or inactive task_id 7'", action="reset", status=500)
    if case == "version":
        env.reset_error = EnvironmentVersionError("observation_version is 'v6'", action="reset")
    trace = written(await runtime(FakeModel(outputs), env).run(JOB))
    assert trace["status"] == "failed" and trace["error"]["stage"] == stage, case
    assert trace["failure_class"] == expected, case
    assert env.closes == 1


async def test_page_without_tools_fails_at_the_tool_stage() -> None:
    env = FakeEnvironment(steps=[env_result(results_state([]))])
    trace = written(await runtime(FakeModel([tool_output("search", {"query": "x"})]), env).run(JOB))
    assert trace["status"] == "failed" and trace["error"]["stage"] == "tools_step_2"
    assert "search_results" in trace["error"]["message"]
