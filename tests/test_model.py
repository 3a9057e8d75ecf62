"""OpenAI-compatible adapter against a real local HTTP server (``openai_stub`` served by uvicorn)."""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import shopsimrl.model as model_module
from shopsimrl.httpclient import HttpService, Timeout
from shopsimrl.model import (
    ChatModel,
    ModelConfigError,
    ModelRequestError,
    OpenAICompatibleChatModel,
    OpenAICompatibleSettings,
)
from shopsimrl.testbed.serving import free_port, running_server
from tests.openai_stub import OpenAIStub, Reply, completion, tool_call
from tests.polling import busy_until_closed_by_server, open_connections_to

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
CLICK_TOOL = {
    "type": "function",
    "function": {
        "name": "click",
        "parameters": {"type": "object", "properties": {"value": {"type": "string", "enum": ["buy now"]}}},
    },
}
TOOLS = [SEARCH_TOOL, CLICK_TOOL]
MESSAGES = [{"role": "system", "content": "你是购物助手"}, {"role": "user", "content": "买一件红色T恤"}]
KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[OpenAIStub, str]]:
    stub = OpenAIStub()
    with running_server(stub) as url:
        yield stub, url + "/v1"


@pytest.fixture
def stub(server: tuple[OpenAIStub, str]) -> OpenAIStub:
    server[0].reset()
    return server[0]


class SleepRecorder:
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


@pytest.fixture
async def make(
    server: tuple[OpenAIStub, str], sleeps: SleepRecorder, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[..., OpenAICompatibleChatModel]]:
    monkeypatch.setenv("SHOPSIMRL_TEST_KEY", KEY)
    made: list[OpenAICompatibleChatModel] = []

    def factory(**overrides: Any) -> OpenAICompatibleChatModel:
        fields: dict[str, Any] = {"model": "stub-model", "base_url": server[1] + "/", "api_key_env": "SHOPSIMRL_TEST_KEY"}
        fields.update(overrides)
        adapter = OpenAICompatibleChatModel(OpenAICompatibleSettings(**fields), sleep=sleeps)
        made.append(adapter)
        return adapter

    yield factory
    for adapter in made:
        await adapter.aclose()


