"""Fuzzing the model-reply path: whatever bytes a model server answers, at most its episode ends.

A real HTTP server (``openai_stub`` under uvicorn) answers replies that hypothesis builds: every
field of a chat completion (content, reasoning, tool-call ids, names and arguments, finish reason,
usage, ids) drawn from text that includes lone surrogates (``"\\ud800"``: valid JSON, not valid
Unicode), pairs split into two code points, control characters and JSON-looking text; sent as
ASCII JSON (surrogates escaped), as UTF-8 with the surrogates' raw bytes, or with stray bytes that
are not UTF-8; as one JSON body or as an SSE stream cut into chunks.

For each reply, the adapter alone, then a whole episode (the real runtime, the adapter and the
testbed shop over HTTP) must hold:

- the adapter returns a ModelOutput or raises ModelRequestError, nothing else;
- no usable field of the output holds a lone surrogate; a reply that had one is a protocol error
  or a policy failure, and ``raw_response`` is the reply exactly (a body that is not JSON: its
  bytes, recoverable with ``surrogateescape``);
- the episode ends completed, or failed with a class other than ``runtime_error`` (a bug); the
  conversation and every action are valid Unicode (what reaches the model server and the shop);
- the trace line round-trips exactly (``parse_trace_line(dump_line(t)) == t``), without
  being repaired, and the summary, the transcript and the steps table read it.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.episode import AgentRuntime
from shopsimrl.metrics import summarize_traces
from shopsimrl.model import RAW_TEXT_CHARS, ModelRequestError, OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.prompts import PromptBuilder
from shopsimrl.records import EpisodeTrace, dump_line, parse_trace_line, to_plain
from shopsimrl.research.tables import STEP_SCHEMA, step_rows
from shopsimrl.research.transcript import read_transcript, render_terminal
from shopsimrl.schemas import EpisodeJob, parse_json
from shopsimrl.skills import NoSkills
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings, create_app
from tests.openai_stub import OpenAIStub, Reply, completion, tool_call

CATALOG = Path(__file__).parent / "testbed" / "fixtures" / "catalog_small.json"
TOOLS = [
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
    }
]
MESSAGES = [{"role": "system", "content": "你是购物助手"}, {"role": "user", "content": "买一个电水壶"}]
VALID_SEARCH = Reply(json=completion(tool_calls=[tool_call("search", '{"query": "电水壶"}')]))


# --------------------------------------------------------------------------- what the server sends


@dataclass(frozen=True)
class Wire:
    """One reply as bytes on the wire: a JSON body, or SSE lines."""

    body: bytes | None = None
    chunks: list[bytes] = field(default_factory=list)

    def reply(self) -> Reply:
        if self.body is not None:
            return Reply(body=self.body, headers={"content-type": "application/json"})
        return Reply(sse=[*self.chunks], done=False)


NASTY = ["\ud800", "\udfff", "\udc80", "\ud83d\ude00", "\ud83d", "😀", "台灯", "\\ud800", "\x00", '"', "\n", "search", "{"]
texts = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=8),  # every code point, surrogates included
    st.lists(st.one_of(st.sampled_from(NASTY), st.text(max_size=3)), min_size=1, max_size=3).map("".join),
    st.tuples(st.text(max_size=3), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.text(max_size=3)).map(
        "".join
    ),  # certainly one lone surrogate
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), texts)


@st.composite
def arguments(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["query", "other", "text", "value"]))
    if kind == "value":
        return draw(st.one_of(scalars, st.dictionaries(texts, scalars, max_size=2)))
    if kind == "text":
        return draw(texts)
    key = "query" if kind == "query" else draw(texts)
    # ensure_ascii: the arguments text spells a surrogate as an escape; else it holds the character
    return json.dumps({key: draw(texts)}, ensure_ascii=draw(st.booleans()))


tool_calls = st.fixed_dictionaries(
    {
        "id": st.one_of(texts, scalars),
        "type": st.sampled_from(["function", None, "tool"]),
        "function": st.one_of(
            st.fixed_dictionaries({"name": st.one_of(st.just("search"), texts), "arguments": arguments()}), scalars
        ),
    }
)
messages = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.one_of(st.none(), texts, st.lists(st.fixed_dictionaries({"text": texts})))},
    optional={"reasoning_content": texts, "tool_calls": st.one_of(st.lists(tool_calls, max_size=2), scalars)},
)
finish_reasons = st.one_of(st.none(), st.sampled_from(["stop", "tool_calls", "length"]), texts)
bodies = st.fixed_dictionaries(
    {
        "id": st.one_of(texts, scalars),
        "object": st.just("chat.completion"),
        "choices": st.one_of(
            st.lists(
                st.fixed_dictionaries({"index": st.just(0), "message": messages, "finish_reason": finish_reasons}), max_size=1
            ),
            scalars,
        ),
    },
    optional={
        "usage": st.one_of(st.dictionaries(texts, st.one_of(st.integers(0, 10**6), texts), max_size=3), scalars),
        "system_fingerprint": texts,
        "created": st.integers(0, 2**31),
    },
)
# Well-formed replies with one search call whose query is arbitrary text, so the valid path (the
# action reaching the shop) is fuzzed as well as the broken ones.
searches = st.builds(
    lambda query, ascii_args, reasoning: completion(
        tool_calls=[tool_call("search", json.dumps({"query": query}, ensure_ascii=ascii_args))], reasoning=reasoning
    ),
    texts,
    st.booleans(),
    st.one_of(st.none(), texts),
)


def encode(value: Any, how: str) -> bytes:
    if how == "ascii":  # lone surrogates as \uXXXX escapes
        return json.dumps(value, ensure_ascii=True).encode("ascii")
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")  # their raw bytes


def sse(body: dict[str, Any], how: str, cut: int) -> list[bytes]:
    """The body as a stream: the top-level fields, then content, reasoning and each call's
    arguments in two pieces cut at ``cut`` (which can split a surrogate pair), then the finish."""
    choice = body["choices"][0] if isinstance(body.get("choices"), list) and body["choices"] else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    top = {k: v for k, v in body.items() if k != "choices"}
    deltas: list[dict[str, Any]] = [{"role": "assistant"}]
    for key in ("content", "reasoning_content"):
        text = message.get(key)
        if isinstance(text, str):
            deltas += [{key: text[:cut]}, {key: text[cut:]}]
    calls = message.get("tool_calls")
    for index, call in enumerate(calls if isinstance(calls, list) else []):
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        head = {"index": index, "id": call.get("id"), "type": call.get("type"), "function": {"name": function.get("name")}}
        deltas.append({"tool_calls": [head]})
        args = function.get("arguments")
        pieces = [args[:cut], args[cut:]] if isinstance(args, str) else [args]
        deltas += [{"tool_calls": [{"index": index, "function": {"arguments": piece}}]} for piece in pieces]
    chunks = [{**top, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
    chunks.append({**top, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason")}]})
    return [b"data: " + encode(chunk, how) + b"\n\n" for chunk in chunks] + [b"data: [DONE]\n\n"]


@st.composite
def wires(draw: st.DrawFn) -> Wire:
    body = draw(st.one_of(bodies, searches, searches))  # valid shapes twice as often: the fuzzed text goes further
    how = draw(st.sampled_from(["ascii", "raw"]))
    stray = draw(st.one_of(st.none(), st.none(), st.none(), st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=2))))
    if draw(st.booleans()):
        data = encode(body, how)
        if stray is not None:  # bytes that need not be UTF-8, somewhere in the body
            at = stray[0] % (len(data) + 1)
            data = data[:at] + stray[1] + data[at:]
        return Wire(body=data)
    chunks = sse(body, how, draw(st.integers(0, 8)))
    if stray is not None:
        at = stray[0] % len(chunks)
        chunks[at] = chunks[at][:-2] + stray[1] + b"\n\n"
    return Wire(chunks=chunks)


# --------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[OpenAIStub, str, str]]:
    stub = OpenAIStub()
    with (
        running_server(stub) as model_url,
        running_server(create_app(ShopSettings(slots=2), catalog_path=CATALOG)) as shop_url,
    ):
        yield stub, model_url + "/v1", shop_url


def _model(url: str, stream: bool) -> OpenAICompatibleChatModel:
    return OpenAICompatibleChatModel(
        OpenAICompatibleSettings(model="stub-model", base_url=url, api_key_env=None, max_retries=1, stream=stream)
    )


def _usable(output_dict: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in output_dict.items() if key != "raw_response"}


def lone_surrogate(value: Any) -> bool:
    """Whether a JSON-like value holds a lone surrogate (U+D800..U+DFFF) in a string or a key."""
    if isinstance(value, str):
        return any(0xD800 <= ord(char) <= 0xDFFF for char in value)
    if isinstance(value, dict):
        return any(lone_surrogate(key) or lone_surrogate(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(lone_surrogate(item) for item in value)
    return False


async def _check_adapter(stub: OpenAIStub, url: str, wire: Wire) -> None:
    stub.reset()
    stub.queue(wire.reply())
    model = _model(url, stream=wire.body is None)
    try:
        output = await model.generate(MESSAGES, TOOLS)
    except ModelRequestError:
        event("adapter: ModelRequestError")
        return  # e.g. a stream chunk that is not JSON: retried, then a failed call (infrastructure)
    finally:
        await model.aclose()
    data = output.to_dict()
    problem = output.protocol_error or output.policy_failure
    event(f"adapter: {problem['code'] if problem else 'usable reply'} ({'json' if wire.body is not None else 'stream'})")
    assert not lone_surrogate(_usable(data)), data
    if wire.body is None:
        return
    try:
        sent = parse_json(wire.body)
    except ValueError:  # not JSON: the bytes are kept, one lone surrogate per byte that is not UTF-8
        assert output.protocol_error is not None and output.protocol_error["code"] == "invalid_json_response"
        text = output.raw_response["text"]
        assert text == wire.body.decode("utf-8", "surrogateescape")[:RAW_TEXT_CHARS]
        return
    if lone_surrogate(sent):
        event("reply holds a lone surrogate")
        assert output.protocol_error is not None or output.policy_failure is not None, data
    if output.raw_response is not None:
        assert output.raw_response == sent


async def _check_episode(stub: OpenAIStub, model_url: str, shop_url: str, wire: Wire) -> dict[str, Any]:
    stub.reset()
    stub.queue(wire.reply(), VALID_SEARCH)
    model = _model(model_url, stream=wire.body is None)
    environment = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=shop_url, max_retries=0))
    runtime = AgentRuntime(model=model, environment=environment, prompts=PromptBuilder(), skills=NoSkills(), max_steps=2)
    try:
        return await runtime.run(EpisodeJob(task_id=0, sample_id=0, seed=7, split="val"))
    finally:
        await model.aclose()
        await environment.aclose()


def _check_trace(typed: EpisodeTrace) -> None:
    trace = to_plain(typed)
    assert trace["failure_class"] != "runtime_error", trace["error"]
    event(f"episode: {trace['status']} {trace['failure_class'] or ''}".strip())
    if any(step["action"] and step["action"] != "search[电水壶]" for step in trace["steps"]):
        event("episode: a fuzzed action reached the shop")
    orjson.dumps(trace["conversation"])  # what was sent to the model: strict UTF-8
    for step in trace["steps"]:
        assert not lone_surrogate(step["action"])  # what reached the shop
    line = dump_line(typed)
    again = parse_trace_line(line)
    assert again is not None and to_plain(again) == trace and "serialization_repaired" not in trace
    orjson.dumps(summarize_traces([again]))  # the summary: strict UTF-8
    pa.RecordBatch.from_pylist(list(step_rows(again)), schema=STEP_SCHEMA)  # Arrow strings are strict UTF-8
    console = Console(file=io.StringIO(), width=100)
    render_terminal(read_transcript(again), console, thinking=True)


@pytest.mark.slow
@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,  # the same examples in every run: CI stays reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(wire=wires())
# The reply: a search whose arguments spell a lone surrogate as a JSON escape.
@example(wire=Wire(body=encode(completion(tool_calls=[tool_call("search", '{"query": "\\ud800"}')]), "ascii")))
@example(wire=Wire(body=encode(completion(content="\ud800", reasoning="\udfff"), "raw")))  # raw surrogate bytes
@example(wire=Wire(body=b'{"id": "\xff\xfe", "choices": []}'))  # bytes that are not UTF-8
@example(wire=Wire(chunks=sse(completion(content="a\ud83d\ude00b"), "ascii", 2)))  # a pair split across chunks
def test_any_model_reply_ends_at_most_its_episode_and_is_stored_exactly(servers: tuple[OpenAIStub, str, str], wire: Wire) -> None:
    stub, model_url, shop_url = servers

    async def scenario() -> None:
        await _check_adapter(stub, model_url, wire)
        _check_trace(await _check_episode(stub, model_url, shop_url, wire))

    asyncio.run(scenario())
