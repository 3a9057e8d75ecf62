"""The chat-model seam and its OpenAI-compatible HTTP adapter (vLLM, SGLang, llama.cpp, OpenAI).

``ChatModel`` is what the runtime talks to: ``generate(messages, tools, seed)`` returns a
``ModelOutput`` whose ``protocol_error`` / ``policy_failure`` say whether the reply is usable.
Unusable replies are *returned*, never resampled: the runtime decides what to do with them.

``OpenAICompatibleChatModel`` POSTs to ``{base_url}/chat/completions`` (a query in ``base_url``,
such as a gateway's ``?api-version=…``, stays after the path) through one pooled connection pool
(:class:`~shopsimrl.httpclient.HttpService`) per adapter instance, shared by every concurrent
episode of a process.
Transient failures are retried inside one ``generate`` call; everything that escapes is
translated into this module's exceptions::

    ModelError                         base of everything raised here
    ├── ModelConfigError (ValueError)  bad settings, an extra_body key that collides with a
    │                                  reserved body key, a missing/blank API key; never retried
    └── ModelRequestError              the call failed: a non-retryable HTTP status (one
                                       attempt), or every attempt failed; carries
                                       .status_code, .attempts (records), .attempt_count

    Retried inside generate() through shopsimrl.retry (capped exponential backoff with jitter, or the server's
    Retry-After), never raised as such: shopsimrl.httpclient.TransportError (connect, timeouts, broken
    connections), HTTP 408/409/429/5xx, a stream without ``[DONE]``, a streamed chunk that is
    not JSON or carries an ``error`` object. Misuse (calling a closed adapter) is a RuntimeError.

Protocol error codes, in check order (the first failing check wins):
``invalid_json_response``, ``invalid_response_body``, ``missing_choices``, ``invalid_choice``,
``invalid_message``, ``invalid_tool_calls``, then per call ``invalid_tool_call``,
``missing_function``, ``missing_tool_call_id``, ``missing_tool_name``; then the policy check
``generation_length`` (``finish_reason == "length"`` with tools offered and not exactly one
fully valid call), so that a call cut off mid-arguments ends the episode instead of getting a
repair turn; then ``invalid_unicode`` (a lone surrogate anywhere in the reply); then per call
``invalid_arguments_type``, ``invalid_arguments_json``, ``invalid_arguments_object``,
``invalid_unicode`` (a lone surrogate in the parsed arguments, e.g. ``{"query": "\\ud800"}``),
``unavailable_tool``; then ``tool_call_count`` (tools offered, ≠1 call), ``mixed_content``
(visible text beside the call) and ``empty_response``.

Text that is not valid Unicode never leaves the adapter in a usable field: a lone surrogate
(U+D800–U+DFFF on its own, which JSON can spell as ``\\ud800`` but UTF-8 cannot carry) in any
field of the reply is replaced by U+FFFD in ``content``, ``reasoning``, ``tool_calls``,
``finish_reason``, ``usage``, ``response_id`` and ``metadata``, and the exact body is kept in
``raw_response`` (the trace writes it with ``\\uXXXX`` escapes, losslessly). Parsed arguments
holding one are not kept (``arguments`` is None); ``raw_arguments`` keeps their exact text.

Context overflow is a policy outcome too: an HTTP 400 (or, from SGLang, an ``error`` chunk in
a stream) saying that the prompt plus ``max_tokens`` exceeds the context window comes back as
``policy_failure = {"code": "context_length"}``, never retried. The texts of vLLM, SGLang,
llama.cpp's server, llama-cpp-python and OpenAI are recognised (``_CONTEXT_OVERFLOW``), and
OpenAI's ``context_length_exceeded`` code and llama.cpp's ``exceed_context_size_error`` type.
When the error states a window that ``max_tokens`` alone does not fit, no conversation could
ever fit: that is a ``ModelRequestError`` (a configuration error), not a policy failure.

Compatibility knob ``assistant_content_empty_string``: some servers (llama.cpp) reject
assistant messages whose ``content`` is ``null``, which is how tool-call turns are recorded.
With the knob on, such messages are sent with ``content: ""``; the caller's list (and so the
trace's ``conversation``) keeps ``null``.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Literal, Protocol, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

import structlog

from shopsimrl.httpclient import HttpService, ReadTimeout, Response, Timeout, TransportError, WriteTimeout
from shopsimrl.inflight import AdaptiveLimit
from shopsimrl.logs import brief
from shopsimrl.retry import Attempt, Backoff, retry_async
from shopsimrl.schemas import (
    ModelOutput,
    ToolCall,
    canonical_json,
    find_lone_surrogate,
    join_surrogate_pairs,
    parse_json,
    redact_uri,
    replace_lone_surrogates,
    sha256_hex,
    wire_json,
)

__all__ = [
    "ChatModel",
    "ModelConfigError",
    "ModelError",
    "ModelRequestError",
    "OpenAICompatibleChatModel",
    "OpenAICompatibleSettings",
    "context_overflow",
    "parse_chat_completion",
]

PROVIDER = "openai_compatible_http"
RESERVED_BODY_KEYS = frozenset(
    {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "temperature", "max_tokens", "top_p", "seed"}
)
RETRYABLE_STATUSES = frozenset({408, 409, 429})  # plus every 5xx
CONNECT_TIMEOUT_CAP = 10.0
ERROR_BODY_CHARS = 500
RAW_TEXT_CHARS = 4000
METADATA_KEYS = ("created", "system_fingerprint", "service_tier")

_log = structlog.get_logger("shopsimrl.model")

Sleep = Callable[[float], Awaitable[Any]]


# --------------------------------------------------------------------------- errors


class ModelError(Exception):
    """Base class of the model adapter's errors."""