def stream_chunks(*deltas: dict[str, Any], finish: str = "tool_calls", usage: dict[str, Any] | None = None) -> list[Any]:
    chunks: list[Any] = [
        {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1700000001, "choices": [{"index": 0, "delta": d}]}
        for d in deltas
    ]
    chunks.append({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append(
        {"id": "chatcmpl-s", "choices": [], "usage": usage or {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}}
    )
    return chunks


FRAGMENTED_CALL = (
    {"role": "assistant", "reasoning_content": "先搜索"},
    {"reasoning_content": "红色T恤。"},
    {"tool_calls": [{"index": 0, "id": "call-s1", "type": "function", "function": {"name": "search", "arguments": '{"qu'}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": 'ery": "红色'}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": ' T恤"}'}}]},
)


# --------------------------------------------------------------------------- reference M1–M9


async def test_m1_retry_then_parse_and_payload(stub: OpenAIStub, make: Any, sleeps: SleepRecorder) -> None:
    stub.queue(
        Reply(status=429, json={"error": {"message": "slow down"}}),
        Reply(json=completion(tool_calls=[tool_call()], reasoning="用户要红色T恤")),
    )
    model = make(checkpoint_id="ckpt-secret-label", extra_body={"enable_thinking": True, "top_k": 20}, top_p=0.95)
    out = await model.generate(MESSAGES, TOOLS, seed=42)

    assert len(stub.completions) == 2 and len(sleeps.calls) == 1
    payload = stub.completions[1].json
    assert payload["seed"] == 42 and payload["enable_thinking"] is True and payload["top_k"] == 20
    assert payload["tool_choice"] == "auto" and payload["tools"] == TOOLS and payload["top_p"] == 0.95
    assert payload["messages"] == MESSAGES and payload["stream"] is False and "stream_options" not in payload
    assert b"ckpt-secret-label" not in stub.completions[1].body
    assert model.identity()["checkpoint_id"] == "ckpt-secret-label"
    assert out.content is None and out.reasoning == "用户要红色T恤"
    assert out.tool_calls[0].arguments == {"query": "红色 T恤"}
    assert out.tool_calls[0].raw_arguments == '{"query": "红色 T恤"}'
    assert out.protocol_error is None and out.policy_failure is None and out.raw_response is None
    assert out.attempt_count == 2 and [a["status"] for a in out.attempts] == [429, 200]
    assert out.response_id == "chatcmpl-1" and out.usage == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert out.metadata == {"created": 1700000000}


async def test_m2_streaming_assembles_reasoning_arguments_usage(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(sse=[": keep-alive comment", *stream_chunks(*FRAGMENTED_CALL)]))
    model = make(stream=True)
    out = await model.generate(MESSAGES, TOOLS, seed=1)

    payload = stub.completions[0].json
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert stub.completions[0].headers["accept"] == "text/event-stream"
    assert out.reasoning == "先搜索红色T恤。"
    assert out.tool_calls[0].call_id == "call-s1"
    assert out.tool_calls[0].arguments == {"query": "红色 T恤"}
    assert out.finish_reason == "tool_calls"
    assert out.usage == {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}
    assert out.response_id == "chatcmpl-s" and out.metadata == {"created": 1700000001}
    assert out.protocol_error is None and out.attempt_count == 1


async def test_m3_broken_stream_is_retried_from_scratch(stub: OpenAIStub, make: Any) -> None:
    first = stream_chunks({"tool_calls": [{"index": 0, "id": "call-old", "function": {"name": "click", "arguments": "{"}}]})
    stub.queue(Reply(sse=first, break_after=1), Reply(sse=stream_chunks(*FRAGMENTED_CALL)))
    out = await make(stream=True).generate(MESSAGES, TOOLS)

    assert len(stub.completions) == 2
    assert [c.call_id for c in out.tool_calls] == ["call-s1"]  # nothing carried over from the broken stream
    assert out.tool_calls[0].name == "search"
    assert out.attempt_count == 2 and out.attempts[1]["error"] is None
    # the dropped connection (a cut-off chunked body), retried
    assert out.attempts[0]["error"].startswith("RemoteProtocolError: the server closed the connection in the middle")


async def test_m4_missing_streamed_call_id_is_derived(stub: OpenAIStub, make: Any) -> None:
    fragments = ({"tool_calls": [{"index": 0, "function": {"name": "search", "arguments": '{"query": "袜子"}'}}]},)
    stub.queue(Reply(sse=stream_chunks(*fragments)), Reply(sse=stream_chunks(*fragments)))
    model = make(stream=True)
    first = await model.generate(MESSAGES, TOOLS)
    second = await model.generate(MESSAGES, TOOLS)

    call_id = first.tool_calls[0].call_id
    assert call_id.startswith("call-stream-") and len(call_id) == len("call-stream-") + 24
    assert second.tool_calls[0].call_id == call_id  # derived from content, so stable
    assert first.protocol_error is None and first.tool_calls[0].arguments == {"query": "袜子"}


async def test_m5_non_retryable_400_fails_after_one_request(stub: OpenAIStub, make: Any, sleeps: SleepRecorder) -> None:
    stub.queue(Reply(status=400, json={"error": {"message": "context length exceeded"}}))
    with pytest.raises(ModelRequestError) as info:
        await make().generate(MESSAGES, TOOLS)
    assert len(stub.completions) == 1 and sleeps.calls == []
    assert info.value.status_code == 400 and info.value.attempt_count == 1
    assert "non-retryable model HTTP 400" in str(info.value) and "context length exceeded" in str(info.value)


async def test_m6_m7_text_reply_is_tool_call_count_without_resampling(stub: OpenAIStub, make: Any) -> None:
    body = completion(content="Action: search[红色T恤]", finish_reason="stop")
    stub.queue(Reply(json=body))
    out = await make().generate(MESSAGES, TOOLS)
    assert len(stub.completions) == 1
    assert out.protocol_error is not None and out.protocol_error["code"] == "tool_call_count"
    assert out.content == "Action: search[红色T恤]" and out.tool_calls == []
    assert out.raw_response == body


async def test_m8_call_with_visible_text_is_mixed_content(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(json=completion(content="我来搜索。", tool_calls=[tool_call()])))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.protocol_error is not None and out.protocol_error["code"] == "mixed_content"
    assert out.tool_calls[0].name == "search" and out.tool_calls[0].arguments == {"query": "红色 T恤"}


async def test_m9_length_without_call_is_generation_length(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(json=completion(content=None, reasoning="想了很久……", finish_reason="length", response_id="chatcmpl-len")))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.policy_failure is not None and out.policy_failure["code"] == "generation_length"
    assert out.protocol_error is None and out.reasoning == "想了很久……"
    assert out.raw_response["id"] == "chatcmpl-len"


# --------------------------------------------------------------------------- protocol classification


async def test_truncated_call_at_length_is_generation_length_not_bad_json(stub: OpenAIStub, make: Any) -> None:
    truncated = [tool_call(arguments='{"query": "红色')]
    stub.queue(
        Reply(json=completion(tool_calls=truncated, finish_reason="length")),
        Reply(json=completion(tool_calls=truncated, finish_reason="stop")),
    )
    model = make()
    at_length = await model.generate(MESSAGES, TOOLS)
    assert at_length.policy_failure == {"code": "generation_length", "message": at_length.policy_failure["message"]}
    assert at_length.protocol_error is None and at_length.tool_calls[0].raw_arguments == '{"query": "红色'
    stopped = await model.generate(MESSAGES, TOOLS)  # the same call without truncation is a repairable error
    assert stopped.protocol_error is not None and stopped.protocol_error["code"] == "invalid_arguments_json"
    assert stopped.policy_failure is None


async def test_length_with_one_complete_call_is_accepted(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(json=completion(tool_calls=[tool_call()], finish_reason="length")))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.policy_failure is None and out.protocol_error is None and out.tool_calls[0].arguments == {"query": "红色 T恤"}


def _message_body(message: Any) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


PROTOCOL_CASES: list[tuple[str, Any, list[dict[str, Any]]]] = [
    ("invalid_response_body", [1, 2], TOOLS),
    ("missing_choices", {"id": "x", "choices": []}, TOOLS),
    ("invalid_choice", {"choices": ["nope"]}, TOOLS),
    ("invalid_message", {"choices": [{"message": "text"}]}, TOOLS),
    ("invalid_tool_calls", _message_body({"role": "assistant", "tool_calls": {"id": "c"}}), TOOLS),
    ("invalid_tool_call", _message_body({"tool_calls": [{"id": "c", "type": "code", "function": {}}]}), TOOLS),
    ("missing_function", _message_body({"tool_calls": [{"id": "c", "type": "function"}]}), TOOLS),
    ("missing_tool_call_id", _message_body({"tool_calls": [{"type": "function", "function": {"name": "search"}}]}), TOOLS),
    ("missing_tool_name", _message_body({"tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}), TOOLS),
    ("invalid_arguments_type", _message_body({"tool_calls": [tool_call(arguments={"query": "x"})]}), TOOLS),
    ("invalid_arguments_json", _message_body({"tool_calls": [tool_call(arguments="{query: x}")]}), TOOLS),
    ("invalid_arguments_object", _message_body({"tool_calls": [tool_call(arguments='["x"]')]}), TOOLS),
    ("unavailable_tool", _message_body({"tool_calls": [tool_call(name="checkout")]}), TOOLS),
    ("tool_call_count", _message_body({"tool_calls": [tool_call(), tool_call(call_id="call-2")]}), TOOLS),
    ("empty_response", _message_body({"role": "assistant", "content": "  "}), []),
    # Order: a structural problem of a later call outranks an argument problem of an earlier one.
    ("missing_tool_name", _message_body({"tool_calls": [tool_call(arguments="{"), {"id": "c2", "function": {}}]}), TOOLS),
]


@pytest.mark.parametrize(("code", "body", "tools"), PROTOCOL_CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(PROTOCOL_CASES)])
async def test_protocol_error_codes(stub: OpenAIStub, make: Any, code: str, body: Any, tools: list[dict[str, Any]]) -> None:
    stub.queue(Reply(json=body))
    out = await make().generate(MESSAGES, tools)
    assert out.protocol_error is not None and out.protocol_error["code"] == code, out.protocol_error
    assert out.raw_response == body and len(stub.completions) == 1
    if code in ("invalid_tool_call", "missing_function", "missing_tool_call_id", "missing_tool_name"):
        assert out.tool_calls == []  # no call ids to answer in a repair turn
    if code in ("invalid_arguments_json", "unavailable_tool", "tool_call_count"):
        assert out.tool_calls and all(c.call_id for c in out.tool_calls)


async def test_non_json_success_body_is_a_protocol_error_and_not_retried(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(body="<html>" + "x" * 5000))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.protocol_error is not None and out.protocol_error["code"] == "invalid_json_response"
    assert out.raw_response == {"text": ("<html>" + "x" * 5000)[:4000]}
    assert len(stub.completions) == 1 and out.attempt_count == 1


async def test_text_parts_are_joined_and_metadata_kept(stub: OpenAIStub, make: Any) -> None:
    parts = [{"type": "text", "text": "你好"}, {"type": "image_url"}, {"type": "text", "text": "，世界"}]
    stub.queue(Reply(json=completion(content=parts, finish_reason="stop", system_fingerprint="fp-1", service_tier="default")))
    out = await make().generate(MESSAGES, [])
    assert out.content == "你好，世界" and out.protocol_error is None  # no tools offered: text is fine
    assert out.metadata == {"created": 1700000000, "system_fingerprint": "fp-1", "service_tier": "default"}
    assert "tools" not in stub.completions[0].json and "tool_choice" not in stub.completions[0].json


# --------------------------------------------------------------------------- retries


async def test_two_503s_then_success_records_every_attempt(stub: OpenAIStub, make: Any, sleeps: SleepRecorder) -> None:
    stub.queue(Reply(status=503, body="busy"), Reply(status=503, body="busy"), Reply(json=completion(tool_calls=[tool_call()])))
    out = await make(retry_backoff_seconds=0.5).generate(MESSAGES, TOOLS)
    assert out.attempt_count == 3 and len(stub.completions) == 3
    assert [a["attempt"] for a in out.attempts] == [1, 2, 3]
    assert [a["status"] for a in out.attempts] == [503, 503, 200]
    assert all(isinstance(a["latency_ms"], float) and a["latency_ms"] >= 0 for a in out.attempts)
    assert out.latency_ms == out.attempts[-1]["latency_ms"]  # the successful attempt only
    assert "HTTP 503: busy" in out.attempts[0]["error"] and out.attempts[2]["error"] is None
    # Capped exponential backoff with jitter: b*2^a + U(0,1)*min(b*2^a, 1).
    assert 0.5 <= sleeps.calls[0] < 1.0 and 1.0 <= sleeps.calls[1] < 2.0
    assert [a["backoff_ms"] for a in out.attempts] == [round(s * 1000, 3) for s in sleeps.calls] + [0.0]


async def test_retry_after_seconds_and_http_date_are_honoured_and_capped(
    stub: OpenAIStub, make: Any, sleeps: SleepRecorder
) -> None:
    far_future = email.utils.formatdate(time.time() + 3600, usegmt=True)
    stub.queue(
        Reply(status=429, headers={"Retry-After": "7"}, body="limited"),
        Reply(status=429, headers={"Retry-After": "120"}, body="limited"),
        Reply(status=503, headers={"Retry-After": far_future}, body="maintenance"),
        Reply(status=409, headers={"Retry-After": "soon"}, body="conflict"),
        Reply(json=completion(tool_calls=[tool_call()])),
    )
    out = await make(max_backoff_seconds=30.0, retry_backoff_seconds=0.0).generate(MESSAGES, TOOLS)
    assert sleeps.calls == [7.0, 30.0, 30.0, 0.0]  # an unparsable header falls back to the backoff (0 here)
    assert out.attempt_count == 5


async def test_retries_exhausted_raise_with_bounded_body(stub: OpenAIStub, make: Any, sleeps: SleepRecorder) -> None:
    stub.queue(Reply(status=500, body="boom" * 1000), Reply(status=502, body="E" * 2000))
    with pytest.raises(ModelRequestError) as info:
        await make(max_retries=2).generate(MESSAGES, TOOLS)
    message = str(info.value)
    assert message.startswith("model request failed after 2 attempts: HTTP 502: ")
    assert message.count("E") <= 500 and len(message) < 600
    assert info.value.status_code == 502 and info.value.attempt_count == 2 and len(sleeps.calls) == 1
    assert len(stub.completions) == 2


async def test_connection_errors_are_retried_then_reported(make: Any, sleeps: SleepRecorder) -> None:
    model = make(base_url=f"http://127.0.0.1:{free_port()}/v1", max_retries=3)
    with pytest.raises(ModelRequestError) as info:
        await model.generate(MESSAGES, TOOLS)
    assert info.value.status_code is None and info.value.attempt_count == 3 and len(sleeps.calls) == 2
    assert "ConnectError" in str(info.value) and all(a["status"] is None for a in info.value.attempts)


async def test_stream_without_done_and_chunk_error_are_retried(stub: OpenAIStub, make: Any) -> None:
    stub.queue(
        Reply(sse=stream_chunks(*FRAGMENTED_CALL), done=False),
        Reply(sse=[{"error": {"message": "engine overloaded"}}]),
        Reply(sse=["data: {not json"]),
        Reply(sse=[]),
        Reply(sse=stream_chunks(*FRAGMENTED_CALL)),
    )
    out = await make(stream=True).generate(MESSAGES, TOOLS)
    assert out.attempt_count == 5 and out.tool_calls[0].arguments == {"query": "红色 T恤"}
    errors = [a["error"] for a in out.attempts[:4]]
    assert "without [DONE]" in errors[0] and "engine overloaded" in errors[1] and "not JSON" in errors[2]
    assert "without any data" in errors[3]


async def test_streamed_truncated_call_is_generation_length(stub: OpenAIStub, make: Any) -> None:
    fragments = ({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "search", "arguments": '{"query": "红'}}]},)
    stub.queue(Reply(sse=stream_chunks(*fragments, finish="length")))
    out = await make(stream=True).generate(MESSAGES, TOOLS)
    assert out.policy_failure is not None and out.policy_failure["code"] == "generation_length"
    assert out.raw_response["id"] == "chatcmpl-s" and out.raw_response["choices"][0]["finish_reason"] == "length"


