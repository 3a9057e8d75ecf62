"""``shopsimrl report`` in a real browser: every plot present, no console errors, nothing loaded
from the network; on a local run, the sharded run on moto S3 and v4 traces."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.research.compare import load_run
from shopsimrl.research.labels import label_counts
from shopsimrl.research.report import build_report, write_report
from shopsimrl.storage.reading import open_run

from .conftest import ResearchRuns, console_errors, element_screenshot, screenshot

REPO = Path(__file__).resolve().parents[2]
SINGLE_RUN_FIGURES = [
    "Reward and success per run",
    "Reward components",
    "Termination reasons",
    "Steps and invalid actions",
    "Model latency and tokens",
    "Protocol errors, policy failures and retries",
]
PAIRED_FIGURES = ["Paired differences against the baseline", "Per-task wins and losses"]


def _open(browser: Any, path: Path) -> dict[str, Any]:
    """Load the page and read what the browser made of it."""
    browser.get(path.as_uri())
    return browser.execute_script(
        """
        const figures = [...document.querySelectorAll('figure')];
        return {
          titles: figures.map(f => f.querySelector('figcaption').textContent),
          svgs: figures.map(f => f.querySelectorAll(':scope > svg').length),
          drawn: figures.map(f => { const b = f.querySelector('svg').getBoundingClientRect(); return b.width > 100 && b.height > 100; }),
          marks: figures.map(f => f.querySelectorAll('svg path, svg use, svg rect').length),
          resources: performance.getEntriesByType('resource').map(r => r.name),
          headings: [...document.querySelectorAll('h2')].map(h => h.textContent),
        };
        """
    )


def _assert_offline(page_html: str) -> None:
    # No URL of any scheme a browser would fetch: the page is self-contained.
    assert not re.search(r"(?:https?|ftp)://|//[a-z0-9.-]+\.[a-z]{2,}/", page_html, flags=re.I)
    assert not re.search(r"<(?:script|link|img|iframe)\b", page_html, flags=re.I)


@pytest.mark.slow
def test_a_checkpoint_sweep_report_renders_every_plot(
    research_runs: ResearchRuns, naive_run: Path, s3_env: dict[str, str], browser: Any, tmp_path: Path
) -> None:
    """Three runs in order: the local run (baseline), the naive-policy run, the sharded run on S3."""
    output = tmp_path / "report.html"
    report = write_report([str(research_runs.local), str(naive_run), research_runs.sharded], output)
    assert report.figures == SINGLE_RUN_FIGURES + PAIRED_FIGURES
    page_html = output.read_text(encoding="utf-8")
    _assert_offline(page_html)
    assert "testing-secret" not in page_html

    seen = _open(browser, output)
    assert seen["titles"] == report.figures
    assert seen["svgs"] == [1] * len(report.figures) and all(seen["drawn"]), seen
    assert all(marks > 5 for marks in seen["marks"]), seen["marks"]
    assert seen["resources"] == []  # nothing was fetched
    assert console_errors(browser) == []
    assert seen["headings"][:2] == ["Runs", "Plots"]
    assert [h for h in seen["headings"] if "baseline" in h] == [
        "B: research against A: research (baseline)",
        "C: research against A: research (baseline)",
    ]
    screenshot(browser, "report-sweep-top")
    forest = browser.find_element("css selector", 'figure[data-title="Paired differences against the baseline"]')
    browser.execute_script("arguments[0].scrollIntoView()", forest)
    screenshot(browser, "report-sweep-forest")
    # The paired table shows the naive run's loss, with its interval, as compare prints it.
    tables = browser.find_elements("css selector", "section table")
    # What each run spent, apart from its score: tokens of every attempt and its active time.
    cost = tables[2].text.splitlines()
    assert cost[0].startswith("run prompt tokens completion tokens active span"), cost
    assert all(re.match(r"^[ABC]: research \d+ \d+ \d+\.\d\d h \d+\.\d\d h – –$", row) for row in cost[1:]), cost
    table = tables[5].text  # after identity, headline, cost, labels, plan
    assert re.search(r"^reward \(ITT\) 24 0\.\d{3} 0\.\d{3} -0\.\d{3} \[-0\.\d{3}, -0\.\d{3}\]", table.splitlines()[1]), table


@pytest.mark.slow
def test_a_single_v4_run_has_the_per_run_plots_only(research_runs: ResearchRuns, browser: Any, tmp_path: Path) -> None:
    output = tmp_path / "legacy.html"
    done = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "report", str(research_runs.legacy), "-o", str(output)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert f"{output}: 1 runs, {len(SINGLE_RUN_FIGURES)} figures" in done.stdout
    page_html = output.read_text(encoding="utf-8")
    _assert_offline(page_html)
    seen = _open(browser, output)
    assert seen["titles"] == SINGLE_RUN_FIGURES and all(seen["drawn"])
    assert console_errors(browser) == []
    assert "no manifest" in page_html and "failed: unknown" in page_html
    screenshot(browser, "report-legacy")


@pytest.mark.slow
def test_report_bad_input_exits_2(research_runs: ResearchRuns, tmp_path: Path) -> None:
    def report(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shopsimrl", "report", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=os.environ,
            timeout=300,
        )

    done = report(str(tmp_path / "missing"), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr
    done = report(str(research_runs.local), str(research_runs.legacy), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 2 and "cannot be paired" in done.stderr and not (tmp_path / "r.html").exists()
    (tmp_path / "a-file").write_text("in the way", encoding="utf-8")
    done = report(str(research_runs.legacy), "-o", str(tmp_path / "a-file" / "r.html"))
    assert done.returncode == 2 and "-o" in done.stderr and "a file is in the way" in done.stderr
    assert "Traceback" not in done.stderr


def _cells(page_html: str, heading: str) -> dict[str, list[str]]:
    """The table after ``heading`` as first cell → the other cells (text only)."""
    table = page_html[page_html.index(heading) :]
    table = table[: table.index("</table>")]
    rows = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table):
        cells = [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td>(.*?)</td>", row)]
        if cells:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_label_counts_per_run_and_their_paired_transitions(research_runs: ResearchRuns, naive_run: Path) -> None:
    """The heuristic run then the naive-policy run: each run's counts are those of ``shopsimrl
    labels`` (labelled from the traces), and the comparison shows the labels gained and lost."""
    runs = [load_run(str(research_runs.local)), load_run(str(naive_run))]
    page_html = build_report(runs).html
    per_run = _cells(page_html, "<h3>Rule labels (episodes per label")
    expected = [label_counts(open_run(location)) for location in (research_runs.local, naive_run)]
    for name in ("wrong_or_missing_options", "wrong_product"):
        shown = [cell.split(" ")[0] for cell in per_run[name]]
        assert shown == [str(counts.labels[name]) for counts in expected], per_run[name]
    assert per_run["episodes labelled"] == [str(research_runs.episodes)] * 2
    # The naive policy never chooses options: it gains the label on episodes the heuristic got right.
    assert expected[1].labels["wrong_or_missing_options"] > expected[0].labels["wrong_or_missing_options"]
    share = 100 * expected[1].labels["wrong_or_missing_options"] / research_runs.episodes
    assert per_run["wrong_or_missing_options"][1].endswith(f"({share:.1f}%)")
    paired = _cells(page_html, "<h3>Rule labels over the 24 paired episodes")
    a, b, gained, lost = (int(cell) for cell in paired["wrong_or_missing_options"])
    assert (a, b) == (expected[0].labels["wrong_or_missing_options"], expected[1].labels["wrong_or_missing_options"])
    assert gained > 0 and a + gained - lost == b


@pytest.mark.slow
def test_the_headline_table_leads_with_itt_and_the_coverage(tmp_path: Path) -> None:
    """B fails every hard task: its completed-only reward is higher than A's, its ITT reward (the
    first column, beside the coverage) lower."""
    from .test_compare import _record, _write_run

    a_records = [_record(task, 0, 0.5) for task in range(10)]
    b_records = [_record(task, 0, 0.6) if task < 5 else _record(task, 0, None, failure="model_error") for task in range(10)]
    runs = [load_run(_write_run(tmp_path / "a", a_records)), load_run(_write_run(tmp_path / "b", b_records))]
    page_html = build_report(runs, resamples=200).html
    section = page_html[page_html.index("<h3>Headline") :]
    header = re.findall(r"<th>(.*?)</th>", section[: section.index("</thead>")])
    assert header[:5] == [
        "run",
        "reward (ITT, 95% CI)",
        "success (ITT, 95% CI)",
        "coverage (completed of planned)",
        "ITT episodes",
    ]
    assert header[5:7] == ["reward (completed only)", "success (completed only)"]
    rows = _cells(page_html, "<h3>Headline")
    assert rows["A: a"][0].startswith("0.500 [") and rows["B: b"][0].startswith("0.300 [")
    assert rows["B: b"][2:4] == ["50.0% (5 of 10)", "10 (5 failed as 0)"] and rows["B: b"][4].startswith("0.600 [")


def _figure_svg(page_html: str, title: str) -> str:
    start = page_html.index(f'<figure data-title="{title}">')
    return page_html[start : page_html.index("</figure>", start)]


def _svg_texts(svg: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", text).strip() for text in re.findall(r"<text\b[^>]*>(.*?)</text>", svg, flags=re.S)]


@pytest.mark.slow
def test_each_plot_shows_what_a_faulty_run_did(
    research_runs: ResearchRuns, faulty_run: Path, browser: Any, tmp_path: Path
) -> None:
    """A clean run against one whose policy answered some calls without a tool call and some with
    HTTP 500: the faults figure shows both runs' protocol-error and retry rates, a rate of 0 is
    written as 0 rather than left as an empty panel, completion tokens have their own axis.
    Every figure is drawn by Chromium and saved as a PNG of its own (report-plot-*.png)."""
    clean, faulty = load_run(str(research_runs.local)), load_run(str(faulty_run))
    behaviour, retries = faulty.summary["behavior"], faulty.summary["retries"]
    assert behaviour["protocol_errors"] > 0 and retries["model_calls_retried"] > 0  # the faults happened
    output = tmp_path / "faulty.html"
    output.write_text(build_report([clean, faulty], resamples=500).html, encoding="utf-8")
    page_html = output.read_text(encoding="utf-8")

    faults = _svg_texts(_figure_svg(page_html, "Protocol errors, policy failures and retries"))
    assert f"{behaviour['protocol_error_rate']:.1%}" in faults
    assert f"{retries['model_calls_retried'] / behaviour['model_steps']:.1%}" in faults
    assert faults.count("0.0%") >= 4  # the clean run's rates: written, not invisible
    invalid = _svg_texts(_figure_svg(page_html, "Steps and invalid actions"))
    assert "0.0%" in invalid and "invalid-action rate (invalid / actions)" in invalid
    cost = _svg_texts(_figure_svg(page_html, "Model latency and tokens"))
    assert "prompt tokens" in cost and "completion tokens" in cost
    completion = faulty.summary["cost"]["tokens"]["completion_tokens"] / faulty.summary["counts"]["completed"]
    assert f"{completion:,.0f}" in cost

    seen = _open(browser, output)
    assert seen["titles"] == SINGLE_RUN_FIGURES + PAIRED_FIGURES and all(seen["drawn"]), seen
    assert console_errors(browser) == []
    for number, title in enumerate(seen["titles"], 1):
        figure = browser.find_element("css selector", f'figure[data-title="{title}"]')
        path = element_screenshot(browser, figure, f"report-plot-{number}")
        assert path.stat().st_size > 5_000, path


@pytest.mark.slow
def test_completion_tokens_are_drawn_on_their_own_scale(research_runs: ResearchRuns, faulty_run: Path) -> None:
    """Prompt tokens are about 180 times the completion here; each has its own axis, on which the
    larger run's bar fills most of the height."""
    from shopsimrl.research.report import _cost_figure

    runs = [load_run(str(research_runs.local)), load_run(str(faulty_run))]
    figure = _cost_figure(runs, ["A", "B"])
    by_title = {axes.get_title(): axes for axes in figure.axes}
    for title in ("prompt tokens\nper completed episode", "completion tokens\nper completed episode"):
        axes = by_title[title]
        tallest = max(bar.get_height() for bar in axes.patches)
        assert tallest / axes.get_ylim()[1] > 0.75, title
