"""The research commands over finished runs: ``compare``, ``report``, ``labels``, ``show``,
``view``, ``export …``, ``gate …``, ``judge …``. The core CLI registers them from its table of
optional parts (:mod:`shopsimrl.cli`); their errors map to exit codes in :mod:`shopsimrl.cli.errors`.

Module level imports typer and the core CLI only: ``shopsimrl --help`` reads this module, and
the research modules (numpy, pandas, starlette) load when a command runs."""

from __future__ import annotations

import json
import os
import sys
from contextlib import AbstractContextManager, ExitStack
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from shopsimrl.cli.common import (
    HELP_STYLE,
    QUIET,
    TRACK,
    VERBOSE,
    setup_logging,
    track_with,
    tracking_settings,
    warn,
    worker_settings,
)
from shopsimrl.cli.errors import READ_FAILED, BadInputError, TryAgainError, context, import_part
from shopsimrl.cli.shards import reduce_and_report
from shopsimrl.exitcodes import ExitCode

app = typer.Typer(rich_markup_mode=None)

# ----------------------------------------------------------------------------- research: compare, report

RESAMPLES = typer.Option(10_000, "--resamples", min=1, help="Bootstrap resamples of tasks.")
BOOTSTRAP_SEED = typer.Option(20260901, "--seed", help="Seed of the bootstrap resampling.")
ALLOW_PARTIAL = typer.Option(
    False,
    "--allow-partial",
    help="Compare the episodes the runs share when their job keys differ, and say how many were dropped.",
)


def _output(option: str) -> AbstractContextManager[None]:
    """An output written by the one rule of research/outputs.py: its errors (refused or
    uncreatable: exit 2; failed partway: exit 3) name ``option``."""
    from shopsimrl.research.outputs import OutputError, OutputStorageError

    return context(OutputError, OutputStorageError, prefix=f"{option} ")


def _output_io() -> ExitStack:
    """Writing ``-o/--output`` from a run: an I/O error of the output names it, any other I/O
    error is the run's storage or the disk failing under way (both exit 3)."""
    from shopsimrl.research.outputs import OutputStorageError

    stack = ExitStack()
    stack.enter_context(context(OSError, prefix=READ_FAILED))
    stack.enter_context(context(OutputStorageError, prefix="-o/--output: "))  # the inner one names it first
    return stack