async def test_stream_request_answered_with_plain_json_is_accepted(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(json=completion(tool_calls=[tool_call()])))
    out = await make(stream=True).generate(MESSAGES, TOOLS)
    assert out.protocol_error is None and out.tool_calls[0].name == "search"


# --------------------------------------------------------------------------- API key


async def test_api_key_is_sent_as_bearer_and_never_leaks(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(json=completion(tool_calls=[tool_call()])), Reply(status=401, body=f"invalid api key {KEY}"))
    model = make()
    await model.generate(MESSAGES, TOOLS)
    assert stub.completions[0].headers["authorization"] == f"Bearer {KEY}"
    with pytest.raises(ModelRequestError) as info:
        await model.generate(MESSAGES, TOOLS)
    assert info.value.status_code == 401
    for text in (
        str(info.value),
        json.dumps(info.value.attempts),
        json.dumps(model.identity()),
        repr(model),
        repr(model.settings),
    ):
        assert KEY not in text
    assert "invalid api key ***" in str(info.value)


async def test_missing_or_blank_key_is_a_config_error_before_any_request(
    stub: OpenAIStub, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make(api_key_env="SHOPSIMRL_ABSENT_KEY")
    monkeypatch.delenv("SHOPSIMRL_ABSENT_KEY", raising=False)
    with pytest.raises(ModelConfigError, match="SHOPSIMRL_ABSENT_KEY"):
        model.check_api_key()
    with pytest.raises(ModelConfigError, match="SHOPSIMRL_ABSENT_KEY"):
        await model.generate(MESSAGES, TOOLS)
    monkeypatch.setenv("SHOPSIMRL_ABSENT_KEY", "   ")
    with pytest.raises(ModelConfigError, match="blank"):
        model.check_api_key()
    assert stub.requests == []


async def test_no_key_env_sends_no_authorization(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(json=completion(tool_calls=[tool_call()])))
    model = make(api_key_env=None)
    model.check_api_key()
    await model.generate(MESSAGES, TOOLS)
    assert "authorization" not in stub.completions[0].headers


# --------------------------------------------------------------------------- settings and identity


@pytest.mark.parametrize("key", sorted(model_module.RESERVED_BODY_KEYS))
def test_extra_body_may_not_override_reserved_keys(key: str) -> None:
    with pytest.raises(ModelConfigError, match=repr(key)):
        OpenAICompatibleSettings(model="m", base_url="http://x/v1", extra_body={key: 1})


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"model": " "}, "model"),
        ({"base_url": "localhost:8000"}, "base_url"),
        ({"max_retries": 0}, "max_retries"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"timeout": 0}, "timeout"),
        ({"checkpoint_id": ""}, "checkpoint_id"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"tool_choice": ""}, "tool_choice"),
        ({"stream": "yes"}, "stream"),
        ({"base_url": "http://user:pw@x/v1"}, "credentials; put the API key in the environment variable named by api_key_env"),
        ({"base_url": "http://x/v1#frag"}, "fragment"),
        ({"extra_body": {"x": object()}}, "extra_body"),
    ],
)
def test_bad_settings_name_the_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelConfigError, match=named):
        OpenAICompatibleSettings(**{"model": "m", "base_url": "http://x/v1", **fields})


