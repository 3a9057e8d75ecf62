"""HTTP for the model and environment adapters: aiohttp's client, with this project's error contract.

One maintained client (aiohttp: its connection pool, C HTTP parser, TLS, proxies, DNS cache) for
``http://`` and ``https://`` alike; this module adds what the adapters need on top of it and
nothing else (docs/benchmarks.md, "HTTP clients", says why not httpx's API over it):

- the "was the request sent?" contract: every transport failure is raised as one of the
  exceptions below, whose ``request_sent`` decides whether a non-idempotent call (``interact``)
  may be sent again;
- a stale-socket check before a pooled connection is reused: a connection the server closed
  while the event loop was busy (its FIN waiting unread) is readable, so it is closed and
  another taken instead of writing a POST into it;
- keep-alive below the servers' (:data:`KEEPALIVE_EXPIRY_S`), a bound on an answer's size
  (:data:`MAX_RESPONSE_BYTES`), DNS answers cached (:data:`DNS_CACHE_TTL_S`), no cookies;
- timeouts per phase (:class:`Timeout`: pool, connect, write, read), the read timeout being
  inactivity, one timer per request.

=================================================================  ===================  =============
failure                                                            raised as            request_sent
=================================================================  ===================  =============
connection refused, unknown host, TLS handshake, a proxy that
  refuses the tunnel, other connect errors                         ConnectError         False
reset before the server's TCP stack took any byte of the request
  (Linux TCP_INFO: none acknowledged; a listen backlog that never
  accepted the connection, or a server that had closed it)         ConnectError         False
no connection within ``timeout.connect``                           ConnectTimeout       False
no free connection within ``timeout.pool`` (``max_connections``)   PoolTimeout          False
a header the client sets itself, a line break or non-ASCII text
  in a header                                                      LocalProtocolError   False (not retried)
the socket does not take the request within ``timeout.write``      WriteTimeout         None (maybe)
no byte of the answer for ``timeout.read`` (while no byte of the
  request is acknowledged, up to 120 s from the write: the
  server's kernel still takes it or resets it)                     ReadTimeout          None (maybe)
a connection closed before any byte of the answer: GET, HEAD,
  PUT, DELETE, OPTIONS, TRACE are sent again once (aiohttp, RFC
  9112 9.3.1); others (POST) fail                                  RemoteProtocolError  None (maybe)
the server hangs up before the answer or its body is complete,
  or breaks the body's framing                                     RemoteProtocolError  None (maybe)
an answer that is not HTTP/1.x                                     RemoteProtocolError  None (maybe)
the connection reset or failed during the exchange                 ReadError            None (maybe)
an answer larger than ``max_response_bytes``                       ResponseTooLarge     True
=================================================================  ===================  =============

"Reset before any byte was acknowledged" is the one "not sent" that the server's side decides:
its kernel acknowledges what reaches a socket at once, so an unacknowledged request reached no
process there (left open: a server that reads a request and aborts the connection before its
kernel's delayed acknowledgement goes out, which no HTTP server does). aiohttp closes a
connection's socket as soon as it is lost, so each request holds a second descriptor of its
socket (``dup``) to read TCP_INFO afterwards. tests/test_listen_backlog.py checks that row from
outside, against a server whose listen backlog overflows.
"""

from __future__ import annotations

import asyncio
import codecs
import contextvars
import json
import select
import socket
import struct
import urllib.request
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final

import aiohttp
import yarl
from multidict import CIMultiDictProxy

__all__ = [
    "DNS_CACHE_TTL_S",
    "KEEPALIVE_EXPIRY_S",
    "MAX_RESPONSE_BYTES",
    "ConnectError",
    "ConnectTimeout",
    "HttpService",
    "LocalProtocolError",
    "PoolTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "Response",
    "ResponseTooLarge",
    "Timeout",
    "TimeoutException",
    "TransportError",
    "WriteTimeout",
    "request_not_sent",
]

# An idle pooled connection is dropped after this long. Below the 5 s of uvicorn (vLLM, SGLang),
# llama.cpp's server and Node, so that we, not the server, end an idle connection; a server with
# a shorter one (gunicorn's 2 s) closes first, and the stale-socket check catches that close once
# it has arrived. The testbed keeps connections 30 s.
KEEPALIVE_EXPIRY_S: Final = 4.0
# The most an answer's body may hold (decoded), so a misbehaving server cannot exhaust memory.
# A chat completion or an observation is kilobytes; a streamed generation of 32k tokens a few MB.
MAX_RESPONSE_BYTES: Final = 64 << 20
# How long a resolved address is reused for new connections (aiohttp's cache).
DNS_CACHE_TTL_S: Final = 10

