"""A lean HTTP/1.1 keep-alive client for plain ``http://`` origins (used by shopsimrl.httpclient).

Why not aiohttp: on the real path a step costs ~2.4 requests and aiohttp's own work per request
(its request/response objects, multidicts, timer contexts, cookie jar, tracing hooks) was most of
the runner's CPU (docs/benchmarks.md, "HTTP clients"). This client does only what the adapters
need: one ``asyncio.Protocol`` per connection, the request written as one ``bytes``, the answer
parsed by httptools (llhttp, the C parser uvicorn uses), a LIFO pool per origin with a limit and
FIFO waiters. Failures are raised as the httpx exceptions shopsimrl.httpclient documents.

Timeouts follow ``httpx.Timeout``, one timer per phase (never one per chunk): ``pool`` while
waiting for a free connection, ``connect`` for the TCP connect, ``write`` only if the socket
buffer stays full after the request was written, ``read`` as inactivity from the write until
the answer is complete (for a stream: while the caller waits for more of it). The read timer
records the time of the last byte and re-arms itself only when it fires early.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httptools
import httpx

__all__ = ["Answer", "Pool", "body", "close_stream", "exchange", "iterate", "request_bytes"]

# A connection closed by the server before any byte of the answer may be a keep-alive that the
# server dropped just as the request went out; these methods can then be sent again (RFC 9110 9.2.2).
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
# How often an idempotent request is sent again after finding its kept-alive connection closed.
_STALE_RETRIES = 3
# Framing is this client's job: a caller's own value could desynchronise the connection.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "host"})
# A streamed answer stops reading from the socket while this much is unread by the caller.
_STREAM_HIGH_WATER = 256 * 1024
_STREAM_LOW_WATER = 64 * 1024
# Linux's struct tcp_info: tcpi_bytes_acked (u64) at this offset (kernel 4.1 and later).
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_BYTES_ACKED_AT = 120
# How long the read timeout waits on while the server has not acknowledged a byte of the request
# (it is not the server's slowness that keeps the answer: the request never reached it). A
# server whose listen backlog overflowed resets such a connection once its SYN-ACK retries are
# spent (Linux: tcp_synack_retries 5, about 63 s), or accepts it late; past this, it is given up.
_UNACKNOWLEDGED_WAIT_S = 120.0


class _Stale(Exception):
    """The server closed a reused connection before any byte of the answer (``error`` says how)."""

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


class Answer:
    """One request's answer as it is parsed: ``ready`` resolves when the whole answer is in
    (or, for a stream, when its head is); a stream's body chunks wait in ``chunks``."""

    __slots__ = (
        "body_bytes",
        "chunks",
        "conn",
        "error",
        "finished",
        "head_only",
        "headers",
        "ready",
        "status",
        "stream",
        "waiter",
    )

    def __init__(self, conn: _Connection, *, stream: bool, head_only: bool) -> None:
        self.conn: _Connection | None = conn
        self.stream = stream
        self.head_only = head_only
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.body_bytes = 0
        self.ready: asyncio.Future[None] = conn.loop.create_future()
        self.finished = False
        self.error: httpx.TransportError | None = None
        self.waiter: asyncio.Future[None] | None = None

    def fail(self, error: BaseException) -> None:
        self.conn = None
        if not self.ready.done():
            self.ready.set_exception(error)
        elif not self.finished:
            self.error = error if isinstance(error, httpx.TransportError) else httpx.ReadError(str(error))
            self._wake()

    def finish(self) -> None:
        self.conn = None
        self.finished = True
        if not self.ready.done():
            self.ready.set_result(None)
        self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.current: Answer | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.received = False  # a byte of the current answer arrived
        self.interim = False  # the message being parsed is a 1xx interim answer
        self.last_read = 0.0
        self.read_timeout: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.reading_paused = False
        self.writing_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.sock: Any = None
        self.written = 0  # bytes written on this connection
        self.sent_before = 0  # of them, before the current request
        self.written_at = 0.0

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sock = transport.get_extra_info("socket")

    def request_unacknowledged(self) -> bool:
        """True when the server's TCP stack provably took no byte of the current request.

        Its kernel acknowledges what reaches the socket at once (a new connection is in quick-ack
        mode; the answer to an earlier request carried the acknowledgement of that one), so none
        acknowledged means the request never reached any process there: a connection its listen
        backlog never took, or one it had closed. Linux only (TCP_INFO); elsewhere False."""
        if _TCP_INFO is None or self.sock is None:
            return False
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
        except OSError:
            return False
        if len(info) < _BYTES_ACKED_AT + 8:
            return False
        # The SYN counts one acknowledged byte; the earlier requests on this connection the rest.
        return bool(struct.unpack_from("=Q", info, _BYTES_ACKED_AT)[0] <= self.sent_before + 1)

    def data_received(self, data: bytes) -> None:
        if self.current is None:  # bytes nobody asked for: the connection can no longer be trusted
            self.close()
            return
        self.received = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        current = self.current
        if current is None:
            return
        if exc is None and current.status and _until_close(current.headers):
            self._complete(keep=False)  # a body delimited by the end of the connection is whole
        elif exc is not None and not self.received and self.request_unacknowledged():
            # Reset, and the server's stack never took a byte of the request: it cannot have
            # reached the server (any request may be sent again). A full listen backlog does this.
            not_taken = httpx.ConnectError(
                f"the server reset the connection before it took any byte of the request "
                f"(never accepted: is its listen backlog full?): {type(exc).__name__}: {exc}"
            )
            self._fail(_Stale(not_taken) if self.reused else not_taken)
        elif not self.received and self.reused:
            error = _closed_error(exc, "the server closed a kept-alive connection before answering")
            self._fail(_Stale(error))
        elif current.status:
            self._fail(_closed_error(exc, "the server closed the connection in the middle of the answer's body"))
        else:
            self._fail(_closed_error(exc, "the server closed the connection without a complete answer"))

    def eof_received(self) -> None:
        if self.current is None:  # the server closed an idle connection: out of the pool now, not at connection_lost
            self.close()
        # returning None lets the transport close; connection_lost settles any answer in progress

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        if self.current is None:  # an answer after the last one, in the same packet: nobody asked
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.current is not None:
            self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        current = self.current
        if current is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # 100 Continue, 103 Early Hints: the real answer follows
            self.interim = True
            current.headers.clear()
            return
        current.status = status
        if current.head_only:  # no body follows, whatever Content-Length says; llhttp cannot know
            self._complete(keep=False)
        elif current.stream:
            current.ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        current = self.current
        if current is None:
            return
        current.chunks.append(body)
        if current.stream:
            current.body_bytes += len(body)
            if current.body_bytes > _STREAM_HIGH_WATER and not self.reading_paused and self.transport is not None:
                self.reading_paused = True
                self.transport.pause_reading()
            current._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.current is not None:
            self._complete(keep=self.parser.should_keep_alive() and self.pool.keep_alive)

    # ---------------------------------------------------------------- the exchange

    def start(self, current: Answer, data: bytes, read_timeout: float | None) -> None:
        assert self.transport is not None
        self.current = current
        self.received = False
        self.read_timeout = read_timeout
        self.sent_before = self.written
        self.written += len(data)
        self.transport.write(data)
        self.last_read = self.written_at = self.loop.time()
        if read_timeout is not None:
            self.timer = self.loop.call_at(self.last_read + read_timeout, self._read_timer)

    async def drain(self, write_timeout: float | None) -> None:
        """Wait until the socket took the request (only if writing it filled the buffer)."""
        if not self.writing_paused or self.closed:
            return
        self.drained = self.loop.create_future()
        try:
            async with asyncio.timeout(write_timeout):
                await self.drained
        except TimeoutError:
            self._fail(httpx.WriteTimeout(f"the request was not taken by the socket within {write_timeout} s"))

    def resume_stream(self, current: Answer) -> None:
        """The caller took body chunks; read again once little is left unread."""
        self.last_read = self.loop.time()
        if self.reading_paused and current.body_bytes < _STREAM_LOW_WATER and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    def _read_timer(self) -> None:
        self.timer = None
        current, timeout = self.current, self.read_timeout
        if current is None or timeout is None:
            return
        if self.reading_paused or (current.stream and current.ready.done() and current.waiter is None):
            due = self.loop.time() + timeout  # the caller, not the server, is the slow side
        else:
            due = self.last_read + timeout
        now = self.loop.time()
        if due <= now and not self.received and now - self.written_at < _UNACKNOWLEDGED_WAIT_S and self.request_unacknowledged():
            # The server has not taken the request yet (a full listen backlog): its stack will
            # take it or reset the connection, which makes it safe to send again. Giving up now
            # could not tell whether it gets there after all.
            due = min(now + timeout, self.written_at + _UNACKNOWLEDGED_WAIT_S)
        if due > now:
            self.timer = self.loop.call_at(due, self._read_timer)
        else:
            self._fail(httpx.ReadTimeout(f"no data from the server for {timeout} s"))

    def _complete(self, *, keep: bool) -> None:
        current, self.current = self.current, None
        self._cancel_timer()
        if current is not None:
            current.finish()
        if self.reading_paused and self.transport is not None:  # the next answer must be read
            self.reading_paused = False
            self.transport.resume_reading()
        if keep and not self.closed:
            self.reused = True
            self.pool.release(self)
        else:
            self.close()

    def _fail(self, error: BaseException) -> None:
        current, self.current = self.current, None
        self._cancel_timer()
        if current is not None:
            current.fail(error)
        self.close()

    def abandon(self) -> None:
        """The caller gave up on the current answer (cancelled, or closed a stream early)."""
        self.current = None
        self._cancel_timer()
        self.close()

    def _cancel_timer(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        self._forget()
        if self.transport is not None:
            self.transport.close()

    def _forget(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)


def _closed_error(exc: Exception | None, message: str) -> httpx.TransportError:
    if exc is None:
        return httpx.RemoteProtocolError(message)
    return httpx.ReadError(f"{message}: {type(exc).__name__}: {exc}")


def _until_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """The answer has neither Content-Length nor Transfer-Encoding: its body ends with the connection."""
    return not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in headers)


