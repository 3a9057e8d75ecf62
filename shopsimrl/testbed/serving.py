"""Serve an ASGI app with uvicorn on a loopback port, in a background thread or in the foreground.

Tests, benchmarks and ``shopsimrl testbed`` all start the testbed servers through here, so
the port choice, start-up wait and clean shutdown live in one place.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

__all__ = ["free_port", "running_server", "serve_forever"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _config(app: Any, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    # Large backlog and no access log: the servers are load-tested with 1,000 open leases.
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("access_log", False)
    kwargs.setdefault("backlog", 4096)
    kwargs.setdefault("timeout_keep_alive", 30)
    return uvicorn.Config(app, host=host, port=port, lifespan="auto", **kwargs)


@contextmanager
def running_server(app: Any, host: str = "127.0.0.1", port: int | None = None, **kwargs: Any) -> Iterator[str]:
    """Run ``app`` in a daemon thread; yield its base URL (``http://host:port``); stop on exit."""
    server = uvicorn.Server(_config(app, host, port or free_port(host), **kwargs))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"server on {host}:{server.config.port} failed to start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"server on {host}:{server.config.port} did not start within 30 s")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def serve_forever(app: Any, host: str, port: int, **kwargs: Any) -> None:
    """Serve in the foreground until Ctrl-C / SIGTERM (uvicorn handles the signals)."""
    uvicorn.Server(_config(app, host, port, **kwargs)).run()
