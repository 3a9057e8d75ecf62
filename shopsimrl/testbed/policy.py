"""The heuristic policy served over the OpenAI chat-completions API, shaped like vLLM.

No GPU serves a model in the testbed, so demos, CI smoke runs and fault tests talk to this
server instead: the runtime cannot tell it from vLLM. The decisions come from the rule-based
:func:`shopsimrl.testbed.heuristics.decide`; this module adds the HTTP surface, token
accounting, latency and fault injection.

Endpoints: ``POST /v1/chat/completions`` (JSON, or SSE with ``stream: true``),
``GET /v1/models``, ``GET /health``, and with ``token_endpoint`` on, SGLang's native
``POST /generate`` over token ids (:mod:`shopsimrl.testbed.generate`, the testbed tokenizer and
chat template of :mod:`shopsimrl.testbed.chat_tokens`), for training rollouts.

Faults. Each request draws its faults from its own ``random.Random``, seeded with
``fault_seed``, the sha256 of the canonical request body and how many times that exact body
has been seen before. So a given conversation meets the same faults in every run, whatever the
concurrency, while a retry of a failed request (same body, next occurrence) gets a fresh draw.
The draws are made in a fixed order (429, 500, timeout, non-JSON, no tool call, length); the
first one that fires is the fault of that request. Latency jitter comes from the same generator.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from shopsimrl.schemas import canonical_json, sha256_hex
from shopsimrl.testbed.analyst import analyst_reply
from shopsimrl.testbed.chat_tokens import TemplateParseError, TestbedChatTokenizer
from shopsimrl.testbed.generate import (
    GenerateRequestError,
    abort_reply,
    context_length_message,
    parse_generate_request,
    reply_text,
    shape_reply,
)
from shopsimrl.testbed.heuristics import Decision, decide
from shopsimrl.testbed.heuristics_naive import decide_naive
from shopsimrl.testbed.judge import judge_reply
from shopsimrl.testbed.serving import serve_forever

__all__ = ["FAULT_KINDS", "PolicySettings", "create_app", "serve"]

FAULT_KINDS = ("429", "500", "timeout", "non_json", "no_tool_call", "length")
_REMEMBERED_BODIES = 65536  # bound on the per-body occurrence table
_TEXT_ONLY_REPLY = "我先分析一下当前页面，再决定下一步操作。"
_NO_TOOLS_REPLY = "当前没有可调用的工具。"
_NON_JSON_BODY = "<html><body>upstream connect error or disconnect/reset before headers</body></html>"


class PolicySettings(BaseSettings):
    """Knobs of the heuristic policy server; every field also reads ``SHOPSIM_POLICY_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="SHOPSIM_POLICY_", extra="forbid", frozen=True)

    model_id: str = Field("shopsim-heuristic", min_length=1)
    """The one model id served; listed by ``/v1/models``."""
    strict_model: bool = True
    """Answer 404 to a request naming another model, as vLLM does."""
    max_model_len: int = Field(131072, ge=1)
    """Context length reported by ``/v1/models`` and enforced like vLLM: HTTP 400 with vLLM's
    text when the prompt estimate reaches it, or when the prompt plus ``max_tokens`` exceeds it."""
    latency_ms: float = Field(0.0, ge=0)
    """Response time of each answer, counted from the request's arrival: the policy's own work
    happens inside it (it answers later only when that work takes longer)."""
    latency_jitter_ms: float = Field(0.0, ge=0)
    """Extra delay drawn uniformly from [0, jitter] per request (seeded, see module doc)."""
    fault_seed: int = 0
    rate_429: float = Field(0.0, ge=0, le=1)
    retry_after_s: int = Field(1, ge=0)
    """``Retry-After`` header value (seconds) sent with injected 429s."""
    rate_500: float = Field(0.0, ge=0, le=1)
    rate_timeout: float = Field(0.0, ge=0, le=1)
    """Sleep ``timeout_sleep_s`` before answering normally, so that client timeouts fire."""
    timeout_sleep_s: float = Field(30.0, ge=0)
    rate_non_json: float = Field(0.0, ge=0, le=1)
    """200 with a body that is not JSON (in a stream: one ``data:`` line that is not JSON)."""
    rate_no_tool_call: float = Field(0.0, ge=0, le=1)
    """Plain text content, no tool call, ``finish_reason: stop``."""
    rate_length: float = Field(0.0, ge=0, le=1)
    """``finish_reason: length`` with the tool-call arguments JSON cut in half."""
    rate_server_crash: float = Field(0.0, ge=0, le=1)
    """Where search is offered, search with the ``<a>`` prefix the real ShopSimulator answers
    HTTP 500 to: an agent action the environment fails on. Drawn per conversation (not per
    occurrence of the request), so an episode run again makes the same choice."""
    reasoning: bool = False
    """Send a short Chinese explanation of each decision as ``reasoning_content``."""
    strategy: Literal["heuristic", "naive"] = "heuristic"
    """``naive``: open the first search result and buy it without choosing options (the first
    value of an axis the shop requires), a weaker policy for comparisons between runs."""
    judge_model_id: str = Field("shopsim-judge", min_length=1)
    """Requests naming this model are answered by the deterministic judge
    (:mod:`shopsimrl.testbed.judge`), not the shopping policy."""
    analyst_model_id: str = Field("shopsim-analyst", min_length=1)
    """Requests naming this model are answered by the deterministic skill analyst
    (:mod:`shopsimrl.testbed.analyst`): success cards, clusters and the compiled skill."""
    judge_fault_rate: float = Field(0.0, ge=0, le=1)
    """Share of episodes (by episode id) the judge answers badly: half never call the tool, half
    send arguments that are not JSON until a repair message follows."""
    token_endpoint: bool = False
    """Serve SGLang's ``POST /generate`` (token ids in, token ids and log-probabilities out) over the
    same policy. The injected faults apply to it too (429, 500, timeout, non-JSON, no tool call,
    length), drawn the same way."""
    rate_abort: float = Field(0.0, ge=0, le=1)
    """``/generate`` only: answer with ``finish_reason.type == "abort"`` and no tokens, as SGLang does
    for a request aborted while weights are updated (drawn per request, apart from the other faults)."""
    max_inflight: int | None = Field(None, ge=1)
    """Chat completions answered at once; one more gets HTTP 429 with ``Retry-After:
    overload_retry_after_s``, as a server whose queue is full does (None: no limit). Counts a
    streamed answer until its response starts."""
    overload_retry_after_s: int = Field(1, ge=0)
    options_need_skill: bool = False
    """Choosing the options the user wants is a skill: the policy does it only when a skill in the
    system prompt carries ``[[testbed:choose-options]]`` (:mod:`shopsimrl.testbed.heuristics_skills`)."""


