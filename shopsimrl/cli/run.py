"""``plan``, ``run``, ``summarize``, ``wait-ready``: one experiment config, in this process
(``run --shards`` and ``plan --shards`` hand over to :mod:`shopsimrl.cli.shards`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import structlog
import typer

from shopsimrl import eventloop
from shopsimrl.cli.common import (
    CHECKPOINT,
    EXPERIMENT,
    FINAL_TEST,
    MODEL,
    QUIET,
    REROLL_FAILED,
    RETRY_FAILED,
    SET,
    TRACK,
    VERBOSE,
    check_rerun_flags,
    command_line_overrides,
    load,
    prepare,
    setup_logging,
    track_summary,
    tracking_settings,
    warn,
    worker_settings,
)
from shopsimrl.cli.errors import BadInputError, TryAgainError, context
from shopsimrl.cli.shards import freeze_sharded_plan, run_sharded
from shopsimrl.config import ExperimentConfig
from shopsimrl.exitcodes import ExitCode
from shopsimrl.manifest import ManifestError, flatten
from shopsimrl.schemas import fingerprint

app = typer.Typer(rich_markup_mode=None)


@app.command("plan")
def plan(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="Experiment YAML."),
    final_test: bool = FINAL_TEST,
    check: bool = typer.Option(False, "--check", help="Also probe the model's /models and the environment's /healthz."),
    run_uri: str | None = typer.Option(
        None,
        "--run",
        help="Run location: a local directory (default: experiment.output_dir/experiment.name); "
        "with --shards also file:// or s3://, where the frozen plan is written.",
    ),
    shards: int | None = typer.Option(
        None, "--shards", min=1, help="Freeze a sharded plan: write manifest.json, jobs.jsonl and shards.json."
    ),
    sets: list[str] | None = SET,
    model: str | None = MODEL,
    checkpoint: str | None = CHECKPOINT,
    experiment: str | None = EXPERIMENT,
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (for scripts) instead of a table."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Show the frozen plan (episodes, seeds, fingerprint, identities, overrides) without running anything."""
    from shopsimrl.storage.local import LocalRunStore

    setup_logging(quiet, verbose)
    overrides = command_line_overrides(sets, model=model, checkpoint=checkpoint, experiment=experiment)
    config = load(config_path, overrides)
    if run_uri is not None and shards is None:
        config = config.at_run_dir(local_run_dir(run_uri))
    prepared = prepare(config, final_test)
    semantic = prepared.plan()
    plan_fp = fingerprint(semantic)
    if shards is not None:
        manifest_state = "frozen (see sharded_run)"  # written or verified below; a conflict exits 42
    else:
        try:
            existing = LocalRunStore(config.run_dir).read_manifest()
            manifest_state = (
                "none"
                if existing is None
                else ("matches" if existing.plan_fingerprint == plan_fp else "CONFLICTS (run would exit 42)")
            )
        except ManifestError as exc:
            manifest_state = f"unreadable: {exc}"
    report: dict[str, Any] = {
        "experiment": config.name,
        "run_dir": str(config.run_dir),
        "existing_manifest": manifest_state,
        "plan_fingerprint": plan_fp,
        "task_split": prepared.split.identity(),
        "selected_tasks": len({job.task_id for job in prepared.jobs}),
        "episodes": len(prepared.jobs),
        "persona": prepared.persona,
        "concurrency": config.experiment.concurrency,
        "model_in_flight": _in_flight_line(config),
        "overrides": [override.as_record() for override in config.overrides],
        "model": {"id": config.model_id, **semantic["model"]},
        "environment": semantic["environment"],
        "runtime": semantic["runtime"],
        "prompt": semantic["prompt"],
        "skills": semantic["skills"],
        "test_guard": semantic["test_guard"],
        "first_jobs": [{**job.to_dict(), "episode_id": job.episode_id} for job in prepared.jobs[:5]],
    }
    if config.cost is not None:
        # Execution only (not fingerprinted); a run keeps the prices it was created with.
        report["cost"] = config.cost.model_dump(exclude_none=True)
    missing_key = prepared.model_settings.api_key_env
    if missing_key:
        from shopsimrl.model import ModelConfigError

        try:
            prepared.model().check_api_key()
        except ModelConfigError as exc:
            report["warnings"] = [str(exc)]
    if shards is not None:
        report["sharded_run"], _ = freeze_sharded_plan(prepared, str(config.run_dir) if run_uri is None else run_uri, shards)
    if check:
        from shopsimrl.runner.experiment import check_services

        result = eventloop.run(check_services(prepared, processes=shards or 1))
        report["services"] = {"ready": result.ready, "reason": result.reason, "detail": result.detail}
        if result.slots is not None:
            report["services"]["environment_slots"] = result.slots.environment_slots
            report["services"]["free_slots"] = result.slots.free_slots
        if result.warnings:
            report.setdefault("warnings", []).extend(result.warnings)
    typer.echo(json.dumps(report, ensure_ascii=False, indent=2) if as_json else _format_plan(report))
    for warning in report.get("warnings", []):
        warn(warning)
    if check and not report["services"]["ready"]:
        raise typer.Exit(int(ExitCode.RETRYABLE))