async def test_a_query_in_base_url_stays_after_the_path(stub: OpenAIStub, make: Any, server: tuple[OpenAIStub, str]) -> None:
    """Gateways such as Azure take ``?api-version=…``; the endpoint path goes before it."""
    stub.queue(Reply(json=completion(tool_calls=[tool_call()])))
    model = make(base_url=server[1] + "/?api-version=2024-06-01")
    out = await model.generate(MESSAGES, TOOLS)
    assert out.protocol_error is None and out.tool_calls[0].name == "search"
    assert await model.list_models() == ["stub-model"]
    assert [(r.method, r.path, r.query) for r in stub.requests] == [
        ("POST", "/v1/chat/completions", "api-version=2024-06-01"),
        ("GET", "/v1/models", "api-version=2024-06-01"),
    ]


def test_identity_shape() -> None:
    settings = OpenAICompatibleSettings(
        model="Qwen/Qwen3.5-4B", base_url="http://vllm:8000/v1/", extra_body={"enable_thinking": True}, stream=True
    )
    model = OpenAICompatibleChatModel(settings)
    assert isinstance(model, ChatModel)
    assert model.identity() == {
        "provider": "openai_compatible_http",
        "model": "Qwen/Qwen3.5-4B",
        "base_url": "http://vllm:8000/v1",
        "transport": {"timeout_seconds": 180.0, "max_retries": 5, "retry_backoff_seconds": 1.0},
        "sampling": {
            "temperature": 0.0,
            "max_tokens": 512,
            "top_p": None,
            "send_seed": True,
            "tool_choice": "auto",
            "extra_body": {"enable_thinking": True},
        },
    }
    assert model.semantic_identity() == {k: v for k, v in model.identity().items() if k not in ("base_url", "transport")}
    moved = OpenAICompatibleChatModel(
        OpenAICompatibleSettings(
            model="Qwen/Qwen3.5-4B", base_url="http://other:1/v1", extra_body={"enable_thinking": True}, timeout=5, max_retries=2
        )
    )
    assert moved.semantic_identity() == model.semantic_identity()
    with_ckpt = OpenAICompatibleChatModel(OpenAICompatibleSettings(model="m", base_url="http://x", checkpoint_id="c1"))
    assert list(with_ckpt.identity())[:3] == ["provider", "checkpoint_id", "model"]