class Pool:
    """Connections to one origin: idle ones reused last-in first-out (the warmest socket), at
    most ``limit`` open or opening, callers beyond it queued first-in first-out."""

    def __init__(self, host: str, port: int, *, limit: int, keepalive_expiry: float, keep_alive: bool) -> None:
        self.host = host
        self.port = port
        self.limit = limit
        self.keepalive_expiry = keepalive_expiry
        self.keep_alive = keep_alive
        self.loop = asyncio.get_running_loop()
        self.count = 0  # open or opening connections
        self.idle: dict[_Connection, None] = {}  # insertion-ordered: popitem() takes the newest
        self.every: set[_Connection] = set()
        self.waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self.reaper: asyncio.TimerHandle | None = None
        self.closing = False

    async def acquire(self, timeout: httpx.Timeout, *, fresh: bool) -> _Connection:
        if self.closing:
            raise httpx.ConnectError("the HTTP client is closed")
        if not fresh:
            now = self.loop.time()
            while self.idle:
                conn, _ = self.idle.popitem()
                if now - conn.idle_since < self.keepalive_expiry:
                    return conn
                conn.close()
        elif self.count >= self.limit and self.idle:
            # A fresh connection is wanted and idle ones hold every slot: without this the caller
            # would wait until the keep-alive expiry closed one. The oldest gives up its slot.
            next(iter(self.idle)).close()
        if self.count < self.limit:
            self.count += 1
            return await self._connect(timeout.connect)
        waiter: asyncio.Future[_Connection | None] = self.loop.create_future()
        self.waiters.append(waiter)
        timer = None if timeout.pool is None else self.loop.call_later(timeout.pool, _pool_timeout, waiter, timeout.pool)
        try:
            handed_over = await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()  # given a connection or a slot just as we were cancelled
                if handed is None:
                    self.count -= 1
                    self._grant_slots()
                else:
                    self.release(handed)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if handed_over is None:  # a slot was freed for us: open a connection in it
            return await self._connect(timeout.connect)
        return handed_over

    async def _connect(self, timeout: float | None) -> _Connection:
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except TimeoutError:
            self._slot_freed()
            raise httpx.ConnectTimeout(f"no connection to {self.host}:{self.port} within {timeout} s") from None
        except OSError as exc:
            self._slot_freed()
            raise httpx.ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        except BaseException:
            self._slot_freed()
            raise
        if self.closing:
            conn.closed = True
            self._slot_freed()
            assert conn.transport is not None
            conn.transport.close()
            raise httpx.ConnectError("the HTTP client is closed")
        self.every.add(conn)
        return conn

    def release(self, conn: _Connection) -> None:
        """A connection whose last answer was read whole, ready for the next request."""
        if self.closing or conn.closed:
            conn.close()
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        conn.idle_since = self.loop.time()
        self.idle[conn] = None
        if self.reaper is None:
            self.reaper = self.loop.call_at(conn.idle_since + self.keepalive_expiry, self._reap)

    def forget(self, conn: _Connection) -> None:
        """A connection closed (by either side)."""
        self.idle.pop(conn, None)
        self.every.discard(conn)
        self._slot_freed()

    def _slot_freed(self) -> None:
        self.count -= 1
        self._grant_slots()

    def _grant_slots(self) -> None:
        while self.waiters and self.count < self.limit:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.count += 1
                waiter.set_result(None)

    def _reap(self) -> None:
        """Close connections idle past the keep-alive expiry (the oldest are first in ``idle``)."""
        self.reaper = None
        now = self.loop.time()
        for conn in list(self.idle):
            if now - conn.idle_since < self.keepalive_expiry:
                self.reaper = self.loop.call_at(conn.idle_since + self.keepalive_expiry, self._reap)
                return
            conn.close()

    def close(self) -> None:
        self.closing = True
        if self.reaper is not None:
            self.reaper.cancel()
            self.reaper = None
        for conn in list(self.every):
            current = conn.current
            conn.current = None
            conn.close()
            if current is not None:
                current.fail(httpx.ReadError("the HTTP client was closed"))
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(httpx.PoolTimeout("the HTTP client was closed"))