# --------------------------------------------------------------------------- helpers


def _error(status: int, message: str, kind: str, param: str | None = None, **headers: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers or None)


def _tokens(chars: int) -> int:
    """Deterministic token estimate: two characters per token."""
    return (chars + 1) // 2


class _BadRequest(ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _validate(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _BadRequest("request body must be a JSON object", None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _BadRequest(f"messages[{index}] must be an object with a string 'role'", f"messages[{index}]")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise _BadRequest("'tools' must be a list of objects", "tools")
    if not isinstance(body.get("stream", False), bool):
        raise _BadRequest("'stream' must be a boolean", "stream")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _BadRequest(f"'{name}' must be a positive integer", name)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _BadRequest("'seed' must be an integer", "seed")
    temperature = body.get("temperature", 0.0)
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise _BadRequest("'temperature' must be a number", "temperature")
    return body


def _context_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> JSONResponse | None:
    """vLLM's two context checks (``_validate_input`` of its OpenAI server), with its texts."""
    if prompt_tokens >= max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
        )
        return _error(400, message, "BadRequestError")
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        message = (
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens})."
        )
        return _error(400, message, "BadRequestError")
    return None


def _restrict_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]]:
    """Apply ``tool_choice``: "none" offers nothing, a named function offers only that one."""
    if tool_choice == "none":
        return []
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        return [t for t in tools if (t.get("function") or {}).get("name") == name]
    return tools


