"""Signals around the event loop: none is lost, none turns into a traceback (run in child
processes, since a stop changes the process's signal dispositions for good)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def run_script(body: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_signal_before_the_graceful_stop_is_installed_is_not_lost(loop: str) -> None:
    """The signal lands inside the loop, before GracefulStop: it is held, then acted on."""
    result = run_script(f"""
        import asyncio, os, signal
        from shopsimrl import eventloop
        from shopsimrl.stopping import GracefulStop
        if "{loop}" == "asyncio":
            eventloop._loop_factory = lambda: None
        def raising(signum, frame):  # what a command installs outside its loop
            raise SystemExit(99)
        signal.signal(signal.SIGTERM, raising)
        stopped = []
        async def main():
            os.kill(os.getpid(), signal.SIGTERM)  # before any stop handling of the loop's own
            await asyncio.sleep(0.1)
            with GracefulStop(lambda: stopped.append(True), cleanup="nothing") as stop:
                await asyncio.sleep(0)
                return stop.requested
        print("requested", eventloop.run(main()), stopped)
    """)
    assert result.returncode == 0, result.stderr
    assert "requested True [True]" in result.stdout and "Traceback" not in result.stderr


def test_a_signal_no_graceful_stop_took_ends_the_command_as_before() -> None:
    result = run_script("""
        import asyncio, os, signal
        from shopsimrl import eventloop
        def raising(signum, frame):
            raise SystemExit(42)
        signal.signal(signal.SIGTERM, raising)
        async def probe():  # a short command with no stop handling (a readiness probe)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.1)
            return "done"
        eventloop.run(probe())
        print("not reached")
    """)
    assert result.returncode == 42 and "not reached" not in result.stdout and "Traceback" not in result.stderr


def test_after_a_graceful_stop_late_signals_are_ignored() -> None:
    result = run_script("""
        import asyncio, os, signal, time
        from shopsimrl import eventloop
        from shopsimrl.stopping import GracefulStop
        async def main():
            with GracefulStop(lambda: None, cleanup="nothing"):
                os.kill(os.getpid(), signal.SIGINT)
                await asyncio.sleep(0.1)
        eventloop.run(main())
        os.kill(os.getpid(), signal.SIGINT)  # the process is on its way out: no KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        print("exited cleanly")
    """)
    assert result.returncode == 0 and "exited cleanly" in result.stdout, result.stderr