def _in_flight_line(config: ExperimentConfig) -> str:
    from shopsimrl.inflight import START_LIMIT

    ceiling = config.model.max_concurrent_requests or config.experiment.concurrency
    if not config.model.adaptive_concurrency:
        return f"fixed at {ceiling} per process"
    return f"adaptive: from {min(START_LIMIT, ceiling)} up to {ceiling} per process"


# The plan table: these keys as headed sections, in this order; the rest as "key  value" rows.
_PLAN_SECTIONS = (
    "overrides",
    "task_split",
    "model",
    "environment",
    "runtime",
    "prompt",
    "skills",
    "test_guard",
    "cost",
    "sharded_run",
    "services",
)


def _format_plan(report: dict[str, Any]) -> str:
    """``plan``'s report for people: aligned rows, nested settings as dotted keys, the first jobs as a table."""
    top = [
        (key.replace("_", " "), value) for key, value in report.items() if key not in (*_PLAN_SECTIONS, "first_jobs", "warnings")
    ]
    lines = _aligned(top, indent="")
    for section in _PLAN_SECTIONS:
        if section == "overrides":
            # Which values replaced the YAML's, and where each came from (--set, a short form, SHOPSIMRL_*).
            rows = [(o["key"], f"{_plan_value(o['value'])}  ({o['from']})") for o in report.get("overrides") or []]
            lines += ["", "overrides", *(_aligned(rows, indent="  ") if rows else ["  none"])]
        elif section in report:
            lines += ["", section.replace("_", " "), *_aligned(list(flatten(report[section]).items()), indent="  ")]
    jobs = report.get("first_jobs") or []
    if jobs:
        lines += ["", f"first {len(jobs)} of {report['episodes']} episodes"]
        columns = list(dict.fromkeys(["episode_id", *(key for job in jobs for key in job)]))
        table = [columns] + [[_plan_value(job.get(column)) for column in columns] for job in jobs]
        widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
        lines += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in table]
    return "\n".join(lines)


def _aligned(rows: list[tuple[str, Any]], indent: str) -> list[str]:
    # A rare deep key (sampling.extra_body.…) does not push every value of its section right.
    width = min(24, max((len(label) for label, _ in rows), default=0))
    return [f"{indent}{label:<{width}}  {_plan_value(value)}".rstrip() for label, value in rows]


def _plan_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (list, dict)):
        return ", ".join(map(_plan_value, value)) if isinstance(value, list) else json.dumps(value, ensure_ascii=False)
    return str(value)


