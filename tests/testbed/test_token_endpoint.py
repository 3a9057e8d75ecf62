"""The testbed's token endpoint: its tokenizer, its chat template and SGLang's ``POST /generate``.

The app is called in-process (httpx's ASGI transport) for the fast tests; one slow test talks
to it over real HTTP through uvicorn.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shopsimrl.model import context_overflow
from shopsimrl.prompts import action_tools
from shopsimrl.testbed.chat_tokens import END_OF_TEXT, IM_END, IM_START, ByteTokenizer, ChatTemplate, TestbedChatTokenizer
from shopsimrl.testbed.policy import PolicySettings, create_app
from shopsimrl.testbed.serving import running_server
from tests.testbed_process import start_testbed

TOKENIZER = TestbedChatTokenizer()
HOME_STATE = {"page_type": "search_home", "search_available": True, "actions": []}
SYSTEM = "你是购物助手。"
FIRST_USER = "购物任务：\n我想买一款黑色的蓝牙耳机，支持主动降噪\n\n页面：搜索首页\n\n页面能力：\n- 支持商品搜索\n"
RESULTS = "页面：搜索结果\n\n可点击：\n- [100000000002] 主动降噪蓝牙耳机 头戴式 黑色 ￥599.0\n- [下一页]\n"
RESULT_STATE = {"page_type": "search_results", "search_available": False, "actions": ["100000000002", "下一页"]}


def _conversation() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST_USER}]


def _client(**knobs: Any) -> httpx.AsyncClient:
    app = create_app(PolicySettings(token_endpoint=True, **knobs))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testbed")


async def _generate(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/generate", json=body)


# --------------------------------------------------------------------------- tokenizer


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_decode_inverts_encode_for_any_unicode_text(text: str) -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_bytes_special_tokens_and_chinese() -> None:
    tokenizer = ByteTokenizer()
    text = "<|im_start|>user\n蓝牙耳机 ￥599<|im_end|><|endoftext|>"
    ids = tokenizer.encode(text)
    assert ids[0] == IM_START and ids[-2:] == [IM_END, END_OF_TEXT]
    assert ids[6:9] == list("蓝".encode()), "a Chinese character is its three UTF-8 bytes"
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\n蓝牙耳机 ￥599"


def test_tokenizer_refuses_lone_surrogates_and_unknown_ids() -> None:
    tokenizer = ByteTokenizer()
    with pytest.raises(ValueError, match="lone surrogate at index 2"):
        tokenizer.encode("ab\ud800c")
    with pytest.raises(ValueError, match="position 1 is not in the vocabulary"):
        tokenizer.decode([65, 259])


def test_decoding_a_cut_character_gives_a_replacement_mark() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("耳机")
    assert tokenizer.decode(ids[:4]) == "耳\ufffd"


# --------------------------------------------------------------------------- chat template


def test_template_renders_qwen_shape_and_parses_back() -> None:
    tools = action_tools(RESULT_STATE)
    messages = [
        *_conversation(),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "降噪耳机"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": RESULTS},
        {"role": "user", "content": "请只调用一个工具。"},
    ]
    text = ChatTemplate().render(messages, tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n你是购物助手。\n\n# Tools\n")
    assert '<tool_call>\n{"name": "search", "arguments": {"query": "降噪耳机"}}\n</tool_call><|im_end|>\n' in text
    assert f"<|im_start|>user\n<tool_response>\n{RESULTS}\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    parsed = TOKENIZER.parse(TOKENIZER.render(messages, tools))
    assert parsed.tools == tools and parsed.generation_prompt
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "tool", "user"]
    assert parsed.messages[2]["tool_calls"][0]["function"] == messages[2]["tool_calls"][0]["function"]
    assert parsed.messages[3]["content"] == RESULTS


def test_template_groups_consecutive_tool_results_in_one_user_turn() -> None:
    messages = [
        *_conversation(),
        {"role": "tool", "tool_call_id": "a", "content": "一"},
        {"role": "tool", "tool_call_id": "b", "content": "二"},
    ]
    text = ChatTemplate().render(messages, None, add_generation_prompt=False)
    assert text.count("<|im_start|>user") == 2
    assert [m["content"] for m in ChatTemplate().parse(text).messages[2:]] == ["一", "二"]


# --------------------------------------------------------------------------- POST /generate


async def test_generate_answers_with_sglang_shape_exact_ids_and_logprobs() -> None:
    ids = TOKENIZER.render(_conversation(), action_tools(HOME_STATE))
    async with _client() as client:
        response = await _generate(
            client, input_ids=ids, sampling_params={"max_new_tokens": 512, "temperature": 0}, return_logprob=True
        )
        again = await _generate(
            client, input_ids=ids, sampling_params={"max_new_tokens": 512, "temperature": 0}, return_logprob=True
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": IM_END}
    assert body["output_ids"][-1] == IM_END, "output_ids include the token the reply stopped on, as SGLang's do"
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(body["output_ids"])
    assert body["text"] == TOKENIZER.decode(body["output_ids"], skip_special_tokens=True)
    call = json.loads(body["text"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "search" and "耳机" in call["arguments"]["query"]
    logprobs = meta["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == body["output_ids"]
    assert all(math.isfinite(entry[0]) and entry[0] <= 0 for entry in logprobs)
    assert again.json() == body, "the same request gets the same answer"


async def test_generate_takes_text_and_decides_as_the_chat_endpoint_does() -> None:
    messages = [
        *_conversation(),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "降噪耳机"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": RESULTS},
    ]
    tools = action_tools(RESULT_STATE)
    text = ChatTemplate().render(messages, tools, add_generation_prompt=True)
    async with _client() as client:
        by_text = (await _generate(client, text=text, sampling_params={"max_new_tokens": 256})).json()
        by_ids = (await _generate(client, input_ids=TOKENIZER.encode(text), sampling_params={"max_new_tokens": 256})).json()
        chat = (await client.post("/v1/chat/completions", json={"messages": messages, "tools": tools})).json()
    assert by_text == by_ids
    function = chat["choices"][0]["message"]["tool_calls"][0]["function"]
    expected = '<tool_call>\n{"name": "' + function["name"] + '", "arguments": ' + function["arguments"] + "}\n</tool_call>"
    assert by_text["text"] == expected


async def test_generate_stops_at_the_token_limit_with_a_length_finish() -> None:
    ids = TOKENIZER.render(_conversation(), action_tools(HOME_STATE))
    async with _client() as client:
        body = (await _generate(client, input_ids=ids, sampling_params={"max_new_tokens": 7}, return_logprob=True)).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert len(body["output_ids"]) == 7 == len(body["meta_info"]["output_token_logprobs"])
    assert IM_END not in body["output_ids"]


async def test_generate_stop_strings_end_the_text_before_the_match() -> None:
    ids = TOKENIZER.render(_conversation(), action_tools(HOME_STATE))
    async with _client() as client:
        body = (await _generate(client, input_ids=ids, sampling_params={"stop": ["arguments"], "max_new_tokens": 300})).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "arguments"}
    assert body["text"] == '<tool_call>\n{"name": "search", "'
    assert TOKENIZER.decode(body["output_ids"]).endswith("arguments")


async def test_generate_with_reasoning_thinks_first() -> None:
    ids = TOKENIZER.render(_conversation(), action_tools(HOME_STATE))
    async with _client(reasoning=True) as client:
        body = (await _generate(client, input_ids=ids, sampling_params={"max_new_tokens": 1000})).json()
    assert body["text"].startswith("<think>\n") and "</think>\n\n<tool_call>\n" in body["text"]


async def test_generate_abort_and_server_faults() -> None:
    ids = TOKENIZER.render(_conversation(), action_tools(HOME_STATE))
    async with _client(rate_abort=1.0) as client:
        body = (await _generate(client, input_ids=ids, return_logprob=True)).json()
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"]["type"] == "abort"
    async with _client(rate_500=1.0) as client:
        response = await _generate(client, input_ids=ids)
    assert response.status_code == 500 and "error" in response.json()


async def test_generate_refuses_a_prompt_beyond_the_context_with_sglangs_text() -> None:
    ids = TOKENIZER.render(_conversation(), action_tools(HOME_STATE))
    async with _client(max_model_len=len(ids) + 10) as client:
        too_long = await _generate(client, input_ids=ids, sampling_params={"max_new_tokens": 11})
        fits = await _generate(client, input_ids=ids, sampling_params={"max_new_tokens": 10})
    assert too_long.status_code == 400 and fits.status_code == 200
    message = too_long.json()["error"]["message"]
    assert f"maximum context length of {len(ids) + 10} tokens" in message
    assert context_overflow(too_long.json(), message) == (message, len(ids) + 10), "the model adapter recognises it"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "exactly one of input_ids and text"),
        ({"input_ids": [1], "text": "a"}, "exactly one of input_ids and text"),
        ({"input_ids": [1, 999]}, "input_ids[1]"),
        ({"input_ids": [[1, 2]]}, "input_ids[0]"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"temprature": 1}}, "sampling_params.temprature"),
        ({"text": "a", "stream": True}, "stream"),
        ({"text": "a", "modalities": []}, "modalities"),
    ],
)
async def test_generate_refuses_bad_requests_naming_the_field(body: dict[str, Any], field: str) -> None:
    async with _client() as client:
        response = await _generate(client, **body)
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]


async def test_generate_refuses_ids_that_are_not_a_template_prompt() -> None:
    async with _client() as client:
        response = await _generate(client, text="hello")
    assert response.status_code == 400 and "not a prompt of the testbed chat template" in response.json()["error"]["message"]


async def test_generate_is_served_only_when_enabled() -> None:
    app = create_app(PolicySettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testbed") as client:
        response = await client.post("/generate", json={"text": "a"})
    assert response.status_code == 404


@pytest.mark.slow
def test_generate_over_real_http() -> None:
    ids = TOKENIZER.render(_conversation(), action_tools(HOME_STATE))
    app = create_app(PolicySettings(token_endpoint=True))
    with running_server(app) as base, httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
        response = client.post(
            "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 256}, "return_logprob": True}
        )
    assert response.status_code == 200
    body = response.json()
    assert body["output_ids"][-1] == IM_END
    assert [entry[1] for entry in body["meta_info"]["output_token_logprobs"]] == body["output_ids"]


@pytest.mark.slow
def test_testbed_up_serves_the_token_endpoint_when_asked() -> None:
    ids = TOKENIZER.render(_conversation(), action_tools(HOME_STATE))
    with start_testbed("--token-endpoint") as bed:
        root = bed.model_url.removesuffix("/v1")
        answer = httpx.post(f"{root}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 256}}, timeout=10)
    with start_testbed() as bed:
        absent = httpx.post(f"{bed.model_url.removesuffix('/v1')}/generate", json={"input_ids": ids}, timeout=10)
    assert answer.status_code == 200 and answer.json()["output_ids"][-1] == IM_END
    assert absent.status_code == 404
