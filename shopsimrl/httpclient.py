"""HTTP for the model and environment adapters: httpx's types over a lean HTTP/1.1 client.

The adapters speak httpx: they get ``httpx.Response`` objects (a whole body's built cheaply,
see ``_ReadResponse``), pass ``httpx.Timeout`` and handle
httpx's exception hierarchy. Underneath, ``http://`` origins go through shopsimrl.http11 (asyncio
protocols, httptools' C parser, a LIFO keep-alive pool per origin); ``https://`` origins (hosted
model endpoints), URLs with user:password@ and services created with ``trust_env`` (proxies from
the environment) go through aiohttp's pool and its TLS, proxy and auth support. Measured on the
real path (docs/benchmarks.md, "HTTP clients"): httpx's own pool (httpcore) scans every pooled
connection on each request, so its CPU per request grows with the episodes in flight; httpx's
client layer costs more than the request itself; aiohttp costs the same at any concurrency, and
the lean client less than aiohttp.

Every failure is raised as the httpx error that says whether the request may have reached the
server, which decides if a non-idempotent call may be sent again. ``http://`` (shopsimrl.http11):

===============================================================  ===================  ==============
failure                                                          httpx                request sent?
===============================================================  ===================  ==============
connection refused, unknown host, other connect errors           ConnectError         no
reset before the server's TCP stack took any byte of the request
  (Linux TCP_INFO: none acknowledged; a listen backlog that never
  accepted the connection, or a server that had closed it)       ConnectError         no
no connection within ``timeout.connect``                         ConnectTimeout       no
no free pooled connection within ``timeout.pool``                PoolTimeout          no
a header the client sets itself, or a line break in a header     LocalProtocolError   no (not retried)
the socket does not take the request within ``timeout.write``    WriteTimeout         maybe
no byte of the answer for ``timeout.read`` (while no byte of the
  request is acknowledged, up to 120 s from the write: the
  server's kernel still takes it or resets it)                   ReadTimeout          maybe
a kept-alive connection closed before any byte of the answer:
  GET, HEAD, PUT, DELETE, OPTIONS, TRACE are sent again (at most
  3 times, asking for a new connection); others (POST) fail      RemoteProtocolError  maybe
the server hangs up before the answer or its body is complete    RemoteProtocolError  maybe
an answer that is not HTTP/1.x                                   RemoteProtocolError  maybe
the connection reset or failed during the exchange               ReadError            maybe
===============================================================  ===================  ==============

"Reset before any byte was acknowledged" is the one "no" that the server's side decides: its
kernel acknowledges what reaches a socket at once, so an unacknowledged request reached no
process there (left open: a server that reads a request and aborts the connection before its
kernel's delayed acknowledgement goes out, which no HTTP server does). Whatever transport
replaces this one must keep the table; tests/test_listen_backlog.py checks that row from
outside, against a server whose listen backlog overflows.

``https://`` and the other aiohttp cases:

========================================  ===========================  ==============
aiohttp                                   httpx                        request sent?
========================================  ===========================  ==============
ClientConnectorError (refused, DNS, TLS)  ConnectError                 no
ConnectionTimeoutError (connect, pool)    ConnectTimeout               no
SocketTimeoutError, ServerTimeoutError    ReadTimeout                  maybe
ServerDisconnectedError                   RemoteProtocolError          maybe
ClientPayloadError (body cut off)         RemoteProtocolError          maybe
ClientOSError, any other ClientError      ReadError                    maybe
========================================  ===========================  ==============
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import httpx
import yarl

from shopsimrl import http11

__all__ = ["HttpService", "request_not_sent"]

_NOT_SENT: tuple[type[BaseException], ...] = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

# Most specific first: aiohttp's classes inherit from one another.
_MAPPING: tuple[tuple[type[BaseException], type[httpx.TransportError]], ...] = (
    (aiohttp.ClientConnectorError, httpx.ConnectError),
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.SocketTimeoutError, httpx.ReadTimeout),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.RemoteProtocolError),
    (aiohttp.ClientError, httpx.ReadError),
)


def request_not_sent(exc: httpx.TransportError) -> bool:
    """True when the failed request provably never left this process (safe to send again)."""
    return isinstance(exc, _NOT_SENT)


def _httpx_error(exc: BaseException) -> httpx.TransportError:
    for source, target in _MAPPING:
        if isinstance(exc, source):
            mapped = target(f"{type(exc).__name__}: {exc}")
            mapped.__cause__ = exc
            return mapped
    raise exc  # not a transport failure: let it through unchanged


class _ReadResponse(httpx.Response):
    """An ``httpx.Response`` whose body was read whole and needs no decoding, built cheaply.

    httpx's constructor parses every header and passes the body through a byte stream (~25 µs,
    about 5 % of the runner's CPU per step at ~2.4 requests a step; docs/benchmarks.md); here the
    headers are parsed only when read (error paths, Retry-After) and the body is set as read.
    It answers as ``httpx.Response(status, headers=raw, content=body)`` does for a body without
    Content-Encoding (tested attribute by attribute against it); an encoded body takes httpx's
    own constructor, which decodes it."""

    def __init__(self, status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        # httpx.Response.__init__ is skipped on purpose; these are the attributes it sets.
        self.status_code = status
        self._raw_headers = raw_headers
        self._parsed_headers: httpx.Headers | None = None
        self._request = None
        self.next_request = None
        self.extensions = {}
        self.history = []
        self.is_closed = True
        self.is_stream_consumed = True
        self.default_encoding = "utf-8"
        self._content = body
        self._num_bytes_downloaded = 0  # as httpx.Response(content=...) reports it
        self.stream = httpx.ByteStream(body)

    @property  # httpx sets a plain attribute; here it is parsed on first read
    def headers(self) -> httpx.Headers:
        if self._parsed_headers is None:
            self._parsed_headers = httpx.Headers(self._raw_headers)
        return self._parsed_headers

    @headers.setter
    def headers(self, value: httpx.Headers) -> None:
        self._parsed_headers = httpx.Headers(value)


def _read_response(status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes) -> httpx.Response:
    for name, _ in raw_headers:
        if len(name) == 16 and name.lower() == b"content-encoding":
            return httpx.Response(status, headers=raw_headers, content=body)  # httpx decodes it
    return _ReadResponse(status, raw_headers, body)


class _Body(httpx.AsyncByteStream):
    """A streamed response body, read from aiohttp as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            raise _httpx_error(exc) from exc

    async def aclose(self) -> None:
        self._response.release()


