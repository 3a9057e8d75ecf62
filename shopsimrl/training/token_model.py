"""The token-level model adapter: the engine's ``ChatModel`` over SGLang's native ``POST /generate``.

For a training rollout the trainer needs the ids the model sampled and their log-probabilities,
so this adapter renders the conversation itself (the :class:`~shopsimrl.training.chat.ChatTokenizer`
's chat template), sends ``input_ids`` with ``return_logprob``, and keeps, per call, the prompt
ids, the sampled ids (``output_ids``, the end-of-turn token included) and their log-probs
(:class:`TurnRecord`). The text of the reply is decoded from those ids and parsed
(:func:`~shopsimrl.training.chat.parse_reply`) into a chat.completion body that goes through the
same protocol checks as the OpenAI adapter's (:func:`shopsimrl.model.parse_chat_completion`), so
the episode engine judges a reply the same way in evaluation and in training.

:class:`TokenModel` holds the settings, the tokenizer and one connection pool per process;
:meth:`TokenModel.session` gives the ``ChatModel`` of one episode (:class:`TokenSession`), which
keeps that episode's turns. Requests carry the session id as ``X-SMG-Routing-Key`` (what slime's
router hashes for session affinity, so one episode's prompts meet their prefix cache).

Failures follow the OpenAI adapter's contract (``shopsimrl.model``): transport errors, HTTP
408/409/429/5xx, a body that is not JSON or not SGLang's shape (``output_ids`` and
``meta_info.output_token_logprobs`` of equal length, the same ids, finite values), and an answer
the server aborted (``finish_reason.type == "abort"``) are retried through
:func:`shopsimrl.retry.retry_async`, then raised as ``ModelRequestError`` (an infrastructure
failure: the episode becomes an abort placeholder for the trainer, never a zero reward); another
4xx is raised at once; a prompt the server refuses as too long for the context window becomes the
policy failure ``context_length`` (no turn is recorded), unless ``max_new_tokens`` alone does not
fit (a configuration error). ``finish_reason.type == "length"`` is the reply cut by the token
limit: the engine's ``generation_length`` policy unless it already holds one complete call.

Sampling: ``top_p`` must be 1 and ``top_k`` −1 (the trainer replays no truncated distribution, so
log-probs of a truncated one would be wrong for it), as the earlier adapter required.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from shopsimrl.httpclient import HttpService, Timeout, TransportError
from shopsimrl.logs import brief
from shopsimrl.model import ModelConfigError, ModelRequestError, context_overflow, parse_chat_completion
from shopsimrl.retry import Attempt, Backoff, retry_async
from shopsimrl.schemas import ModelOutput, parse_json, redact_uri, wire_json
from shopsimrl.training.chat import ChatTokenizer, parse_reply

__all__ = ["PROVIDER", "TokenModel", "TokenModelSettings", "TokenSession", "TurnRecord"]

PROVIDER = "sglang_generate_tokens"
RETRYABLE_STATUSES = frozenset({408, 409, 429})  # plus every 5xx
CONNECT_TIMEOUT_CAP = 10.0
ERROR_BODY_CHARS = 500

_log = structlog.get_logger("shopsimrl.training")


@dataclass(frozen=True, kw_only=True)
class TokenModelSettings:
    """Where the token endpoint is and how to sample.

    ``TokenModelSettings(base_url="http://sglang:30000", max_new_tokens=4096, temperature=0.6)``
    """

    base_url: str
    """The server's root (``POST {base_url}/generate``), not its ``/v1``."""
    model: str = "policy"
    """Identity only: the name the samples and traces record."""
    checkpoint_id: str | None = None
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    send_seed: bool = True
    """Send the episode step's seed as ``sampling_params.sampling_seed`` (SGLang's name)."""
    timeout: float = 180.0
    max_retries: int = 5
    """Total attempts per call."""
    retry_backoff_seconds: float = 1.0
    max_backoff_seconds: float = 30.0
    trust_env: bool = False
    max_connections: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ModelConfigError(f"token model setting 'base_url' must start with http:// or https://, got {self.base_url!r}")
        if "@" in self.base_url.split("//", 1)[1].split("/", 1)[0]:
            raise ModelConfigError("token model setting 'base_url' must not contain user:password@ credentials")
        for name in ("max_new_tokens", "max_retries", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"token model setting {name!r} must be an integer >= 1, got {value!r}")
        for name, minimum in (
            ("temperature", 0.0),
            ("retry_backoff_seconds", 0.0),
            ("max_backoff_seconds", 0.0),
            ("timeout", 0.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
                raise ModelConfigError(f"token model setting {name!r} must be a finite number >= {minimum}, got {value!r}")
        if self.timeout <= 0:
            raise ModelConfigError(f"token model setting 'timeout' must be > 0, got {self.timeout!r}")
        if self.top_p != 1.0:
            raise ModelConfigError(
                f"token model setting 'top_p' must be 1.0, got {self.top_p!r}: the trainer has no replay of a "
                "truncated distribution, so the log-probs it would compare against would not be the sampler's"
            )
        if self.top_k != -1:
            raise ModelConfigError(f"token model setting 'top_k' must be -1 (no top-k truncation), got {self.top_k!r}")


@dataclass
class TurnRecord:
    """One model call of an episode, as the trainer needs it."""

    step_index: int
    """The call's number in the episode (1-based, the trace's ``steps[i].step_index``)."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float]
    finish_type: str
    """``stop`` or ``length`` (SGLang's ``finish_reason.type``)."""


@dataclass
class _Answer:
    output_ids: list[int]
    log_probs: list[float]
    finish_type: str
    meta: dict[str, Any] = field(default_factory=dict)


class _Retryable(Exception):
    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class _ContextOverflow(Exception):
    def __init__(self, message: str, *, status: int, window: int | None) -> None:
        super().__init__(message)
        self.status = status
        self.window = window


Sleep = Callable[[float], Awaitable[Any]]


def _check_answer(body: Any, prompt_length: int) -> _Answer:
    """SGLang's answer → ids, log-probs, finish; anything else is a retryable bad answer."""
    if not isinstance(body, dict):
        raise _Retryable(f"the answer is a {type(body).__name__}, not an object")
    ids = body.get("output_ids")
    meta = body.get("meta_info")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise _Retryable("the answer has no output_ids list of token ids")
    if not isinstance(meta, dict):
        raise _Retryable("the answer has no meta_info object")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        raise _Retryable(f"the server aborted the request: {message}")
    if kind not in ("stop", "length"):
        raise _Retryable(f"meta_info.finish_reason is not stop, length or abort: {finish!r}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise _Retryable(f"meta_info.output_token_logprobs has {got} entries for {len(ids)} output ids")
    log_probs: list[float] = []
    for position, (entry, token) in enumerate(zip(entries, ids, strict=True)):
        value = entry[0] if isinstance(entry, list) and entry else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _Retryable(f"meta_info.output_token_logprobs[{position}] has no finite log-probability: {entry!r}")
        if len(entry) > 1 and entry[1] != token:
            raise _Retryable(f"meta_info.output_token_logprobs[{position}] is for token {entry[1]!r}, output_ids has {token}")
        log_probs.append(float(value))
    prompt_tokens = meta.get("prompt_tokens")
    if isinstance(prompt_tokens, int) and prompt_tokens != prompt_length:
        raise _Retryable(f"meta_info.prompt_tokens is {prompt_tokens}, the prompt sent had {prompt_length} ids")
    return _Answer(output_ids=list(ids), log_probs=log_probs, finish_type=kind, meta=meta)


class TokenModel:
    """The settings, the tokenizer and the connection pool shared by every episode of a process."""

    def __init__(
        self,
        settings: TokenModelSettings,
        tokenizer: ChatTokenizer,
        *,
        http: HttpService | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if not isinstance(settings, TokenModelSettings):
            raise ModelConfigError(f"settings must be TokenModelSettings, got {type(settings).__name__}")
        self.settings = settings
        self.tokenizer = tokenizer
        self._url = settings.base_url.rstrip("/") + "/generate"
        self._http_service = http
        self._owns_http = http is None
        self._sleep = sleep
        self._closed = False

    def identity(self) -> dict[str, Any]:
        s = self.settings
        ident: dict[str, Any] = {"provider": PROVIDER}
        if s.checkpoint_id is not None:
            ident["checkpoint_id"] = s.checkpoint_id
        ident["model"] = s.model
        ident["base_url"] = redact_uri(s.base_url.rstrip("/"))
        ident["transport"] = {
            "timeout_seconds": s.timeout,
            "max_retries": s.max_retries,
            "retry_backoff_seconds": s.retry_backoff_seconds,
        }
        ident["sampling"] = {
            "temperature": s.temperature,
            "max_new_tokens": s.max_new_tokens,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "send_seed": s.send_seed,
        }
        ident["tokenizer"] = self.tokenizer.identity()
        return ident

    def session(self, session_id: str) -> TokenSession:
        """The ``ChatModel`` of one episode; it keeps the episode's turns."""
        return TokenSession(self, session_id)

    def _http(self) -> HttpService:
        if self._closed:
            raise RuntimeError("the token model is closed; create a new one")
        if self._http_service is None:
            self._http_service = HttpService(max_connections=self.settings.max_connections, trust_env=self.settings.trust_env)
        return self._http_service

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_http and self._http_service is not None:
            await self._http_service.aclose()

    def _body(self, prompt_ids: list[int], seed: int | None, rid: str) -> bytes:
        s = self.settings
        params: dict[str, Any] = {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
        }
        if seed is not None and s.send_seed:
            params["sampling_seed"] = seed
        return wire_json({"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True, "rid": rid})

    async def _attempt(self, payload: bytes, session_id: str, prompt_length: int) -> _Answer:
        s = self.settings
        headers = {"Content-Type": "application/json", "X-SMG-Routing-Key": session_id}
        timeout = Timeout(s.timeout, connect=min(s.timeout, CONNECT_TIMEOUT_CAP))
        try:
            response = await self._http().request("POST", self._url, content=payload, headers=headers, timeout=timeout)
        except TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        status = response.status_code
        text = response.text
        if status == 400:
            try:
                error_body: Any = parse_json(response.content)
            except ValueError:
                error_body = None
            overflow = context_overflow(error_body, text)
            if overflow is not None:
                raise _ContextOverflow(overflow[0][:ERROR_BODY_CHARS], status=status, window=overflow[1])
        if status in RETRYABLE_STATUSES or 500 <= status <= 599:
            retry_after = response.headers.get("retry-after")
            delay = float(retry_after) if retry_after and retry_after.strip().isdigit() else None
            raise _Retryable(f"HTTP {status}: {text[:ERROR_BODY_CHARS]}", status=status, retry_after=delay)
        if status != 200:
            raise ModelRequestError(
                f"non-retryable HTTP {status} from POST {redact_uri(self._url)}: {text[:ERROR_BODY_CHARS]}",
                status_code=status,
                attempts=[],
            )
        try:
            body = parse_json(response.content)
        except ValueError:
            raise _Retryable(f"the answer is not JSON: {text[:200]!r}") from None
        return _check_answer(body, prompt_length)

    async def call(
        self, prompt_ids: list[int], *, seed: int | None, session_id: str, rid: str
    ) -> tuple[_Answer | _ContextOverflow, list[dict[str, Any]]]:
        """One generation with retries: the answer (or the context overflow), and the per-attempt records."""
        payload = self._body(prompt_ids, seed, rid)
        attempts: list[dict[str, Any]] = []

        async def attempt(current: Attempt) -> _Answer | _ContextOverflow:
            record: dict[str, Any] = {
                "attempt": current.number,
                "latency_ms": None,
                "status": None,
                "error": None,
                "backoff_ms": 0.0,
            }
            attempts.append(record)
            try:
                answer = await self._attempt(payload, session_id, len(prompt_ids))
            except _ContextOverflow as exc:
                record.update(latency_ms=_ms_since(current.started), status=exc.status, error=str(exc))
                return exc
            except (_Retryable, ModelRequestError) as exc:
                status = exc.status if isinstance(exc, _Retryable) else exc.status_code
                record.update(latency_ms=_ms_since(current.started), status=status, error=str(exc)[:ERROR_BODY_CHARS])
                if isinstance(exc, ModelRequestError):
                    exc.attempts = attempts
                raise
            record.update(latency_ms=_ms_since(current.started), status=200)
            return answer

        def on_retry(failed: Attempt) -> None:
            attempts[-1]["backoff_ms"] = round(failed.delay_s * 1000.0, 3)
            _log.info(
                "token_request_retry",
                attempt=failed.number,
                delay_s=round(failed.delay_s, 2),
                error=brief(attempts[-1]["error"], 120),
            )

        def exhausted(last: Attempt, elapsed_s: float) -> ModelRequestError:
            return ModelRequestError(
                f"token generation failed after {last.number} attempts: {last.error}",
                status_code=getattr(last.error, "status", None),
                attempts=attempts,
            )

        s = self.settings
        result = await retry_async(
            attempt,
            Backoff(
                attempts=s.max_retries, base_delay_s=s.retry_backoff_seconds, max_delay_s=s.max_backoff_seconds, jitter="additive"
            ),
            retryable=lambda exc: isinstance(exc, _Retryable),
            retry_after=lambda exc: exc.retry_after if isinstance(exc, _Retryable) else None,
            on_retry=on_retry,
            exhausted=exhausted,
            sleep=self._sleep,
        )
        return result, attempts


class TokenSession:
    """The ``ChatModel`` of one episode over a :class:`TokenModel`; ``turns`` are its calls."""

    def __init__(self, model: TokenModel, session_id: str) -> None:
        self.model = model
        self.session_id = session_id
        self.turns: list[TurnRecord] = []
        self._calls = 0

    def identity(self) -> dict[str, Any]:
        return self.model.identity()

    async def aclose(self) -> None:
        """Nothing of its own to close: the pool is the :class:`TokenModel`'s."""

    async def generate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], seed: int | None = None) -> ModelOutput:
        self._calls += 1
        step_index = self._calls
        tokenizer = self.model.tokenizer
        prompt_ids = tokenizer.render(messages, tools, add_generation_prompt=True)
        rid = f"{self.session_id}-{step_index}"
        result, attempts = await self.model.call(prompt_ids, seed=seed, session_id=self.session_id, rid=rid)
        if isinstance(result, _ContextOverflow):
            return self._context_failure(result, attempts)
        self.turns.append(
            TurnRecord(
                step_index=step_index,
                prompt_ids=prompt_ids,
                output_ids=result.output_ids,
                output_log_probs=result.log_probs,
                finish_type=result.finish_type,
            )
        )
        reply = parse_reply(tokenizer.decode(result.output_ids, skip_special_tokens=True))
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [
                {"id": f"call-{rid}-{n}", "type": "function", "function": {"name": name, "arguments": arguments}}
                for n, (name, arguments) in enumerate(reply.calls)
            ]
        finish = "length" if result.finish_type == "length" else ("tool_calls" if reply.calls else "stop")
        body = {
            "id": rid,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(result.output_ids),
                "total_tokens": len(prompt_ids) + len(result.output_ids),
            },
        }
        output = parse_chat_completion(body, tools)
        output.latency_ms = attempts[-1]["latency_ms"]
        output.attempt_count = len(attempts)
        output.attempts = attempts
        return output

    def _context_failure(self, exc: _ContextOverflow, attempts: list[dict[str, Any]]) -> ModelOutput:
        budget = self.model.settings.max_new_tokens
        if exc.window is not None and budget >= exc.window:
            raise ModelRequestError(
                f"max_new_tokens ({budget}) is not smaller than the model's context window ({exc.window} tokens): {exc}",
                status_code=exc.status,
                attempts=attempts,
                configuration=True,
            )
        output = ModelOutput(
            policy_failure={
                "code": "context_length",
                "message": f"the conversation no longer fits the model's context window: {exc}",
            },
            raw_response={"http_status": exc.status, "error_body": str(exc)},
        )
        output.latency_ms = attempts[-1]["latency_ms"]
        output.attempt_count = len(attempts)
        output.attempts = attempts
        return output


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000.0, 3)
