"""Signals around the event loop: none is lost, none turns into a traceback (run in child
processes, since a stop changes the process's signal dispositions for good)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

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


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_no_moment_around_a_graceful_stop_lets_a_signal_kill_the_process(loop: str) -> None:
    """SIGTERM every 0.2 ms while a child enters and leaves GracefulStop thousands of times (a
    Ctrl-C and the orchestrator's SIGTERM right behind it): a default disposition in between,
    however brief, ends the child with -15. (Handlers installed with loop.add_signal_handler
    died after tens of signals here.)"""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import asyncio, signal
            from shopsimrl import eventloop
            from shopsimrl.stopping import GracefulStop
            if "{loop}" == "asyncio":
                eventloop._loop_factory = lambda: None
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the loop below runs
            async def main():
                print("ready", flush=True)
                for _ in range(3000):
                    with GracefulStop(lambda: None, cleanup="nothing"):
                        await asyncio.sleep(0)
            eventloop.run(main())
            print("survived", flush=True)
        """),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    sent = 0
    while child.poll() is None:
        try:
            child.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.0002)
    assert child.wait(timeout=60) == 0, f"killed after {sent} signals"
    assert child.stdout.read().endswith("survived\n") and sent > 100, sent


def test_a_signal_as_the_work_ends_without_a_stop_is_passed_on() -> None:
    """The signal reaches GracefulStop's handler, but the block ends before the loop handled it:
    it is not dropped, the command's own handler gets it after the loop."""
    result = run_script("""
        import asyncio, os, signal
        from shopsimrl import eventloop
        from shopsimrl.stopping import GracefulStop
        def raising(signum, frame):
            raise SystemExit(42)
        signal.signal(signal.SIGTERM, raising)
        stopped = []
        async def main():
            with GracefulStop(lambda: stopped.append(True), cleanup="nothing"):
                os.kill(os.getpid(), signal.SIGTERM)  # handled by the next callback, after the block
        eventloop.run(main())
        print("not reached", stopped)
    """)
    assert result.returncode == 42 and "not reached" not in result.stdout, result.stdout + result.stderr
