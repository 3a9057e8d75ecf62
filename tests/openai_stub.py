"""A scriptable OpenAI-compatible server (raw ASGI) for adapter tests.

Each test queues canned replies (status, headers, JSON or raw body, SSE chunks, a stream that
breaks mid-way); every request received is recorded. ``POST .../chat/completions`` pops the
next reply (an empty queue answers 599 so a test that under-scripts fails loudly, unless a
``responder`` is set: a function of the request, sync or async, that scripts the reply from what
was asked); ``GET .../models`` lists ``served_models``.
"""

from __future__ import annotations

import inspect
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    status: int = 200
    json: Any = None
    body: bytes | str | None = None
    """Raw body; wins over ``json``."""
    headers: dict[str, str] = field(default_factory=dict)
    sse: list[Any] | None = None
    """Stream these chunks as ``data: <json>`` events; a str item is sent as a raw SSE line, a
    bytes item as raw bytes (which need not be UTF-8)."""
    done: bool = True
    """End the SSE stream with ``data: [DONE]``."""
    break_after: int | None = None
    """Drop the connection after this many SSE chunks (a broken stream)."""


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    query: str = ""

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class StubBroke(Exception):
    """Raised inside the app to drop the connection mid-stream."""


class OpenAIStub:
    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.requests: list[Received] = []
        self.served_models = ["stub-model"]
        self.responder: Callable[[Received], Any] | None = None
        """Answers a completion request when no canned reply is queued (returns a Reply)."""

    def reset(self) -> None:
        self.replies.clear()
        self.requests.clear()
        self.served_models = ["stub-model"]
        self.responder = None

    def queue(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    @property
    def completions(self) -> list[Received]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.requests.append(
            Received(scope["method"], scope["path"], headers, body, scope.get("query_string", b"").decode("latin-1"))
        )
        if scope["method"] == "GET" and scope["path"].endswith("/models"):
            data = {"object": "list", "data": [{"id": m, "object": "model"} for m in self.served_models]}
            await _send(send, Reply(json=data))
        elif scope["method"] == "POST" and scope["path"].endswith("/chat/completions"):
            if self.replies:
                reply = self.replies.popleft()
            elif self.responder is not None:
                reply = self.responder(self.requests[-1])
                if inspect.isawaitable(reply):
                    reply = await reply
            else:
                reply = Reply(status=599, body="no canned reply queued")
            await _send(send, reply)
        else:
            await _send(send, Reply(status=404, json={"error": {"message": "not found"}}))


async def _send(send: Any, reply: Reply) -> None:
    headers = dict(reply.headers)
    if reply.sse is not None:
        headers.setdefault("content-type", "text/event-stream")
        await send({"type": "http.response.start", "status": reply.status, "headers": _encode(headers)})
        for n, chunk in enumerate(reply.sse):
            if reply.break_after is not None and n >= reply.break_after:
                raise StubBroke("connection dropped by the stub")
            if isinstance(chunk, bytes):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                continue
            line = chunk if isinstance(chunk, str) else "data: " + json.dumps(chunk, ensure_ascii=False)
            await send({"type": "http.response.body", "body": f"{line}\n\n".encode(), "more_body": True})
        tail = b"data: [DONE]\n\n" if reply.done else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return
    if reply.body is not None:
        body = reply.body.encode() if isinstance(reply.body, str) else reply.body
        headers.setdefault("content-type", "text/plain; charset=utf-8")
    else:
        body = json.dumps(reply.json, ensure_ascii=False).encode()
        headers.setdefault("content-type", "application/json")
    headers["content-length"] = str(len(body))
    await send({"type": "http.response.start", "status": reply.status, "headers": _encode(headers)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _encode(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


# --------------------------------------------------------------------------- canned bodies


def completion(
    *,
    content: Any = None,
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str = "tool_calls",
    reasoning: str | None = None,
    response_id: str = "chatcmpl-1",
    usage: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    body = {
        "id": response_id,
        "object": "chat.completion",
        "created": 1700000000,
        "model": "stub-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": usage if usage is not None else {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
    body.update(extra)
    return body


def tool_call(name: str = "search", arguments: Any = '{"query": "红色 T恤"}', call_id: str = "call-1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
