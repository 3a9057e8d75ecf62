"""The adapters' HTTP client maps every transport failure to the httpx error that says whether
the request may have reached the server (real sockets: a closed port and raw TCP servers that
misbehave in exactly one way each)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from shopsimrl.httpclient import HttpService, request_not_sent

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def post(url: str, *, read: float | None = 5.0) -> httpx.Response:
    service = HttpService(max_connections=4)
    try:
        return await service.request("POST", f"{url}/x", content=b'{"a": 1}', timeout=httpx.Timeout(5.0, read=read))
    finally:
        await service.aclose()


async def test_a_refused_connection_is_a_connect_error_never_sent() -> None:
    with pytest.raises(httpx.ConnectError) as failure:
        await post(f"http://127.0.0.1:{closed_port()}")
    assert request_not_sent(failure.value)


async def test_a_server_that_reads_the_request_and_hangs_up_may_have_acted_on_it() -> None:
    received: list[bytes] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await read_request(reader))
        writer.close()

    async with raw_server(hang_up) as url:
        with pytest.raises(httpx.RemoteProtocolError) as failure:
            await post(url)
    assert received and not request_not_sent(failure.value)  # it did arrive: never resend blindly


async def test_no_answer_within_the_read_timeout_is_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async with raw_server(silent) as url:
        with pytest.raises(httpx.ReadTimeout) as failure:
            await post(url, read=0.3)
    assert not request_not_sent(failure.value)


async def test_a_body_cut_off_is_a_protocol_error() -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\nContent-Type: application/json\r\n\r\n{"partial":')
        await writer.drain()
        writer.close()

    async with raw_server(truncated) as url:
        with pytest.raises(httpx.RemoteProtocolError) as failure:
            await post(url)
    assert not request_not_sent(failure.value)


async def test_a_healthy_exchange_reuses_one_connection() -> None:
    connections: list[int] = []

    async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while True:
            try:
                await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")
            await writer.drain()

    async with raw_server(keep_alive) as url:
        service = HttpService(max_connections=4)
        try:
            for _ in range(5):
                response = await service.request("POST", f"{url}/x", content=b"{}", timeout=httpx.Timeout(5.0))
                assert response.status_code == 200 and response.json() == {}
        finally:
            await service.aclose()
    assert len(connections) == 1
