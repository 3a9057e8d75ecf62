"""The tier rule (tests/tiers.py) fails what it must: a test outside the slow tier that starts a
process, itself or through a fixture, whichever test set that fixture up first. Each case is a
small pytest session run in this process (pytester) with the rule loaded."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestAssertRewriteWarning")

RULE = "is not marked slow but it (or a fixture it uses) starts processes"


def run_inner(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makeconftest('pytest_plugins = ["tests.tiers"]\n')
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    slow: outside the fast tier\n")
    pytester.makepyfile(test_inner=source)
    # Without hypothesis's plugin: it costs each inner session most of a second.
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-q")


def test_a_fast_test_that_starts_a_process_fails_naming_it(pytester: pytest.Pytester) -> None:
    result = run_inner(
        pytester,
        """
import subprocess, pytest

def test_starts_one():
    subprocess.run(["true", "--marker-of-this-test"], check=True)

@pytest.mark.slow
def test_marked_slow_may():
    subprocess.run(["true"], check=True)

def test_starts_none():
    assert sum(range(10)) == 45
""",
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([f"*test_inner.py::test_starts_one {RULE}*", "*started a process: true --marker-of-this-test*"])


def test_a_module_marked_slow_may_start_processes(pytester: pytest.Pytester) -> None:
    result = run_inner(
        pytester,
        """
import os, subprocess, pytest

pytestmark = pytest.mark.slow

def test_popen():
    subprocess.run(["true"], check=True)

def test_system():
    assert os.system("true") == 0
""",
    )
    result.assert_outcomes(passed=2)


def test_a_fixture_that_started_a_process_fails_every_fast_test_using_it_whatever_the_order(pytester: pytest.Pytester) -> None:
    # The slow test sets the session fixture up first; the fast tests that reuse it start nothing
    # themselves, yet only the one that does not use it passes.
    result = run_inner(
        pytester,
        """
import subprocess, pytest

@pytest.fixture(scope="session")
def server():
    process = subprocess.Popen(["sleep", "30"])
    yield process
    process.kill()
    process.wait()

@pytest.mark.slow
def test_slow_first(server):
    assert server.poll() is None

def test_fast_reuses_it(server):
    assert server.poll() is None

def test_fast_without_it():
    pass
""",
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [f"*test_fast_reuses_it {RULE}*", "*uses the fixture 'server', which started a process: sleep 30*"]
    )


def test_an_asyncio_subprocess_counts_and_a_test_that_failed_keeps_its_own_failure(pytester: pytest.Pytester) -> None:
    result = run_inner(
        pytester,
        """
import asyncio, subprocess

def test_asyncio_subprocess():
    async def main():
        process = await asyncio.create_subprocess_exec("true")
        return await process.wait()
    assert asyncio.run(main()) == 0

def test_fails_on_its_own():
    subprocess.run(["true"], check=True)
    assert 1 == 2, "its own failure"
""",
    )
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([f"*test_asyncio_subprocess {RULE}*", "*its own failure*"])
