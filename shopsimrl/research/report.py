"""``shopsimrl report``: one self-contained HTML page over one or more runs.

The page needs no network: every plot is an inline SVG drawn by matplotlib (text kept as text,
so it is searchable and the browser's fonts render it), styles are inline, and nothing is
loaded from elsewhere. Runs are shown in the order given (a checkpoint sweep reads left to
right); with two or more, each is also compared with the first by :mod:`shopsimrl.research.compare`
(the same pairing rules, statistics and JSON as ``shopsimrl compare``).

Per-run numbers are the runs' own summaries, recomputed from their records as ``summary.json``
is: first the intent-to-treat reward and success (every planned episode with an outcome, a
failure as 0) beside the coverage, then the means conditional on completing, named as such;
intervals clustered by task.
"""

from __future__ import annotations

import html
import io
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import matplotlib as mpl
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from shopsimrl.manifest import flatten
from shopsimrl.metrics import format_money
from shopsimrl.research.compare import (
    MIN_SLICE_PAIRS,
    NO_SPREAD_FOOTNOTE,
    OTHER_SLICE,
    LoadedRun,
    compare_loaded,
    display_name,
    format_p,
    load_run,
    metric_cells,
)
from shopsimrl.research.labels import LABELS_VERSION, TAXONOMY
from shopsimrl.research.outputs import check_output_location, write_output
from shopsimrl.research.paired_stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED

__all__ = ["Report", "build_report", "write_report"]

_PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")
_SVG_STYLE: dict[Any, Any] = {"svg.fonttype": "none", "svg.hashsalt": "shopsimrl-report", "font.size": 9}
"""Text stays text in the SVG; element ids are deterministic (the hash salt)."""
_TASK_ROWS = 200
"""Per-task rows shown per comparison (the largest differences)."""


@dataclass(frozen=True)
class Report:
    html: str
    figures: list[str]
    """The titles of the figures, in page order."""


# --------------------------------------------------------------------------- figures


def _svg(figure: Figure, number: int) -> str:
    """The figure as an inline ``<svg>`` element: no XML prolog, no metadata, no namespace
    declarations (HTML parses inline SVG into the right namespaces by itself), and ids made
    unique on the page."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r'\s+xmlns(?::\w+)?="[^"]*"', "", text)
    text = re.sub(r'\bid="', f'id="f{number}-', text)
    text = re.sub(r'href="#', f'href="#f{number}-', text)
    return re.sub(r"url\(#", f"url(#f{number}-", text)


def _name(run: LoadedRun) -> str:
    """What a person calls the run: its checkpoint, else its experiment, else its location's last part."""
    name = run.identity.get("checkpoint_id") or run.identity.get("experiment")
    return name if isinstance(name, str) and name else run.location.rstrip("/").rsplit("/", 1)[-1]


def _run_labels(runs: Sequence[LoadedRun]) -> list[str]:
    """Short labels for plots: a letter and the run's name when it is plain ASCII (plot fonts)."""
    labels = []
    for index, run in enumerate(runs):
        name = _name(run)
        name = name if name.isascii() and name.isprintable() else ""
        letter = _letter(index)
        labels.append(f"{letter}: {name[:22]}" if name else letter)
    return labels


def _letter(index: int) -> str:
    return chr(65 + index) if index < 26 else str(index + 1)


def _errors(values: Sequence[float | None], intervals: Sequence[list[float] | None]) -> list[list[float]]:
    low, high = [], []
    for value, interval in zip(values, intervals, strict=True):
        if value is None or interval is None:
            low.append(0.0)
            high.append(0.0)
        else:
            low.append(max(0.0, value - interval[0]))
            high.append(max(0.0, interval[1] - value))
    return [low, high]


