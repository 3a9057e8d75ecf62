"""The structured call: one forced tool, its arguments validated by code, bounded attempts.

An answer counts only when it calls the expected tool exactly once with arguments that pass
the validator. Otherwise the next attempt (at most ``attempts``: 3, 5 for the compiler) asks
again with one repair turn that quotes the contract error and the previous invalid arguments;
only the latest invalid answer is quoted, so the conversation does not grow with each failure.
Attempt ``n`` sends ``seed + n - 1`` so that a deterministic server does not repeat itself.

A reply that is not the chat-completions API's JSON is retried by the adapter's retry loop
(:func:`shopsimrl.research.judge.call.generate_reply`) and is no attempt; a request the
infrastructure fails gives status ``error`` (nothing was decided; a resumed stage tries again).
HTTP 401/403/404 raise :class:`~shopsimrl.research.judge.call.JudgeModelError` (the endpoint
cannot be used at all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from shopsimrl.model import ModelRequestError, OpenAICompatibleChatModel
from shopsimrl.research.judge.call import FATAL_STATUS, JudgeModelError, generate_reply, raw_answer, usage_of
from shopsimrl.schemas import ModelOutput, json_bytes

__all__ = ["ATTEMPTS", "COMPILER_ATTEMPTS", "StructuredResult", "repair_message", "structured_call"]

ATTEMPTS = 3
COMPILER_ATTEMPTS = 5
_QUOTED_CHARS = 4000
"""How much of the previous invalid arguments a repair turn quotes."""

Validator = Callable[[dict[str, Any]], tuple[Any, str | None]]


@dataclass
class StructuredResult:
    status: Literal["ok", "invalid", "error"]
    value: Any = None
    """What the validator made of the accepted arguments."""
    arguments: dict[str, Any] | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None

    @property
    def usage(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for attempt in self.attempts:
            for key, value in attempt["usage"].items():
                total[key] = total.get(key, 0) + value
        return total


def _arguments(output: ModelOutput, name: str) -> tuple[dict[str, Any] | None, str | None, str]:
    """(arguments, contract error, the raw arguments text to quote)."""
    if output.policy_failure is not None:
        return None, f"{output.policy_failure.get('code')}: {output.policy_failure.get('message')}", output.content or ""
    calls = [call for call in output.tool_calls if call.name == name]
    others = sorted({str(call.name) for call in output.tool_calls if call.name != name})
    if not calls:
        problem = output.protocol_error
        detail = f" ({problem.get('code')}: {problem.get('message')})" if problem else ""
        called = f"; it called {', '.join(others)}" if others else ""
        return None, f"no call to {name}{called}{detail}", output.content or ""
    if len(calls) > 1 or others:
        return None, f"{len(output.tool_calls)} tool calls; call {name} exactly once and nothing else", calls[-1].raw_arguments
    (call,) = calls
    if call.arguments is not None:
        return call.arguments, None, call.raw_arguments
    try:
        parsed = orjson.loads(call.raw_arguments)
    except orjson.JSONDecodeError as exc:
        return None, f"the arguments of {name} are not valid JSON ({exc})", call.raw_arguments
    if not isinstance(parsed, dict):
        return None, f"the arguments of {name} are not a JSON object", call.raw_arguments
    return parsed, None, call.raw_arguments


def repair_message(name: str, problem: str, previous: str) -> str:
    """The repair turn: the contract error and the previous invalid arguments, quoted."""
    quoted = previous if len(previous) <= _QUOTED_CHARS else previous[:_QUOTED_CHARS] + " [truncated]"
    return (
        f"Your previous answer broke the contract: {problem}\n"
        f"Your previous arguments were:\n{quoted or '(none)'}\n"
        f"Call the function {name} exactly once, with arguments that are a JSON object matching its "
        "parameters, fixing the problem above, and nothing else."
    )


async def structured_call(
    model: OpenAICompatibleChatModel,
    *,
    system: str,
    user: dict[str, Any] | str,
    tool: dict[str, Any],
    validate: Validator,
    attempts: int = ATTEMPTS,
    seed: int | None = None,
) -> StructuredResult:
    """Ask until ``validate`` accepts the arguments of one call of ``tool``, at most ``attempts``
    times (module docstring)."""
    name = tool["function"]["name"]
    base: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": user if isinstance(user, str) else json_bytes(user).decode("utf-8")},
    ]
    messages = base
    result = StructuredResult(status="invalid")
    for number in range(1, attempts + 1):
        try:
            output = await generate_reply(model, messages, [tool], None if seed is None else seed + number - 1)
        except ModelRequestError as exc:
            if exc.status_code in FATAL_STATUS:
                raise JudgeModelError(f"the analyst model refused the request: {exc}") from None
            result.status = "error"
            result.error = {"type": type(exc).__name__, "message": str(exc)[:500], "status_code": exc.status_code}
            return result
        arguments, problem, quoted = _arguments(output, name)
        value = None
        if problem is None and arguments is not None:
            value, problem = validate(arguments)
        result.attempts.append(
            {
                "attempt": number,
                "raw": raw_answer(output),
                "error": problem,
                "usage": usage_of(output),
                "latency_ms": output.latency_ms,
            }
        )
        if problem is None:
            result.status, result.value, result.arguments = "ok", value, arguments
            return result
        messages = [*base, {"role": "user", "content": repair_message(name, problem, quoted)}]
    last = result.attempts[-1]["error"] if result.attempts else None
    result.error = {"type": "ContractError", "message": f"{attempts} attempts without a valid call of {name}: {last}"}
    return result
