"""The rule that keeps the fast tier fast: a test not marked ``slow`` starts no process.

``make test-fast`` runs ``pytest -m "not slow"``; ``make test`` and ``.ci/run`` run every test.
What makes a test slow here is, above all, a process: a Python interpreter importing the project
(about a second), the testbed servers, an S3 server, a browser, a pip install. Wall-clock time
is not asserted (it depends on the machine's load); process starts are, exactly: a PEP 578 audit
hook sees every process this interpreter starts (``subprocess``, asyncio's subprocesses,
``os.fork``, ``os.posix_spawn``, ``os.system``), and a test during whose setup or call one
started fails unless it is marked ``slow``. A fixture that started a process counts for
every test that uses it, whichever test set it up first, so the verdict does not depend on the
order the tests run in. Loaded by tests/conftest.py; tests/test_tiers.py shows that it fails
what it must.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import pytest

# The audit events of a new process (https://docs.python.org/3/library/audit_events.html).
SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.system"})


@dataclass
class _Running:
    """The item whose setup, call or teardown runs now, and what it started."""

    item: pytest.Item
    spawns: list[str] = field(default_factory=list)


class TierRule:
    """One per pytest session (pytester runs sessions inside a test: each has its own)."""

    def __init__(self) -> None:
        self.running: _Running | None = None
        self.fixtures: list[tuple[str, str]] = []  # (baseid, name) of the fixtures being set up now
        self.spawning_fixtures: dict[tuple[str, str], str] = {}  # fixture -> the first process it started

    def spawned(self, what: str) -> None:
        if self.running is not None:
            self.running.spawns.append(what)
        if self.fixtures:
            self.spawning_fixtures.setdefault(self.fixtures[-1], what)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        self.running = _Running(item)
        _ACTIVE.append(self)
        try:
            return (yield)
        finally:
            _ACTIVE.remove(self)
            self.running = None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]) -> Generator[None, object, object]:
        self.fixtures.append((fixturedef.baseid, fixturedef.argname))
        try:
            return (yield)
        finally:
            self.fixtures.pop()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        running = self.running
        if running is None or running.item is not item or item.get_closest_marker("slow") is not None:
            return report
        # Judged once, after the call, over setup and call. A setup or call that failed or
        # skipped is reported as such, not as this. Teardowns are not judged: the last test of a
        # module or session also runs the finalizers of fixtures other tests set up.
        if report.when == "setup" and report.passed:
            return report
        if report.when == "teardown" or not report.passed:
            running.spawns.clear()
            return report
        found = [f"started {what}" for what in running.spawns]
        running.spawns.clear()
        used = set(getattr(item, "fixturenames", ())) | set(getattr(item, "funcargs", {}))
        for (baseid, name), what in self.spawning_fixtures.items():
            if name in used and _applies(baseid, item.nodeid):
                found.append(f"uses the fixture {name!r}, which started {what}")
        if found:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} is not marked slow but it (or a fixture it uses) starts processes; "
                "a test in the fast tier starts none (tests/tiers.py). Mark it @pytest.mark.slow "
                "(or its module: pytestmark = pytest.mark.slow), or keep the work in this process:\n  "
                + "\n  ".join(dict.fromkeys(found))
            )
        return report


def _applies(baseid: str, nodeid: str) -> bool:
    """Whether a fixture defined at ``baseid`` (a conftest's folder or a module) is visible to ``nodeid``."""
    return not baseid or nodeid == baseid or nodeid.startswith((baseid + "/", baseid + "::"))


def _describe(event: str, args: tuple[Any, ...]) -> str:
    if event == "subprocess.Popen" and len(args) > 1:
        command = args[1]
        words = [str(word) for word in command] if isinstance(command, list | tuple) else [str(command)]
        text = " ".join(words)
        return f"a process: {text[:160]}{'…' if len(text) > 160 else ''}"
    return f"a process ({event})"


_ACTIVE: list[TierRule] = []  # sessions with an item running now, the innermost last


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # Called for every audited event of the interpreter (each open, import, socket …): cheap first.
    if event in SPAWN_EVENTS and _ACTIVE:
        _ACTIVE[-1].spawned(_describe(event, args))


_HOOKED = False


def pytest_configure(config: pytest.Config) -> None:
    global _HOOKED
    if not _HOOKED:  # an audit hook cannot be removed: one for the interpreter, whatever the sessions
        sys.addaudithook(_audit)
        _HOOKED = True
    config.pluginmanager.register(TierRule(), f"tier-rule-{id(config)}")