def _pool_timeout(waiter: asyncio.Future[Any], seconds: float) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.PoolTimeout(f"no free connection within {seconds} s"))


def request_bytes(method: str, target: str, host: str, content: bytes | None, headers: Any, *, keep_alive: bool) -> bytes:
    """The request as written to the socket: head and body in one ``bytes``."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    if headers:
        for name, value in headers.items():
            if name.lower() in _FRAMING:
                raise httpx.LocalProtocolError(f"the {name} header is set by the HTTP client, not by callers")
            lines.append(f"{name}: {value}\r\n")
    if content is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(content) if content else 0}\r\n")
    lines.append("\r\n" if keep_alive else "Connection: close\r\n\r\n")
    head = "".join(lines)
    # One CR or LF more than the lines written is a header value trying to start a header (or a
    # request) of its own. The first line holds two line ends, and so does "Connection: close".
    line_ends = len(lines) + (1 if keep_alive else 2)
    if head.count("\n") != line_ends or head.count("\r") != line_ends:
        raise httpx.LocalProtocolError("a request header name or value contains a line break")
    try:
        encoded = head.encode("latin-1")
    except UnicodeEncodeError:
        raise httpx.LocalProtocolError("a request header is not ISO-8859-1 text") from None
    return encoded + content if content else encoded


async def exchange(
    pool: Pool, method: str, data: bytes, timeout: httpx.Timeout, *, stream: bool
) -> tuple[int, list[tuple[bytes, bytes]], Answer]:
    """Send ``data`` and wait for the answer (its head only, if ``stream``)."""
    stale_retries = 0
    while True:
        conn = await pool.acquire(timeout, fresh=stale_retries > 0)
        assert conn.transport is not None
        if conn.closed or conn.transport.is_closing():  # the server hung up before this request was written
            conn.close()
            continue
        current = Answer(conn, stream=stream, head_only=method == "HEAD")
        conn.start(current, data, timeout.read)
        try:
            await conn.drain(timeout.write)
            await current.ready
        except _Stale as stale:
            if method not in _IDEMPOTENT or stale_retries == _STALE_RETRIES:
                raise stale.error from None
            # Again on a new connection; a full pool may still hand over a reused one (it
            # answered someone else just now), which can be stale too, hence more than once.
            stale_retries += 1
            continue
        except BaseException:
            if conn.current is current:
                conn.abandon()
            raise
        return current.status, current.headers, current


def body(current: Answer) -> bytes:
    """The whole body of an answer read without streaming."""
    chunks = current.chunks
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def iterate(current: Answer) -> AsyncIterator[bytes]:
    """A streamed answer's body chunks as they arrive."""
    loop = asyncio.get_running_loop()
    while True:
        if current.chunks:
            chunk = current.chunks.popleft()
            current.body_bytes -= len(chunk)
            if current.conn is not None:
                current.conn.resume_stream(current)
            yield chunk
        elif current.error is not None:
            raise current.error
        elif current.finished:
            return
        else:
            current.waiter = loop.create_future()
            await current.waiter


def close_stream(current: Answer) -> None:
    """The caller is done with a streamed answer: a connection still reading it cannot be reused."""
    conn = current.conn
    if conn is not None and conn.current is current:
        current.conn = None
        conn.abandon()
