"""CPU per request of the HTTP client choices for the adapters, against the real testbed shop.

    .venv/bin/python bench/http_clients.py [--requests 4000] [--concurrency 1,64,512]

Starts `shopsimrl testbed shop` as its own process and sends the same POST (a `release_one`
of an unknown lease: a small request, a small 409 answer, no server work) through each client,
with C requests in flight, on uvloop. Prints this process's CPU time per request (the client's
cost; the server is another process) and requests/s:

- httpx, default transport (httpcore): what the adapters used first;
- httpx with the httpx-aiohttp transport (only if `httpx-aiohttp` is installed);
- `HttpService` over aiohttp (shopsimrl.httpclient with trust_env, the path https:// origins
  and proxies take): aiohttp's pool behind httpx's types, what the adapters used before the
  lean client;
- aiohttp alone: the floor for any client built on it;
- `HttpService` (shopsimrl.httpclient): the lean HTTP/1.1 client behind httpx's types, what the
  adapters use for http:// origins;
- the lean client alone (shopsimrl.http11 without building an `httpx.Response`): its floor.

Nothing is asserted; the choice and the figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl import http11
from shopsimrl.httpclient import HttpService
from shopsimrl.testbed.serving import free_port

BODY = orjson.dumps({"action": "release_one", "env_idx": 0, "lease_id": "0" * 32})
HEADERS = {"Content-Type": "application/json"}
TIMEOUT = httpx.Timeout(30.0)


async def measure(send: Callable[[], Awaitable[None]], requests: int, concurrency: int) -> tuple[float, float]:
    """(µs of this process's CPU per request, requests/s)."""
    await send()  # open a connection first
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await send()

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    return 1e6 * (time.process_time() - cpu) / requests, requests / (time.perf_counter() - wall)


async def bench(url: str, requests: int, concurrency: int) -> list[tuple[str, float, float]]:
    rows = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)

    plain = httpx.AsyncClient(limits=limits, timeout=TIMEOUT)

    async def via_httpcore() -> None:
        _ = (await plain.post(url, content=BODY, headers=HEADERS)).content

    rows.append(("httpx (httpcore pool)", *await measure(via_httpcore, requests, concurrency)))
    await plain.aclose()

    try:
        from httpx_aiohttp import AiohttpTransport
    except ImportError:
        pass
    else:
        wrapped = httpx.AsyncClient(transport=AiohttpTransport(limits=limits), timeout=TIMEOUT)

        async def via_transport() -> None:
            _ = (await wrapped.post(url, content=BODY, headers=HEADERS)).content

        rows.append(("httpx + httpx-aiohttp transport", *await measure(via_transport, requests, concurrency)))
        await wrapped.aclose()

    # trust_env sends HttpService through aiohttp (no proxy is set here, so it goes direct).
    over_aiohttp = HttpService(max_connections=1024, trust_env=True)

    async def via_service_over_aiohttp() -> None:
        _ = (await over_aiohttp.request("POST", url, content=BODY, headers=HEADERS, timeout=TIMEOUT)).content

    rows.append(("HttpService over aiohttp", *await measure(via_service_over_aiohttp, requests, concurrency)))
    await over_aiohttp.aclose()

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))

    async def via_aiohttp() -> None:
        async with session.post(url, data=BODY, headers=HEADERS) as response:
            await response.read()

    rows.append(("aiohttp alone", *await measure(via_aiohttp, requests, concurrency)))
    await session.close()

    service = HttpService(max_connections=1024)

    async def via_service() -> None:
        _ = (await service.request("POST", url, content=BODY, headers=HEADERS, timeout=TIMEOUT)).content

    rows.append(("HttpService (lean client)", *await measure(via_service, requests, concurrency)))
    await service.aclose()

    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    pool = http11.Pool(host, int(port), limit=1024, keepalive_expiry=5.0, keep_alive=True)
    request = http11.request_bytes("POST", "/api/shop_agent", f"{host}:{port}", BODY, HEADERS, keep_alive=True)

    async def via_lean() -> None:
        _, _, answer = await http11.exchange(pool, "POST", request, TIMEOUT, stream=False)
        _ = http11.body(answer)

    rows.append(("lean client alone (no httpx types)", *await measure(via_lean, requests, concurrency)))
    pool.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", default="1,64,512", help="comma-separated requests in flight")
    args = parser.parse_args()
    port = free_port()
    shop = subprocess.Popen(
        [sys.executable, "-m", "shopsimrl", "testbed", "shop", "--port", str(port)],
        env={**os.environ, "SHOPSIM_ENV_SLOTS": "4"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise SystemExit("the testbed shop did not start") from None
                time.sleep(0.2)
        print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; CPU of this process per request, uvloop")
        print(f"{'client':34} {'C':>5} {'µs CPU/request':>15} {'requests/s':>11}")
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                for name, cpu_us, rate in runner.run(
                    bench(f"http://127.0.0.1:{port}/api/shop_agent", args.requests, concurrency)
                ):
                    print(f"{name:34} {concurrency:>5} {cpu_us:>15.0f} {rate:>11.0f}")
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        shop.terminate()
        shop.wait(10)


if __name__ == "__main__":
    main()