class ModelConfigError(ModelError, ValueError):
    """The adapter is misconfigured (settings, extra_body, API key); retrying cannot help."""


class ModelRequestError(ModelError):
    """A model call failed: a non-retryable HTTP status, or every attempt failed."""

    def __init__(
        self, message: str, *, status_code: int | None, attempts: list[dict[str, Any]], configuration: bool = False
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.attempts = attempts
        self.configuration = configuration
        """The run's settings alone cause it (no conversation could succeed), not the agent."""

    @property
    def attempt_count(self) -> int:
        return len(self.attempts)


class _ContextOverflow(Exception):
    """The server refused the request because the conversation no longer fits its context."""

    def __init__(self, message: str, *, status: int | None, body: Any, excerpt: str) -> None:
        super().__init__(message)
        self.status = status
        self.excerpt = excerpt
        self.window = _stated_window(message, body)


class _Retryable(Exception):
    """One attempt failed in a way that another attempt may fix."""

    def __init__(
        self, message: str, *, status: int | None = None, retry_after: float | None = None, overload: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.overload = overload
        """The server is saying it has too much to do (429, 503, no answer in time)."""


# --------------------------------------------------------------------------- protocol and settings


@runtime_checkable
class ChatModel(Protocol):
    """What the runtime needs from a model; one instance may serve many concurrent episodes."""

    def identity(self) -> dict[str, Any]:
        """JSON-safe description recorded as ``provenance.model`` (never secrets)."""
        ...

    async def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], seed: int | None = None) -> ModelOutput:
        """One reply; unusable replies come back with ``protocol_error``/``policy_failure`` set."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class OpenAICompatibleSettings:
    """Settings of one OpenAI-compatible endpoint.

    ``OpenAICompatibleSettings(model="Qwen/Qwen3.5-4B", base_url="http://vllm:8000/v1",
    api_key_env=None, extra_body={"enable_thinking": True})``
    """

    model: str
    base_url: str
    api_key_env: str | None = "OPENAI_API_KEY"
    """Name of the environment variable holding the API key; None sends no Authorization header."""
    checkpoint_id: str | None = None
    """Identity only (which weights are served); never sent to the server."""
    temperature: float = 0.0
    max_tokens: int = 512
    top_p: float | None = None
    timeout: float = 180.0
    """Read/write/pool timeout of one attempt, in seconds; connecting is capped at 10 s."""
    max_retries: int = 5
    """Total attempts per call (not retries after the first), as in the reference."""
    retry_backoff_seconds: float = 1.0
    max_backoff_seconds: float = 30.0
    stream: bool = False
    send_seed: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    """Merged into the request body (e.g. ``enable_thinking``); may not override reserved keys."""
    trust_env: bool = False
    """Honour proxy variables and netrc; off so localhost traffic never goes through a proxy."""
    max_connections: int = 256
    assistant_content_empty_string: bool = False
    """Send assistant ``content: null`` as ``""`` (for servers such as llama.cpp)."""

    def __post_init__(self) -> None:
        for name in ("model", "base_url"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ModelConfigError(f"model setting {name!r} must be a non-blank string, got {value!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ModelConfigError(
                f"model setting 'base_url' must start with http:// or https://, got {redact_uri(self.base_url)!r}"
            )
        try:
            parts = urlsplit(self.base_url)
        except ValueError:
            raise ModelConfigError("model setting 'base_url' is not a valid URL") from None
        if "@" in parts.netloc:
            # The HTTP client would send them as Basic auth instead of the Bearer key, and servers echo headers.
            raise ModelConfigError(
                "model setting 'base_url' must not contain user:password@ credentials; "
                "put the API key in the environment variable named by api_key_env"
            )
        if parts.fragment:
            raise ModelConfigError("model setting 'base_url' must not have a #fragment")
        for name in ("api_key_env", "checkpoint_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ModelConfigError(f"model setting {name!r} must be null or a non-blank string, got {value!r}")
        for name in ("stream", "send_seed", "trust_env", "assistant_content_empty_string"):
            if not isinstance(getattr(self, name), bool):
                raise ModelConfigError(f"model setting {name!r} must be a boolean, got {getattr(self, name)!r}")
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_number("timeout", self.timeout, minimum=0.0, exclusive=True)
        _check_number("retry_backoff_seconds", self.retry_backoff_seconds, minimum=0.0)
        _check_number("max_backoff_seconds", self.max_backoff_seconds, minimum=0.0)
        if self.top_p is not None:
            _check_number("top_p", self.top_p, minimum=0.0, exclusive=True)
            if self.top_p > 1.0:
                raise ModelConfigError(f"model setting 'top_p' must be in (0, 1], got {self.top_p!r}")
        for name in ("max_tokens", "max_retries", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"model setting {name!r} must be an integer >= 1, got {value!r}")
        if isinstance(self.tool_choice, str):
            if not self.tool_choice.strip():
                raise ModelConfigError("model setting 'tool_choice' must be non-blank")
        elif not isinstance(self.tool_choice, Mapping):
            raise ModelConfigError(f"model setting 'tool_choice' must be a string or an object, got {self.tool_choice!r}")
        else:
            object.__setattr__(self, "tool_choice", _frozen_json("tool_choice", self.tool_choice))
        if not isinstance(self.extra_body, Mapping):
            raise ModelConfigError(f"model setting 'extra_body' must be an object, got {self.extra_body!r}")
        for key in self.extra_body:
            if key in RESERVED_BODY_KEYS:
                raise ModelConfigError(
                    f"model setting 'extra_body' may not set the reserved request key {key!r}; use the dedicated setting instead"
                )
        object.__setattr__(self, "extra_body", _frozen_json("extra_body", self.extra_body))


def _check_number(name: str, value: Any, *, minimum: float, exclusive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > minimum if exclusive else value >= minimum
    if not ok:
        bound = f"> {minimum}" if exclusive else f">= {minimum}"
        raise ModelConfigError(f"model setting {name!r} must be a finite number {bound}, got {value!r}")


def _frozen_json(name: str, value: Mapping[str, Any]) -> Mapping[str, Any]:
    # Identity is fingerprinted, so the mapping must be plain JSON and must not change later.
    try:
        copy = json.loads(canonical_json(dict(value)))
    except (TypeError, ValueError) as exc:
        raise ModelConfigError(f"model setting {name!r} must be JSON-serialisable: {exc}") from exc
    return MappingProxyType(copy)


# --------------------------------------------------------------------------- the adapter


class OpenAICompatibleChatModel:
    """``ChatModel`` over an OpenAI-compatible ``/chat/completions`` endpoint."""

    def __init__(
        self,
        settings: OpenAICompatibleSettings,
        *,
        http: HttpService | None = None,
        sleep: Sleep = asyncio.sleep,
        limit: AdaptiveLimit | None = None,
    ) -> None:
        if not isinstance(settings, OpenAICompatibleSettings):
            raise ModelConfigError(f"settings must be OpenAICompatibleSettings, got {type(settings).__name__}")
        self.settings = settings
        self._base_url = settings.base_url.rstrip("/")
        self._sleep = sleep
        self.limit = limit
        """Requests in flight at the server, adapting to its load (None: no limit here)."""
        self._http_service = http
        self._owns_http = http is None
        self._closed = False

    def __repr__(self) -> str:
        return f"OpenAICompatibleChatModel(model={self.settings.model!r}, base_url={redact_uri(self._base_url)!r})"

    def _endpoint(self, path: str) -> str:
        """``base_url`` joined with ``path``; a query of ``base_url`` stays after the path."""
        parts = urlsplit(self.settings.base_url)
        return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + path, parts.query, ""))

    # ------------------------------------------------------------------ identity

    def identity(self) -> dict[str, Any]:
        s = self.settings
        ident: dict[str, Any] = {"provider": PROVIDER}
        if s.checkpoint_id is not None:
            ident["checkpoint_id"] = s.checkpoint_id
        ident["model"] = s.model
        ident["base_url"] = redact_uri(self._base_url)
        ident["transport"] = {
            "timeout_seconds": s.timeout,
            "max_retries": s.max_retries,
            "retry_backoff_seconds": s.retry_backoff_seconds,
        }
        ident["sampling"] = {
            "temperature": s.temperature,
            "max_tokens": s.max_tokens,
            "top_p": s.top_p,
            "send_seed": s.send_seed,
            "tool_choice": _thaw(s.tool_choice),
            "extra_body": _thaw(s.extra_body),
        }
        return ident

    def semantic_identity(self) -> dict[str, Any]:
        """The identity minus where and how the server is reached: what changes outputs."""
        ident = self.identity()
        del ident["base_url"], ident["transport"]
        return ident

    # ------------------------------------------------------------------ auth

    def check_api_key(self) -> None:
        """Fail fast (before any episode) when the configured key variable is missing or blank."""
        self._api_key()

    def _api_key(self) -> str | None:
        name = self.settings.api_key_env
        if name is None:
            return None
        value = os.environ.get(name, "").strip()
        if not value:
            raise ModelConfigError(
                f"model API key variable {name!r} is not set or blank "
                f"(set it, or set model api_key_env to null for servers without auth)"
            )
        return value

    def _headers(self) -> dict[str, str]:
        key = self._api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _redact(self, text: str) -> str:
        # Servers sometimes echo the rejected key in 401 bodies; it must not reach traces/logs.
        name = self.settings.api_key_env
        key = os.environ.get(name, "").strip() if name else ""
        return text.replace(key, "***") if len(key) >= 4 else text

    # ------------------------------------------------------------------ client

    def _http(self) -> HttpService:
        if self._closed:
            raise RuntimeError("the model adapter is closed; create a new one")
        # Created on first use, so that identity-only uses (plan) never open a pool.
        if self._http_service is None:
            s = self.settings
            self._http_service = HttpService(max_connections=s.max_connections, trust_env=s.trust_env)
        return self._http_service

    def _timeout(self) -> Timeout:
        s = self.settings
        return Timeout(s.timeout, connect=min(s.timeout, CONNECT_TIMEOUT_CAP))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_http and self._http_service is not None:
            await self._http_service.aclose()

    async def list_models(self) -> list[str]:
        """Ids served at ``GET {base_url}/models`` (one attempt; for health probes)."""
        url = self._endpoint("/models")
        shown = redact_uri(url)  # messages may persist; the URL itself may carry credentials
        try:
            response = await self._http().request("GET", url, headers=self._headers(), timeout=self._timeout())
        except TransportError as exc:
            raise ModelRequestError(
                self._redact(f"GET {shown} failed: {_describe(exc)}"), status_code=None, attempts=[]
            ) from None
        status = response.status_code
        if status != 200:
            text = self._redact(response.text[:ERROR_BODY_CHARS])
            raise ModelRequestError(f"GET {shown} returned HTTP {status}: {text}", status_code=status, attempts=[])
        try:
            return [replace_lone_surrogates(str(item["id"])) for item in parse_json(response.content)["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelRequestError(
                f"GET {shown} did not return an OpenAI model list ({type(exc).__name__})", status_code=status, attempts=[]
            ) from None

    # ------------------------------------------------------------------ generate

    def _body(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], seed: int | None) -> dict[str, Any]:
        s = self.settings
        if s.assistant_content_empty_string:
            messages = [
                {**m, "content": ""} if m.get("role") == "assistant" and m.get("content") is None else m for m in messages
            ]
        body: dict[str, Any] = {
            "model": s.model,
            "messages": messages,
            "stream": s.stream,
            "temperature": s.temperature,
            "max_tokens": s.max_tokens,
        }
        if s.top_p is not None:
            body["top_p"] = s.top_p
        if seed is not None and s.send_seed:
            body["seed"] = seed
        if tools:
            body["tools"] = tools
            body["tool_choice"] = _thaw(s.tool_choice)
        if s.stream:
            body["stream_options"] = {"include_usage": True}
        body.update(_thaw(s.extra_body))
        return body

    async def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], seed: int | None = None) -> ModelOutput:
        s = self.settings
        headers = {"Content-Type": "application/json", **self._headers()}
        payload = wire_json(self._body(messages, tools, seed))  # sampling values are validated finite
        allowed = _tool_names(tools)
        url = self._endpoint("/chat/completions")
        client = self._http()
        # The per-attempt records of the trace (``steps[i].model.attempts``), one per attempt.
        attempts: list[dict[str, Any]] = []

        async def attempt(current: Attempt) -> ModelOutput:
            record: dict[str, Any] = {
                "attempt": current.number,
                "latency_ms": None,
                "status": None,
                "error": None,
                "backoff_ms": 0.0,
            }
            attempts.append(record)
            permit = await self.limit.acquire() if self.limit is not None else None
            sent = time.perf_counter()  # a wait for the limit is not the server's latency
            signal: Literal["ok", "overload", "other"] = "other"
            overload: _Retryable | None = None
            try:
                if s.stream:
                    status, body, raw = await self._stream_attempt(client, url, payload, headers)
                else:
                    status, body, raw = await self._plain_attempt(client, url, payload, headers)
                signal = "ok"
            except _Retryable as exc:
                record.update(latency_ms=_ms_since(sent), status=exc.status, error=self._redact(str(exc)))
                if exc.overload:
                    signal, overload = "overload", exc
                raise
            except ModelRequestError as exc:
                record.update(latency_ms=_ms_since(sent), status=exc.status_code, error=str(exc))
                exc.attempts = attempts
                raise
            except _ContextOverflow as exc:
                record.update(latency_ms=_ms_since(sent), status=exc.status, error=self._redact(str(exc)))
                return self._context_length_failure(exc, url, attempts)
            finally:
                if self.limit is not None and permit is not None:
                    self.limit.release(
                        permit,
                        signal,
                        status=overload.status if overload else None,
                        retry_after=overload.retry_after if overload else None,
                    )
            record.update(latency_ms=_ms_since(sent), status=status)
            output = _parse(body, raw, allowed, offered=bool(tools))
            output.latency_ms = record["latency_ms"]
            output.attempt_count = current.number
            output.attempts = attempts
            return output

        def on_retry(failed: Attempt) -> None:
            record = attempts[-1]
            record["backoff_ms"] = round(failed.delay_s * 1000.0, 3)
            status = getattr(failed.error, "status", None)
            # Info, one short line: the live bar counts retries, and load refusals get one
            # aggregated warning there (shopsimrl.runner.progress); the full error is in the trace.
            _log.info(
                "model_request_retry",
                attempt=failed.number,
                status=status,
                delay_s=round(failed.delay_s, 2),
                error=brief(record["error"], 120),
            )

        def exhausted(last: Attempt, elapsed_s: float) -> ModelRequestError:
            return ModelRequestError(
                f"model request failed after {last.number} attempts: {self._redact(str(last.error))}",
                status_code=getattr(last.error, "status", None),
                attempts=attempts,
            )

        return await retry_async(
            attempt,
            self._retries(),
            retryable=lambda exc: isinstance(exc, _Retryable),
            retry_after=lambda exc: exc.retry_after if isinstance(exc, _Retryable) else None,
            on_retry=on_retry,
            exhausted=exhausted,
            sleep=self._sleep,
        )

    def _context_length_failure(self, exc: _ContextOverflow, url: str, attempts: list[dict[str, Any]]) -> ModelOutput:
        """The policy failure ``context_length``, unless the settings alone cannot fit."""
        budget = self.settings.max_tokens
        if exc.window is not None and budget >= exc.window:
            # No conversation could ever fit: a configuration error, not the agent's doing.
            raise ModelRequestError(
                f"model.max_tokens ({budget}) is not smaller than the model's context window ({exc.window} tokens) "
                f"at POST {redact_uri(url)}: {self._redact(str(exc))}",
                status_code=exc.status,
                attempts=attempts,
                configuration=True,
            )
        output = ModelOutput(
            policy_failure={
                "code": "context_length",
                "message": f"the conversation no longer fits the model's context window: {self._redact(str(exc))}",
            },
            raw_response={"http_status": exc.status, "error_body": self._redact(exc.excerpt)},
        )
        output.latency_ms = attempts[-1]["latency_ms"]
        output.attempt_count = len(attempts)
        output.attempts = attempts
        return output

    def _retries(self) -> Backoff:
        """``max_retries`` attempts; base·2^n capped at ``max_backoff_seconds`` plus up to 1 s of jitter,
        or the server's Retry-After (capped)."""
        s = self.settings
        return Backoff(
            attempts=s.max_retries, base_delay_s=s.retry_backoff_seconds, max_delay_s=s.max_backoff_seconds, jitter="additive"
        )

    def _status_error(self, url: str, response: Response, text: str) -> Exception:
        status = response.status_code
        excerpt = self._redact(text[:ERROR_BODY_CHARS])
        if status == 400:
            body, _ = _decode_json(text.encode("utf-8"))
            overflow = _context_overflow_message(body, text)
            if overflow is not None:
                overflow = replace_lone_surrogates(overflow)  # an escaped one in the error body
                return _ContextOverflow(overflow[:ERROR_BODY_CHARS], status=status, body=body, excerpt=text[:ERROR_BODY_CHARS])
        if status in RETRYABLE_STATUSES or 500 <= status <= 599:
            return _Retryable(
                f"HTTP {status}: {excerpt}",
                status=status,
                retry_after=_retry_after(response.headers.get("retry-after")),
                overload=status in (429, 503),
            )
        return ModelRequestError(
            f"non-retryable model HTTP {status} from POST {redact_uri(url)}: {excerpt}", status_code=status, attempts=[]
        )

    async def _plain_attempt(
        self, client: HttpService, url: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, Any, str | None]:
        try:
            response = await client.request("POST", url, content=payload, headers=headers, timeout=self._timeout())
        except TransportError as exc:
            raise _Retryable(_describe(exc), overload=isinstance(exc, (ReadTimeout, WriteTimeout))) from None
        if not response.is_success:
            raise self._status_error(url, response, response.text)
        return response.status_code, *_decode_json(response.content)

    async def _stream_attempt(
        self, client: HttpService, url: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, Any, str | None]:
        request_headers = {**headers, "Accept": "text/event-stream"}
        try:
            async with client.stream("POST", url, content=payload, headers=request_headers, timeout=self._timeout()) as response:
                if not response.is_success:
                    await response.aread()
                    raise self._status_error(url, response, response.text)
                if response.headers.get("content-type", "").startswith("application/json"):
                    # The server ignored stream=true and answered with one completion object.
                    return response.status_code, *_decode_json(await response.aread())
                assembler = _StreamAssembler()
                async for line in response.aiter_lines():
                    if assembler.feed(line):
                        break
                return response.status_code, assembler.finish(), None
        except TransportError as exc:
            raise _Retryable(_describe(exc), overload=isinstance(exc, (ReadTimeout, WriteTimeout))) from None