def test_settings_extra_body_is_a_frozen_copy() -> None:
    source = {"chat_template_kwargs": {"enable_thinking": False}}
    settings = OpenAICompatibleSettings(model="m", base_url="http://x", extra_body=source)
    source["chat_template_kwargs"]["enable_thinking"] = True
    model = OpenAICompatibleChatModel(settings)
    assert model.identity()["sampling"]["extra_body"] == {"chat_template_kwargs": {"enable_thinking": False}}
    with pytest.raises(TypeError):
        settings.extra_body["new"] = 1  # type: ignore[index]


# --------------------------------------------------------------------------- misc behaviour


async def test_list_models(stub: OpenAIStub, make: Any) -> None:
    stub.served_models = ["Qwen/Qwen3.5-4B", "stub-model"]
    assert await make().list_models() == ["Qwen/Qwen3.5-4B", "stub-model"]
    assert stub.requests[0].method == "GET" and stub.requests[0].path == "/v1/models"
    assert stub.requests[0].headers["authorization"] == f"Bearer {KEY}"


async def test_list_models_unreachable_is_a_request_error(make: Any) -> None:
    with pytest.raises(ModelRequestError, match="ConnectError"):
        await make(base_url=f"http://127.0.0.1:{free_port()}/v1").list_models()


@pytest.mark.parametrize("knob", [True, False])
async def test_assistant_content_empty_string(stub: OpenAIStub, make: Any, knob: bool) -> None:
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [tool_call()]},
        {"role": "tool", "tool_call_id": "call-1", "content": "搜索结果"},
    ]
    before = json.dumps(history, ensure_ascii=False)
    stub.queue(Reply(json=completion(tool_calls=[tool_call(name="click", arguments='{"value": "buy now"}')])))
    out = await make(assistant_content_empty_string=knob).generate(history, TOOLS)
    sent = stub.completions[0].json["messages"]
    assert sent[2]["content"] == ("" if knob else None) and sent[2]["tool_calls"] == history[2]["tool_calls"]
    assert sent[:2] == MESSAGES and sent[3] == history[3]
    assert json.dumps(history, ensure_ascii=False) == before  # the caller's list is untouched
    assert out.tool_calls[0].arguments == {"value": "buy now"}


