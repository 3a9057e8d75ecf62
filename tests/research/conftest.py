"""Runs for the research tools, made once per session by the real CLI against the real testbed:
a local run and a 4-shard run of the same plan on moto S3, and the earlier implementation's v4
traces as a run directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.testbed.serving import running_server
from tests.openai_stub import OpenAIStub, Received, Reply
from tests.sharded.conftest import (
    S3_TEST_ENV,
    Backend,
    _make_bucket,
    cli,
    moto_endpoint,
    s3_server,
    seaweedfs_endpoint,
    testbed,
    worker_env,
    write_config,
)
from tests.testbed_process import LocalTestbed, start_testbed

__all__ = ["moto_endpoint", "s3_server", "seaweedfs_endpoint", "testbed"]  # fixtures shared with the sharded tests

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@dataclass
class ResearchRuns:
    local: Path
    """A local run directory (traces.jsonl) of ``episodes`` testbed episodes."""
    sharded: str
    """The same plan as a 4-shard run on moto S3 (``s3://…``)."""
    legacy: Path
    """A run directory holding only v4 traces of the earlier implementation."""
    env: dict[str, str]
    """The S3 settings a reader of the sharded run needs (add them to a subprocess's environment)."""
    episodes: int


@pytest.fixture(scope="session")
def research_runs(tmp_path_factory: pytest.TempPathFactory, testbed: LocalTestbed, moto_endpoint: str) -> Iterator[ResearchRuns]:
    base = tmp_path_factory.mktemp("research-runs")
    episodes = 24
    config = write_config(base, testbed, episodes=episodes, name="research", concurrency=4)
    local = cli("run", str(config), env=worker_env(Backend("local", str(base))))
    assert local.returncode == 0, local.stderr[-3000:]
    (local_dir,) = (base / "local-runs").iterdir()

    s3 = Backend("s3", "", {**S3_TEST_ENV, "AWS_ENDPOINT_URL": moto_endpoint})
    bucket = _make_bucket(moto_endpoint, s3.env["AWS_ACCESS_KEY_ID"], s3.env["AWS_SECRET_ACCESS_KEY"])
    uri = f"s3://{bucket}/runs/research"
    env = worker_env(s3)
    sharded = cli("run", str(config), "--shards", "4", "--run", uri, env=env)
    assert sharded.returncode == 0, sharded.stderr[-3000:]

    legacy = base / "legacy-run"
    legacy.mkdir()
    shutil.copy(FIXTURES / "legacy_v4_traces.jsonl", legacy / "traces.jsonl")
    yield ResearchRuns(local_dir, uri, legacy, s3.env, episodes)


@pytest.fixture(scope="session")
def naive_run(tmp_path_factory: pytest.TempPathFactory, research_runs: ResearchRuns) -> Path:
    """The plan of ``research_runs`` run against a testbed whose policy is the naive strategy
    (``SHOPSIM_POLICY_STRATEGY=naive``: the first result, bought without choosing options): a run
    that differs from ``research_runs.local`` in the policy only (same plan and fingerprint)."""
    base = tmp_path_factory.mktemp("naive-run")
    with start_testbed(SHOPSIM_POLICY_STRATEGY="naive") as bed:
        config = write_config(base, bed, episodes=research_runs.episodes, name="research", concurrency=4)
        result = cli("run", str(config), env=worker_env(Backend("local", str(base))))
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (base / "local-runs").iterdir()
    return run_dir


@pytest.fixture(scope="session")
def faulty_run(tmp_path_factory: pytest.TempPathFactory, research_runs: ResearchRuns) -> Path:
    """The plan of ``research_runs`` against a policy that answers some calls without a tool call
    (protocol errors) and some with HTTP 500 (retried by the model client), seeded."""
    base = tmp_path_factory.mktemp("faulty-run")
    knobs = {"SHOPSIM_POLICY_RATE_NO_TOOL_CALL": "0.1", "SHOPSIM_POLICY_RATE_500": "0.15", "SHOPSIM_POLICY_FAULT_SEED": "7"}
    with start_testbed(**knobs) as bed:
        config = write_config(base, bed, episodes=research_runs.episodes, name="research", concurrency=4)
        result = cli("run", str(config), env=worker_env(Backend("local", str(base))))
    assert result.returncode in (0, 1), result.stderr[-3000:]
    (run_dir,) = (base / "local-runs").iterdir()
    return run_dir


@pytest.fixture
def s3_env(research_runs: ResearchRuns, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The S3 settings in this process too (readers opened in the test talk to moto)."""
    for name, value in research_runs.env.items():
        monkeypatch.setenv(name, value)
    return research_runs.env


# --------------------------------------------------------------------------- a real browser

ARTIFACTS = Path(__file__).resolve().parents[2] / ".cache" / "test-artifacts"
"""Screenshots the browser tests save (ignored by git; kept after the run for a person to look at)."""


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium driven by Selenium through Debian's chromedriver. Skips when they
    are not installed, unless ``SHOPSIMRL_BROWSER_REQUIRED=1`` (``make test`` sets it when they are)."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        if os.environ.get("SHOPSIMRL_BROWSER_REQUIRED") == "1":
            pytest.fail("SHOPSIMRL_BROWSER_REQUIRED=1 but chromium/chromedriver are missing (scripts/install-browser.sh)")
        pytest.skip("chromium and chromium-driver are not installed (scripts/install-browser.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # The machine's network is closed: without the background-networking flags Chromium keeps
    # trying Google's hosts. Root needs --no-sandbox.
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def navigate(driver: Any, element: Any, timeout: float = 60.0) -> None:
    """Click a link or submit button and wait for the page it loads. A click may return before
    the old page is gone; reading right after it could find the old page's elements (stale a
    moment later) or its old text."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element(By.TAG_NAME, "html")
    element.click()

    def old_page_gone(_: Any) -> bool:
        # Asked while the new document replaces the old one, chromedriver may answer "Node with
        # given id does not belong to the document" instead of a stale-element error: gone too.
        try:
            return bool(expected_conditions.staleness_of(old)(driver))
        except WebDriverException as exc:
            if "does not belong to the document" in str(exc):
                return True
            raise

    wait = WebDriverWait(driver, timeout)
    wait.until(old_page_gone)
    wait.until(lambda current: current.execute_script("return document.readyState") == "complete")


def console_errors(driver: Any) -> list[str]:
    """The page's console errors since the last call (SEVERE entries of the browser log)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]


def screenshot(driver: Any, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def element_screenshot(driver: Any, element: Any, name: str) -> Path:
    """A PNG of one element (scrolled into view first), as the browser drew it."""
    driver.execute_script("arguments[0].scrollIntoView()", element)
    path = ARTIFACTS / f"{name}.png"
    assert element.screenshot(str(path)), f"no screenshot of {name}"
    return path


# --------------------------------------------------------------------------- a run with reasoning and repairs


@pytest.fixture(scope="session")
def reasoning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local testbed run whose policy sends its reasoning with each decision and sometimes
    answers without a tool call (protocol errors, repaired), and cuts some replies off
    (generation_length): what the redaction and export tests need to find left out."""
    from tests.testbed_process import start_testbed

    base = tmp_path_factory.mktemp("reasoning-run")
    knobs = {
        "SHOPSIM_POLICY_REASONING": "1",
        "SHOPSIM_POLICY_RATE_NO_TOOL_CALL": "0.15",
        "SHOPSIM_POLICY_RATE_LENGTH": "0.03",
        "SHOPSIM_POLICY_FAULT_SEED": "7",
    }
    with start_testbed(**knobs) as bed:
        config = write_config(base, bed, episodes=16, name="reasoning", concurrency=4)
        done = cli("run", str(config), env=worker_env(Backend("local", str(base))))
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (base / "local-runs").iterdir()
    return run_dir


# --------------------------------------------------------------------------- every kind of run

RUN_KINDS = ("local", "sharded", "legacy")
"""The kinds of run every research command is tested on (attributes of :class:`ResearchRuns`)."""


def run_location(runs: ResearchRuns, kind: str) -> tuple[str, dict[str, str]]:
    """The location of ``runs``' run of ``kind`` and the environment a CLI subprocess reading it
    needs (this process's, with the S3 settings for the sharded run on moto)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SHOPSIMRL_"))}
    if kind == "sharded":
        env.update(runs.env)
    return str(getattr(runs, kind)), env


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[OpenAIStub, str]]:
    """The OpenAI-compatible stub over real HTTP, one per test module: (stub, its /v1 URL)."""
    stub = OpenAIStub()
    with running_server(stub) as url:
        yield stub, url + "/v1"


@pytest.fixture
def stub(served: tuple[OpenAIStub, str]) -> tuple[OpenAIStub, str]:
    """``served``, its queue, responder and recorded requests cleared."""
    served[0].reset()
    return served


PERSONA_SPLITS = Path(__file__).resolve().parents[2] / "configs" / "splits" / "persona_splits.v1.json"


def hold_at(
    server: OpenAIStub, n: int, asked: threading.Event, release: threading.Event, reply: Callable[[], Reply]
) -> Callable[[Received], Awaitable[Reply]]:
    """A responder that answers each request with ``reply()`` but holds the ``n``-th one until
    ``release`` (sets ``asked`` when it arrives): a process can then be stopped at a known point,
    its earlier answers made and none held."""

    async def held(request: Received) -> Reply:
        if len(server.completions) == n:
            asked.set()
            await asyncio.to_thread(release.wait, 120)
        return reply()

    return held


@contextmanager
def stopped_while_held(
    process: subprocess.Popen[bytes], asked: threading.Event, release: threading.Event, waiting_for: str
) -> Iterator[subprocess.Popen[bytes]]:
    """Waits until ``process`` has made the held request (``asked``), then hands it to the body
    to stop; afterwards, whatever happened, the held answer is released and the process never
    outlives the test. The failed wait names ``waiting_for``, or the process's stderr if it died."""
    with reaped(process):
        try:
            assert asked.wait(120), (
                process.stderr.read().decode() if process.poll() is not None and process.stderr else waiting_for
            )
            yield process
        finally:
            release.set()


@contextmanager
def reaped(process: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """``process`` for the body; afterwards, whatever happened, killed if it still runs, so that
    it never outlives the test."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def all_free(bed: LocalTestbed) -> bool:
    """Whether every environment slot of ``bed`` is free (no session left leased)."""
    health = bed.healthz()
    return bool(health["free_slots"] == health["environment_slots"])


@contextmanager
def options_train_run(base: Path, sample_size: int, concurrency: int) -> Iterator[tuple[LocalTestbed, Path]]:
    """A testbed whose policy takes each axis's first value (SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1)
    and its train run of ``sample_size`` persona tasks into ``base``: failures that bought
    without the wanted options. Yields (the testbed, the run's traces.jsonl)."""
    with start_testbed(SHOPSIM_POLICY_OPTIONS_NEED_SKILL="1") as bed:
        tasks = f"split_file: {PERSONA_SPLITS}, split: train, sample_size: {sample_size}"
        yield bed, heuristic_train_run(base, bed, tasks, concurrency=concurrency)


def heuristic_train_run(
    base: Path, bed: LocalTestbed, tasks: str, *, concurrency: int, max_steps: int = 30, environment: str = ""
) -> Path:
    """``shopsimrl run`` of the testbed's heuristic policy on ``bed`` into ``base`` (a subprocess,
    no AWS_/SHOPSIMRL_ settings): ``tasks`` and ``environment`` are the bodies of those YAML flow
    mappings (``environment`` after its base_url). Returns the run's traces.jsonl."""
    path = base / "train.yaml"
    path.write_text(
        f"experiment: {{name: train, output_dir: {base}, seed: 20260830, concurrency: {concurrency}}}\n"
        f"tasks: {{{tasks}}}\n"
        f"environment: {{base_url: '{bed.shop_url}'{environment}}}\n"
        f"runtime: {{max_steps: {max_steps}}}\nskills: {{path: null}}\n"
        f"model: {{id: shopsim-heuristic, name: shopsim-heuristic, base_url: '{bed.model_url}', api_key_env: null}}\n",
        encoding="utf-8",
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SHOPSIMRL_"))}
    done = cli("run", str(path), "--no-progress", "-q", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return base / "train" / "traces.jsonl"