# --------------------------------------------------------------------------- streaming


class _StreamAssembler:
    """Rebuilds one chat.completion object from SSE ``chat.completion.chunk`` lines."""

    def __init__(self) -> None:
        self.chunks = 0
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.top: dict[str, Any] = {}
        self.finish_reason: str | None = None
        self.done = False

    def feed(self, line: str) -> bool:
        """Consume one SSE line; True once ``[DONE]`` arrived."""
        if not line.startswith("data:"):
            return False  # comments, event names, blank separators
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return True
        try:
            chunk = parse_json(data)
        except ValueError:
            raise _Retryable(f"streamed chunk {self.chunks + 1} is not JSON: {data[:200]!r}") from None
        self.chunks += 1
        if not isinstance(chunk, dict):
            raise _Retryable(f"streamed chunk {self.chunks} is not an object")
        if chunk.get("error") is not None:
            text = replace_lone_surrogates(json.dumps(chunk["error"], ensure_ascii=False))
            overflow = _context_overflow_message(chunk, text)
            if overflow is not None:  # SGLang reports it inside a 200 stream
                raise _ContextOverflow(overflow[:ERROR_BODY_CHARS], status=None, body=chunk, excerpt=text[:ERROR_BODY_CHARS])
            raise _Retryable(f"stream reported an error: {text[:ERROR_BODY_CHARS]}")
        for key in ("id", "model", "usage", *METADATA_KEYS):
            if chunk.get(key) is not None:
                self.top[key] = chunk[key]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return False  # the trailing usage-only chunk has no choices
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return False
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        piece = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(piece, str):
            self.reasoning.append(piece)
        fragments = delta.get("tool_calls")
        if isinstance(fragments, list):
            for position, fragment in enumerate(fragments):
                if isinstance(fragment, dict):
                    self._merge_call(fragment, position)
        return False

    def _merge_call(self, fragment: dict[str, Any], position: int) -> None:
        index = fragment.get("index", position)
        index = index if isinstance(index, int) else position
        call = self.calls.setdefault(index, {"id": None, "type": None, "name": "", "arguments": ""})
        if fragment.get("id"):
            call["id"] = fragment["id"]
        if fragment.get("type"):
            call["type"] = fragment["type"]
        function = fragment.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str):
                call["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                call["arguments"] += function["arguments"]

    def finish(self) -> dict[str, Any]:
        if not self.done or self.chunks == 0:
            what = "any data" if self.chunks == 0 else "[DONE]"
            raise _Retryable(f"stream ended without {what} after {self.chunks} chunks")
        response_id = self.top.get("id")
        tool_calls = []
        for index in sorted(self.calls):
            call = self.calls[index]
            call_id = (
                call["id"]
                or "call-stream-"
                + sha256_hex(
                    canonical_json(
                        {"response_id": response_id, "index": index, "name": call["name"], "arguments": call["arguments"]}
                    )
                )[:24]
            )
            tool_calls.append(
                {
                    "id": call_id,
                    "type": call["type"] or "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            )
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) if self.content else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if tool_calls:
            message["tool_calls"] = tool_calls
        body = {**self.top, "object": "chat.completion", "stream_chunks": self.chunks}
        body["choices"] = [{"index": 0, "message": message, "finish_reason": self.finish_reason}]
        # A surrogate pair split across two chunks is one character, as it is within one chunk.
        return join_surrogate_pairs(body) if find_lone_surrogate(body) is not None else body


# --------------------------------------------------------------------------- parsing


_NOT_UNICODE = "not valid Unicode text; write plain UTF-8 characters (no \\ud800-\\udfff escapes outside a pair)"


class _Rejected(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parse(body: Any, raw_text: str | None, allowed: set[str], *, offered: bool) -> ModelOutput:
    """Turn a completion body into a ModelOutput, applying the protocol checks in order."""
    output = ModelOutput()
    if raw_text is not None:
        output.protocol_error = {"code": "invalid_json_response", "message": "the response body is not JSON"}
        output.raw_response = {"text": raw_text[:RAW_TEXT_CHARS]}
        return output
    try:
        _fill(output, body, allowed, offered=offered)
    except _Rejected as exc:
        output.protocol_error = {"code": exc.code, "message": str(exc)}
    if output.protocol_error or output.policy_failure:
        output.raw_response = body
    return output


def _fill(output: ModelOutput, body: Any, allowed: set[str], *, offered: bool) -> None:
    if not isinstance(body, dict):
        raise _Rejected("invalid_response_body", f"the response body is a {type(body).__name__}, not an object")
    # Text that is not valid Unicode (a lone surrogate, which JSON can escape but UTF-8 cannot
    # carry) must not reach the conversation, the environment or a reader: the fields are read
    # from a copy with U+FFFD in its place, the exact body stays in raw_response, and the reply is
    # a protocol error (a repair turn) unless a policy failure ends the episode first.
    invalid_text = find_lone_surrogate(body)
    if invalid_text is not None:
        body = replace_lone_surrogates(body)
    output.response_id = body["id"] if isinstance(body.get("id"), str) else None
    output.usage = body["usage"] if isinstance(body.get("usage"), dict) else None
    output.metadata = {key: body[key] for key in METADATA_KEYS if body.get(key) is not None}
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise _Rejected("missing_choices", "the response has no choices")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise _Rejected("invalid_choice", "choices[0] is not an object")
    output.finish_reason = choice["finish_reason"] if isinstance(choice.get("finish_reason"), str) else None
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _Rejected("invalid_message", "choices[0].message is not an object")
    output.content = _text(message.get("content"))
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    output.reasoning = reasoning if isinstance(reasoning, str) else None
    raw_calls = message.get("tool_calls")
    if raw_calls is None:
        raw_calls = []
    if not isinstance(raw_calls, list):
        raise _Rejected("invalid_tool_calls", "message.tool_calls is not a list")

    # Structure of every call first; argument problems are judged after the length policy.
    # A structurally broken reply keeps no calls: its repair turn cannot answer call ids.
    calls: list[ToolCall] = []
    for i, call in enumerate(raw_calls):
        if not isinstance(call, dict) or call.get("type") not in (None, "function"):
            raise _Rejected("invalid_tool_call", f"tool_calls[{i}] is not a function call object")
        function = call.get("function")
        if not isinstance(function, dict):
            raise _Rejected("missing_function", f"tool_calls[{i}] has no function object")
        if not isinstance(call.get("id"), str) or not call["id"].strip():
            raise _Rejected("missing_tool_call_id", f"tool_calls[{i}] has no id")
        if not isinstance(function.get("name"), str) or not function["name"].strip():
            raise _Rejected("missing_tool_name", f"tool_calls[{i}] has no function name")
        arguments = function.get("arguments")
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(call_id=call["id"], name=function["name"], arguments=None, raw_arguments=raw))
    output.tool_calls = calls

    problems: list[tuple[str, str]] = []
    for i, (call, parsed) in enumerate(zip(raw_calls, output.tool_calls, strict=True)):
        problem = _check_arguments(i, call["function"].get("arguments"), parsed, allowed)
        if problem:
            problems.append(problem)
    valid_calls = len(output.tool_calls) - len(problems)

    if offered and output.finish_reason == "length" and not (len(output.tool_calls) == 1 and valid_calls == 1):
        output.policy_failure = {
            "code": "generation_length",
            "message": "generation hit max_tokens before producing exactly one complete tool call",
        }
        return
    if invalid_text is not None:
        where, index, code_point = invalid_text
        raise _Rejected("invalid_unicode", f"{where} holds a lone surrogate ({code_point}) at index {index}: {_NOT_UNICODE}")
    if problems:
        raise _Rejected(*problems[0])
    if offered and len(output.tool_calls) != 1:
        raise _Rejected("tool_call_count", f"expected exactly one tool call, got {len(output.tool_calls)}")
    if output.tool_calls and output.content and output.content.strip():
        raise _Rejected("mixed_content", "visible text was returned alongside the tool call")
    if not output.tool_calls and not (output.content and output.content.strip()):
        raise _Rejected("empty_response", "the response has neither a tool call nor content")


def _check_arguments(i: int, arguments: Any, call: ToolCall, allowed: set[str]) -> tuple[str, str] | None:
    if not isinstance(arguments, str):
        return "invalid_arguments_type", f"tool_calls[{i}].function.arguments is not a string"
    try:
        parsed = parse_json(arguments)
    except ValueError:
        return "invalid_arguments_json", f"tool_calls[{i}].function.arguments is not valid JSON"
    if not isinstance(parsed, dict):
        return "invalid_arguments_object", f"tool_calls[{i}].function.arguments is not a JSON object"
    invalid_text = find_lone_surrogate(parsed)
    if invalid_text is not None:  # e.g. {"query": "\\ud800"}: the raw arguments keep it, escaped
        where, index, code_point = invalid_text
        return (
            "invalid_unicode",
            f"tool_calls[{i}].function.arguments: {where} holds a lone surrogate ({code_point}) at index {index}: {_NOT_UNICODE}",
        )
    call.arguments = parsed
    if call.name not in allowed:
        return "unavailable_tool", f"tool {call.name!r} was not offered (offered: {sorted(allowed)})"
    return None


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    raise _Rejected("invalid_message", f"message.content is a {type(content).__name__}, not text")


# --------------------------------------------------------------------------- context overflow

# How servers say that the prompt (plus the max_tokens budget) does not fit the context window.
# Each pattern matches the stable part of one server's text; docs/runtime_eval.md lists them.
_CONTEXT_OVERFLOW = re.compile(
    "|".join(
        (
            r"maximum context length is \d+",  # vLLM, OpenAI, llama-cpp-python
            r"context length is only \d+",  # newer vLLM: "…the model's context length is only N tokens…"
            r"maximum context length of \d+",  # SGLang: prompt + max_new_tokens too long
            r"is longer than the model's context length",  # SGLang: the prompt alone
            r"exceeds (?:the available )?context size",  # llama.cpp server
            r"is larger than the max context size",  # llama.cpp server, older builds
            r"input tokens exceed the configured limit",  # OpenAI
            r"requested tokens \(\d+\) exceed context window",  # llama-cpp-python's own error
        )
    ),
    re.IGNORECASE,
)
_OVERFLOW_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})  # OpenAI; llama.cpp type
_WINDOW = re.compile(
    r"(?:maximum context length (?:is|of)|context length is only|context length \(|context size \("
    r"|configured limit of|context window of)\s*(\d+)",
    re.IGNORECASE,
)


