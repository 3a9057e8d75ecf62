"""A fault-injecting HTTP proxy for S3 tests: real TCP in front of a real S3 server.

Per request, a seeded schedule either forwards it, answers ``503 SlowDown`` (in bursts),
drops the connection before forwarding (the request never arrives), or forwards it and then
drops the connection (the request landed, the answer is lost: the case that makes a retried
create-only write see its own object).

A script forces a fault on chosen requests instead of by chance: each ``Scripted`` entry fires
once, on the first request whose method and path match it, before the seeded schedule is asked.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


_CONDITIONAL_CONFLICT = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ConditionalRequestConflict</Code>'
    b"<Message>A conflicting operation occurred. If using PutObject you can retry the request.</Message></Error>"
)


@dataclass
class Scripted:
    """Fire ``action`` once, on the first request with ``method`` whose path matches ``path``.

    Actions: ``lost_response`` (forward, then drop the connection), ``drop`` (drop before
    forwarding), ``503``, ``409_conflict`` (answer AWS's 409 ConditionalRequestConflict without
    forwarding, as S3 does while another conditional write of the key is in flight).
    """

    method: str
    path: str
    action: str
    fired: bool = False


@dataclass
class HeldRequest:
    """A request the proxy holds (``FaultProxy.hold``) until the test decides: ``forward`` or
    ``drop`` (the connection is cut, as if its client died before the request reached the store)."""

    method: str
    path: str
    since: float
    decided: threading.Event = field(default_factory=threading.Event)
    action: str = "forward"

    def decide(self, action: str) -> None:
        self.action = action
        self.decided.set()


@dataclass
class FaultPlan:
    seed: int = 0
    burst_probability: float = 0.0
    burst_length: int = 3
    drop_probability: float = 0.0
    lost_response_probability: float = 0.0
    always_503: bool = False
    delay_s: float = 0.0
    """A wait before each request is handled: the round trip of a store that is not on loopback."""
    script: list[Scripted] = field(default_factory=list)


@dataclass
class FaultProxy:
    upstream: str
    plan: FaultPlan = field(default_factory=FaultPlan)
    injected: Counter[str] = field(default_factory=Counter)
    transferred: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Body bytes per (method, object key) of the requests forwarded and answered: what a PUT
    sent, what a GET read (a listing's key is its bucket with ``?list``)."""
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Requests per (method, object key) forwarded and answered, keyed as ``transferred``."""

    hold: str | None = None
    """While set: hold every request whose path matches this pattern (see ``held``)."""
    held: list[HeldRequest] = field(default_factory=list)

    @property
    def forwarded(self) -> Counter[str]:
        """Requests forwarded and answered, per method."""
        counts: Counter[str] = Counter()
        for (method, _key), count in self.requests.items():
            counts[method] += count
        return counts

    def __post_init__(self) -> None:
        self._rng = random.Random(self.plan.seed)
        self._burst_left = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self.port = 0

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._client = httpx.AsyncClient(base_url=self.upstream, timeout=30)
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            current = asyncio.current_task()
            handlers = [task for task in asyncio.all_tasks() if task is not current]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            await self._client.aclose()

    # -- the schedule -----------------------------------------------------------------------

    def _decide(self, method: str, target: str) -> str:
        path = target.split("?", 1)[0]
        for entry in self.plan.script:
            if not entry.fired and entry.method == method and re.search(entry.path, path):
                entry.fired = True
                return entry.action
        if self.plan.always_503:
            return "503"
        if self._burst_left > 0:
            self._burst_left -= 1
            return "503"
        roll = self._rng.random()
        if roll < self.plan.burst_probability:
            self._burst_left = self.plan.burst_length - 1
            return "503"
        roll -= self.plan.burst_probability
        if roll < self.plan.drop_probability:
            return "drop"
        roll -= self.plan.drop_probability
        if roll < self.plan.lost_response_probability:
            return "lost_response"
        return "forward"

    # -- HTTP/1.1 on the wire ----------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = [tuple(line.split(":", 1)) for line in lines[1:] if ":" in line]
                headers = [(k.strip(), v.strip()) for k, v in headers]
                lower = {k.lower(): v for k, v in headers}
                body = b""
                if lower.get("expect", "").lower() == "100-continue":  # botocore waits for this before the body
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                if "content-length" in lower:
                    body = await reader.readexactly(int(lower["content-length"]))
                elif lower.get("transfer-encoding", "").lower() == "chunked":
                    body = await self._read_chunked(reader)
                if self.plan.delay_s:
                    await asyncio.sleep(self.plan.delay_s)
                if self.hold is not None and re.search(self.hold, target.split("?", 1)[0]):
                    held = HeldRequest(method, target.split("?", 1)[0], time.monotonic())
                    self.held.append(held)
                    await asyncio.to_thread(held.decided.wait, 300)
                    if held.action == "drop":
                        writer.transport.abort()
                        return
                action = self._decide(method, target)
                if action != "forward":
                    self.injected[action] += 1
                if action == "drop":
                    writer.transport.abort()
                    return
                if action == "409_conflict":
                    writer.write(
                        b"HTTP/1.1 409 Conflict\r\nContent-Type: application/xml\r\n"
                        + f"Content-Length: {len(_CONDITIONAL_CONFLICT)}\r\n\r\n".encode()
                        + _CONDITIONAL_CONFLICT
                    )
                    await writer.drain()
                    continue
                if action == "503":
                    writer.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        + f"Content-Length: {len(_SLOWDOWN)}\r\n\r\n".encode()
                        + _SLOWDOWN
                    )
                    await writer.drain()
                    continue
                forward = [
                    (k, v) for k, v in headers if k.lower() not in ("transfer-encoding", "content-length", "connection", "expect")
                ]
                request = self._client.build_request(method, target, headers=forward, content=body)
                response = await self._client.send(request, stream=True)
                payload = b"".join([chunk async for chunk in response.aiter_raw()])
                await response.aclose()
                if action == "lost_response":
                    writer.transport.abort()
                    return
                out = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}".encode()]
                for key, value in response.headers.raw:
                    if key.lower() not in (b"transfer-encoding", b"connection", b"content-length"):
                        out.append(key + b": " + value)
                key = target.split("?", 1)[0].lstrip("/") + ("?list" if "list-type=" in target or target.endswith("?") else "")
                self.transferred[(method, key)] += len(body) if method == "PUT" else len(payload) if method == "GET" else 0
                self.requests[(method, key)] += 1
                length = response.headers.get("content-length") if method == "HEAD" else str(len(payload))
                if length is not None:
                    out.append(f"Content-Length: {length}".encode())
                writer.write(b"\r\n".join(out) + b"\r\n\r\n" + (b"" if method == "HEAD" else payload))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return
        finally:
            if not writer.transport.is_closing():
                writer.close()

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return bytes(body)
            body += await reader.readexactly(size)
            await reader.readexactly(2)
