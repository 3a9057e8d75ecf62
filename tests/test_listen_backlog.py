"""A ShopSimulator whose listen backlog overflows: a request on a connection the server never
accepted is reset by its kernel and never reached it, so the adapter sends it again, ``interact``
included, and every interact arrives exactly once.

Black box: the real adapter (``ShopSimulatorEnvironment``) against a real Werkzeug server (the
real ShopSimulator's server) with a listen backlog of 4, in a network namespace of its own where
the kernel resets what its accept queue cannot take (``tcp_abort_on_overflow=1``); every round of
calls starts at once for 32 episodes. ``bench/listen_backlog.py`` does it and reports what the
kernel counted; the test asserts that the fault happened (overflows, resets of connections the
client saw as open, retries of requests never accepted, interacts among them) and what came of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "listen_backlog.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces and TCP_INFO are Linux's"),
]


def skip_without_a_namespace() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from listen_backlog import namespace_available
    finally:
        sys.path.pop(0)
    why = namespace_available()
    if why is not None:
        pytest.skip(f"needs a network namespace of its own: {why}")


def run_bench(*args: str) -> dict:
    skip_without_a_namespace()
    result = subprocess.run([sys.executable, str(BENCH), *args, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.stdout.strip(), result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_requests_reset_before_the_server_accepted_them_are_sent_again() -> None:
    figures = run_bench("--clients", "32", "--backlog", "4", "--steps", "3", "--accept-delay-ms", "1", "--overflow", "abort")
    kernel = figures["kernel"]
    # The fault happened: the accept queue overflowed and the kernel reset connections that the
    # client had seen open, with a request written on them.
    assert kernel["listen_overflows"] > 0 and kernel["established_resets"] > 0, figures
    assert figures["retries_never_accepted"] > 0, figures
    assert figures["retries_by_action"].get("interact", 0) > 0, figures  # the non-idempotent call too
    # What came of it: every episode finished, every interact reached the server exactly once.
    assert figures["episodes_failed"] == 0, figures["failures"]
    assert figures["interacts_received"] == 32 * 3
    assert figures["interacts_duplicated"] == 0 and figures["interacts_missing"] == 0


# Linux's default overflow handling, made fast: the server completes a connection when its
# request arrives (TCP_DEFER_ACCEPT). Our connection's handshake is done while its accept queue
# (backlog 2) has room, but its request waits in our kernel (TCP_CORK, up to 200 ms) until a
# third connection has filled the queue; so the server drops the request and keeps the half-open
# connection until its one SYN-ACK retry is spent (about 3 s), then resets it. Our read timeout is 1 s.
UNACCEPTED = """
import asyncio, json, socket, sys
sys.path.insert(0, sys.argv[1])
from listen_backlog import _loopback_up, _sysctl
from shopsimrl.httpclient import HttpService, Timeout, TransportError, request_not_sent

_loopback_up()
_sysctl("tcp_abort_on_overflow", 0)
_sysctl("tcp_synack_retries", 1)
_sysctl("tcp_syncookies", 0)
listener = socket.socket()
listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
listener.bind(("127.0.0.1", 0))
listener.listen(2)
address = listener.getsockname()


def connect(data):
    sock = socket.create_connection(address)
    sock.sendall(data)
    return sock


def corked(addr_info):
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
    return sock


def established():  # client ends of connections to the listener that finished their handshake
    lines = open("/proc/net/tcp").read().splitlines()[1:]
    return sum(int(f[2].rsplit(":", 1)[1], 16) == address[1] and f[3] == "01" for f in map(str.split, lines))


filled = [connect(b"GET /a HTTP/1.1\\r\\n\\r\\n"), connect(b"GET /b HTTP/1.1\\r\\n\\r\\n")]


async def main():
    service = HttpService(max_connections=4, socket_factory=corked)
    request = asyncio.ensure_future(
        service.request("POST", f"http://127.0.0.1:{address[1]}/api/shop_agent", content=b'{"action": "interact"}', timeout=Timeout(5, read=1))
    )
    while established() < 3:  # /a, /b and ours
        await asyncio.sleep(0.001)
    filled.append(connect(b"GET /c HTTP/1.1\\r\\n\\r\\n"))  # the accept queue is full now
    try:
        await request
        return {"error": None}
    except TransportError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "not_sent": request_not_sent(exc)}
    finally:
        await service.aclose()


outcome = asyncio.run(main())
listener.setblocking(False)
taken = []
while True:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        break
    conn.settimeout(1)
    taken.append(conn.recv(1000).decode())
outcome["server_took"] = taken
print(json.dumps(outcome))
"""


def test_a_request_the_server_has_not_taken_outlives_the_read_timeout_until_its_reset() -> None:
    """Under Linux's defaults the reset of a connection the backlog never took comes after the
    server's SYN-ACK retries (about 63 s), later than the interact's read timeout (30 s). Giving
    up then would leave "may have been sent"; while no byte of the request is acknowledged the
    client waits for the kernel's verdict instead, and the reset makes it "not sent"."""
    skip_without_a_namespace()
    result = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", UNACCEPTED, str(ROOT / "bench")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["server_took"] == ["GET /a HTTP/1.1\r\n\r\n", "GET /b HTTP/1.1\r\n\r\n", "GET /c HTTP/1.1\r\n\r\n"]
    assert outcome["error"] == "ConnectError", outcome
    assert "never accepted" in outcome["message"] and outcome["not_sent"] is True