def _value(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _headline_figure(runs: Sequence[LoadedRun], labels: list[str]) -> Figure:
    figure = Figure(figsize=(max(5.0, 1.1 * len(runs) + 3), 3.4))
    axes = figure.subplots()
    x = list(range(len(runs)))
    for key, ci_key, name, color, offset in (
        ("reward_mean", "reward_ci95", "reward (ITT)", _PALETTE[0], -0.04),
        ("success_rate", "success_ci95", "success (ITT)", _PALETTE[1], 0.04),
    ):
        values = [run.summary["intent_to_treat"][key] for run in runs]
        intervals = [run.summary["intent_to_treat"][ci_key] for run in runs]
        axes.errorbar(
            [i + offset for i in x],
            [_value(v) for v in values],
            yerr=_errors(values, intervals),
            marker="o",
            capsize=4,
            color=color,
            label=f"{name} (95% CI)",
        )
    completed = [run.summary["primary"]["reward_mean"] for run in runs]
    axes.plot(
        x, [_value(v) for v in completed], linestyle="--", marker="x", color=_PALETTE[2], label="reward (completed episodes only)"
    )
    axes.set_xticks(x, labels)
    axes.set_xlim(-0.5, len(runs) - 0.5)
    axes.set_ylim(-0.02, 1.02)
    axes.set_ylabel("mean over episodes")
    axes.set_xlabel("runs, in the order given")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    return figure


def _grouped_bars(
    axes: Axes,
    groups: list[str],
    series: list[tuple[str, list[float | None]]],
    *,
    value_labels: str | None = None,
    label_rotation: float = 0.0,
) -> None:
    """Bars per group and series. ``value_labels`` (a format such as ``"{:.1%}"``) writes each bar's
    value above it, so a bar of height 0 still says 0 and a missing one says n/a."""
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series):
        positions = [g + (index - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = axes.bar(positions, [_value(v) for v in values], width=width, label=name, color=_PALETTE[index % len(_PALETTE)])
        if value_labels is not None:
            texts = ["n/a" if v is None else value_labels.format(v) for v in values]
            axes.bar_label(bars, texts, padding=2, fontsize=7, rotation=label_rotation)
    axes.set_xticks(range(len(groups)), groups)


def _rate_limits(axes: Axes, values: Sequence[float | None], *, floor: float = 0.05) -> None:
    """A y range that shows the bars and their labels; all-zero rates keep a visible axis."""
    top = max([floor, *[v for v in values if v is not None]])
    axes.set_ylim(0, top * 1.25)
    axes.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0 if top >= 0.1 else 1))


def _components_figure(runs: Sequence[LoadedRun], labels: list[str]) -> Figure:
    components = sorted({key for run in runs for key in run.summary["reward_components"]})
    figure = Figure(figsize=(max(5.0, 0.9 * len(components) + 2), 3.4))
    axes = figure.subplots()
    series = [
        (label, [run.summary["reward_components"].get(key) for key in components])
        for run, label in zip(runs, labels, strict=True)
    ]
    _grouped_bars(
        axes,
        components or ["(none)"],
        series if components else [(label, [None]) for label in labels],
        value_labels="{:.2f}",
        label_rotation=90.0 if len(runs) > 1 else 0.0,
    )
    axes.set_ylim(0, 1.25)  # room for the value labels above a bar at 1
    axes.set_ylabel("mean over completed episodes")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes.grid(axis="y", alpha=0.3)
    return figure


def _outcomes(run: LoadedRun) -> Counter[str]:
    counted: Counter[str] = Counter()
    for row in run.rows.values():
        counted[
            str(row["termination_reason"] or "unknown") if row["completed"] else f"failed: {row['failure_class'] or 'unknown'}"
        ] += 1
    return counted


def _terminations_figure(runs: Sequence[LoadedRun], labels: list[str]) -> Figure:
    counts = [_outcomes(run) for run in runs]
    reasons = sorted({reason for counted in counts for reason in counted}, key=lambda r: (r.startswith("failed"), r))
    figure = Figure(figsize=(7.0, 0.55 * len(runs) + 1.6))
    axes = figure.subplots()
    left = [0.0] * len(runs)
    for index, reason in enumerate(reasons):
        shares = [counted[reason] / max(1, sum(counted.values())) for counted in counts]
        axes.barh(labels, shares, left=left, label=reason, color=_PALETTE[index % len(_PALETTE)])
        left = [a + b for a, b in zip(left, shares, strict=True)]
    axes.invert_yaxis()
    axes.set_xlim(0, 1)
    axes.set_xlabel("share of episodes")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure


def _behaviour_figure(runs: Sequence[LoadedRun], labels: list[str]) -> Figure:
    figure = Figure(figsize=(max(7.0, 1.2 * len(runs) + 4), 3.4))
    steps_axes, invalid_axes = figure.subplots(1, 2)
    steps = [[row["steps"] for row in run.rows.values() if row["completed"]] or [0] for run in runs]
    steps_axes.boxplot(steps, tick_labels=labels, showmeans=True, showfliers=False)  # fliers: one mark per outlier
    steps_axes.set_title("steps per completed episode")
    steps_axes.grid(axis="y", alpha=0.3)
    rates = [run.summary["behavior"]["invalid_action_rate"] for run in runs]
    _grouped_bars(invalid_axes, labels, [("invalid / actions", rates)], value_labels="{:.1%}")
    invalid_axes.set_title("invalid-action rate (invalid / actions)")
    _rate_limits(invalid_axes, rates)
    invalid_axes.grid(axis="y", alpha=0.3)
    for axes in (steps_axes, invalid_axes):
        axes.tick_params(axis="x", labelrotation=20 if len(runs) > 3 else 0)
    return figure


def _tokens_per_episode(run: LoadedRun, key: str) -> float | None:
    tokens = run.summary["cost"]["tokens"].get(key)
    completed = run.summary["counts"]["completed"]
    return tokens / completed if tokens is not None and completed else None


def _cost_figure(runs: Sequence[LoadedRun], labels: list[str]) -> Figure:
    """Latency, and prompt and completion tokens each on its own axis: a prompt is often a hundred
    times the completion, and stacked on it the completion would not show."""
    figure = Figure(figsize=(max(9.0, 1.6 * len(runs) + 6), 3.4))
    latency_axes, prompt_axes, completion_axes = figure.subplots(1, 3)
    series = [
        (name, [run.summary["latency"]["model_step_ms"].get(key) for run in runs])
        for name, key in (("p50", "p50"), ("p95", "p95"), ("mean", "mean"))
    ]
    _grouped_bars(latency_axes, labels, series)
    latency_axes.set_title("model latency\nper step (ms)")
    latency_axes.legend(fontsize=8)
    latency_axes.grid(axis="y", alpha=0.3)
    prompt = [_tokens_per_episode(run, "prompt_tokens") for run in runs]
    _grouped_bars(prompt_axes, labels, [("prompt", prompt)], value_labels="{:,.0f}")
    prompt_axes.set_title("prompt tokens\nper completed episode")
    completion = [("completion", [_tokens_per_episode(run, "completion_tokens") for run in runs])]
    reasoning = [_tokens_per_episode(run, "reasoning_tokens") for run in runs]
    if any(value is not None for value in reasoning):
        completion.append(("of which reasoning", reasoning))
    _grouped_bars(completion_axes, labels, completion, value_labels="{:,.0f}")
    completion_axes.set_title("completion tokens\nper completed episode")
    if len(completion) > 1:
        completion_axes.legend(fontsize=8)
    # Headroom for the value labels; an all-zero panel keeps an axis.
    prompt_axes.set_ylim(0, max([1.0, *[v for v in prompt if v is not None]]) * 1.2)
    completion_axes.set_ylim(0, max([1.0, *[v for _, values in completion for v in values if v is not None]]) * 1.2)
    for axes in (latency_axes, prompt_axes, completion_axes):
        axes.grid(axis="y", alpha=0.3)
        axes.tick_params(axis="x", labelrotation=20 if len(runs) > 3 else 0)
    return figure


def _share_of(count: Any, total: Any) -> float | None:
    return count / total if isinstance(count, int) and isinstance(total, int) and total > 0 else None


def _faults_figure(runs: Sequence[LoadedRun], labels: list[str]) -> Figure:
    """What went wrong on the way: protocol errors and policy failures per model call, model calls
    that needed a retry, and completed episodes that took more than one attempt."""
    figure = Figure(figsize=(max(7.0, 1.8 * len(runs) + 4), 3.6))
    axes = figure.subplots()
    series: list[tuple[str, list[float | None]]] = [
        ("protocol errors / model call", [run.summary["behavior"]["protocol_error_rate"] for run in runs]),
        ("policy failures / model call", [run.summary["behavior"]["policy_failure_rate"] for run in runs]),
        (
            "model calls retried / model call",
            [_share_of(run.summary["retries"]["model_calls_retried"], run.summary["behavior"]["model_steps"]) for run in runs],
        ),
        (
            "episodes retried / completed",
            [_share_of(run.summary["retries"]["episodes_retried"], run.summary["counts"]["completed"]) for run in runs],
        ),
    ]
    _grouped_bars(axes, labels, series, value_labels="{:.1%}")
    _rate_limits(axes, [v for _, values in series for v in values])
    axes.set_ylabel("share")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes.tick_params(axis="x", labelrotation=20 if len(runs) > 3 else 0)
    return figure


