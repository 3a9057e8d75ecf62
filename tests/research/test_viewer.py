"""``shopsimrl view``: the trace viewer, served by the real CLI, read over HTTP and in a real browser."""

from __future__ import annotations

import html
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from shopsimrl.research.episodes import episode_row
from shopsimrl.schemas import EpisodeJob
from shopsimrl.storage.reading import open_run
from tests.fakes import written
from tests.sharded.conftest import REPO

from .conftest import RUN_KINDS, ResearchRuns, console_errors, navigate, run_location, screenshot
from .synthetic import HOSTILE, HOSTILE_ID, hostile_record, perturbed, trace_line

pytestmark = pytest.mark.slow

READY = re.compile(r"viewer at (http://\S+/)")


@dataclass
class Viewer:
    url: str
    process: subprocess.Popen[str]
    lines: list[str]
    """What the viewer printed (stderr) until it served."""

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url.rstrip("/") + path, timeout=60, **kwargs)

    def stop(self, signum: int = signal.SIGINT) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


@contextmanager
def serving(location: str, env: dict[str, str] | None = None, *args: str, ready_within: float = 900) -> Iterator[Viewer]:
    """``shopsimrl view LOCATION --port 0``, until it says where it serves; stopped with SIGINT."""
    process = subprocess.Popen(
        [sys.executable, "-m", "shopsimrl", "view", location, "--port", "0", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert process.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()
    stderr = process.stderr

    def pump() -> None:
        for line in stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    viewer = None
    try:
        while viewer is None:
            line = lines.get(timeout=ready_within)
            if line is None:
                raise AssertionError(f"the viewer exited {process.wait()} before serving: {seen}")
            seen.append(line)
            match = READY.search(line)
            if match:
                viewer = Viewer(match.group(1), process, seen)
        yield viewer
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def _ids(page: str) -> list[str]:
    """The episode ids of a table page, in order."""
    return [html.unescape(found) for found in re.findall(r'<td><a href="/episodes/([^"?]+)', page)]


def _count(page: str) -> tuple[int, int]:
    found = re.search(r"(\d+) of (\d+) episodes", page)
    assert found, page[:2000]
    return int(found.group(1)), int(found.group(2))


# --------------------------------------------------------------------------- runs and servers


@pytest.fixture(scope="module")
def mixed_run(research_runs: ResearchRuns, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 episodes made from the testbed's: some failed (environment_error), some ended by the
    action limit, rewards spread; and one whose texts are hostile."""
    templates = [written(record) for record in open_run(research_runs.local).records()]
    run = tmp_path_factory.mktemp("mixed") / "run"
    run.mkdir()
    jobs = [
        EpisodeJob(task_id=1000 + position // 3, sample_id=position % 3, seed=position, split="val") for position in range(59)
    ]
    lines = [trace_line(perturbed(templates[position % len(templates)], job, position)) for position, job in enumerate(jobs)]
    lines.append(trace_line(hostile_record(templates[0])))
    (run / "traces.jsonl").write_bytes(b"".join(lines))
    return run


@pytest.fixture(scope="module")
def viewers(research_runs: ResearchRuns, mixed_run: Path) -> Iterator[dict[str, Viewer]]:
    """One viewer per kind of run, and one of the mixed run."""
    with (
        serving(*run_location(research_runs, "local")) as local,
        serving(*run_location(research_runs, "sharded")) as sharded,
        serving(*run_location(research_runs, "legacy")) as legacy,
        serving(str(mixed_run), run_location(research_runs, "local")[1]) as mixed,
    ):
        yield {"local": local, "sharded": sharded, "legacy": legacy, "mixed": mixed}


def _rows(location: str) -> list[dict[str, Any]]:
    return [episode_row(record) for record in open_run(location).records()]


def _in_order(rows: list[dict[str, Any]], key: str = "episode_id", desc: bool = False) -> list[str]:
    """The table's order, computed here: by ``key`` (missing last either way), then episode id."""
    present = [row for row in rows if row[key] is not None]
    missing = [row for row in rows if row[key] is None]
    ordered = sorted(present, key=lambda row: row["episode_id"])
    ordered.sort(key=lambda row: row[key], reverse=desc)  # stable: ties stay in episode id order
    return [row["episode_id"] for row in ordered + sorted(missing, key=lambda row: row["episode_id"])]


FILTERS: list[tuple[dict[str, str], Callable[[dict[str, Any]], bool]]] = [
    ({}, lambda row: True),
    ({"status": "completed"}, lambda row: row["status"] == "completed"),
    ({"status": "failed"}, lambda row: row["status"] == "failed"),
    ({"success": "1"}, lambda row: row["success"] == 1.0),
    ({"success": "0"}, lambda row: row["success"] == 0.0),
    ({"success": "none"}, lambda row: row["success"] is None),
    ({"reward_min": "0.3", "reward_max": "0.7"}, lambda row: row["reward"] is not None and 0.3 <= row["reward"] <= 0.7),
    ({"termination_reason": "action_limit"}, lambda row: row["termination_reason"] == "action_limit"),
    ({"failure_class": "environment_error"}, lambda row: row["failure_class"] == "environment_error"),
    ({"category": "›"}, lambda row: row["category"] is not None and "›" in row["category"]),
    (
        {"status": "completed", "reward_min": "0.5", "category": "数码"},
        lambda row: row["status"] == "completed" and (row["reward"] or 0) >= 0.5 and "数码" in (row["category"] or ""),
    ),
]


@pytest.mark.parametrize("kind", [*RUN_KINDS, "mixed"])
def test_the_table_filters_and_sorts_like_the_rows_say(
    research_runs: ResearchRuns, s3_env: dict[str, str], mixed_run: Path, viewers: dict[str, Viewer], kind: str
) -> None:
    rows = _rows(str(mixed_run) if kind == "mixed" else run_location(research_runs, kind)[0])
    viewer = viewers[kind]
    task = rows[len(rows) // 2]["task_id"]
    for params, keep in [*FILTERS, ({"task_id": str(task)}, lambda row: row["task_id"] == task)]:
        page = viewer.get("/", params={**params, "per_page": "500"})
        assert page.status_code == 200
        kept = [row for row in rows if keep(row)]
        assert _ids(page.text) == _in_order(kept), params
        assert _count(page.text) == (len(kept), len(rows))
    for key in ("reward", "steps", "category", "total_tokens"):
        for desc in (False, True):
            page = viewer.get("/", params={"sort": key, "desc": "1" if desc else "", "per_page": "500"})
            assert _ids(page.text) == _in_order(rows, key, desc), (key, desc)


def test_the_table_pages(viewers: dict[str, Viewer], mixed_run: Path) -> None:
    order = _in_order(_rows(str(mixed_run)), "reward", desc=True)
    seen = []
    for page in (1, 2, 3):
        text = viewers["mixed"].get("/", params={"sort": "reward", "desc": "1", "per_page": "25", "page": str(page)}).text
        assert f"page {page} of 3" in text
        seen += _ids(text)
    assert seen == order
    beyond = viewers["mixed"].get("/", params={"per_page": "25", "page": "9"}).text
    assert "page 3 of 3" in beyond and len(_ids(beyond)) == 10


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_every_episode_page_replays_its_steps(
    research_runs: ResearchRuns, s3_env: dict[str, str], viewers: dict[str, Viewer], kind: str
) -> None:
    records = [written(record) for record in open_run(run_location(research_runs, kind)[0]).records()]
    order = sorted(record["episode_id"] for record in records)
    for record in records:
        page = viewers[kind].get(f"/episodes/{record['episode_id']}")
        assert page.status_code == 200, page.text[:500]
        text = page.text
        assert f'<h1 id="episode-id">{record["episode_id"]}</h1>' in text
        instruction = (record.get("reset") or {}).get("task_instruction")
        assert html.escape(instruction) in text if instruction else "(none recorded)" in text
        assert text.count('<li class="step"') == len(record["steps"])
        for step in record["steps"]:
            assert html.escape(step["observation"]) in text
            if step.get("action"):
                assert f"<code>{html.escape(step['action'])}</code>" in text
            if step["model"].get("reasoning"):
                assert f"thinking ({len(step['model']['reasoning'])} characters)" in text
        if record["status"] == "completed":
            assert 'id="reward-detail"' in text and "<td>r_strict</td>" in text
        position = order.index(record["episode_id"])
        assert ('id="prev"' in text) == (position > 0) and ('id="next"' in text) == (position < len(order) - 1)
        assert f"{position + 1} of {len(order)} in the table" in text


def test_requests_the_viewer_refuses(viewers: dict[str, Viewer]) -> None:
    viewer = viewers["local"]
    missing = viewer.get("/episodes/task-424242__sample-000")
    assert missing.status_code == 404 and "has no episode &#x27;task-424242__sample-000&#x27;" in missing.text
    for params, message in (
        ({"reward_min": "abc"}, "reward_min: &#x27;abc&#x27; is not a number"),
        ({"sort": "secret"}, "sort: &#x27;secret&#x27; is not a column"),
        ({"task_id": "-1"}, "task_id: &#x27;-1&#x27; is not a task number"),
        ({"per_page": "100000"}, "per_page: &#x27;100000&#x27; is not a number of rows"),
        ({"success": "maybe"}, "success: &#x27;maybe&#x27; is not one of"),
    ):
        answer = viewer.get("/", params=params)
        assert answer.status_code == 400 and message in answer.text, (params, answer.text[-600:])
    assert httpx.post(viewer.url, timeout=30).status_code == 405
    assert viewer.get("/", headers={"Host": "attacker.example"}).status_code == 400  # DNS rebinding
    assert viewer.get("/", headers={"Host": "localhost"}).status_code == 200
    page = viewer.get("/")
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'none': no script at all
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert viewer.get("/static/viewer.css").headers["content-type"].startswith("text/css")
    assert viewer.url.startswith("http://127.0.0.1:")


def test_hostile_trace_text_is_escaped(viewers: dict[str, Viewer]) -> None:
    viewer = viewers["mixed"]
    for page in (viewer.get(f"/episodes/{HOSTILE_ID}").text, viewer.get("/", params={"task_id": "999999"}).text):
        assert "<script" not in page and "<img" not in page and "<svg" not in page and "<b>" not in page
        assert html.escape(HOSTILE) in page
    episode = viewer.get(f"/episodes/{HOSTILE_ID}").text
    assert "&lt;/pre&gt;" + html.escape(HOSTILE) in episode  # an observation cannot close its <pre>
    assert "503" in episode and "HTTP 503 &lt;overloaded&gt;" in episode


def test_a_taken_port_is_bad_input_and_a_stop_ends_it_cleanly(research_runs: ResearchRuns) -> None:
    location, env = run_location(research_runs, "legacy")
    with serving(location, env) as first:
        port = first.url.rsplit(":", 1)[1].strip("/")
        taken = subprocess.run(
            [sys.executable, "-m", "shopsimrl", "view", location, "--port", port],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=120,
        )
        assert taken.returncode == 2 and taken.stderr.startswith(f"error: --host/--port: cannot listen on 127.0.0.1:{port}"), (
            taken.stderr
        )
        assert first.stop(signal.SIGINT) == 0
    with serving(location, env) as second:
        assert second.get("/").status_code == 200
        assert second.stop(signal.SIGTERM) == 0
    missing = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "view", "/nonexistent/run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert missing.returncode == 2 and missing.stderr.strip() == "error: /nonexistent/run does not exist"


# --------------------------------------------------------------------------- in a real browser


def test_browse_filter_sort_and_open_episodes(
    browser: Any, research_runs: ResearchRuns, s3_env: dict[str, str], viewers: dict[str, Viewer], mixed_run: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    viewer = viewers["sharded"]
    rows = _rows(research_runs.sharded)
    driver.get(viewer.url)
    assert driver.find_element(By.ID, "count").text.startswith(f"{len(rows)} of {len(rows)} episodes")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#episodes tbody tr")) == len(rows)
    screenshot(driver, "viewer-table")

    Select(driver.find_element(By.NAME, "success")).select_by_value("0")
    driver.find_element(By.NAME, "reward_min").send_keys("0.2")
    navigate(driver, driver.find_element(By.ID, "apply"))
    kept = [row for row in rows if row["success"] == 0.0 and row["reward"] is not None and row["reward"] >= 0.2]
    assert driver.find_element(By.ID, "count").text.startswith(f"{len(kept)} of {len(rows)} episodes")
    navigate(driver, driver.find_element(By.CSS_SELECTOR, 'th a[data-column="reward"]'))  # ascending
    navigate(driver, driver.find_element(By.CSS_SELECTOR, 'th a[data-column="reward"]'))  # descending
    shown = [link.text for link in driver.find_elements(By.CSS_SELECTOR, "#episodes tbody td:first-child a")]
    assert shown == _in_order(kept, "reward", desc=True)
    assert Select(driver.find_element(By.NAME, "success")).first_selected_option.get_attribute("value") == "0"  # filters kept
    screenshot(driver, "viewer-filtered")
    assert console_errors(driver) == []

    navigate(driver, driver.find_element(By.LINK_TEXT, shown[0]))
    record = written(open_run(research_runs.sharded).record(shown[0]))
    assert driver.find_element(By.ID, "episode-id").text == shown[0]
    assert driver.find_element(By.ID, "instruction").text == record["reset"]["task_instruction"]
    steps = driver.find_elements(By.CSS_SELECTOR, "li.step")
    assert len(steps) == len(record["steps"])
    assert record["steps"][-1]["action"] in steps[-1].text and "reward" in steps[-1].text
    values = driver.find_element(By.CSS_SELECTOR, "li.step details.tools")
    values.find_element(By.TAG_NAME, "summary").click()
    assert record["steps"][1]["model"]["tool_calls"][0]["arguments"]["value"] in values.text
    screenshot(driver, "viewer-episode")
    assert console_errors(driver) == []

    navigate(driver, driver.find_element(By.ID, "next"))
    assert driver.find_element(By.ID, "episode-id").text == shown[1]
    navigate(driver, driver.find_element(By.ID, "back"))
    assert driver.find_element(By.ID, "count").text.startswith(f"{len(kept)} of {len(rows)} episodes")
    assert console_errors(driver) == []


def test_browse_thinking_collapsed_and_repairs(browser: Any, viewers: dict[str, Viewer]) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(viewers["legacy"].url + "episodes/task-000006__sample-000")
    first = driver.find_element(By.ID, "step-1")
    assert (
        "protocol error tool_call_count" in first.text and "sent back to the model" in first.text.lower()
    )  # a label, set in capitals
    thinking = first.find_element(By.CSS_SELECTOR, "details.thinking")
    assert thinking.get_attribute("open") is None and not thinking.find_element(By.TAG_NAME, "pre").is_displayed()
    thinking.find_element(By.TAG_NAME, "summary").click()
    assert (
        thinking.find_element(By.TAG_NAME, "pre").is_displayed()
        and thinking.find_element(By.TAG_NAME, "pre").text == "直接搜索。"
    )
    screenshot(driver, "viewer-episode-repair")
    assert console_errors(driver) == []


def test_browse_pages_and_hostile_text(browser: Any, viewers: dict[str, Viewer], mixed_run: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    driver.get(viewers["mixed"].url)
    Select(driver.find_element(By.NAME, "per_page")).select_by_value("25")
    navigate(driver, driver.find_element(By.ID, "apply"))
    assert "page 1 of 3" in driver.find_element(By.ID, "count").text
    navigate(driver, driver.find_element(By.ID, "page-next"))
    assert "page 2 of 3" in driver.find_element(By.ID, "count").text
    assert len(driver.find_elements(By.CSS_SELECTOR, "#episodes tbody tr")) == 25
    Select(driver.find_element(By.NAME, "failure_class")).select_by_value("environment_error")
    navigate(driver, driver.find_element(By.ID, "apply"))
    failed = [row for row in _rows(str(mixed_run)) if row["failure_class"] == "environment_error"]
    assert driver.find_element(By.ID, "count").text.startswith(f"{len(failed)} of 60 episodes")
    assert console_errors(driver) == []

    driver.get(viewers["mixed"].url + f"episodes/{HOSTILE_ID}")
    assert driver.title == f"{HOSTILE_ID} · shopsimrl view"  # no injected script retitled it
    assert driver.find_elements(By.CSS_SELECTOR, "main img, main svg, main script, main b") == []
    assert HOSTILE in driver.find_element(By.ID, "instruction").text
    assert "<b>备注</b>: " + HOSTILE in driver.find_element(By.ID, "persona").text
    screenshot(driver, "viewer-hostile")
    assert console_errors(driver) == []
