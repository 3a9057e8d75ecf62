"""``shopsimrl view`` at its edges, against the real running viewer over real sockets: query
numbers no int() takes, request heads and bodies of any size or speed, and the Host check on
every bind (DNS rebinding)."""

from __future__ import annotations

import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from shopsimrl.research.viewer import HEAD_TIMEOUT_S, MAX_BODY_BYTES, MAX_HEAD_BYTES
from tests.sharded.conftest import REPO

from .conftest import FIXTURES
from .test_viewer import Viewer, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("viewer-edges") / "run"
    run.mkdir()
    shutil.copy(FIXTURES / "legacy_v4_traces.jsonl", run / "traces.jsonl")
    return run


@pytest.fixture(scope="module")
def viewer(run: Path) -> Iterator[Viewer]:
    with serving(str(run)) as served:
        yield served


def _address(viewer: Viewer) -> tuple[str, int]:
    parts = urlsplit(viewer.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _connect(viewer: Viewer) -> socket.socket:
    return socket.create_connection(_address(viewer), timeout=60)


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


# --------------------------------------------------------------------------- query numbers


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"page": "²"}, "page: &#x27;²&#x27; is not a page number"),
        ({"page": "٣"}, "page: &#x27;٣&#x27; is not a page number"),
        ({"per_page": "²"}, "per_page: &#x27;²&#x27; is not a number of rows"),
        ({"task_id": "¹²"}, "task_id: &#x27;¹²&#x27; is not a task number"),
        ({"page": "9" * 5000}, "(5000 characters) is too large (5000 digits; at most 18)"),
        ({"task_id": "1" * 4301}, "is too large (4301 digits; at most 18)"),
        ({"per_page": "5" * 20}, "is too large (20 digits; at most 18)"),
        ({"reward_min": "9" * 5000}, "(5000 characters) is not a finite number"),
    ],
)
def test_numbers_int_cannot_take_are_answered_400(viewer: Viewer, params: dict[str, str], message: str) -> None:
    for path in ("/", "/episodes/task-000003__sample-000"):
        answer = viewer.get(path, params=params)
        assert answer.status_code == 400 and message in answer.text, (path, params, answer.status_code, answer.text[-500:])
    assert viewer.get("/", params={"page": "000000000000000000000002"}).status_code == 200  # leading zeros are a number
    assert viewer.get("/", params={"page": "999999999999999999"}).status_code == 200  # past the last page: the last


# --------------------------------------------------------------------------- heads


def test_a_head_larger_than_the_bound_is_431_and_not_read_on(viewer: Viewer) -> None:
    """A 50 MB header: the viewer answers 431 once the bound is passed and closes the
    connection; the client cannot send the rest, and a request beside it is served."""
    flood = _connect(viewer)
    sent = 0
    header = b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: "
    flood.sendall(header)
    chunk = b"a" * 65536
    stopped: OSError | None = None
    try:
        while sent < 50_000_000:
            sent += flood.send(chunk)
    except OSError as exc:  # reset or broken pipe: the server closed it
        stopped = exc
    assert stopped is not None and sent < 50_000_000, sent
    assert sent >= MAX_HEAD_BYTES - len(header)  # the bound was reached, not something else
    answer = _answer(flood)
    assert answer == b"" or _status(answer) == 431  # a reset may discard the answer in flight
    small = _connect(viewer)
    small.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n")
    answer = _answer(small)
    assert _status(answer) == 431 and b"larger than 65536 bytes" in answer
    assert viewer.get("/").status_code == 200


def test_a_head_that_does_not_end_is_408_while_others_are_served(viewer: Viewer) -> None:
    slow = _connect(viewer)
    slow.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: a")  # and nothing more
    served = [viewer.get("/").status_code for _ in range(3)]  # while the head is pending
    assert served == [200, 200, 200]
    answer = _answer(slow)  # blocks until the viewer gives up on the head
    assert _status(answer) == 408 and f"within {HEAD_TIMEOUT_S:.0f} s".encode() in answer


def test_a_connection_left_idle_is_closed_without_an_answer(viewer: Viewer) -> None:
    idle = _connect(viewer)
    assert _answer(idle) == b""  # closed by the viewer; the recv would block forever otherwise


# --------------------------------------------------------------------------- bodies


