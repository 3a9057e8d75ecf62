"""Run a coroutine on uvloop where it is installed (Linux, macOS), else on asyncio's own loop.

uvloop's loop and transports are written in C: the same episodes cost the runner less CPU per
step (docs/benchmarks.md). Nothing depends on which loop runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` with uvloop's event loop when available."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(coroutine)