async def test_one_pooled_client_serves_concurrent_calls(stub: OpenAIStub, make: Any) -> None:
    stub.queue(*[Reply(json=completion(tool_calls=[tool_call()])) for _ in range(24)])
    model = make()
    outs = await asyncio.gather(*[model.generate(MESSAGES, TOOLS, seed=i) for i in range(24)])
    assert all(o.protocol_error is None for o in outs) and len(stub.completions) == 24
    assert sorted(r.json["seed"] for r in stub.completions) == list(range(24))


async def test_send_seed_false_omits_seed(stub: OpenAIStub, make: Any) -> None:
    stub.queue(Reply(json=completion(tool_calls=[tool_call()])))
    await make(send_seed=False, tool_choice="required").generate(MESSAGES, TOOLS, seed=7)
    payload = stub.completions[0].json
    assert "seed" not in payload and payload["tool_choice"] == "required"


async def test_injected_client_is_not_closed_and_closed_adapter_refuses(stub: OpenAIStub, server: Any) -> None:
    stub.queue(Reply(json=completion(tool_calls=[tool_call()])), Reply(json=completion(tool_calls=[tool_call()])))
    http = HttpService()
    model = OpenAICompatibleChatModel(OpenAICompatibleSettings(model="m", base_url=server[1], api_key_env=None), http=http)
    await model.generate(MESSAGES, TOOLS)
    await model.aclose()
    await model.aclose()  # idempotent
    response = await http.request("GET", f"{server[1]}/models", timeout=Timeout(5))  # still open
    assert response.status_code == 200
    await http.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await model.generate(MESSAGES, TOOLS)


