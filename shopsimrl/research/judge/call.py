"""One episode judged: one forced tool call, its arguments checked against the rubric's schema,
at most ``max_repairs`` repair turns, every raw answer kept.

The conversation is a system message (the rubric's instructions) and a user message holding
the judge input as JSON (what ``export judge-input`` writes for the episode). An answer that
cannot be used (no call to ``submit_verdict``, arguments that are not a JSON object, a schema
violation) is kept as an attempt with its error; the answer (its text, or the raw arguments) and
a user message naming the error and asking again are appended, and the model is asked again.
After ``max_repairs`` such turns the record is ``unparseable``. A call that fails for the
infrastructure (the adapter's retries of 429/5xx/timeouts exhausted) gives status ``error``:
nothing was judged, and a resumed stage tries the episode again.

A reply that is not the chat-completions API's JSON (a gateway's HTML page with status 200, a
body without ``choices[0].message``) was not written by the judge model: it is never a verdict
nor a repair turn. The call is made again with the project's retry loop (the model's
``max_retries`` attempts and backoff); when every attempt gets such a reply the record is
``error``, so the episode is judged again by the next run.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime
from typing import Any

import orjson
import structlog

from shopsimrl.model import ModelRequestError, OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.research.judge.config import TOOL_NAME, JudgeConfig, Rubric, schema_errors
from shopsimrl.retry import Attempt, Backoff, retry_async
from shopsimrl.schemas import ModelOutput, json_bytes, redact_uri

__all__ = [
    "FATAL_STATUS",
    "JUDGE_OUTPUT_VERSION",
    "NOT_THE_API",
    "STATUSES",
    "JudgeModelError",
    "generate_reply",
    "judge_episode",
    "judge_model",
    "judged",
    "model_identity",
    "raw_answer",
    "usage_of",
    "wait_for_judge_model",
]

JUDGE_OUTPUT_VERSION = "shopsimrl-judge-output-v1"
STATUSES = ("ok", "unparseable", "error")
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")
FATAL_STATUS = frozenset({401, 403, 404})
"""A wrong key, model name or URL: every episode would fail alike, so the stage stops (exit 2)."""


NOT_THE_API: frozenset[str] = frozenset(
    {"invalid_json_response", "invalid_response_body", "missing_choices", "invalid_choice", "invalid_message"}
)
"""The adapter's protocol-error codes of a reply that is not the chat-completions API's JSON
(not JSON; not an object; no ``choices[0].message`` object): the endpoint's failure, not the
judge model's answer."""

log = structlog.get_logger("shopsimrl.research.judge")


class JudgeModelError(ValueError):
    """The judge model cannot be used at all (HTTP 401/403/404): bad input, exit 2."""


class _NotTheApi(Exception):
    """A reply that is not the chat-completions API's JSON (retried)."""


def judged(record: dict[str, Any]) -> bool:
    """Whether a judge output record is final (a resumed stage skips its episode): ``ok``, or
    ``unparseable`` from the judge model's own answers. ``error`` is not, nor an ``unparseable``
    record that counted replies that were not the API's JSON as answers (as versions before
    these replies were retried wrote them)."""
    if record.get("status") == "ok":
        return True
    if record.get("status") != "unparseable":
        return False
    attempts = record.get("attempts")
    for attempt in attempts if isinstance(attempts, list) else []:
        raw = attempt.get("raw") if isinstance(attempt, dict) else None
        problem = raw.get("protocol_error") if isinstance(raw, dict) else None
        if isinstance(problem, dict) and problem.get("code") in NOT_THE_API:
            return False
    return True


def judge_settings(config: JudgeConfig) -> OpenAICompatibleSettings:
    m = config.model
    choice: str | dict[str, Any] = (
        {"type": "function", "function": {"name": TOOL_NAME}} if m.tool_choice == "forced" else m.tool_choice
    )
    return OpenAICompatibleSettings(
        model=m.model,
        base_url=config.base_url,
        api_key_env=m.api_key_env,
        checkpoint_id=m.checkpoint_id,
        temperature=m.temperature,
        max_tokens=m.max_tokens,
        timeout=m.timeout,
        max_retries=m.max_retries,
        retry_backoff_seconds=m.retry_backoff_seconds,
        send_seed=False,
        tool_choice=choice,
        extra_body=m.extra_body,
        assistant_content_empty_string=m.assistant_content_empty_string,
        max_connections=max(4, config.concurrency),
    )