class _LeanBody(httpx.AsyncByteStream):
    """A streamed response body, read from shopsimrl.http11 as it arrives."""

    def __init__(self, answer: http11.Answer) -> None:
        self._answer = answer

    def __aiter__(self) -> AsyncIterator[bytes]:
        return http11.iterate(self._answer)

    async def aclose(self) -> None:
        http11.close_stream(self._answer)


@dataclass(frozen=True, slots=True)
class _Origin:
    """Where a plain-http URL is sent: the pool's key, the request target and the Host header."""

    address: tuple[str, int]
    target: str
    host: str


class HttpService:
    """The connection pool to one upstream service (a model server, ShopSimulator).

    ``HttpService(max_connections=512)``; ``await service.request("POST", url, content=body,
    timeout=httpx.Timeout(30))`` returns a read ``httpx.Response``; ``async with
    service.stream(...) as response`` one whose body is read as it arrives. The pool is opened
    in the event loop that first uses it, and opened anew if a later call comes from another loop.
    """

    def __init__(
        self, *, max_connections: int = 100, keepalive_expiry: float = 5.0, keep_alive: bool = True, trust_env: bool = False
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self.keep_alive = keep_alive
        self.trust_env = trust_env
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._urls: dict[str, yarl.URL] = {}
        self._origins: dict[str, _Origin | None] = {}
        self._pools: dict[tuple[str, int], http11.Pool] = {}
        self._pools_loop: asyncio.AbstractEventLoop | None = None
        self._timeouts: dict[tuple[Any, ...], aiohttp.ClientTimeout] = {}

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections,
                keepalive_timeout=self.keepalive_expiry if self.keep_alive else None,
                force_close=not self.keep_alive,
            )
            # trust_env: proxies from HTTP(S)_PROXY only when asked (as httpx's trust_env).
            # auto_decompress off: httpx.Response decodes Content-Encoding itself.
            self._session = aiohttp.ClientSession(connector=connector, trust_env=self.trust_env, auto_decompress=False)
            self._loop = loop
        return self._session

    def _origin(self, url: str) -> _Origin | None:
        """The lean client's view of ``url``; None where aiohttp serves it (https, credentials, proxies)."""
        try:
            return self._origins[url]
        except KeyError:
            pass
        if len(self._origins) > 256:  # the adapters use a handful of URLs; never grow without bound
            self._origins.clear()
        parts = urlsplit(url)
        origin = None
        if parts.scheme == "http" and not self.trust_env and "@" not in parts.netloc and parts.hostname:
            # Percent-encode what may not appear raw in a request line (spaces, non-ASCII), as httpx does.
            target = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~") + (
                f"?{quote(parts.query, safe='/%:@!$&()*+,;=~?')}" if parts.query else ""
            )
            origin = _Origin((parts.hostname, parts.port or 80), target, parts.netloc)
        self._origins[url] = origin
        return origin

    def _pool(self, origin: _Origin) -> http11.Pool:
        loop = asyncio.get_running_loop()
        if self._pools_loop is not loop:
            self._pools = {}  # those of an ended event loop cannot be used (or closed) from this one
            self._pools_loop = loop
        pool = self._pools.get(origin.address)
        if pool is None:
            pool = self._pools[origin.address] = http11.Pool(
                *origin.address, limit=self.max_connections, keepalive_expiry=self.keepalive_expiry, keep_alive=self.keep_alive
            )
        return pool

    async def _lean_send(
        self,
        origin: _Origin,
        method: str,
        content: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: httpx.Timeout,
        *,
        stream: bool,
    ) -> tuple[int, list[tuple[bytes, bytes]], http11.Answer]:
        data = http11.request_bytes(method, origin.target, origin.host, content, headers, keep_alive=self.keep_alive)
        return await http11.exchange(self._pool(origin), method, data, timeout, stream=stream)

    def _url(self, url: str) -> yarl.URL:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) > 256:  # the adapters use a handful of URLs; never grow without bound
                self._urls.clear()
            parsed = self._urls[url] = yarl.URL(url)
        return parsed

    def _timeout(self, timeout: httpx.Timeout) -> aiohttp.ClientTimeout:
        key = (timeout.connect, timeout.read, timeout.pool)
        cached = self._timeouts.get(key)
        if cached is None:
            # aiohttp's `connect` covers waiting for a pooled connection plus connecting.
            pool = None if timeout.pool is None or timeout.connect is None else timeout.pool + timeout.connect
            cached = self._timeouts[key] = aiohttp.ClientTimeout(
                total=None, connect=pool, sock_connect=timeout.connect, sock_read=timeout.read
            )
        return cached

    async def _send(
        self, method: str, url: str, content: bytes | None, headers: Mapping[str, str] | None, timeout: httpx.Timeout
    ) -> aiohttp.ClientResponse:
        try:
            return await self._open().request(
                method,
                self._url(url),
                data=content,
                headers=headers,
                timeout=self._timeout(timeout),
                allow_redirects=False,
            )
        except aiohttp.ClientError as exc:
            raise _httpx_error(exc) from exc

    async def request(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout,
    ) -> httpx.Response:
        """Send, and read the whole answer."""
        origin = self._origin(url)
        if origin is not None:
            status, raw_headers, answer = await self._lean_send(origin, method, content, headers, timeout, stream=False)
            return _read_response(status, raw_headers, http11.body(answer))
        response = await self._send(method, url, content, headers, timeout)
        try:
            body = await response.read()
        except aiohttp.ClientError as exc:
            raise _httpx_error(exc) from exc
        finally:
            response.release()
        return _read_response(response.status, list(response.raw_headers), body)

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout,
    ) -> AsyncIterator[httpx.Response]:
        """Send; the answer's body is read as it arrives (``aiter_lines``, ``aread``)."""
        origin = self._origin(url)
        if origin is not None:
            status, raw_headers, answer = await self._lean_send(origin, method, content, headers, timeout, stream=True)
            wrapped = httpx.Response(status, headers=raw_headers, stream=_LeanBody(answer))
        else:
            response = await self._send(method, url, content, headers, timeout)
            wrapped = httpx.Response(response.status, headers=response.raw_headers, stream=_Body(response))
        try:
            yield wrapped
        finally:
            await wrapped.aclose()

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        if self._pools_loop is asyncio.get_running_loop():
            for pool in pools.values():
                pool.close()
        session, self._session = self._session, None
        # A pool opened in an event loop that has since ended cannot be closed from this one.
        if session is not None and self._loop is asyncio.get_running_loop():
            await session.close()
