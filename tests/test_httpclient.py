"""The adapters' HTTP client maps every transport failure to the error that says whether
the request may have reached the server (real sockets: a closed port and raw TCP servers that
misbehave in exactly one way each), one test per row of shopsimrl.httpclient's table; it keeps
connections alive, frames chunked, sized and close-delimited bodies, streams, and talks to the
real testbed shop and policy processes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest

from shopsimrl import httpclient
from shopsimrl.httpclient import HttpService, Response, Timeout, request_not_sent
from shopsimrl.testbed.serving import running_server
from tests.polling import busy_until_closed_by_server, open_connections_to
from tests.testbed_process import LocalTestbed, start_testbed

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/net/tcp")


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


async def post(url: str, *, read: float | None = 5.0) -> Response:
    service = HttpService(max_connections=4)
    try:
        return await service.request("POST", f"{url}/x", content=b'{"a": 1}', timeout=Timeout(5.0, read=read))
    finally:
        await service.aclose()


async def test_a_refused_connection_is_a_connect_error_never_sent() -> None:
    with pytest.raises(httpclient.ConnectError) as failure:
        await post(f"http://127.0.0.1:{closed_port()}")
    assert request_not_sent(failure.value)


async def test_a_server_that_reads_the_request_and_hangs_up_may_have_acted_on_it() -> None:
    received: list[bytes] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await read_request(reader))
        writer.close()

    async with raw_server(hang_up) as url:
        with pytest.raises(httpclient.RemoteProtocolError) as failure:
            await post(url)
    assert received and not request_not_sent(failure.value)  # it did arrive: never resend blindly


async def test_no_answer_within_the_read_timeout_is_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async with raw_server(silent) as url:
        with pytest.raises(httpclient.ReadTimeout) as failure:
            await post(url, read=0.3)
    assert not request_not_sent(failure.value)


async def test_a_get_that_timed_out_is_not_sent_again() -> None:
    """A read timeout ends the exchange: the GET, which the client would resend after a dropped
    connection, is not sent a second time (the server may still be working on the first)."""
    arrived: list[bytes] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            arrived.append(request)

    async with raw_server(silent) as url:
        service = HttpService(max_connections=2)
        try:
            with pytest.raises(httpclient.ReadTimeout):
                await service.request("GET", f"{url}/x", timeout=Timeout(5.0, read=0.3))
            await asyncio.sleep(0.1)  # a resend, had there been one, would have arrived by now
        finally:
            await service.aclose()
    assert len(arrived) == 1


async def test_a_body_cut_off_is_a_protocol_error() -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\nContent-Type: application/json\r\n\r\n{"partial":')
        await writer.drain()
        writer.close()

    async with raw_server(truncated) as url:
        with pytest.raises(httpclient.RemoteProtocolError) as failure:
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
                response = await service.request("POST", f"{url}/x", content=b"{}", timeout=Timeout(5.0))
                assert response.status_code == 200 and response.json() == {}
        finally:
            await service.aclose()
    assert len(connections) == 1


# --------------------------------------------------------------------------- helpers


async def read_requests(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The requests arriving on one connection, until the client closes it."""
    while True:
        try:
            yield await read_request(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            return


def answer(body: bytes = b"{}", *, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%b\r\n%b" % (len(body), extra, body)


async def until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until ``condition`` holds (bounded: a few seconds)."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


# --------------------------------------------------------------------------- the table, row by row


async def test_no_connection_within_the_connect_timeout_is_a_connect_timeout_never_sent() -> None:
    # A listening socket whose accept queue is full: the kernel drops further SYNs, connects hang.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            fillers.append(filler)
            filler.connect_ex(("127.0.0.1", port))
        service = HttpService(max_connections=4)
        try:
            with pytest.raises(httpclient.ConnectTimeout) as failure:
                await service.request("GET", f"http://127.0.0.1:{port}/x", timeout=Timeout(5.0, connect=0.3))
        finally:
            await service.aclose()
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
    assert request_not_sent(failure.value)


async def test_no_free_connection_within_the_pool_timeout_is_a_pool_timeout_never_sent() -> None:
    arrived: list[bytes] = []
    first_in = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            arrived.append(request)
            first_in.set()
            await asyncio.sleep(30)

    async with raw_server(hold) as url:
        service = HttpService(max_connections=1)
        try:
            first = asyncio.create_task(service.request("POST", f"{url}/x", content=b"1", timeout=Timeout(30.0)))
            await first_in.wait()
            with pytest.raises(httpclient.PoolTimeout) as failure:
                await service.request("POST", f"{url}/x", content=b"2", timeout=Timeout(30.0, pool=0.2))
            first.cancel()
        finally:
            await service.aclose()
    assert request_not_sent(failure.value)
    assert len(arrived) == 1 and arrived[0].endswith(b"1")  # the second never left


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Evil": "a\r\nX-Injected: 1"},
        {"X-Evil": "a\nb"},
        {"Content-Length": "3"},
        {"Host": "elsewhere"},
        {"X-Name": "caf\u00e9\u2603"},
    ],
)
async def test_a_bad_or_client_owned_header_is_a_local_protocol_error_and_nothing_is_sent(headers: dict[str, str]) -> None:
    connections: list[int] = []

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    async with raw_server(count) as url:
        service = HttpService(max_connections=4)
        try:
            with pytest.raises(httpclient.LocalProtocolError):
                await service.request("POST", f"{url}/x", content=b"{}", headers=headers, timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert connections == []


async def test_a_socket_that_never_takes_the_request_is_a_write_timeout() -> None:
    stalled = asyncio.Event()

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stalled.wait()  # reads nothing: the kernel buffers on both sides fill up
        writer.close()

    async with raw_server(never_read) as url:
        service = HttpService(max_connections=4)
        try:
            with pytest.raises(httpclient.WriteTimeout) as failure:
                await service.request("POST", f"{url}/x", content=b"x" * (64 << 20), timeout=Timeout(5.0, write=0.3, read=None))
        finally:
            stalled.set()
            await service.aclose()
    assert not request_not_sent(failure.value)


async def test_a_stall_in_the_middle_of_the_body_is_a_read_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial":')
        await writer.drain()
        await asyncio.sleep(30)

    async with raw_server(stall) as url:
        with pytest.raises(httpclient.ReadTimeout) as failure:
            await post(url, read=0.3)
    assert not request_not_sent(failure.value)


@pytest.mark.slow
async def test_the_read_timeout_is_inactivity_not_a_deadline_for_the_whole_answer() -> None:
    # 20 pieces 0.1 s apart take ~2 s in all, twice the read timeout; no gap comes close to it.
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n")
        for _ in range(20):
            await asyncio.sleep(0.1)
            writer.write(b"x")
            await writer.drain()

    async with raw_server(trickle) as url:
        response = await post(url, read=1.0)
    assert response.content == b"x" * 20


async def test_a_kept_alive_connection_closed_before_the_answer_resends_a_get_once_on_a_new_connection() -> None:
    seen: list[bytes] = []

    async def drop_the_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        async for request in read_requests(reader):
            seen.append(request)
            if served == 1:  # the second request on this connection: hang up without a byte
                writer.close()
                return
            served += 1
            writer.write(answer(b'{"n": %d}' % len(seen)))
            await writer.drain()

    async with raw_server(drop_the_second) as url:
        service = HttpService(max_connections=4)
        try:
            first = await service.request("GET", f"{url}/x", timeout=Timeout(5.0))
            second = await service.request("GET", f"{url}/x", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert first.json() == {"n": 1} and second.json() == {"n": 3}
    assert len(seen) == 3  # the dropped GET and its resend on a fresh connection


async def test_a_get_dropped_again_on_its_resend_fails_after_one_resend() -> None:
    seen: list[bytes] = []

    async def drop_after_the_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            seen.append(request.split(b" ")[1])
            if len(seen) > 1:  # every request after the first: hang up without a byte
                writer.close()
                return
            writer.write(answer())
            await writer.drain()

    async with raw_server(drop_after_the_first) as url:
        service = HttpService(max_connections=1)
        try:
            await service.request("GET", f"{url}/warm", timeout=Timeout(5.0))
            with pytest.raises(httpclient.RemoteProtocolError) as failure:
                await service.request("GET", f"{url}/x", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert not request_not_sent(failure.value)
    assert seen == [b"/warm", b"/x", b"/x"]  # sent, dropped, sent once more on a new connection, dropped


async def test_a_get_resent_while_another_request_waits_for_the_pool_goes_out_before_it() -> None:
    """One connection allowed; the server drops each request that arrives on a kept-alive
    connection. The resend keeps the pool's slot, so the waiting request goes out after it."""
    seen: list[bytes] = []
    drop_reused = False

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        async for request in read_requests(reader):
            seen.append(request.split(b" ")[1])
            if drop_reused and served:  # a kept-alive connection: hang up without a byte
                writer.close()
                return
            served += 1
            writer.write(answer())
            await writer.drain()

    async with raw_server(serve) as url:
        service = HttpService(max_connections=1)
        try:
            await service.request("GET", f"{url}/warm", timeout=Timeout(5.0))
            drop_reused = True
            first, second = await asyncio.gather(
                service.request("GET", f"{url}/first", timeout=Timeout(5.0)),
                service.request("GET", f"{url}/second", timeout=Timeout(5.0)),
            )
        finally:
            await service.aclose()
    assert first.status_code == second.status_code == 200
    # each dropped on the kept-alive connection it found, then answered on a new one
    assert seen == [b"/warm", b"/first", b"/first", b"/second", b"/second"]


async def test_a_kept_alive_connection_closed_before_the_answer_fails_a_post_without_resending_it() -> None:
    seen: list[bytes] = []

    async def drop_the_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            seen.append(request)
            if len(seen) == 2:
                writer.close()
                return
            writer.write(answer())
            await writer.drain()

    async with raw_server(drop_the_second) as url:
        service = HttpService(max_connections=4)
        try:
            await service.request("POST", f"{url}/x", content=b"1", timeout=Timeout(5.0))
            with pytest.raises(httpclient.RemoteProtocolError) as failure:
                await service.request("POST", f"{url}/x", content=b"2", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert not request_not_sent(failure.value)  # the server may have acted on it
    assert len(seen) == 2  # and it was not sent again


async def test_an_idle_connection_the_server_closed_is_not_used_so_a_post_goes_out_once_and_succeeds() -> None:
    seen: list[bytes] = []
    closed_after_first = asyncio.Event()

    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            seen.append(request)
            writer.write(answer())  # no "Connection: close": the client keeps it for later
            await writer.drain()
            writer.close()
            closed_after_first.set()
            return

    async with raw_server(one_per_connection) as url:
        service = HttpService(max_connections=4)
        try:
            await service.request("POST", f"{url}/x", content=b"1", timeout=Timeout(5.0))
            await closed_after_first.wait()
            second = await service.request("POST", f"{url}/x", content=b"2", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert second.status_code == 200
    assert [request[-1:] for request in seen] == [b"1", b"2"]


async def test_an_answer_that_is_not_http_is_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    async with raw_server(garbage) as url:
        with pytest.raises(httpclient.RemoteProtocolError) as failure:
            await post(url)
    assert not request_not_sent(failure.value)


async def test_a_chunked_body_cut_off_is_a_protocol_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n10\r\nonly")
        await writer.drain()
        writer.close()

    async with raw_server(cut) as url:
        with pytest.raises(httpclient.RemoteProtocolError):
            await post(url)


async def test_a_connection_reset_during_the_exchange_is_a_read_error() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        writer.transport.abort()

    async with raw_server(reset) as url:
        with pytest.raises(httpclient.ReadError) as failure:
            await post(url)
    assert not request_not_sent(failure.value)


# --------------------------------------------------------------------------- framing and the pool


async def test_chunked_and_close_delimited_bodies_are_read_whole() -> None:
    connections: list[int] = []

    async def framings(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        async for request in read_requests(reader):
            if b"/chunked" in request:
                writer.write(
                    b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{"a\r\n6\r\n": [1]\r\n1\r\n}\r\n0\r\n\r\n'
                )
            elif b"/sized" in request:
                writer.write(answer(b'"again"'))
            else:
                writer.write(b'HTTP/1.1 200 OK\r\n\r\n{"until": "close"}')
                await writer.drain()
                writer.close()
                return
            await writer.drain()

    async with raw_server(framings) as url:
        service = HttpService(max_connections=1)
        try:
            chunked = await service.request("GET", f"{url}/chunked", timeout=Timeout(5.0))
            again = await service.request("GET", f"{url}/sized", timeout=Timeout(5.0))
            until_close = await service.request("GET", f"{url}/close", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert chunked.json() == {"a": [1]} and again.json() == "again" and until_close.json() == {"until": "close"}
    assert len(connections) == 1  # max_connections=1 and every answer framed: one connection served all three


async def test_interim_answers_are_skipped_and_head_answers_have_no_body() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            if request.startswith(b"HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + answer(b'"final"'))
            await writer.drain()

    async with raw_server(serve) as url:
        service = HttpService(max_connections=2)
        try:
            head = await service.request("HEAD", f"{url}/x", timeout=Timeout(5.0))
            final = await service.request("GET", f"{url}/x", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == "1000"
    assert final.status_code == 200 and final.json() == "final" and "link" not in final.headers


async def test_the_server_saying_connection_close_and_keep_alive_false_are_honoured() -> None:
    connections: list[list[bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests: list[bytes] = []
        connections.append(requests)
        async for request in read_requests(reader):
            requests.append(request)
            writer.write(answer(extra=b"Connection: close\r\n" if b"/bye" in request else b""))
            await writer.drain()

    async with raw_server(serve) as url:
        service = HttpService(max_connections=4)
        closing = HttpService(max_connections=4, keep_alive=False)
        try:
            for path in ("/bye", "/bye", "/stay", "/stay"):
                await service.request("GET", f"{url}{path}", timeout=Timeout(5.0))
            for _ in range(2):
                await closing.request("GET", f"{url}/stay", timeout=Timeout(5.0))
        finally:
            await service.aclose()
            await closing.aclose()
    assert [len(requests) for requests in connections] == [1, 1, 2, 1, 1]
    assert all(b"connection: close" in requests[0].lower() for requests in connections[3:])


async def test_the_pool_opens_at_most_max_connections_and_queues_the_rest() -> None:
    connections: list[int] = []
    served = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        connections.append(1)
        async for _ in read_requests(reader):
            await asyncio.sleep(0.01)
            served += 1
            writer.write(answer(b"%d" % served))
            await writer.drain()

    async with raw_server(serve) as url:
        service = HttpService(max_connections=3)
        try:
            responses = await asyncio.gather(
                *(service.request("POST", f"{url}/x", content=b"{}", timeout=Timeout(10.0)) for _ in range(40))
            )
        finally:
            await service.aclose()
    assert sorted(int(r.content) for r in responses) == list(range(1, 41))
    assert len(connections) == 3


async def test_a_cancelled_request_frees_its_connection_slot() -> None:
    arrived = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            if b"/slow" in request:
                arrived.set()
                await asyncio.sleep(30)
            writer.write(answer())
            await writer.drain()

    async with raw_server(serve) as url:
        service = HttpService(max_connections=1)
        try:
            slow = asyncio.create_task(service.request("GET", f"{url}/slow", timeout=Timeout(30.0)))
            await arrived.wait()
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            response = await service.request("GET", f"{url}/fast", timeout=Timeout(5.0, pool=2.0))
        finally:
            await service.aclose()
    assert response.status_code == 200


async def test_a_stream_delivers_each_piece_before_the_server_sends_the_next() -> None:
    client_has_first = asyncio.Event()

    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in read_requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"d\r\ndata: first\n\n\r\n")
            await writer.drain()
            await client_has_first.wait()  # the next piece only after the client has shown it the first
            writer.write(b"e\r\ndata: second\n\n\r\n0\r\n\r\n")
            await writer.drain()

    async with raw_server(sse) as url:
        service = HttpService(max_connections=1)
        try:
            lines = []
            async with service.stream("POST", f"{url}/x", content=b"{}", timeout=Timeout(5.0)) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
                    client_has_first.set()
            again = await service.request("POST", f"{url}/x", content=b"{}", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert [line for line in lines if line] == ["data: first", "data: second"]
    assert again.status_code == 200


async def test_a_stream_closed_before_its_end_does_not_leave_its_connection_in_the_pool() -> None:
    connections: list[int] = []

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        async for _ in read_requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            try:
                while True:
                    writer.write(b"6\r\ndata:\n\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.01)
            except ConnectionError:
                return

    async with raw_server(endless) as url:
        service = HttpService(max_connections=1)
        try:
            for _ in range(2):
                async with service.stream("GET", f"{url}/x", timeout=Timeout(5.0)) as response:
                    async for _ in response.aiter_bytes():
                        break
        finally:
            await service.aclose()
    assert len(connections) == 2


async def test_trust_env_sends_through_the_proxy_the_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            seen.append(request)
            writer.write(answer(b'"via proxy"'))
            await writer.drain()

    async with raw_server(proxy) as proxy_url:
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        service = HttpService(max_connections=1, trust_env=True)
        try:
            response = await service.request("GET", "http://shop.invalid:5700/healthz", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert response.json() == "via proxy"
    assert seen[0].startswith(b"GET http://shop.invalid:5700/healthz HTTP/1.1")


# --------------------------------------------------------------------------- a server with a short keep-alive

STALE_CONNECTIONS = 8
STALE_ROUNDS = 3


class CountingApp:
    """A raw ASGI app answering every request with ``{}`` and recording each body it received."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})


@linux_only
@pytest.mark.slow
async def test_a_pooled_connection_the_server_closed_while_the_loop_was_busy_is_replaced_before_a_post() -> None:
    """uvicorn with a 1 s keep-alive. Each round pools 8 connections, keeps the event loop busy
    until the server has closed all 8 (their FINs wait unread: CLOSE_WAIT, counted from
    /proc/net/tcp), then sends 8 POSTs at once: each must find its pooled connection stale, go out
    once on a new one and succeed. A POST written into such a connection fails, and a POST is
    never sent again (the server may have acted on it)."""
    app = CountingApp()
    with running_server(app, timeout_keep_alive=1) as url:
        port = int(url.rsplit(":", 1)[1])
        service = HttpService(max_connections=STALE_CONNECTIONS)
        closed_by_server = 0
        try:
            for round_ in range(STALE_ROUNDS):
                for phase in ("before", "after"):
                    answers = await asyncio.gather(
                        *(
                            service.request(
                                "POST", f"{url}/x", content=b"%d-%d-%b" % (round_, n, phase.encode()), timeout=Timeout(10.0)
                            )
                            for n in range(STALE_CONNECTIONS)
                        )
                    )
                    assert [answer.status_code for answer in answers] == [200] * STALE_CONNECTIONS
                    if phase == "before":
                        closed_by_server += busy_until_closed_by_server(port, STALE_CONNECTIONS)
        finally:
            await service.aclose()
    # The fault happened every round: every pooled connection was closed under a busy loop.
    assert closed_by_server >= STALE_ROUNDS * STALE_CONNECTIONS
    assert service.stale_connections_discarded >= STALE_ROUNDS * STALE_CONNECTIONS
    # What came of it: every POST arrived, exactly once.
    sent = [b"%d-%d-%b" % (r, n, p) for r in range(STALE_ROUNDS) for p in (b"before", b"after") for n in range(STALE_CONNECTIONS)]
    assert sorted(app.bodies) == sorted(sent)


HTTPS_CLIENT = """
import asyncio, json, ssl, sys
from shopsimrl.httpclient import HttpService, Timeout
from shopsimrl.model import OpenAICompatibleChatModel, OpenAICompatibleSettings

cert, key = sys.argv[1], sys.argv[2]
ANSWER = {"id": "c1", "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "好"}}]}
seen, connections = [], []


async def serve(reader, writer):
    connections.append(1)
    while True:
        try:
            head = await reader.readuntil(b"\\r\\n\\r\\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        length = next((int(l.split(b":")[1]) for l in head.split(b"\\r\\n") if l.lower().startswith(b"content-length")), 0)
        seen.append((head.split(b" ")[1].decode(), len(await reader.readexactly(length))))
        body = json.dumps(ANSWER).encode()
        writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: %d\\r\\n\\r\\n%b" % (len(body), body))
        await writer.drain()


async def main():
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=tls)
    url = f"https://localhost:{server.sockets[0].getsockname()[1]}"
    model = OpenAICompatibleChatModel(OpenAICompatibleSettings(model="m", base_url=f"{url}/v1", api_key_env=None))
    outputs = [await model.generate([{"role": "user", "content": "hi"}], []) for _ in range(2)]
    await model.aclose()
    service = HttpService(max_connections=1)
    try:
        await service.request("GET", url.replace("localhost", "127.0.0.1") + "/x", timeout=Timeout(5))
        refused = None
    except Exception as exc:
        refused = [type(exc).__name__, exc.request_sent, str(exc)]
    await service.aclose()
    server.close()
    print(json.dumps({"contents": [o.content for o in outputs], "attempts": [o.attempt_count for o in outputs], "seen": seen, "connections": len(connections), "refused": refused}))


asyncio.run(main())
"""


@pytest.mark.slow
def test_https_goes_through_the_same_client_and_checks_the_certificate(tmp_path: Path) -> None:
    """A TLS server with a certificate for localhost, trusted through SSL_CERT_FILE (read when
    the client starts, so in a process of its own): the model adapter's calls succeed over https
    on one kept-alive connection; the same certificate at an address it does not name is a
    ConnectError, never sent."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"openssl cannot make a certificate here: {made.stderr[-500:]}")
    done = subprocess.run(
        [sys.executable, "-c", HTTPS_CLIENT, str(cert), str(key)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SSL_CERT_FILE": str(cert)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["contents"] == ["好", "好"] and outcome["attempts"] == [1, 1]
    assert [path for path, _ in outcome["seen"]] == ["/v1/chat/completions"] * 2 and outcome["connections"] == 1
    name, request_sent, message = outcome["refused"]
    assert name == "ConnectError" and request_sent is False and "certificate" in message.lower()


# --------------------------------------------------------------------------- the real testbed


@pytest.fixture(scope="module")
def testbed() -> Iterator[LocalTestbed]:
    with start_testbed() as bed:
        yield bed


@pytest.mark.slow
async def test_the_testbed_shop_answers_many_concurrent_requests_over_a_few_connections(testbed: LocalTestbed) -> None:
    service = HttpService(max_connections=8)
    release = orjson.dumps({"action": "release_one", "env_idx": 0, "lease_id": "0" * 32})
    try:
        health = await service.request("GET", f"{testbed.shop_url}/healthz", timeout=Timeout(10.0))
        answers = await asyncio.gather(
            *(
                service.request(
                    "POST",
                    f"{testbed.shop_url}/api/shop_agent",
                    content=release,
                    headers={"Content-Type": "application/json"},
                    timeout=Timeout(10.0),
                )
                for _ in range(200)
            )
        )
        shop_port = int(testbed.shop_url.rsplit(":", 1)[1])
        assert 1 <= len(open_connections_to(shop_port)) <= 8  # the answered ones wait in the pool
    finally:
        await service.aclose()
    assert health.json()["ready"] is True
    assert {a.status_code for a in answers} == {answers[0].status_code} and answers[0].status_code >= 400
    assert len({a.content for a in answers}) == 1 and answers[0].json()


@pytest.mark.slow
async def test_the_testbed_policy_streams_a_chat_completion(testbed: LocalTestbed) -> None:
    service = HttpService(max_connections=2)
    payload = orjson.dumps({"messages": [{"role": "user", "content": "hello"}], "stream": True, "seed": 1})
    try:
        events = []
        async with service.stream(
            "POST",
            f"{testbed.model_url}/chat/completions",
            content=payload,
            headers={"Content-Type": "application/json"},
            timeout=Timeout(10.0),
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
    finally:
        await service.aclose()
    assert events[-1] == "[DONE]"
    assert all(orjson.loads(event)["object"] == "chat.completion.chunk" for event in events[:-1]) and len(events) > 1


async def test_a_large_stream_read_after_it_arrived_leaves_its_connection_reusable() -> None:
    # The answer is written at once, so the client reads it in two pieces (an event loop reads at
    # most 256 KiB at a time): the first stays under the high-water mark of unread stream bytes,
    # the second crosses it and completes the answer. Reading pauses there, and the connection,
    # back in the pool, must read again for the next answer.
    sent = asyncio.Event()
    size = 300_000

    async def bulk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            if b"/bulk" in request:
                writer.write(answer(b"x" * size))
                await writer.drain()
                sent.set()
            else:
                writer.write(answer(b'"next"'))
                await writer.drain()

    async with raw_server(bulk) as url:
        service = HttpService(max_connections=1)
        try:
            for _ in range(3):
                sent.clear()
                async with service.stream("GET", f"{url}/bulk", timeout=Timeout(5.0)) as response:
                    await asyncio.wait_for(sent.wait(), 5)
                    await asyncio.sleep(0.05)
                    received = sum([len(chunk) async for chunk in response.aiter_bytes()])
                # bounded: a connection left paused would wait forever (a paused read is not a timeout)
                following = await asyncio.wait_for(service.request("GET", f"{url}/next", timeout=Timeout(5.0)), 30)
                assert received == size and following.json() == "next"
        finally:
            await service.aclose()


# --------------------------------------------------------------------------- the response object


@pytest.mark.parametrize("trust_env", [False, True], ids=["direct", "trust_env"])
async def test_a_whole_answer_reads_its_charset_headers_and_encoding(trust_env: bool) -> None:
    """What the adapters read of an answer: the status, headers case-insensitively (Retry-After),
    the text decoded with the charset of Content-Type, the same body through aread and
    aiter_lines; a gzip answer arrives decoded."""
    import gzip

    plain = '{"商品": "中文"}'.encode("gbk")
    packed = gzip.compress(b'{"packed": true}')

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            if b"/gzip" in request:
                head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Type: application/json\r\n"
                writer.write(head + b"Content-Length: %d\r\n\r\n" % len(packed) + packed)
            elif b"/bad-charset" in request:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=no-such\r\nContent-Length: 4\r\n\r\n\xff\xfeok"
                )
            else:
                head = b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json; charset=gbk\r\nRetry-After: 7\r\n"
                writer.write(head + b"Content-Length: %d\r\n\r\n" % len(plain) + plain)
            await writer.drain()

    async with raw_server(serve) as url:
        service = HttpService(max_connections=2, trust_env=trust_env)
        try:
            limited = await service.request("POST", f"{url}/limited", content=b"{}", timeout=Timeout(5.0))
            packed_answer = await service.request("GET", f"{url}/gzip", timeout=Timeout(5.0))
            bad_charset = await service.request("GET", f"{url}/bad-charset", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert isinstance(limited, Response) and limited.status_code == 429 and not limited.is_success
    assert limited.content == plain and limited.encoding == "gbk" and limited.text == plain.decode("gbk")
    assert orjson.loads(limited.text) == {"商品": "中文"}
    assert limited.headers["retry-after"] == "7" and limited.headers.get("Content-Type") == "application/json; charset=gbk"
    assert repr(limited) == "<Response [429]>"
    assert await limited.aread() == plain and [line async for line in limited.aiter_lines()] == [plain.decode("gbk")]
    assert packed_answer.is_success and packed_answer.json() == {"packed": True}
    assert bad_charset.encoding == "utf-8" and bad_charset.text == "\ufffd\ufffdok"  # undecodable bytes replaced


async def test_lines_split_on_every_line_end_across_chunks() -> None:
    """aiter_lines: LF, CRLF (also split between two chunks) and CR end a line; a last line
    without an end is still a line; an empty line (an SSE event's end) is kept."""
    pieces = [b"data: a\r", b"\ndata: b\n\nda", b"ta: \xe4\xb8", b"\xad\rlast"]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in read_requests(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for piece in pieces:
                writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with raw_server(serve) as url:
        service = HttpService(max_connections=1)
        try:
            async with service.stream("GET", f"{url}/x", timeout=Timeout(5.0)) as response:
                lines = [line async for line in response.aiter_lines()]
        finally:
            await service.aclose()
    assert lines == ["data: a", "data: b", "", "data: 中", "last"]


async def test_an_answer_larger_than_the_bound_is_refused() -> None:

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in read_requests(reader):
            size = 2000 if b"/big" in request else 10
            if b"/chunked" in request:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for _ in range(4):
                    writer.write(b"1f4\r\n" + b"x" * 500 + b"\r\n")
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(answer(b"x" * size))
            await writer.drain()

    async with raw_server(serve) as url:
        service = HttpService(max_connections=1, max_response_bytes=1000)
        try:
            with pytest.raises(httpclient.ResponseTooLarge) as sized:
                await service.request("POST", f"{url}/big", content=b"{}", timeout=Timeout(5.0))
            with pytest.raises(httpclient.ResponseTooLarge):
                async with service.stream("GET", f"{url}/chunked", timeout=Timeout(5.0)) as response:
                    await response.aread()
            small = await service.request("GET", f"{url}/small", timeout=Timeout(5.0))
        finally:
            await service.aclose()
    assert sized.value.request_sent is True  # it was answered: a non-idempotent call is not sent again
    assert small.content == b"x" * 10  # and the pool serves on