def parse_chat_completion(body: Any, tools: list[dict[str, Any]]) -> ModelOutput:
    """A chat.completion body → ``ModelOutput`` with this module's protocol checks, in their order.
    For adapters that build the body themselves (the training adapter parses token ids into one),
    so that every adapter judges a reply the same way."""
    return _parse(body, None, _tool_names(tools), offered=bool(tools))


def context_overflow(body: Any, text: str) -> tuple[str, int | None] | None:
    """(the server's message, the window it states or None) when an error answer says that the
    prompt does not fit the context window (the texts of ``_CONTEXT_OVERFLOW``), else None."""
    message = _context_overflow_message(body, text)
    if message is None:
        return None
    return message, _stated_window(message, body)


def _error_fields(body: Any) -> tuple[list[str], set[str]]:
    """Messages and code/type strings of an error body in the shapes servers use."""
    messages: list[str] = []
    codes: set[str] = set()
    if not isinstance(body, dict):
        return messages, codes
    for holder in (body, body.get("error")):
        if isinstance(holder, str):
            messages.append(holder)
        elif isinstance(holder, dict):
            for key in ("message", "detail"):
                if isinstance(holder.get(key), str):
                    messages.append(holder[key])
            codes.update(str(holder[key]) for key in ("code", "type") if isinstance(holder.get(key), str))
    return messages, codes