# Linux's struct tcp_info: tcpi_bytes_acked (u64) at this offset (kernel 4.1 and later).
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_BYTES_ACKED_AT = 120
# How long the read timeout waits on while the server has not acknowledged a byte of the request
# (it is not the server's slowness that keeps the answer: the request never reached it). A
# server whose listen backlog overflowed resets such a connection once its SYN-ACK retries are
# spent (Linux: tcp_synack_retries 5, about 63 s), or accepts it late; past this, it is given up.
_UNACKNOWLEDGED_WAIT_S = 120.0
# Framing is the client's job: a caller's own value could desynchronise the connection.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "host"})
# Headers aiohttp would add that the adapters do not want: Content-Type (aiohttp's default for
# bytes is application/octet-stream; callers name theirs), Accept-Encoding (answers come
# uncompressed, as before; a compressed one is still decoded), User-Agent.
_SKIP_AUTO_HEADERS = ("Content-Type", "Accept-Encoding", "User-Agent")


# --------------------------------------------------------------------------- the error contract


class TransportError(Exception):
    """The request failed below HTTP. ``request_sent``: False when it provably never reached the
    server (safe to send again, whatever the method), True when the server answered, None when
    it may have arrived."""

    request_sent: bool | None = None


class ConnectError(TransportError):
    request_sent = False


class TimeoutException(TransportError):
    """A phase of the exchange took longer than its :class:`Timeout` allows."""


class ConnectTimeout(TimeoutException):
    request_sent = False


class PoolTimeout(TimeoutException):
    request_sent = False


class WriteTimeout(TimeoutException):
    pass


class ReadTimeout(TimeoutException):
    pass


class LocalProtocolError(TransportError):
    request_sent = False


class RemoteProtocolError(TransportError):
    pass


class ReadError(TransportError):
    pass


class ResponseTooLarge(TransportError):
    request_sent = True


def request_not_sent(exc: TransportError) -> bool:
    """True when the failed request provably never left this process (safe to send again)."""
    return exc.request_sent is False


# --------------------------------------------------------------------------- timeouts and answers

_UNSET: Any = object()


class Timeout:
    """Seconds allowed per phase (None: no limit), as ``Timeout(30)`` or ``Timeout(30, read=None)``
    or with all four named: ``pool`` (a free connection), ``connect``, ``write`` (the socket takes
    the request), ``read`` (inactivity while the answer arrives)."""

    __slots__ = ("connect", "pool", "read", "write")

    def __init__(
        self,
        timeout: float | None = _UNSET,
        *,
        connect: float | None = _UNSET,
        read: float | None = _UNSET,
        write: float | None = _UNSET,
        pool: float | None = _UNSET,
    ) -> None:
        phases = {"connect": connect, "read": read, "write": write, "pool": pool}
        if timeout is _UNSET and _UNSET in phases.values():
            missing = ", ".join(name for name, value in phases.items() if value is _UNSET)
            raise ValueError(f"Timeout needs a default or all four phases; missing: {missing}")
        self.connect: float | None = timeout if connect is _UNSET else connect
        self.read: float | None = timeout if read is _UNSET else read
        self.write: float | None = timeout if write is _UNSET else write
        self.pool: float | None = timeout if pool is _UNSET else pool

    def _key(self) -> tuple[float | None, ...]:
        return (self.connect, self.read, self.write, self.pool)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Timeout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Timeout(connect={self.connect}, read={self.read}, write={self.write}, pool={self.pool})"