def test_adapter_survives_a_new_event_loop(server: tuple[OpenAIStub, str]) -> None:
    # e.g. `plan` probes the model in one asyncio.run() and the run happens in another.
    server[0].reset()
    model = OpenAICompatibleChatModel(OpenAICompatibleSettings(model="m", base_url=server[1], api_key_env=None))

    async def probe_then_close() -> list[str]:
        ids = await model.list_models()
        await model.aclose()
        return ids

    assert asyncio.run(model.list_models()) == ["stub-model"]
    assert asyncio.run(probe_then_close()) == ["stub-model"]
    assert len(server[0].requests) == 2


def test_stream_call_id_formula() -> None:
    # Pinned so that ids stay stable across versions (they end up in traces and repair turns).
    from shopsimrl.schemas import canonical_json

    expected = hashlib.sha256(
        canonical_json({"response_id": "r", "index": 0, "name": "search", "arguments": "{}"}).encode()
    ).hexdigest()[:24]
    assembler = model_module._StreamAssembler()
    for line in (
        'data: {"id": "r", "choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "search", "arguments": "{}"}}]}}]}',
        "data: [DONE]",
    ):
        assembler.feed(line)
    assert assembler.finish()["choices"][0]["message"]["tool_calls"][0]["id"] == "call-stream-" + expected


def test_public_surface() -> None:
    assert sorted(model_module.__all__) == [
        "ChatModel",
        "ModelConfigError",
        "ModelError",
        "ModelRequestError",
        "OpenAICompatibleChatModel",
        "OpenAICompatibleSettings",
        "context_overflow",
        "parse_chat_completion",
    ]


def test_parse_chat_completion_applies_the_adapters_checks_in_order() -> None:
    tools = [{"type": "function", "function": {"name": "click", "parameters": {}}}]
    call = {"id": "c", "type": "function", "function": {"name": "click", "arguments": '{"value": "x"}'}}
    body = {
        "choices": [{"message": {"role": "assistant", "content": "看看", "tool_calls": [call]}, "finish_reason": "tool_calls"}]
    }
    assert model_module.parse_chat_completion(body, tools).protocol_error == {
        "code": "mixed_content",
        "message": "visible text was returned alongside the tool call",
    }
    cut = {"choices": [{"message": {"role": "assistant", "content": "<tool_call>"}, "finish_reason": "length"}]}
    assert model_module.parse_chat_completion(cut, tools).policy_failure["code"] == "generation_length"  # type: ignore[index]


# --------------------------------------------------------------------------- text that is not valid Unicode


def _body(**message: Any) -> bytes:
    """A completion body whose message fields are given as JSON text, so a lone surrogate can be
    spelled as the escape a server writes (Python's json, unlike UTF-8, can carry it)."""
    fields = ",".join(f'"{key}":{value}' for key, value in message.items())
    return (
        b'{"id":"chatcmpl-u","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
        + fields.encode()
        + b'},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}'
    )


def _raw(body: bytes) -> Reply:
    return Reply(body=body, headers={"content-type": "application/json"})


async def test_a_lone_surrogate_in_the_arguments_is_an_invalid_unicode_protocol_error(stub: OpenAIStub, make: Any) -> None:
    arguments = json.dumps('{"query": "台灯\\ud800"}')  # the arguments text spells the escape: pure ASCII
    body = _body(
        content="null", tool_calls=f'[{{"id":"call-u","type":"function","function":{{"name":"search","arguments":{arguments}}}}}]'
    )
    stub.queue(_raw(body))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.protocol_error is not None and out.protocol_error["code"] == "invalid_unicode"
    message = out.protocol_error["message"]
    assert message.startswith("tool_calls[0].function.arguments: query holds a lone surrogate (U+D800) at index 2")
    (call,) = out.tool_calls
    assert call.arguments is None and call.raw_arguments == '{"query": "台灯\\ud800"}'  # the exact text
    assert out.raw_response == json.loads(body)


