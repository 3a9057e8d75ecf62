"""The token-level model adapter against the testbed's SGLang-style ``/generate`` over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from shopsimrl.episode import classify_failure
from shopsimrl.model import ModelRequestError
from shopsimrl.prompts import action_tools
from shopsimrl.testbed.chat_tokens import TestbedChatTokenizer
from shopsimrl.testbed.policy import PolicySettings, create_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.training.token_model import TokenModel, TokenModelSettings

pytestmark = pytest.mark.slow

TOKENIZER = TestbedChatTokenizer()
HOME = {"page_type": "search_home", "search_available": True, "actions": []}
MESSAGES = [
    {"role": "system", "content": "你是购物助手。"},
    {
        "role": "user",
        "content": "购物任务：\n我想买一款黑色的蓝牙耳机，支持主动降噪\n\n页面：搜索首页\n\n页面能力：\n- 支持商品搜索\n",
    },
]


async def _no_wait(seconds: float) -> None:
    """Backoff waits are skipped: the attempts, not the time between them, are under test."""


@contextmanager
def _served(**knobs: Any) -> Iterator[str]:
    with running_server(create_app(PolicySettings(token_endpoint=True, **knobs))) as base:
        yield base


def _model(base: str, **settings: Any) -> TokenModel:
    return TokenModel(TokenModelSettings(base_url=base, **settings), TOKENIZER, sleep=_no_wait)


async def test_a_call_keeps_the_exact_ids_and_gives_the_engine_a_tool_call() -> None:
    tools = action_tools(HOME)
    with _served() as base:
        model = _model(base, max_new_tokens=256, temperature=0.6)
        session = model.session("episode-1")
        try:
            output = await session.generate(list(MESSAGES), tools, seed=5)
        finally:
            await model.aclose()
    assert output.protocol_error is None and output.policy_failure is None
    (call,) = output.tool_calls
    assert call.name == "search" and "耳机" in call.arguments["query"]
    (turn,) = session.turns
    assert turn.prompt_ids == TOKENIZER.render(MESSAGES, tools)
    assert turn.output_ids[-1] == TOKENIZER.eos_token_id and turn.finish_type == "stop"
    assert len(turn.output_log_probs) == len(turn.output_ids)
    assert TOKENIZER.decode(turn.output_ids, skip_special_tokens=True) == (
        '<tool_call>\n{"name": "search", "arguments": ' + call.raw_arguments + "}\n</tool_call>"
    )
    assert output.usage == {
        "prompt_tokens": len(turn.prompt_ids),
        "completion_tokens": len(turn.output_ids),
        "total_tokens": len(turn.prompt_ids) + len(turn.output_ids),
    }
    recorded = json.dumps(output.to_dict())
    assert str(turn.output_ids[:8])[1:-1] not in recorded, "no token ids in what the trace records"
    assert session.identity()["tokenizer"]["chat_template"] == "testbed-chatml-tools-v1"


async def test_server_errors_are_retried_then_an_infrastructure_failure() -> None:
    tools = action_tools(HOME)
    with _served(rate_500=0.5, fault_seed=3) as base:
        model = _model(base, max_retries=8)
        retried = model.session("episode-2")
        output = await retried.generate(list(MESSAGES), tools)
        await model.aclose()
    assert output.attempt_count > 1, "the seeded faults made the first attempt fail"
    assert [a["status"] for a in output.attempts][:-1] == [500] * (output.attempt_count - 1)
    assert len(retried.turns) == 1
    with _served(rate_500=1.0) as base:
        model = _model(base, max_retries=3)
        failing = model.session("episode-3")
        with pytest.raises(ModelRequestError, match="failed after 3 attempts") as caught:
            await failing.generate(list(MESSAGES), tools)
        await model.aclose()
    assert caught.value.attempt_count == 3 and failing.turns == []
    assert classify_failure(caught.value) == "infrastructure"


async def test_an_aborted_generation_is_retried_and_never_recorded() -> None:
    with _served(rate_abort=1.0) as base:
        model = _model(base, max_retries=2)
        session = model.session("episode-4")
        with pytest.raises(ModelRequestError, match="the server aborted the request"):
            await session.generate(list(MESSAGES), action_tools(HOME))
        await model.aclose()
    assert session.turns == []


async def test_the_token_limit_is_a_generation_length_policy_failure_with_its_turn_kept() -> None:
    with _served() as base:
        model = _model(base, max_new_tokens=12)
        session = model.session("episode-5")
        output = await session.generate(list(MESSAGES), action_tools(HOME))
        await model.aclose()
    assert output.policy_failure is not None and output.policy_failure["code"] == "generation_length"
    (turn,) = session.turns
    assert turn.finish_type == "length" and len(turn.output_ids) == 12


async def test_context_overflow_is_a_policy_failure_and_a_budget_beyond_the_window_a_configuration_error() -> None:
    tools = action_tools(HOME)
    prompt = len(TOKENIZER.render(MESSAGES, tools))
    with _served(max_model_len=prompt + 20) as base:
        model = _model(base, max_new_tokens=64)
        session = model.session("episode-6")
        output = await session.generate(list(MESSAGES), tools)
        too_big = _model(base, max_new_tokens=prompt + 20).session("episode-7")
        with pytest.raises(ModelRequestError, match="is not smaller than the model's context window") as caught:
            await too_big.generate(list(MESSAGES), tools)
        await model.aclose()
        await too_big.model.aclose()
    assert output.policy_failure is not None and output.policy_failure["code"] == "context_length"
    assert session.turns == [] and output.attempt_count == 1
    assert classify_failure(caught.value) == "configuration_error"


async def test_a_client_error_is_not_retried() -> None:
    with _served() as base:
        # The OpenAI base URL where the server's root belongs: /v1/generate does not exist.
        model = _model(base + "/v1", max_retries=5)
        with pytest.raises(ModelRequestError, match="non-retryable HTTP 404") as caught:
            await model.session("episode-8").generate(list(MESSAGES), action_tools(HOME))
        await model.aclose()
    assert caught.value.attempt_count == 1 and caught.value.status_code == 404
    assert classify_failure(caught.value) == "configuration_error"