def test_bodies_are_bounded_in_size_and_time(viewer: Viewer) -> None:
    big = b"x" * (MAX_BODY_BYTES + 1)
    declared = _connect(viewer)
    declared.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(big))
    answer = _answer(declared)  # answered before the body is sent at all
    assert _status(answer) == 413 and b"at most 65536" in answer

    chunked = _connect(viewer)
    chunked.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n")
    for start in range(0, len(big), 8192):
        piece = big[start : start + 8192]
        try:
            chunked.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except OSError:
            break  # refused mid-body
    answer = _answer(chunked)
    assert _status(answer) == 413

    huge = _connect(viewer)
    huge.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 99999999999999999999\r\n\r\n")
    assert _status(_answer(huge)) == 413

    stalled = _connect(viewer)
    stalled.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\nabc")  # 97 bytes never come
    answer = _answer(stalled)
    assert _status(answer) == 408 and b"request body paused" in answer

    small = httpx.request("GET", viewer.url, content=b"a small body", headers={"Host": "localhost"}, timeout=60)
    assert small.status_code == 200  # a body within the bounds is read and ignored
    assert httpx.post(viewer.url, content=b"x" * 100, timeout=60).status_code == 405


# --------------------------------------------------------------------------- the Host check


def test_every_bind_checks_the_host_header(run: Path) -> None:
    """Bound to 0.0.0.0 (every interface), the viewer answers the local names, its bind address
    and the names given with --allow-host, and refuses any other: a page of another site that
    rebinds its DNS name to this machine names its own host."""
    with serving(str(run), None, "--host", "0.0.0.0", "--allow-host", "viewer.lab.example") as viewer:
        port = _address(viewer)[1]
        url = f"http://127.0.0.1:{port}/"
        answers = {
            host: httpx.get(url, headers={"Host": host}, timeout=60).status_code
            for host in (
                "attacker.example",
                f"attacker.example:{port}",
                "127.0.0.1.attacker.example",
                "localhost",
                f"localhost:{port}",
                f"127.0.0.1:{port}",
                "0.0.0.0",
                "viewer.lab.example",
                f"VIEWER.lab.example.:{port}",
                "[::1]",
                "",
                "[not-ipv6]",
            )
        }
        refused = httpx.get(url, headers={"Host": "attacker.example"}, timeout=60)
    assert answers == {
        "attacker.example": 400,
        f"attacker.example:{port}": 400,
        "127.0.0.1.attacker.example": 400,
        "localhost": 200,
        f"localhost:{port}": 200,
        f"127.0.0.1:{port}": 200,
        "0.0.0.0": 200,
        "viewer.lab.example": 200,
        f"VIEWER.lab.example.:{port}": 200,
        "[::1]": 200,
        "": 400,
        "[not-ipv6]": 400,
    }
    assert "--allow-host NAME" in refused.text and "attacker.example" in refused.text
    assert any("answering requests for the host names" in line and "viewer.lab.example" in line for line in viewer.lines)


def test_a_bad_allow_host_is_bad_input(run: Path) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "view", str(run), "--allow-host", "http://x.example:80/"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: --allow-host 'http://x.example:80/': not a host name")


def test_trickled_heads_do_not_stall_the_viewer_and_get_no_more_time(viewer: Viewer) -> None:
    """Ten connections trickle a head a byte at a time while a reader opens pages: every page is
    served while all ten heads are pending, and the trickling does not extend a head's deadline
    (each is answered 408, the time from its first byte)."""
    stop = threading.Event()
    pending = []
    for _ in range(10):
        sock = _connect(viewer)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
        pending.append(sock)
    trickled = [0] * len(pending)

    def trickle() -> None:
        while not stop.is_set():
            for number, sock in enumerate(pending):
                try:
                    sock.send(b"a")
                    trickled[number] += 1
                except OSError:
                    pass
            time.sleep(0.05)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        statuses = [viewer.get("/episodes/task-000003__sample-000").status_code for _ in range(5)]
        answers = [_answer(sock) for sock in pending]  # until the viewer gives up on each head
    finally:
        stop.set()
        thread.join()
    assert statuses == [200] * 5
    assert all(count > 0 for count in trickled)  # every head was being trickled while pages were served
    assert [_status(answer) for answer in answers] == [408] * len(pending)
