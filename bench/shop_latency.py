"""Step latency of the testbed shop server with 1,000 leases held at once.

Starts `shopsimrl testbed shop` in a subprocess with SHOPSIM_ENV_SLOTS=LEASES, then opens LEASES
episodes concurrently from one asyncio client (one keep-alive connection per episode), so every lease is held
at the same time, and plays a fixed script on each: search, open a product, select options,
page back. Reports p50/p95/p99 of `interact` latency as the client sees it (loopback HTTP,
JSON, the page renderer and the FTS5 search included).

    .venv/bin/python bench/shop_latency.py [--leases 1000] [--steps 6]

Ideal: a server whose only cost is the HTTP round trip; its lower bound here is the latency of
GET /healthz under the same concurrency, printed alongside for the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shopsimrl.testbed.serving import free_port  # noqa: E402

QUERIES = ["蓝牙耳机 降噪", "洗地机", "运动鞋 男", "保温杯 不锈钢", "猫粮 成猫", "儿童 绘本"]


class Connection:
    """One keep-alive HTTP/1.1 connection (the load generator must be cheaper than the server:
    a pooled httpx client spends more CPU per request than the server under test)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: dict) -> dict:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(payload).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        return json.loads(await self.reader.readexactly(length))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def server_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


async def episode(port: int, task_id: int, steps: int, lat: list[float], barrier: asyncio.Barrier, think_ms: float) -> None:
    client = Connection("127.0.0.1", port)
    url = "/api/shop_agent"
    reset = (await client.post(url, {"action": "reset", "idx": task_id, "if_persona": True}))["result"]
    lease = {"env_idx": reset["env_idx"], "lease_id": reset["lease_id"]}
    await barrier.wait()  # every lease is held before anyone steps
    rng = random.Random(task_id)
    state = reset["observation_state"]
    for step in range(steps):
        await asyncio.sleep(think_ms * rng.uniform(0.5, 1.5) / 1000)
        if state.get("search_available"):
            action = f"search[{QUERIES[(task_id + step) % len(QUERIES)]}]"
        else:
            actions = state.get("actions") or []
            choices = [a for a in actions if a not in ("buy now",)]
            action = f"click[{choices[(task_id + step) % len(choices)]}]" if choices else "click[back to search]"
        started = time.perf_counter()
        result = (await client.post(url, {"action": "interact", "response": action, **lease}))["result"]
        lat.append((time.perf_counter() - started) * 1000)
        if result.get("done"):
            break
        state = result["observation_state"]
    await barrier.wait()
    await client.post(url, {"action": "release_one", **lease})
    await client.close()


async def main_async(leases: int, steps: int, port: int, think_ms: float) -> None:
    idle: list[float] = []
    for i in range(20):  # the ideal: the same script, one episode at a time on an idle server
        await episode(port, 19 + i, steps, idle, asyncio.Barrier(1), 0.0)
    lat: list[float] = []
    barrier = asyncio.Barrier(leases)
    started = time.perf_counter()
    await asyncio.gather(*(episode(port, 19 + i % 4000, steps, lat, barrier, think_ms) for i in range(leases)))
    wall = time.perf_counter() - started
    health = (await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/healthz")).json()
    print(
        f"{leases} leases held at once, {len(lat)} interact calls, think {think_ms:.0f} ms, {wall:.1f} s wall, {len(lat) / wall:.0f} steps/s"
    )
    print(
        f"interact latency ms: p50 {percentile(lat, 0.5):.1f}  p95 {percentile(lat, 0.95):.1f}  p99 {percentile(lat, 0.99):.1f}  mean {statistics.fmean(lat):.1f}"
    )
    print(f"idle server, one episode at a time (ideal): p50 {percentile(idle, 0.5):.1f}  p95 {percentile(idle, 0.95):.1f}")
    print(
        f"ratio loaded/ideal: p50 {percentile(lat, 0.5) / percentile(idle, 0.5):.2f}  p95 {percentile(lat, 0.95) / percentile(idle, 0.95):.2f}"
    )
    print(f"free slots after release: {health['free_slots']}/{health['environment_slots']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--think-ms", type=float, default=2000.0)
    args = parser.parse_args()
    port = free_port()
    env = {**os.environ, "SHOPSIM_ENV_SLOTS": str(args.leases)}
    server = subprocess.Popen([sys.executable, "-m", "shopsimrl", "testbed", "shop", "--port", str(port)], env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).json().get("ready"):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("shop server did not start")
            time.sleep(0.1)
        cpu_before, started = server_cpu_seconds(server.pid), time.perf_counter()
        asyncio.run(main_async(args.leases, args.steps, port, args.think_ms))
        busy = (server_cpu_seconds(server.pid) - cpu_before) / (time.perf_counter() - started)
        print(f"server process CPU: {busy * 100:.0f} % of one core (client shares the same machine)")
    finally:
        server.terminate()
        server.wait(timeout=20)


if __name__ == "__main__":
    main()
