"""Run the async part of a command: on uvloop where it is installed, with the collector tuned.

- uvloop's loop and transports are written in C: the same episodes cost the runner less CPU per
  step than on asyncio's own loop.
- The cyclic garbage collector's full passes visit every live object, and a run with 1,024
  episodes in flight keeps a lot alive (their conversations and traces): with the default
  thresholds the runner's CPU per step grew with the concurrency. Objects created before the
  run (modules, the plan, the split) are frozen out of the collector, and it runs less often;
  reference counting still frees everything that is not a cycle at once. Measured in
  docs/benchmarks.md ("Throughput").

Nothing depends on which loop runs.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shopsimrl.stopping import hold_signals

__all__ = ["run"]

T = TypeVar("T")

GC_THRESHOLDS = (50_000, 20, 100)
"""Allocations before a young collection (default 700), then collections before an older one."""


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` with uvloop's event loop when available and the collector tuned.

    SIGTERM/SIGINT are held while the loop runs (``stopping.hold_signals``): a handler that
    raises must never run inside the loop, where the exception would be lost."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        with hold_signals(), asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(coroutine)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