@app.command("run")
def run(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="Experiment YAML."),
    final_test: bool = FINAL_TEST,
    retry_failed: bool = RETRY_FAILED,
    reroll_failed: bool = REROLL_FAILED,
    max_episode_retries: int | None = typer.Option(
        None, min=0, help="Extra attempts per episode for infrastructure failures (default: runtime.max_episode_retries)."
    ),
    concurrency: int | None = typer.Option(
        None, min=1, help="Episodes in flight: --set experiment.concurrency=N (not part of the plan)."
    ),
    sets: list[str] | None = SET,
    model: str | None = MODEL,
    checkpoint: str | None = CHECKPOINT,
    experiment: str | None = EXPERIMENT,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a live progress bar."),
    shards: int | None = typer.Option(
        None, "--shards", min=1, help="Run as N shard worker processes (like an Indexed Job), then reduce."
    ),
    run_uri: str | None = typer.Option(
        None,
        "--run",
        help="Run location: a local directory (default: experiment.output_dir/experiment.name); "
        "with --shards also file:// or s3://.",
    ),
    backoff_limit_per_index: int = typer.Option(2, min=0, help="With --shards: restarts of a crashed shard worker."),
    track: list[str] | None = TRACK,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Run (or resume) every episode of the plan in this process, then write summary.json.

    With --shards N: N `shopsimrl worker` processes write write-once parts to --run, then `reduce`."""
    from shopsimrl.runner.local import run_local

    setup_logging(quiet, verbose)
    check_rerun_flags(retry_failed, reroll_failed)
    overrides = command_line_overrides(sets, model=model, checkpoint=checkpoint, experiment=experiment, concurrency=concurrency)
    if shards is not None:
        if max_episode_retries is not None:
            raise BadInputError(
                "--max-episode-retries applies to single-process runs; sharded workers use runtime.max_episode_retries",
            )
        run_sharded(
            config_path,
            run_uri,
            shards,
            final_test,
            backoff_limit_per_index,
            overrides,
            retry_failed,
            reroll_failed,
            progress,
            track,
        )
        return
    config = load(config_path, overrides)
    if run_uri is not None:
        config = config.at_run_dir(local_run_dir(run_uri))
    tracking = tracking_settings(track, config)
    prepared = prepare(config, final_test)
    structlog.contextvars.bind_contextvars(run=config.name)
    prepared.model().check_api_key()
    store, summary = run_local(
        prepared,
        max_episode_retries=max_episode_retries,
        retry_failed=retry_failed,
        reroll_failed=reroll_failed,
        show_progress=progress,
        announce=lambda line: typer.echo(line, err=True),
    )
    _print_summary(summary, store.summary_path)
    track_summary(str(store.run_dir), summary, tracking)
    _exit_for(summary)


def local_run_dir(location: str) -> Path:
    """``--run`` of a single-process run: a directory path or ``file:///absolute/path``; an
    object store needs the sharded route (its create-only parts)."""
    from urllib.parse import unquote, urlsplit

    if not location.strip():
        raise BadInputError("--run: the run location is empty")
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", location)
    if scheme is None:
        return Path(location).expanduser().resolve()
    parts = urlsplit(location)
    if scheme.group(1).lower() == "file" and parts.netloc in ("", "localhost") and parts.path.startswith("/"):
        if parts.query or parts.fragment:
            raise BadInputError(f"--run {location}: a run location takes no ?query or #fragment")
        return Path(unquote(parts.path))
    from shopsimrl.schemas import redact_uri

    raise BadInputError(
        f"--run {redact_uri(location)}: a single-process run writes to a local directory (a path or file:///absolute/path); "
        "an object store location needs --shards N"
    )


def _print_summary(summary: dict[str, Any], where: Path) -> None:
    from shopsimrl.metrics import format_summary_table

    typer.echo(format_summary_table(summary))
    typer.echo(f"summary: {where}")
    typer.echo(f"traces:  {where.parent / 'traces.jsonl'}")


def _exit_for(summary: dict[str, Any]) -> None:
    counts = summary.get("counts", {})
    if counts.get("failed", 0) or counts.get("missing", 0):
        raise typer.Exit(int(ExitCode.EPISODES_FAILED))


@app.command("summarize")
def summarize(
    run_dir_arg: str = typer.Argument(..., metavar="RUN_DIR", help="A local run directory (manifest.json + traces.jsonl)."),
    requested: int | None = typer.Option(None, help="Requested episode count when the run has no manifest."),
    track: list[str] | None = TRACK,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Recompute summary.json from the traces of a run directory (also traces of the earlier format)."""
    from shopsimrl.runner.local import summarize_local
    from shopsimrl.storage.local import LocalRunStore, RunWriteError

    setup_logging(quiet, verbose)
    tracking = tracking_settings(track)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", run_dir_arg):
        raise BadInputError(
            f"{run_dir_arg} is a run location URI; summarize reads a local run directory "
            f"(the summary of a sharded run is written by `shopsimrl reduce {run_dir_arg}`)",
        )
    run_dir = Path(run_dir_arg)
    store = LocalRunStore(run_dir)
    if not store.traces_path.exists():
        if (run_dir / "shards.json").is_file():
            raise BadInputError(
                f"{run_dir} is a sharded run (shards.json, no traces.jsonl): "
                f"`shopsimrl reduce {run_dir}` writes its summary.json",
            )
        raise BadInputError(f"{store.traces_path} does not exist")
    manifest = store.read_manifest()
    requested_ids = None
    if manifest is not None and requested is None:
        from shopsimrl.schemas import EpisodeJob

        requested_ids = [EpisodeJob.from_dict(job).episode_id for job in manifest.plan.get("jobs")]
    # A failed write loses only the derived summary: the traces are safe, and the message says so.
    with context(RunWriteError, suffix=f"; the traces are saved, `shopsimrl summarize {store.run_dir}` rewrites it"):
        summary = summarize_local(store, manifest, requested_ids, requested)
    _print_summary(summary, store.summary_path)
    track_summary(str(store.run_dir), summary, tracking)