@app.command("compare")
def compare(
    runs: list[str] = typer.Argument(
        ..., metavar="RUN_A RUN_B [RUN...]", help="Runs (directories or URIs); the first is the baseline."
    ),
    json_out: str | None = typer.Option(
        None, "--json", metavar="OUT", help="Also write the comparison as JSON to OUT ('-': stdout only)."
    ),
    allow_partial: bool = ALLOW_PARTIAL,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Paired comparison of runs of one job list: each run against the first, episode by episode."""
    setup_logging(quiet, verbose)
    if len(runs) < 2:
        raise BadInputError("compare needs at least two runs (RUN_A RUN_B)")
    module = import_part("shopsimrl.research.compare", "research")
    from shopsimrl.research.outputs import check_output_location, write_output

    with _output("--json"):
        if json_out not in (None, "-"):
            check_output_location(runs, Path(json_out))
        result = module.compare_runs(runs, allow_partial=allow_partial, resamples=resamples, seed=seed)
    text = json.dumps(result, indent=2, ensure_ascii=False)
    if json_out == "-":
        typer.echo(text)
        return
    typer.echo(module.format_comparison(result))
    if json_out is not None:
        with _output("--json"):
            write_output(Path(json_out), (text + "\n").encode("utf-8"))


@app.command("report")
def report(
    runs: list[str] = typer.Argument(
        ..., metavar="RUN [RUN...]", help="Runs (directories or URIs) in the order to show; the first is the baseline."
    ),
    output: Path = typer.Option(..., "-o", "--output", help="The HTML file to write."),
    allow_partial: bool = ALLOW_PARTIAL,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """One self-contained HTML page over the runs: identity, plots, paired differences."""
    setup_logging(quiet, verbose)
    module = import_part("shopsimrl.research.report", "research")
    with _output("-o"):
        written = module.write_report(runs, output, allow_partial=allow_partial, resamples=resamples, seed=seed)
    typer.echo(f"{output}: {len(runs)} runs, {len(written.figures)} figures")


# ----------------------------------------------------------------------------- skill gates

gate_app = typer.Typer(help="Skill gates: paired val rollouts that measure what each skill chunk is worth.", **HELP_STYLE)
app.add_typer(gate_app, name="gate")
GATE_CONFIG = typer.Argument(..., metavar="GATE.yaml", help="Gate config (a gate_a or an online_gate section).")

FAILED_EPISODES = typer.Option(
    None, "--failed-episodes", metavar="refuse|drop", help="Failed masked episodes: refuse (default) or drop their pairs."
)
MAX_DROPPED_SHARE = typer.Option(
    None, "--max-dropped-share", help="With drop: the largest share of pairs dropped (default 0.02)."
)


def _gate_call(call: Any) -> Any:
    """Run one gate step (its errors are the table's, in shopsimrl/cli/errors.py)."""
    return call(import_part("shopsimrl.research.gate.commands", "research"))


def _gate_command(quiet: bool, verbose: bool, step: Any, show: Any) -> Any:
    """A gate command: logging, the worker's settings, ``step(gate, settings)``, and its result
    printed by ``show(gate, result)``; returns the result."""
    setup_logging(quiet, verbose)
    settings = worker_settings()
    result = _gate_call(lambda gate: step(gate, settings))
    typer.echo(_gate_call(lambda gate: show(gate, result)))
    return result


@gate_app.command("plan")
def gate_plan(
    gate_config: Path = GATE_CONFIG,
    shards: int | None = typer.Option(None, "--shards", min=1, help="Freeze the masked rollouts as a sharded run of N shards."),
    run_uri: str | None = typer.Option(
        None, "--run", help="With --shards: the masked run's location (a directory or an s3:// URI)."
    ),
    helm_values: Path | None = typer.Option(
        None, "--helm-values", help="With --shards and --run: write the Helm chart's values for the masked run."
    ),
    failed_episodes: str | None = FAILED_EPISODES,
    max_dropped_share: float | None = MAX_DROPPED_SHARE,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Check the bare run and the mask design, and freeze the gate (no rollout, no model call)."""
    _gate_command(
        quiet,
        verbose,
        lambda gate, settings: gate.plan_gate(
            gate_config,
            shards=shards,
            run=run_uri,
            settings=settings,
            helm_values=helm_values,
            failed_episodes=failed_episodes,
            max_dropped_share=max_dropped_share,
        ),
        lambda gate, report: gate.format_plan(report),
    )


@gate_app.command("run")
def gate_run(
    gate_config: Path = GATE_CONFIG,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a live progress bar."),
    shards: int | None = typer.Option(
        None, "--shards", min=1, help="Run the masked rollouts as N shard worker processes (like `run --shards`)."
    ),
    run_uri: str | None = typer.Option(None, "--run", help="With --shards: the masked run's location (dir or s3://)."),
    backoff_limit_per_index: int = typer.Option(2, min=0, help="With --shards: restarts of a crashed shard worker."),
    failed_episodes: str | None = FAILED_EPISODES,
    max_dropped_share: float | None = MAX_DROPPED_SHARE,
    track: list[str] | None = TRACK,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Plan, run the masked rollouts here (resumable) and fit. Exit 1: the gate is incomplete.

    With --shards N --run URI: plan them as a sharded run, run N workers as `run --shards` does
    (resumable the same way), reduce, then fit. --track: the fit's figures to W&B or MLflow."""
    tracking = tracking_settings(track)
    drops = {"failed_episodes": failed_episodes, "max_dropped_share": max_dropped_share}
    if shards is not None or run_uri is not None:
        setup_logging(quiet, verbose)
        _gate_run_sharded(gate_config, shards, run_uri, backoff_limit_per_index, progress, worker_settings(), tracking, drops)
        return
    result = _gate_command(
        quiet,
        verbose,
        lambda gate, settings: gate.run_gate(
            gate_config,
            settings=settings,
            show_progress=progress,
            announce=lambda line: typer.echo(line, err=True),
            **drops,
        ),
        lambda gate, result: gate.format_result(result),
    )
    _track_gate(tracking, result)
    raise typer.Exit(int(result.code))


def _track_gate(tracking: Any, result: Any) -> None:
    track_with(tracking, lambda trackers: trackers.track_gate(tracking, result))


def _gate_run_sharded(
    gate_config: Path,
    shards: int | None,
    run_uri: str | None,
    backoff_limit: int,
    progress: bool,
    settings: Any,
    tracking: Any = None,
    drops: dict[str, Any] | None = None,
) -> None:
    from shopsimrl.runner.local_job import run_indexed
    from shopsimrl.runner.progress import ShardedRunProgress

    if shards is None or run_uri is None:
        raise BadInputError("--shards and --run go together: a sharded masked run needs a location (a dir or s3://…)")
    drops = drops or {}
    report = _gate_call(lambda gate: gate.plan_gate(gate_config, shards=shards, run=run_uri, settings=settings, **drops))
    typer.echo(
        f"gate {report.gate_dir.name}: {report.episodes} masked rollouts in {shards} shards → {report.masked_run}", err=True
    )
    jobs_per_shard = [len(range(index, report.episodes, shards)) for index in range(shards)]  # the round-robin shard map
    with ShardedRunProgress(jobs_per_shard, enabled=progress and sys.stderr.isatty()) as bar:
        outcome = run_indexed(
            run_uri,
            report.masked_config.resolve(),
            shards,
            backoff_limit_per_index=backoff_limit,
            on_event=bar.on_worker_event,
            on_tick=bar.tick,
        )
    if outcome.exit_code in (ExitCode.FINGERPRINT_MISMATCH, ExitCode.BAD_INPUT) or outcome.interrupted:
        raise typer.Exit(int(outcome.exit_code))
    reduced = reduce_and_report(run_uri, wait=False, timeout=0.0, include_uncommitted=False)
    if reduced not in (ExitCode.OK, ExitCode.EPISODES_FAILED):
        raise typer.Exit(int(reduced))
    result = _gate_call(lambda gate: gate.fit_gate(gate_config, settings=settings, **drops))
    typer.echo(_gate_call(lambda gate: gate.format_result(result)))
    _track_gate(tracking, result)
    raise typer.Exit(int(result.code))


@gate_app.command("fit")
def gate_fit(
    gate_config: Path = GATE_CONFIG,
    masked_run: str | None = typer.Option(
        None, "--masked-run", help="The masked run (dir or URI); default: where `gate plan` put it."
    ),
    failed_episodes: str | None = FAILED_EPISODES,
    max_dropped_share: float | None = MAX_DROPPED_SHARE,
    track: list[str] | None = TRACK,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Fit the contributions from the bare and the masked run, offline. Exit 1: the gate is incomplete.

    A gate directory of the earlier implementation is refitted into its refit/ directory."""
    tracking = tracking_settings(track)
    result = _gate_command(
        quiet,
        verbose,
        lambda gate, settings: gate.fit_gate(
            gate_config,
            masked_run=masked_run,
            settings=settings,
            failed_episodes=failed_episodes,
            max_dropped_share=max_dropped_share,
        ),
        lambda gate, result: gate.format_result(result),
    )
    _track_gate(tracking, result)
    raise typer.Exit(int(result.code))


# ----------------------------------------------------------------------------- judge


class _JudgeGroup(TyperGroup):
    """``shopsimrl judge JUDGE.yaml`` is ``shopsimrl judge run JUDGE.yaml``: a first argument
    that names no subcommand is the config."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)


judge_app = typer.Typer(
    cls=_JudgeGroup,
    help="The offline judge: a judge model's verdicts on a frozen run (JUDGE.yaml), local or sharded.",
    **HELP_STYLE,
)
app.add_typer(judge_app, name="judge")
JUDGE_CONFIG = typer.Argument(..., metavar="JUDGE.yaml", help="Judge config: source run, rubric, judge model, selection.")


def _judge_call(call: Any) -> Any:
    """Run one judge step (its errors are the table's, in shopsimrl/cli/errors.py)."""
    return call(import_part("shopsimrl.research.judge.commands", "research"))


def _judge_report(result: Any) -> NoReturn:
    typer.echo(_judge_call(lambda judge: judge.format_summary(result.summary, result.outputs, result.summary_path)))
    code = result.code if hasattr(result, "code") else (ExitCode.EPISODES_FAILED if result.errors else ExitCode.OK)
    raise typer.Exit(int(code))


@judge_app.command("run")
def judge_run(
    judge_config: Path = JUDGE_CONFIG,
    shards: int | None = typer.Option(None, "--shards", min=1, help="Judge as N shards (local Indexed Job), then reduce."),
    out: str | None = typer.Option(None, "--out", help="With --shards: the judge location (a directory or an s3:// URI)."),
    parallelism: int | None = typer.Option(None, "--parallelism", min=1, help="With --shards: workers at once (default N)."),
    track: list[str] | None = TRACK,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Judge the selected episodes (resumable). Exit 1: some episodes are not judged yet (rerun).
    --track: the judge summary's figures to W&B or MLflow."""
    setup_logging(quiet, verbose)
    tracking = tracking_settings(track)
    result = _judge_call(lambda judge: judge.judge_run(judge_config, shards=shards, out=out, parallelism=parallelism))
    track_with(tracking, lambda trackers: trackers.track_judge(tracking, result, judge_config))
    _judge_report(result)


@judge_app.command("plan")
def judge_plan(
    judge_config: Path = JUDGE_CONFIG,
    shards: int = typer.Option(..., "--shards", min=1, help="Number of shards."),
    out: str = typer.Option(..., "--out", help="The judge location (a directory or an s3:// URI)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Freeze the selected episodes' judge inputs, the rubric and the settings as N shards."""
    setup_logging(quiet, verbose)
    plan = _judge_call(lambda judge: judge.judge_plan(judge_config, shards, out))
    typer.echo(f"judge plan {plan.fingerprint[:12]}… · {plan.document['selected']} episodes · {plan.shards} shards · {out}")


@judge_app.command("worker")
def judge_worker(
    judge_config: Path = JUDGE_CONFIG,
    out: str = typer.Option(..., "--out", help="The judge location the plan is at."),
    index: int | None = typer.Option(None, "--index", min=0, help="Shard index (default: JOB_COMPLETION_INDEX)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Judge one shard (resumable) and commit it. Exit 1: some episodes ended in error; 3: stopped by a signal (verdicts saved)."""
    setup_logging(quiet, verbose)
    raise typer.Exit(int(_judge_call(lambda judge: judge.judge_worker(judge_config, out, index))))


@judge_app.command("status")
def judge_status_command(
    location: str = typer.Argument(..., metavar="URI", help="The judge location."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Per-shard progress of a sharded judge from its commit markers and part listings (no part is read)."""
    setup_logging(quiet, verbose)
    report = _judge_call(lambda judge: judge.judge_status(location))
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False, indent=2))
        return
    typer.echo(
        f"judge {report['judge_location']} · {report['judge_fingerprint'][:12]} · {report['episodes']} episodes · "
        f"{report['committed_shards']}/{len(report['shards'])} shards committed ({report['judged_in_committed_shards']} judged) · "
        + ("no summary yet" if report["summary_over_shards"] is None else f"summary over {report['summary_over_shards']} shards")
    )
    for row in report["shards"]:
        if row["state"] == "committed":
            detail = f"{row['judged']}/{row['episodes']} judged" + (f" · errors {row['errors']}" if row["errors"] else "")
        elif row["parts"] and report["flush_every"]:
            detail = (
                f"at most {row['parts'] * report['flush_every']} of {row['episodes']} judged (parts of ≤ {report['flush_every']})"
            )
        else:
            detail = f"{row['episodes']} episodes"
        typer.echo(f"  shard {row['shard']:>5}  {row['state']:<14} {detail} · parts {row['parts']}")


@judge_app.command("wait-ready")
def judge_wait_ready(
    judge_config: Path = JUDGE_CONFIG,
    timeout: float = typer.Option(600.0, min=0, help="Give up after this many seconds."),
    interval: float = typer.Option(5.0, min=0.1, help="Seconds between probes."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Wait until the judge model lists the configured model (exit 3 on timeout)."""
    setup_logging(quiet, verbose)
    ready, detail = _judge_call(lambda judge: judge.judge_wait_ready(judge_config, timeout=timeout, interval=interval))
    if not ready:
        raise TryAgainError(f"the judge model is not ready after {timeout:g} s: {detail}")
    typer.echo(f"ready: {detail}")


@judge_app.command("reduce")
def judge_reduce(
    location: str = typer.Argument(..., metavar="URI", help="The judge location."),
    wait: bool = typer.Option(False, "--wait", help="First wait for the plan and every shard's commit (at most --timeout)."),
    timeout: float = typer.Option(86400.0, "--timeout", min=0, help="With --wait: seconds to wait at most."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """judge_outputs.jsonl and judge_summary.json from the committed shards. Exit 1: incomplete."""
    setup_logging(quiet, verbose)
    _judge_report(_judge_call(lambda judge: judge.judge_reduce(location, timeout if wait else None)))


# ----------------------------------------------------------------------------- labels and exports

export_app = typer.Typer(help="Write data sets derived from a run (redacted by default), never into the run.", **HELP_STYLE)
app.add_typer(export_app, name="export")

RUN_ARGUMENT = typer.Argument(
    ..., metavar="RUN", help="A local run directory, a sharded run (a directory or s3://bucket/path), or v4 traces."
)
INCLUDE = typer.Option(
    "",
    "--include",
    help="Comma-separated: reasoning, persona (judge-input also goal). Left out unless named; export sft keeps the "
    "persona the policy saw without its user id and times, and persona includes it in full.",
)


def _open_research_run(location: str) -> Any:
    return import_part("shopsimrl.storage.reading", "research").open_run(location)


@app.command("labels")
def labels_command(
    location: str = RUN_ARGUMENT,
    output: Path | None = typer.Option(
        None,
        "-o",
        "--output",
        help="Where to write the label records (JSONL; default: beside a local RUN, RUN.labels.jsonl).",
        show_default=False,
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Rule labels for every episode (failure taxonomy with step evidence), and the counts per label."""
    setup_logging(quiet, verbose)
    labels = import_part("shopsimrl.research.labels", "research")
    output = output or _beside_run(location, ".labels.jsonl")
    run = _open_research_run(location)
    with _output_io():
        counts = labels.write_labels(run, output)
    typer.echo(f"{counts.labels_version}: {counts.episodes} episodes, {counts.clean} without a label")
    for name, count in counts.labels.items():
        codes = ", ".join(f"{code} {number}" for code, number in counts.codes.get(name, {}).items())
        typer.echo(f"  {name:<24} {count:>6}" + (f"  ({codes})" if codes else ""))
    typer.echo(f"labels: {output}")


def _beside_run(location: str, suffix: str) -> Path:
    """The default output of a research tool: next to the run (never inside it, never in the
    current directory): ``runs/x`` → ``runs/x<suffix>``, a traces file ``t.jsonl`` → ``t<suffix>``."""
    if "://" in location:
        raise BadInputError(f"-o/--output: {location} is not on this machine; name the file to write")
    path = Path(location)
    return path.with_name(path.stem + suffix) if path.is_file() else path.resolve().parent / (path.resolve().name + suffix)


def _include(text: str, allowed: tuple[str, ...]) -> frozenset[str]:
    from shopsimrl.research.redaction import parse_include

    try:
        return parse_include(text, allowed)
    except ValueError as exc:  # parse_include's plain ValueError: too broad for the table
        raise BadInputError(str(exc)) from exc


@export_app.command("sft")
def export_sft_command(
    location: str = RUN_ARGUMENT,
    output: Path = typer.Option(..., "-o", "--output", help="The SFT file (OpenAI chat fine-tuning JSONL)."),
    select: str = typer.Option("success", help="Episodes: success (completed, r_success == 1) or completed."),
    include: str = INCLUDE,
    near_duplicate: float = typer.Option(0.9, help="Estimated Jaccard similarity at which an episode is a near duplicate."),
    report: Path | None = typer.Option(None, help="The dedup and coverage report (default: OUTPUT's stem + .report.json)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Chat fine-tuning records of the selected episodes, deduplicated, with a report."""
    setup_logging(quiet, verbose)
    export = import_part("shopsimrl.research.export", "research")
    included = _include(include, ("reasoning", "persona", "goal"))
    if not 0.0 < near_duplicate <= 1.0:
        raise BadInputError(f"--near-duplicate must be in (0, 1], got {near_duplicate}")
    run = _open_research_run(location)
    with _output_io():
        summary = export.export_sft(run, output, include=included, select=select, near_duplicate=near_duplicate, report=report)
    dropped = ", ".join(f"{reason} {count}" for reason, count in summary["dropped"]["by_reason"].items()) or "none"
    coverage = summary["coverage"]
    typer.echo(
        f"selected {summary['selection']['selected']} of {summary['selection']['episodes_in_run']} episodes · "
        f"kept {summary['kept']} · dropped {dropped} · {summary['records']} records"
    )
    typer.echo(
        f"coverage: tasks {coverage['tasks']['kept']}/{coverage['tasks']['selected']} selected · "
        f"categories {coverage['categories_kept']}/{len(coverage['categories'])}"
    )
    typer.echo(f"sft: {output}\nreport: {report or export.report_path_for(output)}")


@export_app.command("judge-input")
def export_judge_input_command(
    location: str = RUN_ARGUMENT,
    output: Path = typer.Option(..., "-o", "--output", help="The judge input (JSONL, one episode a line)."),
    select: str = typer.Option("completed", help="Episodes: success, completed or all."),
    include: str = INCLUDE,
    report: Path | None = typer.Option(None, help="The selection report (default: OUTPUT's stem + .report.json)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """What a judge may see of each selected episode: task, transcript, public outcome; no reward."""
    setup_logging(quiet, verbose)
    export = import_part("shopsimrl.research.export", "research")
    included = _include(include, ("reasoning", "persona", "goal"))
    run = _open_research_run(location)
    with _output_io():
        summary = export.export_judge_input(run, output, include=included, select=select, report=report)
    typer.echo(
        f"selected {summary['selection']['selected']} of {summary['selection']['episodes_in_run']} episodes · {summary['records']} records"
    )
    typer.echo(f"judge input: {output}\nreport: {report or export.report_path_for(output)}")


# ----------------------------------------------------------------------------- research: show, view, export table


@app.command("show")
def show(
    run_location: str = RUN_ARGUMENT,
    episode_id: str = typer.Argument(..., metavar="EPISODE_ID", help="e.g. task-000012__sample-001"),
    thinking: bool = typer.Option(False, "--thinking", help="Print each step's thinking in full (default: its beginning)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Print one episode's transcript: instruction, persona, every observation as the model saw
    it, thinking, tool calls, feedback, per-step latency and usage, reward detail."""
    from rich.console import Console

    from shopsimrl.research.transcript import read_transcript, render_terminal
    from shopsimrl.storage.reading import open_run

    setup_logging(quiet, verbose)

    def transcript() -> Any:
        run = open_run(run_location)
        return run, read_transcript(*run.find(episode_id))

    run, episode = transcript()
    render_terminal(episode, Console(highlight=False, soft_wrap=False), thinking=thinking, location=run.location)


@app.command("view")
def view(
    run_location: str = RUN_ARGUMENT,
    port: int = typer.Option(8700, "--port", min=0, max=65535, help="Port (0: any free one, printed)."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Bind address; anything but loopback exposes the traces unauthenticated."
    ),
    allow_host: list[str] = typer.Option(
        [],
        "--allow-host",
        metavar="NAME",
        help="Also answer requests for this host name (repeatable); by default only localhost names and the bind address.",
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Serve a read-only web viewer of a run: the episode table (filters, sorting, pages) and
    each episode step by step. The run is read once at start."""
    viewer = import_part("shopsimrl.research.viewer", "research")
    from shopsimrl.storage.reading import open_run

    setup_logging(quiet, verbose)
    bad_names = [name for name in allow_host if not viewer.valid_host_name(name)]
    if bad_names:
        raise BadInputError(f"--allow-host {bad_names[0]!r}: not a host name or IP address (no scheme, port or path)")
    run = open_run(run_location)
    with context(viewer.ViewerError, prefix="--host/--port: "):
        sock = viewer.bind(host, port)
    typer.echo(f"reading {run.location} …", err=True)
    viewer.serve(run, sock, announce=lambda line: typer.echo(line, err=True), host=host, allow_hosts=allow_host)


class TableFormat(StrEnum):
    parquet = "parquet"
    csv = "csv"


class TableLevel(StrEnum):
    episodes = "episodes"
    steps = "steps"


@export_app.command("table")
def export_table(
    run_locations: list[str] = typer.Argument(
        ...,
        metavar="RUN_OR_LOCATION...",
        help="A run (a local run directory, a sharded run, v4 traces), or a folder or s3:// prefix holding runs "
        "(found as `shopsimrl runs` finds them); several: one table, each row with its run's identity columns.",
    ),
    to: TableFormat = typer.Option(..., "--to", help="File format."),
    level: TableLevel = typer.Option(TableLevel.episodes, "--level", help="One row per episode, or one per step (model call)."),
    output: Path = typer.Option(..., "-o", "--output", help="The file to write (replaced whole at the end)."),
    identity: bool = typer.Option(
        False, "--identity", help="Add the run's identity columns (run_location, run_experiment, ...) to a single run's rows too."
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Several runs: fail (exit 2) on a run that cannot be read, instead of leaving it out with a warning.",
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Write a run's episodes or steps as Parquet or CSV, streamed in row batches; or those of
    several runs (a location holding runs, or several runs given) as one table whose rows carry
    their run's identity. A Parquet file lists the runs in its key/value metadata (shopsimrl.runs)."""
    tables = import_part("shopsimrl.research.tables", "research")
    from shopsimrl.research.runset import RunSet, SkippedRun, resolve

    setup_logging(quiet, verbose)
    source = resolve(run_locations[0] if len(run_locations) == 1 else run_locations)
    skipped: list[SkippedRun] = []

    def warn(run: SkippedRun) -> None:
        skipped.append(run)
        typer.echo(f"warning: left out a run that cannot be read: {run.error}", err=True)

    with _output("-o/--output:"):
        rows = tables.export_table(
            source, output, to=to.value, level=level.value, identity=identity or None, strict=strict, on_skip=warn
        )
    if isinstance(source, RunSet):
        read = len(source) - len(skipped)
        left_out = f" ({len(skipped)} left out: see the warnings)" if skipped else ""
        typer.echo(f"wrote {rows} {level.value[:-1]} rows of {read} runs to {output}{left_out}")
    else:
        typer.echo(f"wrote {rows} {level.value[:-1]} rows to {output}")


# --------------------------------------------------------------------------- skills

skills_app = typer.Typer(help="The skill builder: skill chunks from a frozen train run's traces, for the gates.", **HELP_STYLE)
app.add_typer(skills_app, name="skills")


@skills_app.command("build")
def skills_build(
    skills_config: Path = typer.Argument(..., metavar="SKILLS.yaml", help="Traces, output folder, analyst and compiler models."),
    shards: int | None = typer.Option(None, "--shards", min=1, help="Analyse in N local worker processes (needs --run)."),
    run: str | None = typer.Option(None, "--run", help="With --shards: the analysis location (directory or s3:// URI)."),
    parallelism: int | None = typer.Option(None, "--parallelism", min=1, help="With --shards: workers at once."),
    track: list[str] | None = TRACK,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Analyse the trajectories (the failed ones in live ShopSimulator sessions),
    consolidate the cards, compile the Gate A draft (resumable: each stage skips what its
    input fingerprint says is done). With --shards: the analysis as plan, worker processes
    and reduce first. Exit 1: a stage is not complete (rerun). --track: the stage's figures to
    W&B or MLflow."""
    setup_logging(quiet, verbose)
    build = import_part("shopsimrl.research.skills.build", "research")
    config = build.load_skills_config(skills_config)
    tracking = _skills_tracking(config, track)
    if (shards is None) != (run is None):
        raise BadInputError("--shards and --run go together (the sharded analysis needs a location)")
    if shards is not None and run is not None:
        reduced = _skills_sharded_analysis(skills_config, config, shards, run, parallelism)
        if reduced is not None:
            raise typer.Exit(int(reduced))
    result = build.build_skills(config)
    typer.echo(build.format_build(result))
    track_with(
        tracking,
        lambda trackers: trackers.log_skill_stage(
            tracking,
            name=skills_config.stem,
            analysis=result.analysis,
            consolidation=result.consolidation,
            manifest=result.manifest,
            output_dir=result.output_dir,
        ),
    )
    raise typer.Exit(int(ExitCode.OK if result.complete else ExitCode.EPISODES_FAILED))


SKILLS_CONFIG = typer.Argument(..., metavar="SKILLS.yaml", help="Traces, output folder, analyst and compiler models.")
SKILLS_RUN = typer.Option(..., "--run", help="The analysis location: a directory or an s3:// URI.")


def _skills_sharded() -> Any:
    return import_part("shopsimrl.research.skills.sharded", "research")


@skills_app.command("plan")
def skills_plan(
    skills_config: Path = SKILLS_CONFIG,
    run: str = SKILLS_RUN,
    shards: int = typer.Option(..., "--shards", min=1, help="Number of shards (worker indexes)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Freeze the traces, their input fingerprints and the analysts as N shards at --run."""
    setup_logging(quiet, verbose)
    sharded = _skills_sharded()
    build = import_part("shopsimrl.research.skills.build", "research")
    plan = sharded.plan_skills(build.load_skills_config(skills_config), run, shards)
    episodes = plan.document["episodes"]
    todo = sum(1 for episode in episodes if episode["input_fingerprint"] is not None)
    typer.echo(
        f"skills plan {plan.fingerprint[:12]} · {len(episodes)} episodes ({todo} to analyse) · {plan.shards} shards · {run}"
    )


@skills_app.command("worker")
def skills_worker(
    skills_config: Path = SKILLS_CONFIG,
    run: str = typer.Option(..., "--run", help="The analysis location the plan is at."),
    index: int | None = typer.Option(None, "--index", min=0, help="Shard index (default: JOB_COMPLETION_INDEX)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Analyse one shard's trajectories (resumable) and commit it. Exit 1: some analyses
    failed; 3: stopped by a signal (analyses saved)."""
    setup_logging(quiet, verbose)
    sharded = _skills_sharded()
    build = import_part("shopsimrl.research.skills.build", "research")
    if index is None:
        raw = os.environ.get("SHOPSIMRL_SHARD_INDEX") or os.environ.get("JOB_COMPLETION_INDEX")
        if raw is None or not raw.isdigit():
            raise BadInputError("no shard index: pass --index, or set JOB_COMPLETION_INDEX (an Indexed Job sets it)")
        index = int(raw)
    raise typer.Exit(int(sharded.run_skills_worker(build.load_skills_config(skills_config), run, index)))


@skills_app.command("wait-ready")
def skills_wait_ready(
    skills_config: Path = SKILLS_CONFIG,
    timeout: float = typer.Option(600.0, min=0, help="Give up after this many seconds."),
    interval: float = typer.Option(5.0, min=0.1, help="Seconds between probes."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Wait until the analyst server lists the analyst model and, when a shop is configured,
    ShopSimulator says ready (exit 3 on timeout; a worker pod's init container)."""
    setup_logging(quiet, verbose)
    sharded = _skills_sharded()
    build = import_part("shopsimrl.research.skills.build", "research")
    settings = worker_settings()
    processes = min(settings.parallelism or settings.shards or 1, settings.shards or settings.parallelism or 1)
    result = sharded.skills_wait_ready(
        build.load_skills_config(skills_config), timeout=timeout, interval=interval, processes=processes
    )
    for warning in result.warnings:
        warn(warning)
    if not result.ready:
        raise TryAgainError(f"{result.reason} after {timeout:g} s: {result.detail}")
    typer.echo(f"ready: {result.detail}")


@skills_app.command("status")
def skills_status_command(
    location: str = typer.Argument(..., metavar="URI", help="The analysis location."),
    as_json: bool = typer.Option(False, "--json", help="The report as JSON."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Per-shard progress of a sharded analysis from its markers (no part is read)."""
    setup_logging(quiet, verbose)
    sharded = _skills_sharded()
    report = sharded.skills_status(location)
    typer.echo(json.dumps(report, indent=2) if as_json else sharded.format_status(report))


@skills_app.command("reduce")
def skills_reduce(
    location: str = typer.Argument(..., metavar="URI", help="The analysis location."),
    output: Path | None = typer.Option(None, "--output", help="Also write the files here (for skills build)."),
    wait: bool = typer.Option(False, "--wait", help="First wait for the plan and every shard's commit."),
    timeout: float = typer.Option(86400.0, "--timeout", min=0, help="With --wait: seconds to wait at most."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """The local stage's analysis files from the committed shards. Exit 1: incomplete."""
    setup_logging(quiet, verbose)
    sharded = _skills_sharded()
    result = sharded.reduce_skills(location, output_dir=output, wait_s=timeout if wait else None)
    typer.echo(sharded.format_reduce(result))
    raise typer.Exit(int(result.code))


def _skills_sharded_analysis(path: Path, config: Any, shards: int, run: str, parallelism: int | None) -> ExitCode | None:
    """Plan, run the workers as a local Indexed Job, reduce into the output folder; the exit
    code when the analysis is not complete (build then stops), else None."""
    from shopsimrl.runner.local_job import run_indexed

    sharded = _skills_sharded()
    sharded.plan_skills(config, run, shards)
    command = [sys.executable, "-m", "shopsimrl", "skills", "worker", str(path), "--run", run]
    indexed = run_indexed(run, path, shards, parallelism=parallelism, command=command)
    if indexed.interrupted:
        raise TryAgainError("interrupted; run the same command again to resume")
    result = sharded.reduce_skills(run, output_dir=config.resolve(config.experiment.output_dir))
    typer.echo(sharded.format_reduce(result))
    return None if result.code == ExitCode.OK else result.code


@skills_app.command("analyze")
def skills_analyze(
    online_config: Path = typer.Argument(..., metavar="ONLINE.yaml", help="Training round, current bank, output, models."),
    track: list[str] | None = TRACK,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Analyse every full-skill retry the training triage left pending, then compile the online
    candidate pool. Any failure still writes a pool with no candidate (the gate then runs on the
    current bank). Exit 1: an analysis or the consolidation failed (rerun). --track: the
    round's figures to W&B or MLflow."""
    setup_logging(quiet, verbose)
    online = import_part("shopsimrl.research.skills.online", "research")
    config = online.load_online_config(online_config)
    tracking = _skills_tracking(config, track)

    def log_round(result: Any) -> None:
        track_with(
            tracking,
            lambda trackers: trackers.log_online_analysis(
                tracking, name=config.online_analysis.name, summary=result.summary, output_dir=result.output_dir
            ),
        )

    try:
        result = online.analyze(config)
    except online.OnlineAnalysisFailed as failed:
        typer.echo(online.format_summary(failed.result))
        log_round(failed.result)
        if isinstance(failed.cause, BadInputError | online.SkillInputError):
            typer.echo(f"error: {failed.cause}", err=True)
            raise typer.Exit(int(ExitCode.BAD_INPUT)) from None
        typer.echo(f"error: {type(failed.cause).__name__}: {failed.cause}", err=True)
        raise typer.Exit(int(ExitCode.EPISODES_FAILED)) from None
    typer.echo(online.format_summary(result))
    log_round(result)
    raise typer.Exit(result.exit_code)


@skills_app.command("watch")
def skills_watch(
    online_config: Path = typer.Argument(..., metavar="ONLINE.yaml", help="Training round, current bank, output, models."),
    poll_seconds: float = typer.Option(5.0, "--poll-seconds", min=0.05, help="Seconds between two looks at the triage."),
    stop_file: Path | None = typer.Option(None, "--stop-file", help="Stop once this file exists."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Analyse new triage files while training runs, until SIGTERM, SIGINT or the stop file
    (exit 0). Then run skills analyze to drain the rest and compile the pool."""
    setup_logging(quiet, verbose)
    online = import_part("shopsimrl.research.skills.online", "research")
    config = online.load_online_config(online_config)
    result = online.watch(config, poll_seconds=poll_seconds, stop_file=stop_file, echo=typer.echo)
    typer.echo(
        f"watch stopped ({result.stopped_by}) after {result.polls} polls: "
        f"{result.analysed} retries analysed, {result.errors} ANALYST_ERROR"
    )


def _skills_tracking(config: Any, names: list[str] | None) -> Any:
    """SKILLS.yaml's ``tracking:`` block (its ``dir`` relative to the file) with --track added."""
    from shopsimrl.config import TrackingSection

    tracking_settings(names)  # an unknown --track name exits 2 before anything runs
    block = config.tracking if config.tracking is not None else TrackingSection()
    settings = block.with_trackers(list(names or ()))
    if not settings.backends:
        return None
    if settings.dir is not None:
        settings = settings.model_copy(update={"dir": str(config.resolve(settings.dir))})
    return settings


DRAFT_DIR = typer.Argument(..., metavar="DRAFT_DIR", help="The folder `skills build` wrote the draft to.")


@skills_app.command("review")
def skills_review(
    draft_dir: Path = DRAFT_DIR,
    accept: list[str] | None = typer.Option(None, "--accept", metavar="ID", help="Accept this chunk (repeatable)."),
    reject: list[str] | None = typer.Option(None, "--reject", metavar="ID", help="Reject this chunk (repeatable)."),
    reviewer: str | None = typer.Option(None, "--reviewer", help="Who decides (required without --file)."),
    note: str = typer.Option("", "--note", help="Why: kept with every decision of this call."),
    review_file: Path | None = typer.Option(
        None, "--file", metavar="REVIEW.yaml", help="Decisions from a file: reviewer, decisions."
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Accept or reject chunks of a compiled draft: each decision (reviewer, note, time) is
    appended to DRAFT_DIR/skill_review.jsonl; the latest one of a chunk counts."""
    setup_logging(quiet, verbose)
    snapshot = import_part("shopsimrl.research.skills.snapshot", "research")
    decisions = [(i, "accepted", note) for i in accept or []] + [(i, "rejected", note) for i in reject or []]
    if review_file is not None:
        if decisions or reviewer is not None:
            raise BadInputError("--file carries its reviewer and decisions: give no --accept, --reject or --reviewer with it")
        reviewer, decisions = snapshot.load_review_file(review_file)
    if reviewer is None:
        raise BadInputError("--reviewer: required (who decides)")
    rows = snapshot.review(draft_dir, decisions, reviewer)
    for chunk_id, status in snapshot.review_status(draft_dir).items():
        typer.echo(f"{chunk_id:32} {status['status']:10} {status['reviewer'] or ''}")
    typer.echo(f"{len(rows)} decisions appended to {draft_dir / snapshot.REVIEW_NAME}")


@skills_app.command("snapshot")
def skills_snapshot(
    draft_dir: Path = DRAFT_DIR,
    out: Path | None = typer.Option(None, "--out", help="Where (default: DRAFT_DIR/skillbank.snapshot.json)."),
    selected: Path | None = typer.Option(
        None, "--selected", metavar="BANK", help="A gate's selected_skillbank.json: freeze its chunks."
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Freeze the reviewed draft as an immutable, content-addressed skillbank.snapshot.json:
    accepted chunks enabled. Exit 2: another snapshot is at that path (never overwritten)."""
    setup_logging(quiet, verbose)
    snapshot = import_part("shopsimrl.research.skills.snapshot", "research")
    result = snapshot.freeze_snapshot(draft_dir, out, selected=selected)
    document = result.snapshot
    what = "written" if result.written else "already there (identical; nothing written)"
    typer.echo(f"snapshot {document['snapshot_id']} ({document['stage']}) {what}: {result.path}")
    typer.echo(f"enabled   {', '.join(result.enabled)}")
    if result.unreviewed:
        typer.echo(f"unreviewed (recorded, not enabled): {', '.join(result.unreviewed)}", err=True)
