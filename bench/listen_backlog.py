"""Many concurrent episodes against a ShopSimulator-style server whose listen backlog overflows.

The real server is Flask's threaded Werkzeug server: listen backlog 128 (Werkzeug's
``LISTEN_QUEUE``), one new connection per request (it closes each one). With more clients than
that connecting at once, Linux drops what its accept queue cannot take: a SYN is dropped (the
connect is retried, seconds later), or a connection the client already sees as open is never
accepted; once the server's SYN-ACK retries are spent (``tcp_synack_retries``), or at once with
``tcp_abort_on_overflow=1``, the client's request is answered with a reset. That request never
reached the server, so the client may send it again, ``interact`` included.

This benchmark runs such a server (Werkzeug's ``ThreadedWSGIServer``, HTTP/1.0, a minimal
ShopSimulator protocol that counts every ``interact`` it receives) with ``--backlog`` and a slow
accept loop, and ``--clients`` episodes at once through the real adapter
(``ShopSimulatorEnvironment``): reset, ``--steps`` interacts, release. It reports what the kernel
dropped or reset (``ListenOverflows``, resets sent), the adapter's retries of requests that were
never accepted, and whether every episode succeeded with every ``interact`` received exactly once.

It runs in a network namespace of its own (``unshare -rn``: an unprivileged user namespace), so
the kernel settings it needs (``tcp_abort_on_overflow``, ``tcp_synack_retries``) touch nothing
else. On loopback a TCP handshake completes before the next SYN is even looked at, so the accept
queue could only ever refuse SYNs; ``TCP_DEFER_ACCEPT`` on the listening socket makes the server
complete a connection when its request arrives, as the round trip between two hosts does, so a
connection the client sees as open can find the queue full.

    .venv/bin/python bench/listen_backlog.py --clients 64 --backlog 2            # resets at once (abort)
    .venv/bin/python bench/listen_backlog.py --overflow drop --synack-retries 1  # Linux's default path, sped up
    .venv/bin/python bench/listen_backlog.py --clients 384 --backlog 128 --overflow drop --synack-retries 5

``--json`` prints the figures as one JSON object (tests/test_listen_backlog.py reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_IN_NAMESPACE = "SHOPSIMRL_BENCH_NETNS"
OBSERVATION_VERSION = "shopping-observation-v7"


# --------------------------------------------------------------------------- the namespace


def namespace_available() -> str | None:
    """None when ``unshare -rn`` works here, else why not."""
    try:
        result = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -rn cannot run: {exc}"
    return None if result.returncode == 0 else f"unshare -rn failed: {result.stderr.strip()}"


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, 0x8913, request)[:18])[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH", b"lo", flags | 0x1))  # SIOCSIFFLAGS: IFF_UP


def _sysctl(name: str, value: int) -> None:
    Path("/proc/sys/net/ipv4", name).write_text(f"{value}\n")


def _counters() -> dict[str, int]:
    """TCP counters of this network namespace."""
    found: dict[str, int] = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        lines = Path(path).read_text().splitlines()
        for head, values in zip(lines[::2], lines[1::2], strict=False):
            prefix, names = head.split(":", 1)
            for name, value in zip(names.split(), values.split(":", 1)[1].split(), strict=False):
                if value.lstrip("-").isdigit():
                    found[f"{prefix}.{name}"] = int(value)
    return found


# --------------------------------------------------------------------------- the server


class Shop:
    """A minimal ShopSimulator protocol (reset / interact / release_one / healthz) that counts
    every interact it receives, by the action text (unique per episode and step)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.leases: dict[int, str] = {}
        self.next_slot = 0
        self.received: Counter[str] = Counter()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ["PATH_INFO"] == "/healthz":
            body: dict[str, Any] = {"ready": True, "environment_slots": 100_000, "free_slots": 100_000 - len(self.leases)}
            return self._answer(start_response, 200, body)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        payload = json.loads(environ["wsgi.input"].read(length))
        action = payload.get("action")
        with self.lock:
            if action == "reset":
                slot, self.next_slot = self.next_slot, self.next_slot + 1
                lease = self.leases[slot] = uuid.uuid4().hex
                result = {
                    "task_instruction": f"task {payload.get('idx')}",
                    "observation": "home",
                    "observation_state": {"observation_version": OBSERVATION_VERSION, "page_type": "search_home"},
                    "env_idx": slot,
                    "lease_id": lease,
                }
                return self._answer(start_response, 200, {"result": result})
            slot, lease = payload.get("env_idx"), payload.get("lease_id")
            if self.leases.get(slot) != lease:
                return self._answer(start_response, 409, {"result": {"error": f"stale or invalid lease for environment {slot}"}})
            if action == "release_one":
                del self.leases[slot]
                return self._answer(start_response, 200, {"result": {"message": "released"}})
            self.received[str(payload.get("response"))] += 1
        state = {"observation_version": OBSERVATION_VERSION, "page_type": "search_results"}
        result = {"observation": "results", "observation_state": state, "done": False, "reward": 0.0, "env_idx": slot}
        return self._answer(start_response, 200, {"result": result})

    @staticmethod
    def _answer(start_response: Any, status: int, body: dict[str, Any]) -> list[bytes]:
        data = json.dumps(body).encode()
        start_response(f"{status} X", [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]


def start_server(shop: Shop, backlog: int, accept_delay_s: float) -> tuple[Any, int]:
    from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        protocol_version = "HTTP/1.0"  # one connection per request, as the real server

        def log_request(self, *args: Any, **kwargs: Any) -> None:
            pass

    class SmallBacklog(ThreadedWSGIServer):
        request_queue_size = backlog

        def server_bind(self) -> None:
            # The server completes a connection when its request arrives (see the module docstring).
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
            super().server_bind()

        def get_request(self) -> Any:
            time.sleep(accept_delay_s)  # a busy server: its accept loop falls behind a burst
            return super().get_request()

    server = SmallBacklog("127.0.0.1", 0, shop, handler=Handler)
    threading.Thread(target=server.serve_forever, name="shop", daemon=True).start()
    return server, server.server_address[1]


# --------------------------------------------------------------------------- the clients


async def play(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import structlog

    from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings

    settings = ShopSimulatorSettings(
        base_url=url,
        timeout=args.timeout,
        reset_timeout=None,
        max_retries=args.max_retries,
        retry_backoff_seconds=args.retry_backoff,
        max_connections=args.clients + 8,
        cleanup_grace_seconds=60,
    )
    env = ShopSimulatorEnvironment(settings)
    calls: list[float] = []
    failures: Counter[str] = Counter()

    async def call(coroutine: Any) -> Any:
        started = time.monotonic()
        try:
            return await coroutine
        finally:
            calls.append(time.monotonic() - started)

    # Every call of a round starts at once (agents whose model replies came back together):
    # each round is a burst of new connections, interacts included.
    barrier = asyncio.Barrier(args.clients)

    async def episode(number: int) -> None:
        handle = env.open_episode()
        failed = False
        for step in range(-1, args.steps):
            await barrier.wait()
            if failed:
                continue
            try:
                await call(handle.reset(number) if step < 0 else handle.step(f"search[q-{number}-{step}]"))
            except Exception as exc:
                failures[f"{type(exc).__name__}: {str(exc)[:160]}"] += 1
                failed = True
        await handle.close()

    with structlog.testing.capture_logs() as logs:
        started = time.monotonic()
        await asyncio.gather(*(episode(n) for n in range(args.clients)))
        wall = time.monotonic() - started
        await env.aclose()
    retried = [line for line in logs if line.get("event") == "environment call retried"]
    return {
        "wall_s": round(wall, 2),
        "episodes_failed": sum(failures.values()),
        "failures": dict(failures),
        "retries": len(retried),
        "retries_never_accepted": sum("never accepted" in str(line.get("error")) for line in retried),
        "retries_by_action": dict(Counter(str(line.get("action")) for line in retried)),
        "call_s": {
            "p50": round(statistics.median(calls), 3) if calls else None,
            "p99": round(sorted(calls)[int(0.99 * (len(calls) - 1))], 3) if calls else None,
            "max": round(max(calls), 3) if calls else None,
        },
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    _loopback_up()
    _sysctl("tcp_abort_on_overflow", 1 if args.overflow == "abort" else 0)
    _sysctl("tcp_synack_retries", args.synack_retries)
    _sysctl("tcp_syncookies", args.syncookies)
    shop = Shop()
    server, port = start_server(shop, args.backlog, args.accept_delay_ms / 1000)
    before = _counters()
    try:
        from shopsimrl import eventloop

        client = eventloop.run(play(f"http://127.0.0.1:{port}", args))
    finally:
        server.shutdown()
    after = _counters()

    def delta(name: str) -> int:
        return after.get(name, 0) - before.get(name, 0)

    expected = {f"search[q-{n}-{s}]" for n in range(args.clients) for s in range(args.steps)}
    return {
        "clients": args.clients,
        "backlog": args.backlog,
        "overflow": args.overflow,
        "synack_retries": args.synack_retries,
        "syncookies": args.syncookies,
        "accept_delay_ms": args.accept_delay_ms,
        "steps": args.steps,
        "requests": args.clients * (args.steps + 2),
        **client,
        "interacts_received": sum(shop.received.values()),
        "interacts_duplicated": sum(count - 1 for count in shop.received.values() if count > 1),
        "interacts_missing": len(expected - set(shop.received)),
        "kernel": {
            "listen_overflows": delta("TcpExt.ListenOverflows"),
            "listen_drops": delta("TcpExt.ListenDrops"),
            "resets_sent": delta("Tcp.OutRsts"),
            "established_resets": delta("Tcp.EstabResets"),
            "connect_fails": delta("Tcp.AttemptFails"),
            "syn_retransmits": delta("TcpExt.TCPSynRetrans"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="episodes at once (default 64)")
    parser.add_argument("--backlog", type=int, default=2, help="the server's listen backlog (the real server's: 128)")
    parser.add_argument("--steps", type=int, default=5, help="interacts per episode")
    parser.add_argument("--accept-delay-ms", type=float, default=2.0, help="the server's pause before each accept")
    parser.add_argument(
        "--overflow",
        choices=["abort", "drop"],
        default="abort",
        help="tcp_abort_on_overflow 1 (abort) or 0 (drop: Linux's default)",
    )
    parser.add_argument(
        "--synack-retries", type=int, default=5, help="tcp_synack_retries (Linux's default 5: ~63 s to the reset)"
    )
    parser.add_argument(
        "--syncookies",
        type=int,
        choices=[0, 1, 2],
        default=1,
        help="tcp_syncookies (Linux's default 1; 0: a full SYN queue drops SYNs)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="environment.timeout (connect, read)")
    parser.add_argument("--max-retries", type=int, default=3, help="environment.max_retries")
    parser.add_argument("--retry-backoff", type=float, default=0.5, help="environment.retry_backoff_seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if os.environ.get(_IN_NAMESPACE) != "1":
        why = namespace_available()
        if why is not None:
            print(f"listen_backlog: needs a network namespace of its own: {why}", file=sys.stderr)
            return 2
        command = ["unshare", "-rn", sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])]
        os.execvpe("unshare", command, {**os.environ, _IN_NAMESPACE: "1"})  # the same process: a signal reaches it
    figures = measure(args)
    if args.json:
        print(json.dumps(figures))
    else:
        print(json.dumps(figures, indent=2))
    return 0 if figures["episodes_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