class Response:
    """An answer: ``status_code``, ``headers`` (case-insensitive), and the body as ``content`` /
    ``text`` / ``json()``; a streamed one reads its body with ``aread``, ``aiter_bytes`` or
    ``aiter_lines`` first. ``text`` decodes with the charset of Content-Type, else UTF-8,
    replacing what does not decode."""

    __slots__ = ("_content", "_stream", "headers", "status_code")

    def __init__(
        self, status_code: int, headers: CIMultiDictProxy[str], content: bytes | None, stream: _Stream | None = None
    ) -> None:
        self.status_code = status_code
        self.headers = headers
        self._content = content
        self._stream = stream

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def content(self) -> bytes:
        if self._content is None:
            raise RuntimeError("the body of a streamed answer is read with aread() first")
        return self._content

    @property
    def encoding(self) -> str:
        return _charset(self.headers.get("content-type")) or "utf-8"

    @property
    def text(self) -> str:
        return self.content.decode(self.encoding, errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)

    async def aread(self) -> bytes:
        if self._content is None:
            assert self._stream is not None
            self._content = b"".join([chunk async for chunk in self._stream.chunks()])
        return self._content

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if self._content is not None:
            if self._content:
                yield self._content
            return
        assert self._stream is not None
        async for chunk in self._stream.chunks():
            yield chunk

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's text line by line, without line ends (``\\n``, ``\\r\\n`` or ``\\r``)."""
        decoder = codecs.getincrementaldecoder(self.encoding)(errors="replace")
        pending = ""
        async for chunk in self.aiter_bytes():
            pending += decoder.decode(chunk)
            # A CR at the end may be the first half of a CRLF: keep it for the next chunk.
            cut = len(pending) - 1 if pending.endswith("\r") else len(pending)
            lines = pending[:cut].replace("\r\n", "\n").replace("\r", "\n").split("\n")
            pending = lines.pop() + pending[cut:]
            for line in lines:
                yield line
        pending += decoder.decode(b"", final=True)
        if pending:
            lines = pending.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            for line in lines if lines[-1] else lines[:-1]:
                yield line

    def __repr__(self) -> str:
        return f"<Response [{self.status_code}]>"


def _charset(content_type: str | None) -> str | None:
    if not content_type or "charset" not in content_type.lower():
        return None
    for param in content_type.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip():
            name = value.strip().strip("\"'")
            try:
                return codecs.lookup(name).name
            except LookupError:
                return None
    return None


# --------------------------------------------------------------------------- one exchange


def _bytes_acked(sock: socket.socket | None) -> int | None:
    if sock is None or _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < _BYTES_ACKED_AT + 8:
        return None
    acked: int = struct.unpack_from("=Q", info, _BYTES_ACKED_AT)[0]
    return acked


