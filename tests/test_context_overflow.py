"""Context overflow is a scored policy failure (issue 10): the servers' real error texts, over HTTP.

Every body below is what the named server answers when the prompt (plus ``max_tokens``) does not
fit its context window, from its source or from its responses as quoted verbatim in public
threads: vLLM ``_validate_input`` (three generations of wording), SGLang
``TokenizerManager._validate_one_request`` (both checks, as a 400 and as an ``error`` chunk
inside a 200 stream), the llama.cpp server (``ERROR_TYPE_EXCEED_CONTEXT_SIZE``, two wordings),
llama-cpp-python's server (``errors.context_length_exceeded``) and OpenAI
(``context_length_exceeded``, two wordings).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from shopsimrl.episode import AgentRuntime
from shopsimrl.model import ModelRequestError, OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.prompts import PromptBuilder
from shopsimrl.records import read_trace
from shopsimrl.schemas import EpisodeJob
from shopsimrl.skills import NoSkills
from shopsimrl.testbed.serving import running_server
from tests.fakes import FakeEnvironment, written
from tests.openai_stub import OpenAIStub, Reply, completion, tool_call

TOOLS = [
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
    }
]
MESSAGES = [{"role": "system", "content": "你是购物助手"}, {"role": "user", "content": "买一件红色T恤"}]
KEY = "sk-test-overflow-0123456789"

OVERFLOW_BODIES = {
    "vllm-prompt": {
        "error": {
            "message": "This model's maximum context length is 32768 tokens. However, your request has 40000 input tokens. "
            "Please reduce the length of the input messages.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    },
    "vllm-max-tokens": {
        "error": {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 512. This model's maximum context length is "
            "4096 tokens and your request has 3700 input tokens (512 > 4096 - 3700).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    },
    "vllm-older": {
        "object": "error",
        "message": "This model's maximum context length is 4096 tokens. However, you requested 4600 tokens (4088 in the "
        "messages, 512 in the completion). Please reduce the length of the messages or completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    },
    "vllm-newer": {
        "error": {
            "message": "You passed 98305 input tokens and requested 512 output tokens. However, the model's context length "
            "is only 98816 tokens, resulting in a maximum input length of 98304 tokens. Please reduce the length "
            "of the input prompt. (parameter=input_tokens, value=98305)",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    },
    "sglang-prompt": {
        "object": "error",
        "message": "The input (40000 tokens) is longer than the model's context length (32768 tokens).",
        "type": "BadRequest",
        "param": None,
        "code": 400,
    },
    "sglang-total": {
        "object": "error",
        "message": "Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a "
        "total of 33000 tokens: 32488 tokens from the input messages and 512 tokens for the completion. "
        "Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
        "type": "BadRequest",
        "param": None,
        "code": 400,
    },
    "llama.cpp": {
        "error": {
            "code": 400,
            "message": "request (9412 tokens) exceeds the available context size (8192 tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 9412,
            "n_ctx": 8192,
        }
    },
    "llama.cpp-older": {
        "error": {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
        }
    },
    "llama-cpp-python": {
        "error": {
            "message": "This model's maximum context length is 8192 tokens. However, you requested 8700 tokens (8188 in the "
            "messages, 512 in the completion). Please reduce the length of the messages or completion.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    },
    "openai": {
        "error": {
            "message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 "
            "tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    },
    "openai-configured-limit": {
        "error": {
            "message": "Input tokens exceed the configured limit of 272000 tokens. Your messages resulted in 509178 tokens. "
            "Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[OpenAIStub, str]]:
    stub = OpenAIStub()
    with running_server(stub) as url:
        yield stub, url + "/v1"


@pytest.fixture
def stub(server: tuple[OpenAIStub, str]) -> OpenAIStub:
    server[0].reset()
    return server[0]


@pytest.fixture
async def make(
    server: tuple[OpenAIStub, str], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[..., OpenAICompatibleChatModel]]:
    monkeypatch.setenv("SHOPSIMRL_TEST_KEY", KEY)
    made: list[OpenAICompatibleChatModel] = []
    sleeps: list[float] = []

    async def no_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    def factory(**overrides: Any) -> OpenAICompatibleChatModel:
        fields: dict[str, Any] = {"model": "stub-model", "base_url": server[1], "api_key_env": "SHOPSIMRL_TEST_KEY"}
        fields.update(overrides)
        adapter = OpenAICompatibleChatModel(OpenAICompatibleSettings(**fields), sleep=no_sleep)
        made.append(adapter)
        return adapter

    yield factory
    assert sleeps == []  # an overflow is never retried
    for adapter in made:
        await adapter.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("server_name", sorted(OVERFLOW_BODIES))
async def test_each_servers_overflow_400_is_a_context_length_policy_failure(
    stub: OpenAIStub, make: Any, server_name: str, stream: bool
) -> None:
    body = OVERFLOW_BODIES[server_name]
    stub.queue(Reply(status=400, json=body))
    out = await make(stream=stream).generate(MESSAGES, TOOLS)
    assert len(stub.completions) == 1
    assert out.policy_failure is not None and out.policy_failure["code"] == "context_length"
    message = body["error"]["message"] if "error" in body else body["message"]
    assert message[:60] in out.policy_failure["message"]
    assert out.protocol_error is None and out.tool_calls == [] and out.finish_reason is None
    assert out.attempt_count == 1 and out.attempts[0]["status"] == 400
    assert out.raw_response["http_status"] == 400 and message[:60] in out.raw_response["error_body"]


async def test_sglang_overflow_inside_a_stream_is_a_context_length_policy_failure(stub: OpenAIStub, make: Any) -> None:
    # SGLang validates inside its stream generator: headers 200, then one error chunk.
    error = {"error": {"object": "error", **OVERFLOW_BODIES["sglang-prompt"], "code": 400}}
    stub.queue(Reply(sse=[error]))
    out = await make(stream=True).generate(MESSAGES, TOOLS)
    assert len(stub.completions) == 1
    assert out.policy_failure is not None and out.policy_failure["code"] == "context_length"
    assert "longer than the model's context length" in out.policy_failure["message"]


@pytest.mark.parametrize(
    "reply",
    [
        Reply(
            status=400,
            json={"error": {"message": "max_tokens must be at least 1, got 0.", "type": "BadRequestError", "code": 400}},
        ),
        Reply(status=400, json={"error": {"message": "context length exceeded"}}),  # not any server's wording
        Reply(
            status=404,
            json={"error": {"message": "The model `stub-model` does not exist.", "type": "NotFoundError", "code": 404}},
        ),
        Reply(status=422, json={"detail": [{"loc": ["body", "messages"], "msg": "field required"}]}),
    ],
    ids=["bad-max-tokens", "vague", "unknown-model", "validation"],
)
async def test_other_client_errors_stay_request_errors(stub: OpenAIStub, make: Any, reply: Reply) -> None:
    stub.queue(reply)
    with pytest.raises(ModelRequestError) as info:
        await make().generate(MESSAGES, TOOLS)
    assert info.value.status_code == reply.status and len(stub.completions) == 1


async def test_max_tokens_that_cannot_fit_the_window_is_a_configuration_error(stub: OpenAIStub, make: Any) -> None:
    body = {
        "error": {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 8192. This model's maximum context "
            "length is 4096 tokens and your request has 60 input tokens (8192 > 4096 - 60).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    stub.queue(Reply(status=400, json=body), Reply(status=400, json=OVERFLOW_BODIES["llama.cpp"]))
    with pytest.raises(ModelRequestError, match=r"model.max_tokens \(8192\) is not smaller than .* \(4096 tokens\)"):
        await make(max_tokens=8192).generate(MESSAGES, TOOLS)
    with pytest.raises(ModelRequestError, match=r"\(8192 tokens\)"):  # llama.cpp states n_ctx in the body
        await make(max_tokens=8192).generate(MESSAGES, TOOLS)


async def test_an_echoed_api_key_never_reaches_the_policy_failure(stub: OpenAIStub, make: Any) -> None:
    body = {"error": {"message": f"This model's maximum context length is 4096 tokens (key {KEY}).", "code": 400}}
    stub.queue(Reply(status=400, json=body))
    out = await make().generate(MESSAGES, TOOLS)
    assert out.policy_failure is not None and KEY not in str(out.policy_failure) and KEY not in str(out.raw_response)
    assert KEY not in str(out.attempts)


async def test_runtime_terminates_an_overflow_as_generation_length_and_scores_it(stub: OpenAIStub, make: Any) -> None:
    stub.queue(
        Reply(json=completion(tool_calls=[tool_call("search", '{"query": "蓝牙耳机"}')])),
        Reply(status=400, json=OVERFLOW_BODIES["vllm-prompt"]),
    )
    env = FakeEnvironment()
    runtime = AgentRuntime(model=make(), environment=env, prompts=PromptBuilder(), skills=NoSkills())
    trace = written(await runtime.run(EpisodeJob(task_id=7, sample_id=0, seed=50, split="val")))
    assert trace["status"] == "completed" and read_trace(trace).completed and trace["failure_class"] is None
    assert env.terminations == ["generation_length"]  # the only policy reason ShopSimulator accepts
    assert trace["final"]["reward"] == 0.0 and trace["final"]["termination_reason"] == "generation_length"
    first, second = trace["steps"]
    assert first["action"] == "search[蓝牙耳机]" and "policy_failure" not in first
    assert second["policy_failure"]["code"] == "context_length"  # the distinct code stays in the trace
    assert second["model"]["policy_failure"]["code"] == "context_length"
    assert second["action"] is None and second["environment"] is None


async def test_testbed_policy_answers_like_vllm_when_the_prompt_does_not_fit() -> None:
    from shopsimrl.testbed.policy import PolicySettings, create_app

    window = 300
    with running_server(create_app(PolicySettings(max_model_len=window))) as url:
        adapter = OpenAICompatibleChatModel(
            OpenAICompatibleSettings(model="shopsim-heuristic", base_url=url + "/v1", api_key_env=None, max_tokens=64)
        )
        try:
            fits = await adapter.generate(MESSAGES, TOOLS)
            assert fits.policy_failure is None and fits.usage["prompt_tokens"] + 64 <= window
            grown = [*MESSAGES, {"role": "user", "content": "页面" * (window - 64 - fits.usage["prompt_tokens"] + 2)}]
            budget = await adapter.generate(grown, TOOLS)  # the prompt fits, prompt + max_tokens does not
            assert budget.policy_failure is not None and budget.policy_failure["code"] == "context_length"
            assert "'max_tokens' or 'max_completion_tokens' is too large: 64" in budget.policy_failure["message"]
            huge = [*MESSAGES, {"role": "user", "content": "页面" * window}]
            prompt = await adapter.generate(huge, TOOLS)
            assert prompt.policy_failure is not None
            assert (
                f"This model's maximum context length is {window} tokens. However, your request has"
                in prompt.policy_failure["message"]
            )
        finally:
            await adapter.aclose()