@app.command("wait-ready")
def wait_ready(
    config_path: Path = typer.Option(..., "--config", envvar="SHOPSIMRL_CONFIG", help="Experiment YAML."),
    timeout: float = typer.Option(600.0, min=0, help="Give up after this many seconds."),
    interval: float = typer.Option(5.0, min=0.1, help="Seconds between probes."),
    sets: list[str] | None = SET,
    model: str | None = MODEL,
    require_free_slot: bool = typer.Option(
        True,
        "--require-free-slot/--no-require-free-slot",
        help="Count a ShopSimulator without a free slot as not ready. Shard pods turn this off: other shards "
        "hold slots legitimately, and a pod releases its dead predecessor's leases only once it runs.",
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Wait until the model lists the served model and the environment says ready (exit 3 on timeout)."""
    from shopsimrl.runner.experiment import check_services

    settings = worker_settings()
    setup_logging(quiet, verbose)
    config = load(config_path, command_line_overrides(sets, model=model))
    # Readiness does not depend on the split guard: probe with the test guard satisfied.
    prepared = prepare(config, final_test=_is_test_split(config))
    processes = min(settings.parallelism or settings.shards or 1, settings.shards or settings.parallelism or 1)
    result = eventloop.run(
        check_services(prepared, timeout=timeout, interval=interval, processes=processes, require_free_slot=require_free_slot)
    )
    for warning in result.warnings:
        warn(warning)
    if not result.ready:
        raise TryAgainError(f"{result.reason}: {result.detail}")
    typer.echo(f"ready: {result.detail}")


def _is_test_split(config: ExperimentConfig) -> bool:
    from shopsimrl.tasks import SplitError, load_task_split

    try:
        return load_task_split(config.resolve(config.tasks.split_file), config.tasks.split).is_test and config.skills.path is None
    except SplitError:
        return False