def _context_overflow_message(body: Any, text: str) -> str | None:
    """The server's message when an error body says the context window is exceeded, else None."""
    messages, codes = _error_fields(body)
    for message in messages or [text]:
        if _CONTEXT_OVERFLOW.search(message):
            return message
    if codes & _OVERFLOW_CODES:
        return messages[0] if messages else text
    return None


def _stated_window(message: str, body: Any) -> int | None:
    """The context window (tokens) an overflow error states, when it states one."""
    error = body.get("error") if isinstance(body, dict) else None
    stated = error.get("n_ctx") if isinstance(error, dict) else None
    if isinstance(stated, int):  # llama.cpp
        return stated
    found = _WINDOW.search(message)
    return int(found.group(1)) if found else None


# --------------------------------------------------------------------------- small helpers


def _tool_names(tools: list[dict[str, Any]]) -> set[str]:
    names = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def _decode_json(content: bytes) -> tuple[Any, str | None]:
    """(parsed body, None), or (None, body text) when the body is not JSON. The text keeps every
    byte: one that is not UTF-8 becomes a lone surrogate U+DC80–U+DCFF (``surrogateescape``), so
    ``text.encode("utf-8", "surrogateescape")`` gives the bytes back."""
    try:
        return parse_json(content), None
    except ValueError:
        return None, content.decode("utf-8", errors="surrogateescape")


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP date); None if absent/invalid."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)


def _describe(exc: BaseException) -> str:
    detail = str(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000.0, 3)


def _thaw(value: Any) -> Any:
    """Plain dict/list copies of settings values (which are stored read-only)."""
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_thaw(v) for v in value]
    return value