def _forest_figure(comparisons: list[dict[str, Any]], labels: list[str]) -> Figure:
    """B − A with its interval for every metric on the reward scale, one colour per comparison."""
    names = [m["metric"] for m in comparisons[0]["metrics"] if _on_unit_scale(m["metric"])]
    rows = len(names)
    figure = Figure(figsize=(7.0, 0.32 * rows * len(comparisons) + 1.4))
    axes = figure.subplots()
    band = 0.8 / len(comparisons)
    for index, comparison in enumerate(comparisons):
        by_name = {m["metric"]: m for m in comparison["metrics"]}
        # Two groups: bootstrap intervals, and the no-spread ones (hollow, dashed): those are
        # an assumption about the spread, not a measurement of it.
        points: dict[bool, tuple[list[float], list[float], list[float], list[float]]] = {
            False: ([], [], [], []),
            True: ([], [], [], []),
        }
        for row, name in enumerate(names):
            entry = by_name.get(name)
            if entry is None or entry["difference"] is None:
                continue
            ci = entry["ci95"] or [entry["difference"], entry["difference"]]
            ys, xs, low, high = points[bool(entry.get("ci95_note"))]
            ys.append(row + (index - (len(comparisons) - 1) / 2) * band)
            xs.append(entry["difference"])
            low.append(entry["difference"] - ci[0])
            high.append(ci[1] - entry["difference"])
        color = _PALETTE[(index + 1) % len(_PALETTE)]
        for no_spread, (ys, xs, low, high) in points.items():
            if not xs:
                continue
            bars = axes.errorbar(
                xs,
                ys,
                xerr=[low, high],
                fmt="o",
                capsize=3,
                color=color,
                markerfacecolor="white" if no_spread else color,
                label=f"{labels[index + 1]} − {labels[0]}" + (" (no spread between tasks)" if no_spread else ""),
            )
            if no_spread:
                for line in bars[2]:
                    line.set_linestyle("--")
    axes.axvline(0.0, color="#444", linewidth=1)
    axes.set_yticks(range(rows), [display_name(name) for name in names])
    axes.invert_yaxis()
    axes.set_xlabel("paired difference against the baseline (95% bootstrap CI over tasks)")
    axes.grid(axis="x", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure


def _on_unit_scale(metric: str) -> bool:
    return metric in ("reward", "success", "reward_itt", "success_itt") or metric.startswith("r_")


def _win_loss_figure(comparisons: list[dict[str, Any]], labels: list[str]) -> Figure:
    names = [f"{labels[index + 1]} vs {labels[0]}" for index in range(len(comparisons))]
    figure = Figure(figsize=(7.0, 0.55 * len(comparisons) + 1.4))
    axes = figure.subplots()
    left = [0] * len(comparisons)
    for key, label, color in (("win", "wins", _PALETTE[2]), ("tie", "ties", _PALETTE[7]), ("loss", "losses", _PALETTE[3])):
        counts = [comparison["per_task"][key] for comparison in comparisons]
        axes.barh(names, counts, left=left, color=color, label=label)
        for y, (start, count) in enumerate(zip(left, counts, strict=True)):
            if count:
                axes.text(start + count / 2, y, str(count), ha="center", va="center", color="white", fontsize=8)
        left = [a + b for a, b in zip(left, counts, strict=True)]
    axes.invert_yaxis()
    axes.set_xlabel("tasks (mean reward (ITT): a failure counts 0)")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure


# --------------------------------------------------------------------------- tables


def _e(value: Any) -> str:
    return html.escape("–" if value is None else str(value))


def _num(value: float | None) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"


def _ci(ci: Sequence[float | None] | None) -> str:
    return f"[{_num(ci[0])}, {_num(ci[1])}]" if ci else "–"


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, classes: Sequence[str] = ()) -> str:
    head = "".join(f"<th>{_e(cell)}</th>" for cell in header)
    body = "".join(
        f'<tr class="{classes[i] if i < len(classes) else ""}">' + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _runs_section(runs: Sequence[LoadedRun], labels: list[str]) -> str:
    rows = []
    for run, label in zip(runs, labels, strict=True):
        identity, counts = run.identity, run.summary["counts"]
        fingerprint = identity.get("plan_fingerprint")
        rows.append(
            [
                _e(label),
                f"<code>{_e(run.location)}</code>",
                _e(run.kind),
                _e(identity.get("experiment")),
                _e(identity.get("model_name") or identity.get("model_id")),
                _e(identity.get("checkpoint_id")),
                f"<code>{_e(fingerprint[:16] if isinstance(fingerprint, str) else None)}</code>",
                _e((identity.get("split") or {}).get("name")),
                f"{counts['requested']} / {counts['completed']} / {counts['failed']}",
            ]
        )
    identities = _html_table(
        [
            "run",
            "location",
            "kind",
            "experiment",
            "model",
            "checkpoint",
            "plan fingerprint",
            "split",
            "requested / completed / failed",
        ],
        rows,
    )
    plans = [flatten({k: v for k, v in (run.plan or {}).items() if k != "jobs"}) for run in runs]
    keys = sorted({key for flat in plans for key in flat})
    plan_rows, plan_classes = [], []
    for key in keys:
        values = [flat.get(key, "<absent>") for flat in plans]
        plan_rows.append([f"<code>{_e(key)}</code>", *(_e(v) for v in values)])
        plan_classes.append("differs" if len({repr(v) for v in values}) > 1 else "")
    no_plan = [label for run, label in zip(runs, labels, strict=True) if run.plan is None]
    plan_note = (
        f"<p>{_e(', '.join(no_plan))}: no manifest (traces of the earlier implementation), so no plan.</p>" if no_plan else ""
    )
    plan = _html_table(["plan key", *labels], plan_rows, classes=plan_classes)
    headline_rows = []
    for run, label in zip(runs, labels, strict=True):
        primary, itt, counts = run.summary["primary"], run.summary["intent_to_treat"], run.summary["counts"]
        headline_rows.append(
            [
                _e(label),
                f"{_num(itt['reward_mean'])} {_ci(itt['reward_ci95'])}",
                f"{_num(itt['success_rate'])} {_ci(itt['success_ci95'])}",
                _e(f"{100 * counts['coverage']:.1f}% ({counts['completed']} of {counts['requested']})"),
                _e(f"{itt['episodes']} ({itt['failed_counted_as_zero']} failed as 0)"),
                f"{_num(primary['reward_mean'])} {_ci(primary['reward_ci95'])}",
                f"{_num(primary['success_rate'])} {_ci(primary['success_ci95'])}",
                _e(run.summary["per_task"]["tasks"]),
            ]
        )
    headline = _html_table(
        [
            "run",
            "reward (ITT, 95% CI)",
            "success (ITT, 95% CI)",
            "coverage (completed of planned)",
            "ITT episodes",
            "reward (completed only)",
            "success (completed only)",
            "tasks",
        ],
        headline_rows,
    )
    return (
        "<section><h2>Runs</h2>"
        + identities
        + "<h3>Headline (the summary's numbers; intervals clustered by task)</h3>"
        + '<p class="note">ITT, intent to treat, is the number to quote: every planned episode with an outcome, '
        "a failed one counting 0 (infrastructure failures excused). The completed-only means are conditional on "
        "completing: a run that fails on hard tasks looks better there.</p>"
        + headline
        + _cost_table(runs, labels)
        + _labels_table(runs, labels)
        + "<details><summary>Plan of each run (differing keys highlighted)</summary>"
        + plan_note
        + plan
        + "</details></section>"
    )


def _cost_table(runs: Sequence[LoadedRun], labels: list[str]) -> str:
    """Tokens spent, wall time and money per run: what each run cost, apart from how it scored."""
    rows = []
    for run, label in zip(runs, labels, strict=True):
        cost, throughput = run.summary["cost"], run.summary["throughput"]
        spent = cost.get("tokens_all_attempts") or {}
        active, span = throughput.get("active_seconds"), throughput.get("span_seconds")
        hours = cost.get("accelerator_hours")
        rows.append(
            [
                _e(label),
                _e(spent.get("prompt_tokens")),
                _e(spent.get("completion_tokens")),
                _e("–" if active is None else f"{active / 3600:.2f} h"),
                _e("–" if span is None else f"{span / 3600:.2f} h"),
                _e("–" if hours is None else f"{hours:.3f}"),
                _e(format_money(cost.get("money"))),
            ]
        )
    notes = [
        f"{label}: {note}" for run, label in zip(runs, labels, strict=True) for note in run.summary["cost"].get("notes") or []
    ]
    return (
        "<h3>Cost and time</h3>"
        + '<p class="note">Tokens over every attempt (failed and superseded ones too), as the model server reported them. '
        "Active: wall time with an episode in flight (pauses up to a minute bridged); span: first start to last end. "
        "Accelerator hours: active hours × accelerators × the model server's share; money from the prices recorded "
        "in the run's manifest (<code>cost:</code> in its config); a dash where none were set.</p>"
        + _html_table(
            ["run", "prompt tokens", "completion tokens", "active", "span", "accelerator hours", "money"],
            rows,
        )
        + "".join(f'<p class="note">{_e(note)}</p>' for note in notes)
    )


def _share(count: int, total: int) -> str:
    return f"{count} ({100 * count / total:.1f}%)" if total else str(count)


def _labels_table(runs: Sequence[LoadedRun], labels: list[str]) -> str:
    """Episodes per rule label per run, with their share of the run's episodes."""
    counts = [run.label_counts for run in runs]
    if any(counted is None for counted in counts):
        return ""
    known = [counted for counted in counts if counted is not None]
    rows = [[_e(name), *(_share(c.labels.get(name, 0), c.episodes) for c in known)] for name in TAXONOMY]
    rows.append(["(no label)", *(_share(c.clean, c.episodes) for c in known)])
    rows.append(["episodes labelled", *(_e(c.episodes) for c in known)])
    return f"<h3>Rule labels (episodes per label and share of the run's episodes; {_e(LABELS_VERSION)})</h3>" + _html_table(
        ["label", *labels], rows
    )


def _comparison_labels(changes: dict[str, Any]) -> str:
    rows = [
        [_e(row["label"]), _e(row["a"]), _e(row["b"]), _e(row["gained"]), _e(row["lost"])]
        for row in changes["rows"]
        if row["a"] or row["b"]
    ]
    rows.append(["(no label)", _e(changes["clean_a"]), _e(changes["clean_b"]), "", ""])
    return f"<h3>Rule labels over the {changes['episodes']} paired episodes</h3>" + _html_table(
        ["label", "A", "B", "gained (not in A, in B)", "lost (in A, not in B)"], rows
    )


def _comparison_section(comparison: dict[str, Any], title: str) -> str:
    rows = []
    for entry in comparison["metrics"]:
        test = entry.get("mcnemar")
        rows.append(
            [
                _e(display_name(entry["metric"])),
                _e(entry["pairs"]),
                *(_e(cell) for cell in metric_cells(entry)),
                _e(f"p = {format_p(test['p_value'])} (only A {test['only_a']}, only B {test['only_b']})" if test else ""),
            ]
        )
    significant = ["excludes-zero" if e["ci95"] and (e["ci95"][0] > 0 or e["ci95"][1] < 0) else "" for e in comparison["metrics"]]
    metrics = _html_table(["metric", "pairs", "A", "B", "B − A", "95% CI", "McNemar (exact)"], rows, classes=significant)
    if any(entry.get("ci95_note") for entry in comparison["metrics"]):
        metrics += f'<p class="note">{_e(NO_SPREAD_FOOTNOTE)}</p>'
    plan = "".join(f"<li><code>{_e(line)}</code></li>" for line in comparison["plan_differences"]) or "<li>none</li>"
    dropped = ""
    if comparison["dropped"]:
        dropped = (
            "<p>Partial comparison: dropped " + _e(", ".join(f"{n} {why}" for why, n in comparison["dropped"].items())) + ".</p>"
        )
    transitions = _html_table(
        ["A", "B", "episodes"], [[_e(t["a"]), _e(t["b"]), _e(t["episodes"])] for t in comparison["termination_transitions"]]
    )
    per_task = comparison["per_task"]
    # The largest differences both ways; every task is in `shopsimrl compare --json`.
    moved = sorted(per_task["tasks"], key=lambda t: (-abs(t["b"] - t["a"]), t["task"]))[:_TASK_ROWS]
    ordered = sorted(moved, key=lambda t: (t["b"] - t["a"], t["task"]))
    more = len(per_task["tasks"]) - len(ordered)
    more_note = (
        f'<p class="note">{more} more tasks, with smaller differences, are in <code>shopsimrl compare --json</code>.</p>'
        if more
        else ""
    )
    task_rows = [
        [_e(t["task"]), _e(t["category"]), _e(t["episodes"]), _num(t["a"]), _num(t["b"]), _e(t["outcome"])] for t in ordered
    ]
    tasks = _html_table(["task", "category", "pairs", "A", "B", "B vs A"], task_rows, classes=[t["outcome"] for t in ordered])
    category_rows = []
    for piece in comparison["categories"]:
        reward, success = piece["metrics"]
        folded = piece.get("folded") or []
        name = piece["category"] + (f" ({len(folded)} categories: {', '.join(folded)})" if folded else "")
        category_rows.append(
            [
                _e(name),
                _e(reward["pairs"]),
                *(_e(cell) for cell in metric_cells(reward)),
                _e(format_p(reward.get("p_value"))),
                _e(format_p(reward.get("p_holm"))),
                _num(success["difference"]),
                _e(format_p(success.get("p_holm"))),
            ]
        )
    categories = _html_table(
        [
            "category",
            "pairs",
            "reward (ITT) A",
            "reward (ITT) B",
            "B − A",
            "95% CI",
            "p (bootstrap)",
            "p (Holm)",
            "success (ITT) B − A",
            "success p (McNemar, Holm)",
        ],
        category_rows,
    ) + (
        f'<p class="note">Categories with fewer than {MIN_SLICE_PAIRS} pairs are folded into {OTHER_SLICE}. '
        "p (Holm): adjusted over the slices of the metric, so that the chance of any false finding among them stays "
        "at 5 %; read the unadjusted p of one slice only for a category chosen before looking.</p>"
    )
    excused = comparison.get("itt_excused") or {}
    excused_note = (
        f"<p>Left out of the (ITT) rows, an infrastructure failure on either side: {sum(excused.values())} pairs "
        f"(only in A {excused['only_a']}, only in B {excused['only_b']}, in both {excused['both']}).</p>"
        if any(excused.values())
        else ""
    )
    return (
        f"<section><h2>{_e(title)}</h2>"
        f"<p>{comparison['episodes']} paired episodes over {comparison['tasks']} tasks (up to {comparison['repeats']} per task); "
        f"completed in both {comparison['completed_in_both']}, failed only in A {comparison['failed_only_in_a']}, "
        f"only in B {comparison['failed_only_in_b']}, in both {comparison['failed_in_both']}.</p>"
        f"{excused_note}{dropped}<h3>Plan differences</h3><ul>{plan}</ul>"
        f"<h3>Paired differences</h3>{metrics}"
        f"<h3>Termination reasons (A → B)</h3>{transitions}"
        f"{_comparison_labels(comparison['labels'])}"
        f"<details><summary>Per task (mean reward (ITT)): {per_task['win']} wins, {per_task['tie']} ties, {per_task['loss']} losses for B</summary>{tasks}{more_note}</details>"
        f"<details><summary>By catalog category</summary>{categories}</details></section>"
    )


_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", "Noto Sans CJK SC", sans-serif; margin: 2rem auto; max-width: 1100px;
       color: #222; line-height: 1.45; padding: 0 1rem; }
h1 { font-size: 1.5rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2rem; margin-top: 2.2rem; }
table { border-collapse: collapse; margin: .6rem 0 1rem; font-size: .85rem; }
th, td { border: 1px solid #ddd; padding: .25rem .5rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
tr.differs td { background: #fff4d6; } tr.excludes-zero td { font-weight: 600; }
tr.win td:last-child { color: #2b7a3d; } tr.loss td:last-child { color: #b03030; }
figure { margin: 1.2rem 0; } figcaption { font-weight: 600; margin-bottom: .3rem; }
figure svg { max-width: 100%; height: auto; }
code { font-size: .82rem; } details { margin: .5rem 0; } summary { cursor: pointer; }
.note { color: #555; font-size: .85rem; }
"""


# --------------------------------------------------------------------------- the page


def build_report(
    runs: Sequence[LoadedRun], *, allow_partial: bool = False, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> Report:
    """The HTML page of ``runs`` (raises CompareError when two or more runs cannot be paired)."""
    labels = _run_labels(runs)
    comparisons = (
        compare_loaded(runs, allow_partial=allow_partial, resamples=resamples, seed=seed)["comparisons"] if len(runs) > 1 else []
    )
    plots: list[tuple[str, str, Callable[[], Figure]]] = [
        (
            "Reward and success per run",
            "Intent-to-treat means (every planned episode with an outcome, a failure as 0) with 95% intervals clustered "
            "by task; the reward over completed episodes only, dashed; runs in the order given.",
            lambda: _headline_figure(runs, labels),
        ),
        ("Reward components", "Each r_* component's mean over completed episodes.", lambda: _components_figure(runs, labels)),
        (
            "Termination reasons",
            "How episodes ended; failed episodes by failure class.",
            lambda: _terminations_figure(runs, labels),
        ),
        (
            "Steps and invalid actions",
            "Steps per completed episode (box: quartiles, whiskers: 1.5 IQR, outliers not drawn, triangle: mean) and the pooled invalid-action rate.",
            lambda: _behaviour_figure(runs, labels),
        ),
        (
            "Model latency and tokens",
            "Per-step model latency percentiles; prompt and completion tokens per completed episode, each on its own scale.",
            lambda: _cost_figure(runs, labels),
        ),
        (
            "Protocol errors, policy failures and retries",
            "Protocol errors and policy failures per model call (completed episodes), model calls that needed more than "
            "one HTTP attempt, and completed episodes that needed more than one attempt.",
            lambda: _faults_figure(runs, labels),
        ),
    ]
    if comparisons:
        plots += [
            (
                "Paired differences against the baseline",
                "Forest plot: B − A per metric with its paired bootstrap interval; 0 is no difference. Hollow markers "
                "with dashed bars: every task's pairs differ by the same amount, so the interval assumes the largest "
                "spread a difference can have (not an exact result).",
                lambda: _forest_figure(comparisons, labels),
            ),
            (
                "Per-task wins and losses",
                "Tasks where the run's mean reward is above, equal to or below the baseline's.",
                lambda: _win_loss_figure(comparisons, labels),
            ),
        ]
    figures = []
    with mpl.rc_context(_SVG_STYLE):
        for number, (title, caption, draw) in enumerate(plots, 1):
            figure = draw()
            figures.append(
                f'<figure data-title="{_e(title)}"><figcaption>{_e(title)}</figcaption>{_svg(figure, number)}'
                f'<p class="note">{_e(caption)}</p></figure>'
            )
    sections = [_runs_section(runs, labels), "<section><h2>Plots</h2>" + "".join(figures) + "</section>"]
    sections += [_comparison_section(c, f"{labels[i + 1]} against {labels[0]} (baseline)") for i, c in enumerate(comparisons)]
    if comparisons:
        sections.append(
            f'<p class="note">Paired bootstrap: {resamples:,} resamples of tasks (seed {seed}), percentile intervals. '
            "The (ITT) rows, the headline, count every paired episode, a failed one as 0; a pair with an infrastructure "
            "failure on either side is left out of them. The (completed) rows count only pairs completed in both runs. "
            "Success: exact McNemar test on the discordant pairs.</p>"
        )
    title = "shopsimrl report: " + ", ".join(f"{_letter(i)} {_name(run)}" for i, run in enumerate(runs))
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{_e(title)}</h1>"
        f'<p class="note">Written {datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")} by shopsimrl {_e(version("shopsimrl"))}.</p>'
        + "".join(sections)
        + "</body></html>"
    )
    return Report(page, [title for title, _, _ in plots])


def write_report(
    locations: Sequence[str],
    output: Path,
    *,
    allow_partial: bool = False,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Report:
    """Read the runs, build the page and write it to ``output``, whole or not at all, never into
    a run (raises RunReadError, CompareError and the errors of :mod:`shopsimrl.research.outputs`)."""
    check_output_location(locations, output)
    report = build_report(
        [load_run(location) for location in locations], allow_partial=allow_partial, resamples=resamples, seed=seed
    )
    write_output(output, report.html.encode("utf-8"))
    return report
