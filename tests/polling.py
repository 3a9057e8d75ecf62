"""Waiting for a condition instead of for a fixed time: a fixed sleep is too short on a loaded
machine (the test flakes) and too long on an idle one (the suite crawls)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

# /proc/net/tcp states (include/net/tcp_states.h): the socket still holds its end of the connection.
_OPEN_STATES = {"01": "ESTABLISHED", "08": "CLOSE_WAIT"}


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0, interval: float = 0.01) -> None:
    """Yield to the event loop until ``condition()`` holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(interval)


def open_connections_to(port: int) -> list[str]:
    """The states of this host's TCP sockets connected to ``port`` that have not closed their end
    yet (Linux, /proc/net/tcp and tcp6): a client that saw the server go has none left."""
    states = []
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] in _OPEN_STATES:
                states.append(_OPEN_STATES[fields[3]])
    return states


def busy_until_closed_by_server(port: int, count: int, timeout: float = 30.0) -> int:
    """Keep the calling thread busy (so its event loop reads nothing) until ``count`` of this
    host's connections to ``port`` have the server's FIN waiting unread (CLOSE_WAIT): the server
    closed them while the client's loop was busy. Returns how many; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while (closed := open_connections_to(port).count("CLOSE_WAIT")) < count:
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {count} connections to :{port} closed by the server"
        time.sleep(0.02)  # blocks the event loop on purpose
    return closed