class _Completion:
    """One answer before rendering: either a tool call or plain text, plus token accounting."""

    def __init__(self, decision: Decision | None, reasoning: bool, prompt_tokens: int, max_tokens: int | None) -> None:
        self.name = decision.tool if decision else None
        self.arguments = json.dumps(decision.arguments, ensure_ascii=False) if decision else None
        self.reasoning = decision.reasoning if (decision and reasoning) else None
        self.content: str | None = None if decision else _NO_TOOLS_REPLY
        self.finish_reason = "tool_calls" if decision else "stop"
        self.prompt_tokens = prompt_tokens
        if max_tokens is not None:
            self._truncate(max_tokens)

    def _truncate(self, max_tokens: int) -> None:
        """Cut the output at ``max_tokens`` like a real server: reasoning first, then arguments."""
        budget = max_tokens * 2
        if self.completion_chars <= budget:
            return
        self.finish_reason = "length"
        if self.reasoning is not None:
            self.reasoning = self.reasoning[:budget]
            budget -= len(self.reasoning)
        if self.arguments is not None:
            room = budget - len(self.name or "")
            if room <= 0:
                self.name = self.arguments = None
                self.content = ""
            else:
                self.arguments = self.arguments[:room]

    def cut_arguments(self) -> None:
        """Injected length fault: half of the arguments JSON, so it no longer parses."""
        self.finish_reason = "length"
        if self.arguments is not None:
            self.arguments = self.arguments[: max(1, len(self.arguments) // 2)]

    def as_text(self, text: str) -> None:
        self.name = self.arguments = None
        self.content = text
        self.finish_reason = "stop"

    @property
    def completion_chars(self) -> int:
        return sum(len(part or "") for part in (self.reasoning, self.name, self.arguments, self.content))

    def usage(self) -> dict[str, int]:
        completion = max(1, _tokens(self.completion_chars))
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


# --------------------------------------------------------------------------- the app


class _PolicyServer:
    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        self.created = int(time.time())
        self._seen: OrderedDict[str, int] = OrderedDict()
        self.tokenizer = TestbedChatTokenizer()
        self.inflight = 0

    def _occurrence(self, digest: str) -> int:
        count = self._seen.pop(digest, 0)
        self._seen[digest] = count + 1
        if len(self._seen) > _REMEMBERED_BODIES:
            self._seen.popitem(last=False)
        return count

    def _draw_fault(self, rng: random.Random) -> str | None:
        s = self.settings
        rates = (s.rate_429, s.rate_500, s.rate_timeout, s.rate_non_json, s.rate_no_tool_call, s.rate_length)
        # Draw for every kind up front, so changing one knob never shifts the draws of the others.
        draws = [rng.random() for _ in FAULT_KINDS]
        return next((kind for kind, rate, u in zip(FAULT_KINDS, rates, draws, strict=True) if u < rate), None)

    def _decide(self, body: dict[str, Any], tools: list[dict[str, Any]]) -> Decision | None:
        """The tool call of the configured strategy."""
        if self.settings.strategy == "naive":
            return decide_naive(body["messages"], tools)
        temperature = float(body.get("temperature") or 0.0)
        return decide(
            body["messages"],
            tools,
            seed=body.get("seed"),
            temperature=temperature,
            options_need_skill=self.settings.options_need_skill,
        )

    def _crash_search(self, body: dict[str, Any], tools: list[dict[str, Any]], decision: Decision | None) -> Decision | None:
        """``rate_server_crash``: now and then search with the ``<a>`` prefix the real server fails on."""
        rate = self.settings.rate_server_crash
        if not rate or decision is None or not any(tool["function"]["name"] == "search" for tool in tools):
            return decision
        if random.Random(f"{self.settings.fault_seed}:{_conversation_key(body)}:server-crash").random() >= rate:
            return decision
        return Decision("search", {"query": "<a> " + str(decision.arguments.get("query", "商品"))}, decision.reasoning)

    def _judge(self, body: dict[str, Any]) -> Response:
        """The deterministic judge's answer (non-streamed; the judge stage does not stream)."""
        if body.get("stream"):
            return _error(400, "the testbed judge does not stream", "BadRequestError", "stream")
        content, arguments, finish = judge_reply(body["messages"], self.settings.judge_fault_rate)
        digest = sha256_hex(canonical_json(body))  # plain JSON from orjson.loads
        message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": []}
        if arguments is not None:
            call = {"name": "submit_verdict", "arguments": arguments}
            message["tool_calls"] = [{"id": "chatcmpl-tool-" + digest[:32], "type": "function", "function": call}]
        prompt = _tokens(len(canonical_json(body["messages"])))
        completion = _tokens(len(content or "") + len(arguments or ""))
        return JSONResponse(
            {
                "id": "chatcmpl-" + digest[:32],
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.settings.judge_model_id,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            }
        )

    def _analyst(self, body: dict[str, Any]) -> Response:
        """The deterministic analyst's answer (non-streamed, like the judge's)."""
        if body.get("stream"):
            return _error(400, "the testbed analyst does not stream", "BadRequestError", "stream")
        tools = [tool for tool in body.get("tools") or [] if isinstance(tool, dict)]
        content, name, arguments = analyst_reply(body["messages"], tools, body.get("tool_choice"))
        digest = sha256_hex(canonical_json(body))  # plain JSON from orjson.loads
        message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": []}
        if name is not None:
            call = {"name": name, "arguments": arguments}
            message["tool_calls"] = [{"id": "chatcmpl-tool-" + digest[:32], "type": "function", "function": call}]
        prompt = _tokens(len(canonical_json(body["messages"])))
        completion = _tokens(len(content or "") + len(arguments or ""))
        finish = "tool_calls" if name is not None else "stop"
        return JSONResponse(
            {
                "id": "chatcmpl-" + digest[:32],
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.settings.analyst_model_id,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            }
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.settings.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "shopsimrl",
            "root": self.settings.model_id,
            "parent": None,
            "max_model_len": self.settings.max_model_len,
        }
        judge = {**model, "id": self.settings.judge_model_id, "root": self.settings.judge_model_id}
        analyst = {**model, "id": self.settings.analyst_model_id, "root": self.settings.analyst_model_id}
        return JSONResponse({"object": "list", "data": [model, judge, analyst]})

    async def chat_completions(self, request: Request) -> Response:
        s = self.settings
        if s.max_inflight is None:
            return await self._chat_completions(request)
        if self.inflight >= s.max_inflight:
            retry_after = {"Retry-After": str(s.overload_retry_after_s)}
            return _error(429, f"server busy: {self.inflight} requests in progress", "RateLimitError", None, **retry_after)
        self.inflight += 1
        try:
            return await self._chat_completions(request)
        finally:
            self.inflight -= 1

    async def _chat_completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        raw = await request.body()
        try:
            body = _validate(orjson.loads(raw))
        except ValueError as exc:
            param = exc.param if isinstance(exc, _BadRequest) else None
            message = str(exc) if isinstance(exc, _BadRequest) else f"request body is not valid JSON: {exc}"
            return _error(400, message, "BadRequestError", param)
        s = self.settings
        model = body.get("model")
        if model == s.judge_model_id:
            verdict = self._judge(body)
            await _answer_time(arrived, s.latency_ms)
            return verdict
        if model == s.analyst_model_id:
            answer = self._analyst(body)
            await _answer_time(arrived, s.latency_ms)
            return answer
        # Like vLLM, an omitted model means the served one.
        if s.strict_model and model is not None and model != s.model_id:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

        # orjson.loads gives plain JSON values only (no NaN, no other types): json_safe would copy it unchanged.
        digest = sha256_hex(canonical_json(body))
        occurrence = self._occurrence(digest)
        rng = random.Random(f"{s.fault_seed}:{digest}:{occurrence}")
        fault = self._draw_fault(rng)
        delay = s.latency_ms + rng.uniform(0.0, s.latency_jitter_ms)
        if fault in ("429", "500", "timeout"):
            await _answer_time(arrived, delay)
        if fault == "429":
            return _error(429, "injected rate limit", "RateLimitError", None, **{"Retry-After": str(s.retry_after_s)})
        if fault == "500":
            return _error(500, "injected internal server error", "InternalServerError")
        if fault == "timeout":
            await asyncio.sleep(s.timeout_sleep_s)

        tools = _restrict_tools(body.get("tools") or [], body.get("tool_choice"))
        prompt_chars = len(canonical_json(body["messages"])) + len(canonical_json(tools))
        prompt_tokens = _tokens(prompt_chars)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        too_long = _context_error(s.max_model_len, prompt_tokens, max_tokens)
        if too_long is not None:
            return too_long
        decision = self._decide(body, tools)
        decision = self._crash_search(body, tools, decision)
        completion = _Completion(decision, s.reasoning, prompt_tokens, max_tokens)
        if fault == "no_tool_call":
            completion.as_text(_TEXT_ONLY_REPLY)
        elif fault == "length":
            completion.cut_arguments()

        await _answer_time(arrived, delay)
        response_id = "chatcmpl-" + sha256_hex(f"{digest}:{occurrence}")[:32]
        call_id = "chatcmpl-tool-" + sha256_hex(f"{response_id}:0")[:32]
        model_name = model if isinstance(model, str) and model else s.model_id
        if body.get("stream", False):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = _stream(completion, response_id, call_id, model_name, include_usage, fault == "non_json")
            return StreamingResponse(chunks, media_type="text/event-stream")
        if fault == "non_json":
            return PlainTextResponse(_NON_JSON_BODY, status_code=200)
        # The bytes starlette's JSONResponse writes (compact, UTF-8), from orjson at a fraction of the CPU.
        return Response(orjson.dumps(_full_response(completion, response_id, call_id, model_name)), media_type="application/json")

    async def generate(self, request: Request) -> Response:
        """SGLang's ``POST /generate`` over the policy (:mod:`shopsimrl.testbed.generate`)."""
        arrived = time.monotonic()
        raw = await request.body()
        try:
            parsed = parse_generate_request(orjson.loads(raw), self.tokenizer)
        except (GenerateRequestError, ValueError) as exc:
            message = str(exc) if isinstance(exc, GenerateRequestError) else f"request body is not valid JSON: {exc}"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        s = self.settings
        digest = sha256_hex(canonical_json({"input_ids": parsed.input_ids, "params": repr(parsed)}))
        occurrence = self._occurrence(digest)
        rng = random.Random(f"{s.fault_seed}:{digest}:{occurrence}")
        fault = self._draw_fault(rng)
        delay = s.latency_ms + rng.uniform(0.0, s.latency_jitter_ms)
        if fault in ("429", "500", "timeout"):
            await _answer_time(arrived, delay)
        if fault == "429":
            return JSONResponse(
                {"error": {"message": "injected rate limit"}}, status_code=429, headers={"Retry-After": str(s.retry_after_s)}
            )
        if fault == "500":
            return JSONResponse({"error": {"message": "injected internal server error"}}, status_code=500)
        if fault == "timeout":
            await asyncio.sleep(s.timeout_sleep_s)
        too_long = context_length_message(len(parsed.input_ids), parsed.max_new_tokens, s.max_model_len)
        if too_long is not None:
            return JSONResponse({"error": {"message": too_long}}, status_code=400)
        if s.rate_abort and random.Random(f"{s.fault_seed}:{digest}:{occurrence}:abort").random() < s.rate_abort:
            await _answer_time(arrived, delay)
            return Response(orjson.dumps(abort_reply(parsed, digest, "Abort request: injected")), media_type="application/json")
        try:
            prompt = self.tokenizer.parse(parsed.input_ids)
        except TemplateParseError as exc:
            return JSONResponse(
                {"error": {"message": f"input_ids: not a prompt of the testbed chat template: {exc}"}}, status_code=400
            )
        body: dict[str, Any] = {"messages": prompt.messages, "temperature": parsed.temperature, "seed": parsed.seed}
        decision = self._decide(body, prompt.tools) if prompt.generation_prompt else None
        decision = self._crash_search(body, prompt.tools, decision)
        if decision is None or fault == "no_tool_call":
            text = reply_text(None, None, None, _TEXT_ONLY_REPLY if decision is not None else _NO_TOOLS_REPLY)
        else:
            reasoning = decision.reasoning if s.reasoning else None
            text = reply_text(decision.tool, decision.arguments, reasoning, None)
        # The length fault: the reply cut halfway, as if max_new_tokens had run out there.
        cut = len(self.tokenizer.encode(text)) // 2 if fault == "length" else None
        answer = shape_reply(parsed, text, self.tokenizer, prompt_digest=digest, cut_to=cut)
        await _answer_time(arrived, delay)
        if fault == "non_json":
            return PlainTextResponse(_NON_JSON_BODY, status_code=200)
        return Response(orjson.dumps(answer), media_type="application/json")


def _conversation_key(body: dict[str, Any]) -> str:
    """What the conversation says, without the ids each answer draws anew (tool-call ids differ
    between two runs of one episode): the same episode gets the same key in every run."""
    said = [
        [
            message.get("role"),
            message.get("content"),
            [
                [(call.get("function") or {}).get("name"), (call.get("function") or {}).get("arguments")]
                for call in message.get("tool_calls") or []
            ],
        ]
        for message in body["messages"]
        if isinstance(message, dict)
    ]
    return sha256_hex(canonical_json({"messages": said, "seed": body.get("seed")}))


async def _answer_time(arrived: float, delay_ms: float) -> None:
    """Wait until ``delay_ms`` after the request arrived. The policy's own work (reading the
    request, deciding) happens inside the latency, as a model server's tokenising and scheduling
    happen inside its response time; a burst of requests then queues for the policy's CPU only
    when that work outgrows the latency."""
    remaining = delay_ms / 1000 - (time.monotonic() - arrived)
    if remaining > 0:
        await asyncio.sleep(remaining)


def _message(completion: _Completion, call_id: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": completion.content, "tool_calls": []}
    if completion.reasoning is not None:
        message["reasoning_content"] = completion.reasoning
    if completion.name is not None:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": completion.name, "arguments": completion.arguments},
            }
        ]
    return message


def _full_response(completion: _Completion, response_id: str, call_id: str, model: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": _message(completion, call_id),
                "logprobs": None,
                "finish_reason": completion.finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": completion.usage(),
    }


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


async def _stream(
    completion: _Completion, response_id: str, call_id: str, model: str, include_usage: bool, broken: bool
) -> AsyncIterator[bytes]:
    """SSE chunks in vLLM's order: role, reasoning deltas, tool-call fragments, finish, usage."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    yield chunk({"role": "assistant", "content": ""})
    if broken:
        yield b'data: {"id": "' + response_id.encode() + b'", "choices": [\n\n'
        yield b"data: [DONE]\n\n"
        return
    for piece in _pieces(completion.reasoning or "", 8) if completion.reasoning else []:
        yield chunk({"reasoning_content": piece})
    if completion.content:
        for piece in _pieces(completion.content, 8):
            yield chunk({"content": piece})
    if completion.name is not None:
        head = {"index": 0, "id": call_id, "type": "function", "function": {"name": completion.name, "arguments": ""}}
        yield chunk({"tool_calls": [head]})
        for piece in _pieces(completion.arguments or "", 10):
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        await asyncio.sleep(0)  # let the server flush between the call and its finish
    yield chunk({}, completion.finish_reason)
    if include_usage:
        usage = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
        usage |= {"choices": [], "usage": completion.usage()}
        yield f"data: {json.dumps(usage)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def create_app(settings: PolicySettings | None = None) -> Starlette:
    """The ASGI app; ``settings`` default to ``PolicySettings()`` (environment variables)."""
    server = _PolicyServer(settings or PolicySettings())
    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
    ]
    if server.settings.token_endpoint:
        routes.append(Route("/generate", server.generate, methods=["POST"]))
    app = Starlette(routes=routes)
    app.state.policy_settings = server.settings
    return app


def serve(host: str = "127.0.0.1", port: int = 8000, settings: PolicySettings | None = None) -> None:
    """Serve the heuristic policy in the foreground until interrupted."""
    serve_forever(create_app(settings), host, port)
