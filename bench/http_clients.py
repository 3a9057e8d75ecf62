"""CPU per request of the HTTP client choices for the adapters, against the real testbed shop.

    .venv/bin/python bench/http_clients.py [--requests 4000] [--concurrency 1,64,512]

Starts `shopsimrl testbed shop` as its own process and sends the same POST (a `release_one`
of an unknown lease: a small request, a small 409 answer, no server work) through each client,
with C requests in flight, on uvloop. Prints this process's CPU time per request (the client's
cost; the server is another process) and requests/s:

- httpx, default transport (httpcore): what the adapters used first;
- httpx with the httpx-aiohttp transport (only if `httpx-aiohttp` is installed): httpx's API
  over aiohttp's pool, the other way to keep one maintained client;
- aiohttp alone, set up as `HttpService` sets it up (no cookie jar, no automatic
  Content-Type, Accept-Encoding or User-Agent): the floor for any client built on it;
- `HttpService` (shopsimrl.httpclient): aiohttp with the project's error contract, stale-socket
  check, timeouts, size bound, what the adapters use;
- `HttpService` with trust_env (proxies from the environment, looked up once per URL; none is
  set here, so it goes direct).

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
import yarl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.httpclient import HttpService, Timeout
from shopsimrl.testbed.serving import free_port

BODY = orjson.dumps({"action": "release_one", "env_idx": 0, "lease_id": "0" * 32})
HEADERS = {"Content-Type": "application/json"}
TIMEOUT = Timeout(30.0)


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

    plain = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0))

    async def via_httpcore() -> None:
        _ = (await plain.post(url, content=BODY, headers=HEADERS)).content

    rows.append(("httpx (httpcore pool)", *await measure(via_httpcore, requests, concurrency)))
    await plain.aclose()

    try:
        from httpx_aiohttp import AiohttpTransport  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        wrapped = httpx.AsyncClient(transport=AiohttpTransport(limits=limits), timeout=httpx.Timeout(30.0))

        async def via_transport() -> None:
            _ = (await wrapped.post(url, content=BODY, headers=HEADERS)).content

        rows.append(("httpx + httpx-aiohttp transport", *await measure(via_transport, requests, concurrency)))
        await wrapped.aclose()

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1024),
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent"),
    )
    parsed = yarl.URL(url)

    async def via_aiohttp() -> None:
        async with session.post(parsed, data=BODY, headers=HEADERS) as response:
            await response.read()

    rows.append(("aiohttp alone", *await measure(via_aiohttp, requests, concurrency)))
    await session.close()

    for name, trust_env in (("HttpService", False), ("HttpService, trust_env", True)):
        service = HttpService(max_connections=1024, trust_env=trust_env)

        async def via_service(service: HttpService = service) -> None:
            _ = (await service.request("POST", url, content=BODY, headers=HEADERS, timeout=TIMEOUT)).content

        rows.append((name, *await measure(via_service, requests, concurrency)))
        await service.aclose()
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