def judge_model(config: JudgeConfig) -> OpenAICompatibleChatModel:
    """The project's model adapter, set up for the judge (one pool for every episode of a process)."""
    return OpenAICompatibleChatModel(judge_settings(config))


async def wait_for_judge_model(config: JudgeConfig, *, timeout: float, interval: float) -> tuple[bool, str]:
    """Probe ``GET {base_url}/models`` until it lists the judge model, at most ``timeout``
    seconds: (ready, what the last probe saw). A pod's readiness check before it judges, so a
    model server still loading does not turn a shard's episodes into ``error`` records."""
    model = judge_model(config)
    model.check_api_key()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                ids = await model.list_models()
            except ModelRequestError as exc:
                seen = f"model_unreachable: {exc}"
            else:
                if config.model.model in ids:
                    return True, f"{config.model.model!r} is served at {redact_uri(config.base_url)}"
                seen = f"model_not_listed: {config.model.model!r} is not among the served models {ids}"
            if time.monotonic() + interval > deadline:
                return False, seen
            await asyncio.sleep(interval)
    finally:
        await model.aclose()


def model_identity(config: JudgeConfig) -> dict[str, Any]:
    """The judge model as records name it: model, base URL without credentials, checkpoint."""
    m = config.model
    return {"model": m.model, "base_url": redact_uri(config.base_url), "checkpoint_id": m.checkpoint_id}


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _problem(output: ModelOutput, rubric: Rubric) -> tuple[str | None, dict[str, Any] | None]:
    """(why the answer cannot be used, the verdict when it can)."""
    calls = [call for call in output.tool_calls if call.name == TOOL_NAME]
    if output.policy_failure is not None:
        return f"{output.policy_failure.get('code')}: {output.policy_failure.get('message')}", None
    if not calls:
        problem = output.protocol_error
        detail = f" ({problem.get('code')}: {problem.get('message')})" if problem else ""
        return f"no call to {TOOL_NAME}{detail}", None
    if len(calls) > 1:
        return f"{len(calls)} calls to {TOOL_NAME}; call it exactly once", None
    (call,) = calls
    if call.arguments is None:
        try:
            parsed = orjson.loads(call.raw_arguments)
        except orjson.JSONDecodeError as exc:
            return f"the arguments of {TOOL_NAME} are not valid JSON ({exc})", None
        if not isinstance(parsed, dict):
            return f"the arguments of {TOOL_NAME} are not a JSON object", None
        arguments: dict[str, Any] = parsed
    else:
        arguments = call.arguments
    errors = schema_errors(arguments, rubric.verdict_schema)
    if errors:
        return "the verdict does not match the schema: " + "; ".join(errors[:5]), None
    return None, arguments


def raw_answer(output: ModelOutput) -> dict[str, Any]:
    return {
        "content": output.content,
        "tool_calls": [{"name": call.name, "arguments": call.raw_arguments} for call in output.tool_calls],
        "finish_reason": output.finish_reason,
        "protocol_error": output.protocol_error,
        "raw_response": output.raw_response if output.protocol_error else None,
    }


def usage_of(output: ModelOutput) -> dict[str, int]:
    usage = output.usage or {}
    return {key: int(usage[key]) for key in _USAGE_KEYS if isinstance(usage.get(key), int)}


def _excerpt(output: ModelOutput, settings: OpenAICompatibleSettings) -> str:
    """The reply's beginning on one line, without the API key should a gateway echo it."""
    raw = output.raw_response
    text = raw["text"] if isinstance(raw, dict) and isinstance(raw.get("text"), str) else orjson.dumps(raw).decode()
    key = os.environ.get(settings.api_key_env, "").strip() if settings.api_key_env else ""
    if len(key) >= 4:
        text = text.replace(key, "***")
    return " ".join(text.split())[:160]


