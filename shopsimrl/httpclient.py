"""HTTP for the model and environment adapters: httpx's types, aiohttp's connection pool.

The adapters speak httpx: they get ``httpx.Response`` objects, pass ``httpx.Timeout`` and handle
httpx's exception hierarchy. Underneath, requests go through aiohttp's connection pool and its
C HTTP parser. Measured on the real path (docs/benchmarks.md, "Throughput"): httpx's own pool
(httpcore) scans every pooled connection on each request, so its CPU per request grows with the
episodes in flight; httpx's client layer (URL parsing, cookies, redirects, auth hooks) costs
more than the request itself; aiohttp costs the same per request at any concurrency.

Every aiohttp failure is mapped to the httpx error that says whether the request may have
reached the server, which decides if a non-idempotent call may be sent again:

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
from typing import Any

import aiohttp
import httpx
import yarl

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
        response = await self._send(method, url, content, headers, timeout)
        try:
            body = await response.read()
        except aiohttp.ClientError as exc:
            raise _httpx_error(exc) from exc
        finally:
            response.release()
        return httpx.Response(response.status, headers=response.raw_headers, content=body)

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
        response = await self._send(method, url, content, headers, timeout)
        wrapped = httpx.Response(response.status, headers=response.raw_headers, stream=_Body(response))
        try:
            yield wrapped
        finally:
            await wrapped.aclose()

    async def aclose(self) -> None:
        session, self._session = self._session, None
        # A pool opened in an event loop that has since ended cannot be closed from this one.
        if session is not None and self._loop is asyncio.get_running_loop():
            await session.close()