async def test_lone_surrogates_in_reply_fields_are_replaced_and_the_reply_kept_exactly(stub: OpenAIStub, make: Any) -> None:
    body = _body(
        content='"\\udfff"',
        reasoning_content='"想\\ud83d"',
        tool_calls='[{"id":"call-\\udc80","type":"function","function":{"name":"search","arguments":"{}"}}]',
    )
    stub.queue(_raw(body))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.protocol_error is not None and out.protocol_error["code"] == "invalid_unicode"
    assert out.protocol_error["message"].startswith("choices[0].message.content holds a lone surrogate (U+DFFF) at index 0")
    assert (out.content, out.reasoning, out.tool_calls[0].call_id) == ("\ufffd", "想\ufffd", "call-\ufffd")
    assert out.raw_response == json.loads(body) and out.raw_response["choices"][0]["message"]["content"] == "\udfff"


async def test_a_reply_cut_off_by_the_token_limit_stays_generation_length(stub: OpenAIStub, make: Any) -> None:
    body = _body(content='"\\ud800"').replace(b'"finish_reason":"tool_calls"', b'"finish_reason":"length"')
    stub.queue(_raw(body))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.policy_failure is not None and out.policy_failure["code"] == "generation_length"
    assert out.protocol_error is None and out.content == "\ufffd" and out.raw_response == json.loads(body)


async def test_a_surrogate_pair_split_across_stream_chunks_is_one_character(stub: OpenAIStub, make: Any) -> None:
    call = {"index": 0, "id": "call-p", "type": "function", "function": {"name": "search", "arguments": '{"query": "灯"}'}}
    chunks = stream_chunks({"role": "assistant"}, {"tool_calls": [call]})
    chunks[0:0] = ['data: {"id":"chatcmpl-s","choices":[{"index":0,"delta":{"reasoning_content":"a\\ud83d"}}]}']
    chunks[1:1] = ['data: {"id":"chatcmpl-s","choices":[{"index":0,"delta":{"reasoning_content":"\\ude00b"}}]}']
    stub.queue(Reply(sse=chunks))
    out = await make(stream=True).generate(MESSAGES, TOOLS)
    assert out.protocol_error is None and out.reasoning == "a😀b"


async def test_a_body_that_is_not_utf8_is_kept_byte_for_byte(stub: OpenAIStub, make: Any) -> None:
    body = b'{"id": "\xff\xfe chatcmpl", "choices": [\xed\xa0\x80'
    stub.queue(_raw(body))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.protocol_error is not None and out.protocol_error["code"] == "invalid_json_response"
    assert out.raw_response["text"].encode("utf-8", "surrogateescape") == body


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/net/tcp")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_calls_after_the_server_closed_idle_connections_under_a_busy_loop_need_no_retry(
    stream: bool, sleeps: SleepRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model server with a 1 s keep-alive (vLLM's and SGLang's uvicorn keep 5 s). 8 calls at
    once, then the event loop stays busy until the server has closed every pooled connection
    (their FINs wait unread), then 8 calls again, 3 rounds: each must succeed on its first
    attempt. Written into a connection the server had closed, a call fails and costs a retry."""
    calls, rounds = 8, 3
    monkeypatch.setenv("SHOPSIMRL_TEST_KEY", KEY)
    stub = OpenAIStub()
    with running_server(stub, timeout_keep_alive=1) as url:
        port = int(url.rsplit(":", 1)[1])
        settings = OpenAICompatibleSettings(
            model="stub-model", base_url=f"{url}/v1", api_key_env="SHOPSIMRL_TEST_KEY", stream=stream
        )
        model = OpenAICompatibleChatModel(settings, sleep=sleeps)
        reply = Reply(sse=stream_chunks(*FRAGMENTED_CALL)) if stream else Reply(json=completion(tool_calls=[tool_call()]))
        closed_by_server, outputs = 0, []
        try:
            for _ in range(rounds):
                stub.queue(*[reply] * calls)
                outputs += await asyncio.gather(*(model.generate(MESSAGES, TOOLS, seed=n) for n in range(calls)))
                closed_by_server += busy_until_closed_by_server(port, len(open_connections_to(port)))
                stub.queue(*[reply] * calls)
                outputs += await asyncio.gather(*(model.generate(MESSAGES, TOOLS, seed=n) for n in range(calls)))
        finally:
            await model.aclose()
    assert closed_by_server >= rounds * calls  # the fault, every round
    assert [output.attempt_count for output in outputs] == [1] * (2 * rounds * calls) and sleeps.calls == []
    assert all(output.protocol_error is None for output in outputs) and len(stub.completions) == 2 * rounds * calls