async def generate_reply(
    model: OpenAICompatibleChatModel, messages: list[dict[str, Any]], tools: list[dict[str, Any]], seed: int | None = None
) -> ModelOutput:
    """``model.generate``, made again while the reply is not the API's JSON; raises
    :class:`ModelRequestError` when every attempt got such a reply. Public: every research
    stage that makes a forced tool call (the skill builder too) needs the same guard."""
    s = model.settings

    async def attempt(current: Attempt) -> ModelOutput:
        output = await model.generate(messages, tools, seed)
        problem = output.protocol_error or {}
        if problem.get("code") in NOT_THE_API:
            raise _NotTheApi(f"{problem.get('code')}: {problem.get('message')}: {_excerpt(output, s)!r}")
        return output

    def on_retry(failed: Attempt) -> None:
        log.info("judge_reply_not_the_api", attempt=failed.number, delay_s=round(failed.delay_s, 2), error=str(failed.error))

    def exhausted(last: Attempt, elapsed_s: float) -> ModelRequestError:
        return ModelRequestError(
            f"the judge endpoint {redact_uri(s.base_url)} answered {last.number} times with something that is not "
            f"the chat-completions API's JSON ({last.error})",
            status_code=None,
            attempts=[],
        )

    backoff = Backoff(
        attempts=s.max_retries, base_delay_s=s.retry_backoff_seconds, max_delay_s=s.max_backoff_seconds, jitter="additive"
    )
    return await retry_async(
        attempt, backoff, retryable=lambda exc: isinstance(exc, _NotTheApi), on_retry=on_retry, exhausted=exhausted
    )


def _repair_message(problem: str) -> str:
    return (
        f"Your answer could not be used: {problem}. Call the function {TOOL_NAME} exactly once, "
        "with arguments that are a JSON object matching its parameters, and nothing else."
    )


async def judge_episode(
    model: OpenAICompatibleChatModel,
    rubric: Rubric,
    item: dict[str, Any],
    *,
    max_repairs: int,
    identity: dict[str, Any],
    tool: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The judge output record of one judge input (``export``'s ``judge_input``); ``tool``: the
    tool offered (default ``rubric.tool()``)."""
    started = _now()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": rubric.instructions},
        {"role": "user", "content": json_bytes(item).decode("utf-8")},
    ]
    attempts: list[dict[str, Any]] = []
    status, verdict, error = "unparseable", None, None
    for number in range(1, max_repairs + 2):
        try:
            output = await generate_reply(model, messages, [tool or rubric.tool()])
        except ModelRequestError as exc:
            if exc.status_code in FATAL_STATUS:
                raise JudgeModelError(f"the judge model refused the request: {exc}") from None
            status, error = "error", {"type": type(exc).__name__, "message": str(exc)[:500], "status_code": exc.status_code}
            break
        problem, verdict = _problem(output, rubric)
        attempts.append(
            {
                "attempt": number,
                "raw": raw_answer(output),
                "error": problem,
                "usage": usage_of(output),
                "latency_ms": output.latency_ms,
            }
        )
        if problem is None:
            status = "ok"
            break
        answer = output.content or "".join(call.raw_arguments for call in output.tool_calls) or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": _repair_message(problem)}]
    usage: dict[str, int] = {}
    for attempt in attempts:
        for key, value in attempt["usage"].items():
            usage[key] = usage.get(key, 0) + value
    return {
        "judge_output_version": JUDGE_OUTPUT_VERSION,
        "episode_id": item["episode_id"],
        "task_id": item.get("task_id"),
        "sample_id": item.get("sample_id"),
        "status": status,
        "verdict": verdict,
        "repairs": max(0, len(attempts) - 1),
        "attempts": attempts,
        "error": error,
        **rubric.to_dict(),
        "judge_model": identity,
        "usage": usage,
        "started_at": started,
        "ended_at": _now(),
    }