class _Exchange:
    """One request's state across aiohttp: its connection's socket (a second descriptor, so that
    TCP_INFO stays readable once aiohttp has closed its own), and its one timer, which enforces
    the write and read timeouts by aborting the connection."""

    __slots__ = (
        "acked_before",
        "expired",
        "last_read",
        "loop",
        "reused",
        "sock",
        "streaming",
        "timeout",
        "timer",
        "transport",
        "waiting",
        "written_at",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: Timeout) -> None:
        self.loop = loop
        self.timeout = timeout
        self.transport: asyncio.Transport | None = None
        self.sock: socket.socket | None = None
        self.acked_before: int | None = None
        self.reused = False
        self.written_at = 0.0
        self.last_read = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.expired: TimeoutException | None = None
        self.streaming = False  # the head of a streamed answer is in: the caller reads at its pace
        self.waiting = False  # the caller waits for more of a streamed answer

    def bind(self, transport: asyncio.Transport, *, reused: bool) -> None:
        """The connection the request is written to now (again, after aiohttp's resend)."""
        if self.expired is not None:
            raise self.expired  # a timeout aborted the attempt: no resend
        self.release_socket()
        self.transport = transport
        self.reused = reused
        if _TCP_INFO is not None:
            own = transport.get_extra_info("socket")
            if own is not None:
                try:
                    self.sock = socket.fromfd(own.fileno(), own.family, own.type)
                except OSError:
                    self.sock = None
                # Every byte written before this request was answered, and so acknowledged.
                self.acked_before = _bytes_acked(self.sock)
        self.written_at = self.last_read = self.loop.time()
        self._arm(self._first_due())

    def unacknowledged(self) -> bool:
        """True when the server's TCP stack provably took no byte of this request (Linux only)."""
        if self.acked_before is None:
            return False
        acked = _bytes_acked(self.sock)
        return acked is not None and acked <= self.acked_before

    def _first_due(self) -> float | None:
        write, read = self.timeout.write, self.timeout.read
        if write is None and read is None:
            return None
        return self.written_at + min(t for t in (write, read) if t is not None)

    def _arm(self, due: float | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = None if due is None else self.loop.call_at(due, self._fire)

    def _fire(self) -> None:
        self.timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        now = self.loop.time()
        write, read = self.timeout.write, self.timeout.read
        if write is not None and transport.get_write_buffer_size() > 0:
            due = self.written_at + write  # the socket has not taken the whole request yet
            if due <= now:
                self._expire(WriteTimeout(f"the request was not taken by the socket within {write} s"))
                return
            self._arm(due if read is None else min(due, now + read))
            return
        if read is None:
            return
        if self.streaming and not self.waiting:
            self._arm(now + read)  # the caller, not the server, is the slow side
            return
        due = self.last_read + read
        if due <= now and now - self.written_at < _UNACKNOWLEDGED_WAIT_S and self.unacknowledged():
            # The server has not taken the request yet (a full listen backlog): its stack will
            # take it or reset the connection, which makes it safe to send again. Giving up now
            # could not tell whether it gets there after all.
            due = min(now + read, self.written_at + _UNACKNOWLEDGED_WAIT_S)
        if due > now:
            self._arm(due)
        else:
            self._expire(ReadTimeout(f"no data from the server for {read} s"))

    def _expire(self, error: TimeoutException) -> None:
        self.expired = error
        assert self.transport is not None
        self.transport.abort()  # aiohttp fails the request; error() reports it as this timeout

    def release_socket(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def finish(self) -> None:
        self._arm(None)
        self.release_socket()
        self.transport = None

    def error(self, exc: BaseException) -> TransportError:
        """The contract's error for what aiohttp raised (``exc`` becomes its cause)."""
        if self.expired is not None:
            return self.expired
        if isinstance(exc, aiohttp.ClientConnectorError):
            return ConnectError(f"cannot connect to {exc.host}:{exc.port}: {exc.os_error}")
        if isinstance(exc, aiohttp.ClientHttpProxyError):
            return ConnectError(f"the proxy refused the connection: HTTP {exc.status} {exc.message}")
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return ConnectTimeout(f"no connection within {self.timeout.connect} s")
        detail = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ConnectionResetError | aiohttp.ClientOSError) and self.unacknowledged():
            # Reset, and the server's stack never took a byte of the request: it cannot have
            # reached the server (any request may be sent again). A full listen backlog does this.
            return ConnectError(
                f"the server reset the connection before it took any byte of the request "
                f"(never accepted: is its listen backlog full?): {detail}"
            )
        if isinstance(exc, aiohttp.ServerDisconnectedError):
            if self.reused:
                return RemoteProtocolError("the server closed a kept-alive connection before answering")
            return RemoteProtocolError("the server closed the connection without a complete answer")
        if isinstance(exc, aiohttp.ClientPayloadError):
            return RemoteProtocolError(f"the server closed the connection in the middle of the answer's body: {detail}")
        if isinstance(exc, aiohttp.ClientResponseError):
            return RemoteProtocolError(f"malformed HTTP answer: {exc.message}")
        return ReadError(f"the connection failed during the exchange: {detail}")


# The exchange in progress in this task, for the connector: set around aiohttp's request call.
_EXCHANGE: contextvars.ContextVar[_Exchange | None] = contextvars.ContextVar("shopsimrl_http_exchange", default=None)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's pool, checking a pooled connection before it is reused and binding each
    connection to the exchange that writes on it."""

    def __init__(self, counters: _Counters, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._counters = counters
        self._handed: weakref.WeakSet[Any] = weakref.WeakSet()  # connections handed out before
        self._poll = select.poll()

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:
        while True:
            conn = await super().connect(req, traces, timeout)
            protocol, transport = conn.protocol, conn.transport
            reused = protocol in self._handed
            if reused and (transport is None or self._readable(transport)):
                # Idle in the pool, and readable: the server's FIN (or bytes nobody asked for)
                # arrived while the event loop was busy. Writing a request into it would fail.
                self._counters.stale += 1
                conn.close()
                continue
            if not reused:
                self._handed.add(protocol)
            exchange = _EXCHANGE.get()
            if exchange is not None and transport is not None:
                try:
                    exchange.bind(transport, reused=reused)
                except BaseException:
                    conn.close()
                    raise
            return conn

    def _readable(self, transport: asyncio.BaseTransport) -> bool:
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        fd = sock.fileno()
        if fd < 0:
            return True
        self._poll.register(fd, select.POLLIN)
        try:
            return bool(self._poll.poll(0))
        finally:
            self._poll.unregister(fd)


class _Counters:
    __slots__ = ("stale",)

    def __init__(self) -> None:
        self.stale = 0


# --------------------------------------------------------------------------- streamed bodies


class _Stream:
    """A streamed answer's body, read from aiohttp as the caller asks for it."""

    __slots__ = ("_exchange", "_limit", "_response", "_size", "done")

    def __init__(self, response: aiohttp.ClientResponse, exchange: _Exchange, limit: int) -> None:
        self._response = response
        self._exchange = exchange
        self._limit = limit
        self._size = 0
        self.done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        exchange, content = self._exchange, self._response.content
        while not self.done:
            exchange.waiting = True
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, OSError) as exc:
                raise exchange.error(exc) from exc
            finally:
                exchange.waiting = False
            if not chunk:
                self.done = True
                return
            exchange.last_read = exchange.loop.time()
            self._size += len(chunk)
            if self._size > self._limit:
                raise ResponseTooLarge(f"the answer's body is larger than {self._limit} bytes")
            yield chunk


async def _read_body(response: aiohttp.ClientResponse, exchange: _Exchange, limit: int) -> bytes:
    content = response.content
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        exchange.last_read = exchange.loop.time()
        size += len(chunk)
        if size > limit:
            raise ResponseTooLarge(f"the answer's body is larger than {limit} bytes")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# --------------------------------------------------------------------------- the service


class _Target:
    __slots__ = ("proxy", "proxy_headers", "url")

    def __init__(self, url: yarl.URL, proxy: yarl.URL | None, proxy_headers: dict[str, str] | None) -> None:
        self.url = url
        self.proxy = proxy
        self.proxy_headers = proxy_headers


class HttpService:
    """The connection pool to one upstream service (a model server, ShopSimulator).

    ``HttpService(max_connections=512)``; ``await service.request("POST", url, content=body,
    timeout=Timeout(30))`` returns a read :class:`Response`; ``async with service.stream(...) as
    response`` one whose body is read as it arrives. ``trust_env``: proxies from ``HTTP(S)_PROXY``
    and ``NO_PROXY`` (read once per URL). ``socket_factory`` makes each connection's socket from
    its address (``getaddrinfo``'s tuple), for socket options (aiohttp's hook). The pool is
    opened in the event loop that first uses it, and opened anew if a later call comes from
    another loop.
    """

    def __init__(
        self,
        *,
        max_connections: int = 100,
        keepalive_expiry: float = KEEPALIVE_EXPIRY_S,
        keep_alive: bool = True,
        trust_env: bool = False,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        socket_factory: Callable[[Any], socket.socket] | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self.keep_alive = keep_alive
        self.trust_env = trust_env
        self.max_response_bytes = max_response_bytes
        self.socket_factory = socket_factory
        self._counters = _Counters()
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._targets: dict[str, _Target] = {}
        self._timeouts: dict[float | None, aiohttp.ClientTimeout] = {}

    @property
    def stale_connections_discarded(self) -> int:
        """Pooled connections found closed by the server at reuse, and replaced."""
        return self._counters.stale

    def _open(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore, asyncio.AbstractEventLoop]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._slots is None or self._loop is not loop:
            # The limit is this service's own semaphore (a pool timeout apart from the connect
            # timeout); requests in flight bound the connections, so aiohttp's limit is off.
            connector = _Connector(
                self._counters,
                limit=0,
                limit_per_host=0,
                keepalive_timeout=self.keepalive_expiry if self.keep_alive else None,
                force_close=not self.keep_alive,
                use_dns_cache=True,
                ttl_dns_cache=DNS_CACHE_TTL_S,
                socket_factory=self.socket_factory,
            )
            # Proxies are looked up here once per URL (trust_env), not by aiohttp per request,
            # which would also read ~/.netrc credentials into the model's requests.
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=_SKIP_AUTO_HEADERS,
                trust_env=False,
                raise_for_status=False,
            )
            self._slots = asyncio.Semaphore(self.max_connections)
            self._loop = loop
        return self._session, self._slots, loop

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) > 256:  # the adapters use a handful of URLs; never grow without bound
                self._targets.clear()
            parsed = yarl.URL(url)
            proxy, proxy_headers = _env_proxy(parsed) if self.trust_env else (None, None)
            target = self._targets[url] = _Target(parsed, proxy, proxy_headers)
        return target

    def _client_timeout(self, timeout: Timeout) -> aiohttp.ClientTimeout:
        cached = self._timeouts.get(timeout.connect)
        if cached is None:
            # The read and write timeouts are the exchange's timer; aiohttp keeps the connect one
            # (DNS, TCP, TLS, a proxy's tunnel). There is no pool wait inside aiohttp.
            cached = self._timeouts[timeout.connect] = aiohttp.ClientTimeout(
                total=None, connect=timeout.connect, sock_connect=None, sock_read=None
            )
        return cached

    async def _acquire(self, slots: asyncio.Semaphore, timeout: Timeout) -> None:
        if not slots.locked() or timeout.pool is None:
            await slots.acquire()
            return
        try:
            async with asyncio.timeout(timeout.pool):
                await slots.acquire()
        except TimeoutError:
            raise PoolTimeout(f"no free connection within {timeout.pool} s") from None

    async def _send(
        self,
        session: aiohttp.ClientSession,
        exchange: _Exchange,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: Timeout,
    ) -> aiohttp.ClientResponse:
        target = self._target(url)
        token = _EXCHANGE.set(exchange)
        try:
            return await session.request(
                method,
                target.url,
                data=content,
                headers=headers,
                timeout=self._client_timeout(timeout),
                allow_redirects=False,
                proxy=target.proxy,
                proxy_headers=target.proxy_headers,
            )
        except (aiohttp.ClientError, OSError) as exc:
            raise exchange.error(exc) from exc
        finally:
            _EXCHANGE.reset(token)

    async def request(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: Timeout,
    ) -> Response:
        """Send, and read the whole answer."""
        _check_headers(headers)
        session, slots, loop = self._open()
        await self._acquire(slots, timeout)
        exchange = _Exchange(loop, timeout)
        try:
            response = await self._send(session, exchange, method, url, content, headers, timeout)
            exchange.last_read = exchange.loop.time()
            try:
                body = await _read_body(response, exchange, self.max_response_bytes)
            except BaseException as exc:
                response.close()  # a connection whose answer was not taken whole is not reused
                if isinstance(exc, aiohttp.ClientError | OSError):
                    raise exchange.error(exc) from exc
                raise
            response.release()  # back to the pool
            return Response(response.status, response.headers, body)
        finally:
            exchange.finish()
            slots.release()

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: Timeout,
    ) -> AsyncIterator[Response]:
        """Send; the answer's body is read as it arrives (``aiter_lines``, ``aread``)."""
        _check_headers(headers)
        session, slots, loop = self._open()
        await self._acquire(slots, timeout)
        exchange = _Exchange(loop, timeout)
        try:
            response = await self._send(session, exchange, method, url, content, headers, timeout)
            body = _Stream(response, exchange, self.max_response_bytes)
            exchange.last_read = exchange.loop.time()
            exchange.streaming = True
            try:
                yield Response(response.status, response.headers, None, body)
            finally:
                if body.done:
                    response.release()
                else:
                    response.close()  # a connection still carrying this answer cannot be reused
        finally:
            exchange.finish()
            slots.release()

    async def aclose(self) -> None:
        session, self._session = self._session, None
        # A pool opened in an event loop that has since ended cannot be closed from this one.
        if session is not None and self._loop is asyncio.get_running_loop():
            await session.close()


def _check_headers(headers: Mapping[str, str] | None) -> None:
    if not headers:
        return
    for name, value in headers.items():
        if name.lower() in _FRAMING:
            raise LocalProtocolError(f"the {name} header is set by the HTTP client, not by callers")
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
            raise LocalProtocolError("a request header name or value contains a line break")
        if not (name.isascii() and value.isascii()):
            raise LocalProtocolError("a request header is not ASCII text")


def _env_proxy(url: yarl.URL) -> tuple[yarl.URL | None, dict[str, str] | None]:
    """The proxy ``HTTP_PROXY`` / ``HTTPS_PROXY`` name for ``url`` unless ``NO_PROXY`` exempts it,
    with its user:password as a Proxy-Authorization header."""
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme)
    if not proxy or (url.host and urllib.request.proxy_bypass(url.host)):
        return None, None
    parsed = yarl.URL(proxy)
    if parsed.user is None:
        return parsed, None
    auth = aiohttp.BasicAuth(parsed.user, parsed.password or "").encode()
    return parsed.with_user(None), {"Proxy-Authorization": auth}
