"""``shopsimrl`` command line: plan, run, worker, reduce, status, summarize, wait-ready, env, testbed;
over finished runs (``shopsimrl/research/``): compare, report, view, show, labels, export, gate, judge.

Exit codes are those of :mod:`shopsimrl.exitcodes` (0 done, 1 some episodes failed, 2 bad input,
3 interrupted/retryable, 42 the run exists with another fingerprint).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import signal
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

import structlog
import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from shopsimrl import eventloop
from shopsimrl.config import (
    ConfigError,
    ExperimentConfig,
    WorkerSettings,
    check_environment_url,
    describe_settings_error,
    load_experiment_config,
)
from shopsimrl.exitcodes import ExitCode
from shopsimrl.logs import configure_logging
from shopsimrl.manifest import FingerprintMismatchError, ManifestError, flatten
from shopsimrl.schemas import fingerprint

# Plain (click) help, not rich panels: rich's option table crops long option names at 80
# columns and shows a type for every flag; click's layout wraps the help text instead.
HELP_STYLE: dict[str, Any] = {"rich_markup_mode": None, "no_args_is_help": True}
app = typer.Typer(add_completion=False, help="Frozen, resumable rollouts of shopping agents on ShopSimulator.", **HELP_STYLE)
testbed_app = typer.Typer(help="Local stand-ins: a ShopSimulator-compatible shop and a heuristic policy model.", **HELP_STYLE)
app.add_typer(testbed_app, name="testbed")
env_app = typer.Typer(help="Operate a ShopSimulator server: slot usage, releasing every lease.", **HELP_STYLE)
app.add_typer(env_app, name="env")


def _print_version(requested: bool) -> None:
    if requested:
        typer.echo(f"shopsimrl {importlib.metadata.version('shopsimrl')}")
        raise typer.Exit


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
) -> None:
    pass  # --version acts in its callback; the commands do the rest


def _fail(code: ExitCode, message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(int(code))


QUIET = typer.Option(False, "-q", "--quiet", help="Log warnings and errors only.")
VERBOSE = typer.Option(
    False, "-v", "--verbose", help="Also log debug lines (a run: one per episode). Default level: SHOPSIMRL_LOG_LEVEL, else info."
)


def _setup_logging(quiet: bool, verbose: bool) -> None:
    """Logging from SHOPSIMRL_LOG_FORMAT/SHOPSIMRL_LOG_LEVEL and the command's -q/-v."""
    if quiet and verbose:
        _fail(ExitCode.BAD_INPUT, "-q/--quiet and -v/--verbose exclude each other")
    try:
        configure_logging(1 if verbose else -1 if quiet else 0)
    except ValidationError as exc:
        _fail(ExitCode.BAD_INPUT, describe_settings_error(exc))


def _import_extra(module: str, extra: str) -> Any:
    """A module of an optional part (a pyproject extra; the worker image has none): exit 2 without it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        _fail(
            ExitCode.BAD_INPUT,
            f"{module} is not installed here ({exc.name} missing): pip install 'shopsimrl[{extra}]', or use the shopsimrl-{extra} image",
        )


def _record_errors() -> tuple[type[Exception], ...]:
    """A trace record this shopsimrl cannot read: of another schema version, or not fitting its
    model. Bad input (exit 2); the message names the file and line. Records are read as a command
    goes, so these come after the run opened, from anywhere that reads it."""
    from shopsimrl.records import RecordFormatError, RecordVersionError

    return (RecordVersionError, RecordFormatError)


def _run_read_errors() -> tuple[type[Exception], ...]:
    """A run, or a record in it, that cannot be read: bad input (exit 2) for every research command."""
    from shopsimrl.storage.reading import RunReadError

    return (RunReadError, *_record_errors())


def _load(config_path: Path) -> ExperimentConfig:
    try:
        return load_experiment_config(config_path).with_overrides(worker_settings())
    except ConfigError as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))


def worker_settings() -> WorkerSettings:
    """Settings from SHOPSIMRL_* / JOB_COMPLETION_INDEX; a malformed variable is bad input (exit 2)."""
    try:
        return WorkerSettings()
    except ValidationError as exc:
        _fail(ExitCode.BAD_INPUT, describe_settings_error(exc))


def _prepare(config: ExperimentConfig, final_test: bool) -> Any:
    from shopsimrl.model import ModelConfigError
    from shopsimrl.planning import PlanError
    from shopsimrl.prompts import PromptError
    from shopsimrl.runner.experiment import prepare
    from shopsimrl.skills import SkillBankError
    from shopsimrl.tasks import SplitError

    try:
        return prepare(config, final_test=final_test)
    except (ConfigError, SplitError, PlanError, SkillBankError, PromptError, ModelConfigError) as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))


FINAL_TEST = typer.Option(False, "--final-test", help="Allow running the held-out test split (requires skills.path: null).")
RETRY_FAILED = typer.Option(
    True,
    "--retry-failed/--no-retry-failed",
    help="Run again the episodes whose earlier failure says nothing about the agent (infrastructure, configuration).",
)
REROLL_FAILED = typer.Option(
    False,
    "--reroll-failed",
    help="Also run again the failures that are the agent's outcomes (final otherwise); each re-roll is marked and counted.",
)


def _check_rerun_flags(retry_failed: bool, reroll_failed: bool) -> None:
    if reroll_failed and not retry_failed:
        _fail(ExitCode.BAD_INPUT, "--reroll-failed and --no-retry-failed contradict each other")


@app.command()
def plan(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="Experiment YAML."),
    final_test: bool = FINAL_TEST,
    check: bool = typer.Option(False, "--check", help="Also probe the model's /models and the environment's /healthz."),
    run_uri: str | None = typer.Option(
        None, "--run", help="Run location (dir, file://, s3://); with --shards the frozen plan is written there."
    ),
    shards: int | None = typer.Option(
        None, "--shards", min=1, help="Freeze a sharded plan: write manifest.json, jobs.jsonl and shards.json."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (for scripts) instead of a table."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Show the frozen plan (episodes, seeds, fingerprint, identities) without running anything."""
    from shopsimrl.storage.local import LocalRunStore

    _setup_logging(quiet, verbose)
    if run_uri is not None and shards is None:
        _fail(ExitCode.BAD_INPUT, "--run needs --shards (a single-process run writes to the config's run directory)")
    config = _load(config_path)
    prepared = _prepare(config, final_test)
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
        "model": {"id": config.model_id, **semantic["model"]},
        "environment": semantic["environment"],
        "runtime": semantic["runtime"],
        "prompt": semantic["prompt"],
        "skills": semantic["skills"],
        "test_guard": semantic["test_guard"],
        "first_jobs": [{**job.to_dict(), "episode_id": job.episode_id} for job in prepared.jobs[:5]],
    }
    missing_key = prepared.model_settings.api_key_env
    if missing_key:
        from shopsimrl.model import ModelConfigError

        try:
            prepared.model().check_api_key()
        except ModelConfigError as exc:
            report["warnings"] = [str(exc)]
    if shards is not None:
        report["sharded_run"], _ = _freeze_sharded_plan(prepared, str(config.run_dir) if run_uri is None else run_uri, shards)
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
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
    if check and not report["services"]["ready"]:
        raise typer.Exit(int(ExitCode.RETRYABLE))


# The plan table: these keys as headed sections, in this order; the rest as "key  value" rows.
_PLAN_SECTIONS = ("task_split", "model", "environment", "runtime", "prompt", "skills", "test_guard", "sharded_run", "services")


def _format_plan(report: dict[str, Any]) -> str:
    """``plan``'s report for people: aligned rows, nested settings as dotted keys, the first jobs as a table."""
    top = [
        (key.replace("_", " "), value) for key, value in report.items() if key not in (*_PLAN_SECTIONS, "first_jobs", "warnings")
    ]
    lines = _aligned(top, indent="")
    for section in _PLAN_SECTIONS:
        if section in report:
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


@app.command()
def run(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="Experiment YAML."),
    final_test: bool = FINAL_TEST,
    retry_failed: bool = RETRY_FAILED,
    reroll_failed: bool = REROLL_FAILED,
    max_episode_retries: int | None = typer.Option(
        None, min=0, help="Extra attempts per episode for infrastructure failures (default: runtime.max_episode_retries)."
    ),
    concurrency: int | None = typer.Option(None, min=1, help="Episodes in flight (default: experiment.concurrency)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a live progress bar."),
    shards: int | None = typer.Option(
        None, "--shards", min=1, help="Run as N shard worker processes (like an Indexed Job), then reduce."
    ),
    run_uri: str | None = typer.Option(
        None, "--run", help="With --shards: run location (dir, file://, s3://); default: the config's run directory."
    ),
    backoff_limit_per_index: int = typer.Option(2, min=0, help="With --shards: restarts of a crashed shard worker."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Run (or resume) every episode of the plan in this process, then write summary.json.

    With --shards N: N `shopsimrl worker` processes write write-once parts to --run, then `reduce`."""
    from shopsimrl.model import ModelConfigError
    from shopsimrl.runner.local import RunStopped, run_local

    _setup_logging(quiet, verbose)
    _check_rerun_flags(retry_failed, reroll_failed)
    if shards is not None:
        if max_episode_retries is not None:
            _fail(
                ExitCode.BAD_INPUT,
                "--max-episode-retries applies to single-process runs; sharded workers use runtime.max_episode_retries",
            )
        _run_sharded(
            config_path, run_uri, shards, final_test, backoff_limit_per_index, concurrency, retry_failed, reroll_failed, progress
        )
        return
    if run_uri is not None:
        _fail(ExitCode.BAD_INPUT, "--run needs --shards (a single-process run writes to the config's run directory)")
    config = _load(config_path)
    if concurrency:
        config = config.model_copy(update={"experiment": config.experiment.model_copy(update={"concurrency": concurrency})})
    prepared = _prepare(config, final_test)
    structlog.contextvars.bind_contextvars(run=config.name)
    try:
        prepared.model().check_api_key()
    except ModelConfigError as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    try:
        store, summary = run_local(
            prepared,
            max_episode_retries=max_episode_retries,
            retry_failed=retry_failed,
            reroll_failed=reroll_failed,
            show_progress=progress,
            announce=lambda line: typer.echo(line, err=True),
        )
    except RunStopped as stop:
        _fail(stop.code, str(stop))
    _print_summary(summary, store.summary_path)
    _exit_for(summary)


def _print_summary(summary: dict[str, Any], where: Path) -> None:
    from shopsimrl.metrics import format_summary_table

    typer.echo(format_summary_table(summary))
    typer.echo(f"summary: {where}")
    typer.echo(f"traces:  {where.parent / 'traces.jsonl'}")


def _exit_for(summary: dict[str, Any]) -> None:
    counts = summary.get("counts", {})
    if counts.get("failed", 0) or counts.get("missing", 0):
        raise typer.Exit(int(ExitCode.EPISODES_FAILED))


@app.command()
def summarize(
    run_dir_arg: str = typer.Argument(..., metavar="RUN_DIR", help="A local run directory (manifest.json + traces.jsonl)."),
    requested: int | None = typer.Option(None, help="Requested episode count when the run has no manifest."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Recompute summary.json from the traces of a run directory (also traces of the earlier format)."""
    from shopsimrl.runner.local import summarize_local
    from shopsimrl.storage.local import LocalRunStore, RunWriteError

    _setup_logging(quiet, verbose)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", run_dir_arg):
        _fail(
            ExitCode.BAD_INPUT,
            f"{run_dir_arg} is a run location URI; summarize reads a local run directory "
            f"(the summary of a sharded run is written by `shopsimrl reduce {run_dir_arg}`)",
        )
    run_dir = Path(run_dir_arg)
    store = LocalRunStore(run_dir)
    if not store.traces_path.exists():
        if (run_dir / "shards.json").is_file():
            _fail(
                ExitCode.BAD_INPUT,
                f"{run_dir} is a sharded run (shards.json, no traces.jsonl): "
                f"`shopsimrl reduce {run_dir}` writes its summary.json",
            )
        _fail(ExitCode.BAD_INPUT, f"{store.traces_path} does not exist")
    try:
        manifest = store.read_manifest()
    except ManifestError as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    requested_ids = None
    if manifest is not None and requested is None:
        from shopsimrl.schemas import EpisodeJob

        requested_ids = [EpisodeJob.from_dict(job).episode_id for job in manifest.plan.get("jobs")]
    try:
        summary = summarize_local(store, manifest, requested_ids, requested)
    except _record_errors() as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except RunWriteError as exc:  # the traces are safe; only the derived summary is missing
        _fail(
            ExitCode.RETRYABLE if exc.retryable else ExitCode.BAD_INPUT,
            f"{exc}; the traces are saved, `shopsimrl summarize {store.run_dir}` rewrites it",
        )
    _print_summary(summary, store.summary_path)


# ----------------------------------------------------------------------------- sharded runs


def _freeze_sharded_plan(prepared: Any, run_uri: str, shards: int) -> tuple[dict[str, Any], list[int]]:
    """Write or verify the frozen sharded plan; returns its part of `plan`'s report and every shard's job count."""
    from shopsimrl.runner.worker import plan_run
    from shopsimrl.storage.objectstore import RunLocationError, StoreUnavailableError
    from shopsimrl.storage.sharded import ShardedRunStore, ShardMapError

    try:
        store = ShardedRunStore(run_uri)
        manifest, shard_map = plan_run(prepared, store, shards)
    except FingerprintMismatchError as exc:
        _fail(ExitCode.FINGERPRINT_MISMATCH, str(exc))
    except (ShardMapError, RunLocationError, ManifestError) as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except StoreUnavailableError as exc:
        _fail(ExitCode.RETRYABLE, str(exc))
    jobs_per_shard = [len(ids) for ids in shard_map.episode_ids]
    report = {
        "run": store.display_uri,
        "plan_fingerprint": manifest.plan_fingerprint,
        "shards": shard_map.count,
        "jobs_per_shard": jobs_per_shard[:16],
    }
    return report, jobs_per_shard


def _run_sharded(
    config_path: Path,
    run_uri: str | None,
    shards: int,
    final_test: bool,
    backoff_limit: int,
    concurrency: int | None,
    retry_failed: bool,
    reroll_failed: bool,
    progress: bool,
) -> None:
    from shopsimrl.runner.local_job import run_indexed
    from shopsimrl.runner.progress import ShardedRunProgress

    config = _load(config_path)
    prepared = _prepare(config, final_test)
    uri = str(config.run_dir) if run_uri is None else run_uri
    frozen, jobs_per_shard = _freeze_sharded_plan(prepared, uri, shards)
    typer.echo(f"run {config.name}: {len(prepared.jobs)} episodes in {shards} shards → {frozen['run']}", err=True)
    env = {"SHOPSIMRL_CONCURRENCY": str(concurrency)} if concurrency else {}
    with ShardedRunProgress(jobs_per_shard, enabled=progress and sys.stderr.isatty()) as bar:
        result = run_indexed(
            uri,
            config_path.resolve(),
            shards,
            backoff_limit_per_index=backoff_limit,
            final_test=final_test,
            retry_failed=retry_failed,
            reroll_failed=reroll_failed,
            env=env,
            on_event=bar.on_worker_event,
            on_tick=bar.tick,
        )
    for outcome in result.indexes:
        if outcome.exit_code not in (0, 1):
            typer.secho(
                f"shard {outcome.index}: exit codes {outcome.exit_codes} ({outcome.restarts} restarts)",
                fg=typer.colors.YELLOW,
                err=True,
            )
    if result.exit_code in (ExitCode.FINGERPRINT_MISMATCH, ExitCode.BAD_INPUT) or result.interrupted:
        raise typer.Exit(int(result.exit_code))
    code = _reduce_and_report(uri, wait=False, timeout=0.0, include_uncommitted=False)
    raise typer.Exit(int(max(code, result.exit_code, key=_severity)))


def _severity(code: ExitCode) -> int:
    return {
        ExitCode.OK: 0,
        ExitCode.EPISODES_FAILED: 1,
        ExitCode.RETRYABLE: 2,
        ExitCode.BAD_INPUT: 3,
        ExitCode.FINGERPRINT_MISMATCH: 4,
    }[ExitCode(code)]


def _reduce_and_report(
    uri: str,
    *,
    wait: bool,
    timeout: float,
    include_uncommitted: bool,
    partial_on_timeout: bool = False,
    worker_job: str | None = None,
    namespace: str | None = None,
) -> ExitCode:
    from shopsimrl.metrics import format_summary_table
    from shopsimrl.runner.reduce import reduce_run, wait_for_markers
    from shopsimrl.storage.objectstore import RunLocationError, StoreUnavailableError
    from shopsimrl.storage.sharded import RunNotPlannedError, ShardedRunStore, ShardMapError

    try:
        store = ShardedRunStore(uri)
        waited = None
        if wait:
            give_up = _failed_indexes_of(worker_job, namespace or "default") if worker_job else None
            waited = wait_for_markers(store, timeout=timeout, interval=min(5.0, max(0.2, timeout / 20)), give_up=give_up)
            # Shards the worker Job has given up on will never commit: waiting longer cannot help.
            if waited.pending and not (partial_on_timeout or waited.why):
                _fail(ExitCode.RETRYABLE, f"timed out after {timeout:g} s; shards without a commit marker: {waited.pending[:20]}")
            if waited.pending:
                typer.secho(
                    f"warning: {waited.reason}: {waited.pending[:20]}; writing a partial summary",
                    fg=typer.colors.YELLOW,
                    err=True,
                )
        summary = reduce_run(
            store,
            include_uncommitted=include_uncommitted,
            incomplete_reason=waited.reason if waited and waited.pending else None,
            missing_why=waited.why if waited else None,
        )
    except (RunNotPlannedError, ShardMapError, RunLocationError, ManifestError) as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except StoreUnavailableError as exc:
        _fail(ExitCode.RETRYABLE, str(exc))
    report = summary["shards"]
    typer.echo(format_summary_table(summary))
    typer.echo(
        f"shards       {report['committed']}/{report['count']} committed · uncommitted {report['uncommitted'][:10]} · "
        f"corrupt {report['corrupt'][:10]} · duplicates {report['duplicate_records']} · episodes rerun {report['episodes_rerun']} · "
        f"uncommitted parts {report['uncommitted_parts']} · unreadable lines {report['unreadable_lines']} · "
        f"foreign objects {len(report['foreign_objects'])}"
    )
    for problem in report["problems"]:
        typer.secho(f"  {problem}", fg=typer.colors.YELLOW, err=True)
    for missing in (summary.get("incomplete") or {}).get("missing_shards", [])[:20]:
        typer.secho(f"  shard {missing['shard']} missing: {missing['why']}", fg=typer.colors.YELLOW, err=True)
    typer.echo(f"summary: {store.display_uri}/summary.json")
    counts = summary.get("counts", {})
    incomplete = report["uncommitted"] or report["corrupt"] or counts.get("failed") or counts.get("missing")
    return ExitCode.EPISODES_FAILED if incomplete else ExitCode.OK


def _failed_indexes_of(job: str, namespace: str) -> Any:
    """A ``give_up`` for :func:`~shopsimrl.runner.reduce.wait_for_markers` that watches the worker Job."""
    kube = _import_extra("shopsimrl.runner.kube", "kube")
    return kube.give_up_on_failed_indexes(
        job, namespace, warn=lambda line: typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)
    )


@app.command()
def worker(
    run_uri: str | None = typer.Option(
        None, "--run", envvar="SHOPSIMRL_RUN", help="Run location (dir, file://, s3://bucket/prefix)."
    ),
    shard_index: int | None = typer.Option(None, "--shard-index", min=0, help="Shard to run (default: JOB_COMPLETION_INDEX)."),
    config_path: Path | None = typer.Option(None, "--config", envvar="SHOPSIMRL_CONFIG", help="Experiment YAML."),
    shards: int | None = typer.Option(
        None, "--shards", envvar="SHOPSIMRL_SHARDS", min=1, help="Shard count (default: the frozen shards.json)."
    ),
    final_test: bool = FINAL_TEST,
    retry_failed: bool = RETRY_FAILED,
    reroll_failed: bool = REROLL_FAILED,
    processes: int | None = typer.Option(
        None,
        "--processes",
        min=1,
        max=256,
        help="Event-loop processes over the shard's jobs (default SHOPSIMRL_PROCESSES, else 1): use the pod's cores.",
    ),
    succeed_once_committed: bool = typer.Option(
        False,
        "--succeed-once-committed",
        help="Exit 0, not 1, when the shard is committed with failed episodes (counted in its marker and the summary): "
        "for a JobSet, whose reducer starts only once every worker index succeeded.",
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Run one shard of a sharded run into write-once parts and commit it (one pod of an Indexed Job)."""
    from shopsimrl.runner.worker import WorkerOptions, run_worker

    settings = worker_settings()
    if processes is not None:
        settings = settings.model_copy(update={"processes": processes})
    _setup_logging(quiet, verbose)
    _check_rerun_flags(retry_failed, reroll_failed)
    index = shard_index if shard_index is not None else settings.shard_index
    if run_uri is None or config_path is None or index is None:
        _fail(
            ExitCode.BAD_INPUT,
            "worker needs --run (SHOPSIMRL_RUN), --config (SHOPSIMRL_CONFIG) and --shard-index (JOB_COMPLETION_INDEX)",
        )
    code = run_worker(
        WorkerOptions(
            run=run_uri,
            config=config_path,
            shard_index=index,
            shards=shards,
            final_test=final_test,
            retry_failed=retry_failed,
            reroll_failed=reroll_failed,
            settings=settings,
        )
    )
    if succeed_once_committed and code == ExitCode.EPISODES_FAILED:
        # run_worker answers EPISODES_FAILED only once the shard's commit marker is written.
        code = ExitCode.OK
    raise typer.Exit(int(code))


@app.command()
def reduce(
    run_uri: str = typer.Argument(..., metavar="URI", help="A local run directory, or the location of a sharded run."),
    wait: bool = typer.Option(False, "--wait", help="Poll until every shard has a commit marker (exit 3 on timeout)."),
    timeout: float = typer.Option(3600.0, "--timeout", min=0, help="With --wait: give up after this many seconds."),
    include_uncommitted: bool = typer.Option(
        False, "--include-uncommitted", help="Also read parts of shards without a commit marker (a partial summary)."
    ),
    partial_on_timeout: bool = typer.Option(
        False,
        "--partial-on-timeout",
        help="With --wait: at the timeout, write summary.json from the committed shards, marked incomplete, and exit 1 instead of 3.",
    ),
    worker_job: str | None = typer.Option(
        None,
        "--worker-job",
        help="With --wait: the Kubernetes worker Job of this run; stop waiting (partial summary, exit 1) once its failed indexes cover every uncommitted shard or it has finished.",
    ),
    namespace: str | None = typer.Option(None, "--namespace", help="Namespace of --worker-job (default: default)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Merge committed shards into summary.json: de-duplicated by episode_id, checksums verified."""
    _setup_logging(quiet, verbose)
    if (partial_on_timeout or worker_job) and not wait:
        _fail(ExitCode.BAD_INPUT, "--partial-on-timeout and --worker-job need --wait")
    code = _reduce_and_report(
        run_uri,
        wait=wait,
        timeout=timeout,
        include_uncommitted=include_uncommitted,
        partial_on_timeout=partial_on_timeout,
        worker_job=worker_job,
        namespace=namespace,
    )
    raise typer.Exit(int(code))


@app.command()
def status(
    run_uri: str = typer.Argument(..., metavar="URI", help="A local run directory, or the location of a sharded run."),
    namespace: str | None = typer.Option(None, "--namespace", help="Kubernetes namespace of the release (adds the Job's view)."),
    release: str | None = typer.Option(None, "--release", help="Helm release name (with --namespace)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    env_url: str | None = typer.Option(
        None,
        "--env-url",
        envvar="SHOPSIMRL_ENV_BASE_URL",
        help="ShopSimulator to show the slot usage of (default: the one the running shards' lease journals name).",
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Per-shard progress from commit markers and the workers' progress objects (no trace part is
    read), leases held per running shard, the shop's slot usage; with --namespace/--release also
    the Job. A local run directory: its state and counts while another process runs it (no lock
    taken), its leases, the shop's slot usage."""
    from shopsimrl.runner.status import is_local_run, lease_status, shard_status
    from shopsimrl.storage.objectstore import RunLocationError, StoreUnavailableError
    from shopsimrl.storage.sharded import RunNotPlannedError, ShardedRunStore, ShardMapError

    _setup_logging(quiet, verbose)
    if env_url is not None:
        try:
            check_environment_url(env_url)
        except ConfigError as exc:
            _fail(ExitCode.BAD_INPUT, f"--env-url: {exc}")
    if is_local_run(run_uri):
        if namespace or release:
            _fail(ExitCode.BAD_INPUT, f"--namespace/--release: {run_uri} is a local run, it has no Kubernetes Job")
        _local_status(run_uri, env_url, as_json)
        return
    try:
        store = ShardedRunStore(run_uri)
        report = shard_status(store)
        journal_url = lease_status(store, report)
    except RunNotPlannedError as exc:
        _fail(ExitCode.BAD_INPUT, _judge_location_hint(store, run_uri) or str(exc))
    except (ShardMapError, RunLocationError, ManifestError) as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except StoreUnavailableError as exc:
        _fail(ExitCode.RETRYABLE, str(exc))
    report["environment"] = _slot_status(env_url or journal_url)
    if namespace or release:
        report["kubernetes"] = _kube_status(namespace, release)
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False, indent=2))
        return
    typer.echo(
        f"run {report['run']} · plan {report['plan_fingerprint'][:12]} · {report['completed']}/{report['jobs']} episodes completed · "
        f"{report['committed_shards']}/{len(report['shards'])} shards committed"
    )
    for row in report["shards"]:
        extra = f" · failed {row['failed']}" if row.get("failed") else ""
        if row.get("leases_held") or row.get("leases_left_by_stopped_workers"):
            extra += f" · leases {row.get('leases_held', 0)}"
            if row.get("leases_left_by_stopped_workers"):
                extra += f" (+{row['leases_left_by_stopped_workers']} left by a stopped worker)"
        if row.get("failed_attempts"):
            extra += f" · failed attempts {row['failed_attempts']}"
        completed = "?" if row.get("completed") is None else row["completed"]
        typer.echo(
            f"  shard {row['shard']:>5}  {row['state']:<14} {completed}/{row['jobs']}{extra} · parts {row['parts']}{_heartbeat_note(row)}"
        )
    shop = report["environment"]
    if shop.get("url"):
        state = shop.get("error") or f"{shop['free_slots']}/{shop['environment_slots']} slots free"
        typer.echo(f"shop {shop['url']}: {state}")
    if "kubernetes" in report:
        typer.echo("kubernetes: " + json.dumps(report["kubernetes"], ensure_ascii=False, default=str))


def _local_status(run_dir: str, env_url: str | None, as_json: bool) -> None:
    from shopsimrl.runner.status import local_status

    bad_input: tuple[type[Exception], ...] = (ManifestError, *_record_errors())
    try:
        report = local_status(run_dir)
    except bad_input as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except OSError as exc:
        _interrupted_io(exc)
    report["environment"] = _slot_status(env_url or report.pop("environment_url"))
    report.pop("environment_url", None)
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False, indent=2))
        return
    jobs = "?" if report["jobs"] is None else report["jobs"]
    head = (
        f"run {report['run']} (local) · plan {report['plan_fingerprint'][:12]} · {report['completed']}/{jobs} episodes completed"
    )
    process = report.get("process")
    state = report["state"]
    if process and state in ("running", "running?", "stopped"):
        state += f" (pid {process['pid']} on {process['host']})"
    typer.echo(f"{head} · {state}{_heartbeat_note(report) if report['state'].startswith('running') else ''}")
    invocation = report.get("invocation")
    if invocation:
        reward = invocation["reward_mean"]
        typer.echo(
            f"  {'this' if report['state'] == 'running' else 'latest'} invocation (started {invocation['started_at']}): "
            f"{invocation['completed']} completed · "
            f"{invocation['failed']} failed · requeued {invocation['requeued']} · model retries {invocation['model_retries']} · "
            f"reward {'-' if reward is None else f'{reward:.3f}'} · {invocation['settled_before']} settled before"
        )
    leases = f" · leases {report['leases_held']}"
    if report.get("leases_left_by_stopped_processes"):
        leases += f" (+{report['leases_left_by_stopped_processes']} left by a stopped process)"
    summary = " · summary.json written" if report["summary"] else ""
    typer.echo(f"  traces.jsonl {report['trace_lines']} lines{leases}{summary}")
    shop = report["environment"]
    if shop.get("url"):
        state = shop.get("error") or f"{shop['free_slots']}/{shop['environment_slots']} slots free"
        typer.echo(f"shop {shop['url']}: {state}")


def _judge_location_hint(store: Any, run_uri: str) -> str | None:
    """What to run instead when ``status`` is pointed at a judge location (it has no run plan)."""
    try:
        is_judge = store.read_bytes("judge_plan.json") is not None
    except Exception:  # the store failed on this second look: keep the first error
        return None
    return f"{store.display_uri} is a judge location: `shopsimrl judge status {run_uri}` shows its shards" if is_judge else None


def _heartbeat_note(row: dict[str, Any]) -> str:
    """How long ago an uncommitted shard's worker last reported, in the unit that reads best."""
    age = row.get("heartbeat_age_s")
    if row["state"] == "committed" or age is None:
        return " · no progress object" if row["state"] == "running?" else ""
    shown = f"{age:.0f} s" if age < 120 else f"{age / 60:.0f} min" if age < 7200 else f"{age / 3600:.1f} h"
    return f" (no heartbeat for {shown})" if row.get("stale") else f" · heartbeat {shown} ago"


def _slot_status(url: str | None) -> dict[str, Any]:
    """The shop's slot usage for ``status`` (a few seconds at most; never fails the command)."""
    from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
    from shopsimrl.schemas import redact_uri

    if not url:
        return {"url": None, "error": "no running shard names its ShopSimulator; pass --env-url"}

    async def probe() -> dict[str, Any]:
        environment = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=url, timeout=3.0, max_retries=0))
        try:
            usage = await environment.slot_usage()
            return {"url": redact_uri(url), "environment_slots": usage.environment_slots, "free_slots": usage.free_slots}
        finally:
            await environment.aclose()

    try:
        return eventloop.run(probe())
    except Exception as exc:  # unreachable from here (an in-cluster URL): say so, keep the rest
        return {"url": redact_uri(url), "error": f"unreachable: {type(exc).__name__}: {str(exc)[:200]}"}


def _kube_status(namespace: str | None, release: str | None) -> dict[str, Any]:
    if not (namespace and release):
        return {"error": "--namespace and --release are both needed for the Job's view"}
    try:
        from shopsimrl.runner import kube
    except ImportError as exc:
        return {"error": f"Kubernetes support is not available in this installation ({exc})"}
    try:
        return kube.load_release_status(namespace, release).to_dict()
    except Exception as exc:  # no kubeconfig, no cluster, RBAC: report it, keep the store's view
        return {"error": f"cannot read the Jobs of release {release!r} in {namespace!r}: {type(exc).__name__}: {exc}"}


@app.command("wait-ready")
def wait_ready(
    config_path: Path = typer.Option(..., "--config", envvar="SHOPSIMRL_CONFIG", help="Experiment YAML."),
    timeout: float = typer.Option(600.0, min=0, help="Give up after this many seconds."),
    interval: float = typer.Option(5.0, min=0.1, help="Seconds between probes."),
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
    _setup_logging(quiet, verbose)
    config = _load(config_path)
    # Readiness does not depend on the split guard: probe with the test guard satisfied.
    prepared = _prepare(config, final_test=_is_test_split(config))
    processes = min(settings.parallelism or settings.shards or 1, settings.shards or settings.parallelism or 1)
    result = eventloop.run(
        check_services(prepared, timeout=timeout, interval=interval, processes=processes, require_free_slot=require_free_slot)
    )
    for warning in result.warnings:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
    if not result.ready:
        _fail(ExitCode.RETRYABLE, f"{result.reason}: {result.detail}")
    typer.echo(f"ready: {result.detail}")


def _is_test_split(config: ExperimentConfig) -> bool:
    from shopsimrl.tasks import SplitError, load_task_split

    try:
        return load_task_split(config.resolve(config.tasks.split_file), config.tasks.split).is_test and config.skills.path is None
    except SplitError:
        return False


# ----------------------------------------------------------------------------- env (operator)

ENV_URL = typer.Option(..., "--url", envvar="SHOPSIMRL_ENV_BASE_URL", help="ShopSimulator base URL, e.g. http://shop:5700.")


def _operator_environment(url: str) -> Any:
    from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings

    try:
        check_environment_url(url)
        return ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=url, timeout=10.0, max_retries=1))
    except ValueError as exc:
        _fail(ExitCode.BAD_INPUT, f"--url: {exc}")


@env_app.command("slots")
def env_slots(
    url: str = ENV_URL,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Show the server's slot pool: size, free, leased (exit 3 when unreachable)."""
    from shopsimrl.environment import ShopEnvironmentError
    from shopsimrl.schemas import redact_uri

    _setup_logging(quiet, verbose)
    environment = _operator_environment(url)

    async def probe() -> Any:
        try:
            return await environment.slot_usage()
        finally:
            await environment.aclose()

    try:
        usage = eventloop.run(probe())
    except ShopEnvironmentError as exc:
        _fail(ExitCode.RETRYABLE, f"{redact_uri(url)}: {exc}")
    leased = None if usage.environment_slots is None or usage.free_slots is None else usage.environment_slots - usage.free_slots
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "url": redact_uri(url),
                    "environment_slots": usage.environment_slots,
                    "free_slots": usage.free_slots,
                    "leased": leased,
                }
            )
        )
    else:
        typer.echo(f"{redact_uri(url)}: {usage.describe()}" + ("" if leased is None else f", {leased} leased"))


@env_app.command("release-all")
def env_release_all(
    url: str = ENV_URL,
    yes: bool = typer.Option(False, "--yes", help="Confirm: every client of the server loses its leases."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Free every slot of the server (release_all). Every client's leases become invalid, including
    runs in progress elsewhere: their episodes fail with a stale lease and are retried."""
    from shopsimrl.environment import ShopEnvironmentError
    from shopsimrl.schemas import redact_uri

    _setup_logging(quiet, verbose)
    if not yes:
        _fail(
            ExitCode.BAD_INPUT,
            f"release-all frees every slot of {redact_uri(url)} and invalidates the leases of EVERY client of that "
            "server, including runs in progress; add --yes to do it",
        )
    environment = _operator_environment(url)

    async def release() -> tuple[Any, str, Any]:
        try:
            before = await environment.slot_usage()
            message = await environment.release_all()
            return before, message, await environment.slot_usage()
        finally:
            await environment.aclose()

    try:
        before, message, after = eventloop.run(release())
    except ShopEnvironmentError as exc:
        _fail(ExitCode.RETRYABLE, f"{redact_uri(url)}: {exc}")
    typer.echo(f"{redact_uri(url)}: {message or 'released'}; before {before.describe()}, now {after.describe()}")


# ----------------------------------------------------------------------------- research: compare, report

RESAMPLES = typer.Option(10_000, "--resamples", min=1, help="Bootstrap resamples of tasks.")
BOOTSTRAP_SEED = typer.Option(20260901, "--seed", help="Seed of the bootstrap resampling.")
ALLOW_PARTIAL = typer.Option(
    False,
    "--allow-partial",
    help="Compare the episodes the runs share when their job keys differ, and say how many were dropped.",
)


def _output_errors() -> tuple[type[Exception], ...]:
    """An output the research tools refuse or cannot create (bad input, exit 2)."""
    from shopsimrl.research.outputs import OutputLocationError, OutputWriteError

    return (OutputLocationError, OutputWriteError)


def _write_output(write: Callable[[], Any], option: str) -> Any:
    """``write()``, an output written by the one rule of research/outputs.py: refused or
    uncreatable is bad input (exit 2), a write that fails partway is retryable (exit 3)."""
    from shopsimrl.research.outputs import OutputStorageError

    try:
        return write()
    except _output_errors() as exc:
        _fail(ExitCode.BAD_INPUT, f"{option} {exc}")
    except OutputStorageError as exc:
        _fail(ExitCode.RETRYABLE, f"{option} {exc}")


@app.command()
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
    _setup_logging(quiet, verbose)
    if len(runs) < 2:
        _fail(ExitCode.BAD_INPUT, "compare needs at least two runs (RUN_A RUN_B)")
    module = _import_extra("shopsimrl.research.compare", "research")
    from shopsimrl.research.outputs import check_output_location, write_output

    try:
        if json_out not in (None, "-"):
            check_output_location(runs, Path(json_out))
        result = module.compare_runs(runs, allow_partial=allow_partial, resamples=resamples, seed=seed)
    except (module.CompareError, *_run_read_errors(), *_output_errors()) as exc:
        _fail(ExitCode.BAD_INPUT, f"--json {exc}" if isinstance(exc, _output_errors()) else str(exc))
    text = json.dumps(result, indent=2, ensure_ascii=False)
    if json_out == "-":
        typer.echo(text)
        return
    typer.echo(module.format_comparison(result))
    if json_out is not None:
        _write_output(lambda: write_output(Path(json_out), (text + "\n").encode("utf-8")), "--json")


@app.command()
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
    _setup_logging(quiet, verbose)
    module = _import_extra("shopsimrl.research.report", "research")
    from shopsimrl.research.compare import CompareError

    bad_input: tuple[type[Exception], ...] = (CompareError, *_run_read_errors())
    try:
        written = _write_output(
            lambda: module.write_report(runs, output, allow_partial=allow_partial, resamples=resamples, seed=seed), "-o"
        )
    except bad_input as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    typer.echo(f"{output}: {len(runs)} runs, {len(written.figures)} figures")


# ----------------------------------------------------------------------------- skill gates

gate_app = typer.Typer(help="Skill gates: paired val rollouts that measure what each skill chunk is worth.", **HELP_STYLE)
app.add_typer(gate_app, name="gate")
GATE_CONFIG = typer.Argument(..., metavar="GATE.yaml", help="Gate config (a gate_a or an online_gate section).")


def _gate_call(call: Any) -> Any:
    """Run one gate step; its errors become one line and their exit code."""
    gate = _import_extra("shopsimrl.research.gate.commands", "research")
    try:
        return call(gate)
    except Exception as exc:
        code = ExitCode.BAD_INPUT if isinstance(exc, _run_read_errors()) else gate.exit_code_for(exc)
        if code is None:
            raise
        _fail(code, str(exc))


def _gate_command(quiet: bool, verbose: bool, step: Any, show: Any) -> Any:
    """A gate command: logging, the worker's settings, ``step(gate, settings)``, and its result
    printed by ``show(gate, result)``; returns the result."""
    _setup_logging(quiet, verbose)
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
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Check the bare run and the mask design, and freeze the gate (no rollout, no model call)."""
    _gate_command(
        quiet,
        verbose,
        lambda gate, settings: gate.plan_gate(
            gate_config, shards=shards, run=run_uri, settings=settings, helm_values=helm_values
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
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Plan, run the masked rollouts here (resumable) and fit. Exit 1: the gate is incomplete.

    With --shards N --run URI: plan them as a sharded run, run N workers as `run --shards` does
    (resumable the same way), reduce, then fit."""
    if shards is not None or run_uri is not None:
        _setup_logging(quiet, verbose)
        _gate_run_sharded(gate_config, shards, run_uri, backoff_limit_per_index, progress, worker_settings())
        return
    result = _gate_command(
        quiet,
        verbose,
        lambda gate, settings: gate.run_gate(
            gate_config, settings=settings, show_progress=progress, announce=lambda line: typer.echo(line, err=True)
        ),
        lambda gate, result: gate.format_result(result),
    )
    raise typer.Exit(int(result.code))


def _gate_run_sharded(
    gate_config: Path, shards: int | None, run_uri: str | None, backoff_limit: int, progress: bool, settings: Any
) -> None:
    from shopsimrl.runner.local_job import run_indexed
    from shopsimrl.runner.progress import ShardedRunProgress

    if shards is None or run_uri is None:
        _fail(ExitCode.BAD_INPUT, "--shards and --run go together: a sharded masked run needs a location (a dir or s3://…)")
    report = _gate_call(lambda gate: gate.plan_gate(gate_config, shards=shards, run=run_uri, settings=settings))
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
    reduced = _reduce_and_report(run_uri, wait=False, timeout=0.0, include_uncommitted=False)
    if reduced not in (ExitCode.OK, ExitCode.EPISODES_FAILED):
        raise typer.Exit(int(reduced))
    result = _gate_call(lambda gate: gate.fit_gate(gate_config, settings=settings))
    typer.echo(_gate_call(lambda gate: gate.format_result(result)))
    raise typer.Exit(int(result.code))


@gate_app.command("fit")
def gate_fit(
    gate_config: Path = GATE_CONFIG,
    masked_run: str | None = typer.Option(
        None, "--masked-run", help="The masked run (dir or URI); default: where `gate plan` put it."
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Fit the contributions from the bare and the masked run, offline. Exit 1: the gate is incomplete.

    A gate directory of the earlier implementation is refitted into its refit/ directory."""
    result = _gate_command(
        quiet,
        verbose,
        lambda gate, settings: gate.fit_gate(gate_config, masked_run=masked_run, settings=settings),
        lambda gate, result: gate.format_result(result),
    )
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
    judge = _import_extra("shopsimrl.research.judge.commands", "research")
    try:
        return call(judge)
    except Exception as exc:
        code = ExitCode.BAD_INPUT if isinstance(exc, _run_read_errors()) else judge.exit_code_for(exc)
        if code is None:
            raise
        _fail(code, str(exc))


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
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Judge the selected episodes (resumable). Exit 1: some episodes are not judged yet (rerun)."""
    _setup_logging(quiet, verbose)
    _judge_report(_judge_call(lambda judge: judge.judge_run(judge_config, shards=shards, out=out, parallelism=parallelism)))


@judge_app.command("plan")
def judge_plan(
    judge_config: Path = JUDGE_CONFIG,
    shards: int = typer.Option(..., "--shards", min=1, help="Number of shards."),
    out: str = typer.Option(..., "--out", help="The judge location (a directory or an s3:// URI)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Freeze the selected episodes' judge inputs, the rubric and the settings as N shards."""
    _setup_logging(quiet, verbose)
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
    _setup_logging(quiet, verbose)
    raise typer.Exit(int(_judge_call(lambda judge: judge.judge_worker(judge_config, out, index))))


@judge_app.command("status")
def judge_status_command(
    location: str = typer.Argument(..., metavar="URI", help="The judge location."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Per-shard progress of a sharded judge from its commit markers and part listings (no part is read)."""
    _setup_logging(quiet, verbose)
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
    _setup_logging(quiet, verbose)
    ready, detail = _judge_call(lambda judge: judge.judge_wait_ready(judge_config, timeout=timeout, interval=interval))
    if not ready:
        _fail(ExitCode.RETRYABLE, f"the judge model is not ready after {timeout:g} s: {detail}")
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
    _setup_logging(quiet, verbose)
    _judge_report(_judge_call(lambda judge: judge.judge_reduce(location, timeout if wait else None)))


# ----------------------------------------------------------------------------- testbed


@testbed_app.command("shop")
def testbed_shop(
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(5700, help="Port."),
) -> None:
    """Serve the ShopSimulator-compatible shop (POST /api/shop_agent, GET /healthz)."""
    _import_extra("shopsimrl.testbed.shop.server", "testbed").serve(host=host, port=port)


@testbed_app.command("policy")
def testbed_policy(
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8000, help="Port."),
) -> None:
    """Serve the heuristic policy as an OpenAI-compatible model (POST /v1/chat/completions)."""
    _import_extra("shopsimrl.testbed.policy", "testbed").serve(host=host, port=port)


@testbed_app.command("up")
def testbed_up(
    host: str = typer.Option("127.0.0.1", help="Bind address of both services."),
    shop_port: int = typer.Option(5700, help="Shop port."),
    policy_port: int = typer.Option(8000, help="Policy port."),
) -> None:
    """Serve both testbed services until Ctrl-C."""
    _import_extra("shopsimrl.testbed.up", "testbed").serve_both(host=host, shop_port=shop_port, policy_port=policy_port)


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
    runs = _import_extra("shopsimrl.storage.reading", "research")
    try:
        return runs.open_run(location)
    except _run_read_errors() as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))


def _research_errors() -> tuple[type[Exception], ...]:
    """Bad input from the labelling and export modules (each names the file, line or option)."""
    from shopsimrl.research.export import ExportError
    from shopsimrl.research.labels import LabelsFileError
    from shopsimrl.research.outputs import OutputLocationError, OutputWriteError
    from shopsimrl.research.redaction import ExportRefusedError

    return (ExportError, LabelsFileError, OutputLocationError, OutputWriteError, ExportRefusedError, *_run_read_errors())


def _interrupted_io(exc: OSError) -> NoReturn:
    # Outputs that cannot be created are bad input (above); an I/O error later is the run's
    # storage or the disk failing under way: safe to retry once it is back.
    from shopsimrl.research.outputs import OutputStorageError

    if isinstance(exc, OutputStorageError):
        _fail(ExitCode.RETRYABLE, f"-o/--output: {exc}")
    _fail(ExitCode.RETRYABLE, f"reading the run or writing the output failed: {exc}")


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
    _setup_logging(quiet, verbose)
    labels = _import_extra("shopsimrl.research.labels", "research")
    output = output or _beside_run(location, ".labels.jsonl")
    run = _open_research_run(location)
    try:
        counts = labels.write_labels(run, output)
    except _research_errors() as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except OSError as exc:
        _interrupted_io(exc)
    typer.echo(f"{counts.labels_version}: {counts.episodes} episodes, {counts.clean} without a label")
    for name, count in counts.labels.items():
        codes = ", ".join(f"{code} {number}" for code, number in counts.codes.get(name, {}).items())
        typer.echo(f"  {name:<24} {count:>6}" + (f"  ({codes})" if codes else ""))
    typer.echo(f"labels: {output}")


def _beside_run(location: str, suffix: str) -> Path:
    """The default output of a research tool: next to the run (never inside it, never in the
    current directory): ``runs/x`` → ``runs/x<suffix>``, a traces file ``t.jsonl`` → ``t<suffix>``."""
    if "://" in location:
        _fail(ExitCode.BAD_INPUT, f"-o/--output: {location} is not on this machine; name the file to write")
    path = Path(location)
    return path.with_name(path.stem + suffix) if path.is_file() else path.resolve().parent / (path.resolve().name + suffix)


def _include(text: str, allowed: tuple[str, ...]) -> frozenset[str]:
    from shopsimrl.research.redaction import parse_include

    try:
        return parse_include(text, allowed)
    except ValueError as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))


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
    _setup_logging(quiet, verbose)
    export = _import_extra("shopsimrl.research.export", "research")
    included = _include(include, ("reasoning", "persona", "goal"))
    if not 0.0 < near_duplicate <= 1.0:
        _fail(ExitCode.BAD_INPUT, f"--near-duplicate must be in (0, 1], got {near_duplicate}")
    run = _open_research_run(location)
    try:
        summary = export.export_sft(run, output, include=included, select=select, near_duplicate=near_duplicate, report=report)
    except _research_errors() as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except OSError as exc:
        _interrupted_io(exc)
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
    _setup_logging(quiet, verbose)
    export = _import_extra("shopsimrl.research.export", "research")
    included = _include(include, ("reasoning", "persona", "goal"))
    run = _open_research_run(location)
    try:
        summary = export.export_judge_input(run, output, include=included, select=select, report=report)
    except _research_errors() as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except OSError as exc:
        _interrupted_io(exc)
    typer.echo(
        f"selected {summary['selection']['selected']} of {summary['selection']['episodes_in_run']} episodes · {summary['records']} records"
    )
    typer.echo(f"judge input: {output}\nreport: {report or export.report_path_for(output)}")


# ----------------------------------------------------------------------------- research: show, view, export table


def _research_call(call: Any) -> Any:
    """Run ``call`` (it reads a run): an unreadable run or episode is bad input, an object
    store that does not answer is retryable."""
    from shopsimrl.storage.objectstore import StoreUnavailableError

    try:
        return call()
    except _run_read_errors() as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    except StoreUnavailableError as exc:
        _fail(ExitCode.RETRYABLE, str(exc))


@app.command()
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

    _setup_logging(quiet, verbose)

    def transcript() -> Any:
        run = open_run(run_location)
        return run, read_transcript(*run.find(episode_id))

    run, episode = _research_call(transcript)
    render_terminal(episode, Console(highlight=False, soft_wrap=False), thinking=thinking, location=run.location)


@app.command()
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
    viewer = _import_extra("shopsimrl.research.viewer", "research")
    from shopsimrl.storage.reading import open_run

    _setup_logging(quiet, verbose)
    bad_names = [name for name in allow_host if not viewer.valid_host_name(name)]
    if bad_names:
        _fail(ExitCode.BAD_INPUT, f"--allow-host {bad_names[0]!r}: not a host name or IP address (no scheme, port or path)")
    run = _research_call(lambda: open_run(run_location))
    try:
        sock = viewer.bind(host, port)
    except viewer.ViewerError as exc:
        _fail(ExitCode.BAD_INPUT, f"--host/--port: {exc}")
    typer.echo(f"reading {run.location} …", err=True)
    _research_call(
        lambda: viewer.serve(run, sock, announce=lambda line: typer.echo(line, err=True), host=host, allow_hosts=allow_host)
    )


class TableFormat(StrEnum):
    parquet = "parquet"
    csv = "csv"


class TableLevel(StrEnum):
    episodes = "episodes"
    steps = "steps"


@export_app.command("table")
def export_table(
    run_location: str = RUN_ARGUMENT,
    to: TableFormat = typer.Option(..., "--to", help="File format."),
    level: TableLevel = typer.Option(TableLevel.episodes, "--level", help="One row per episode, or one per step (model call)."),
    output: Path = typer.Option(..., "-o", "--output", help="The file to write (replaced whole at the end)."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Write a run's episodes or steps as Parquet or CSV, streamed in row batches."""
    tables = _import_extra("shopsimrl.research.tables", "research")
    from shopsimrl.storage.reading import open_run

    _setup_logging(quiet, verbose)
    rows = _research_call(
        lambda: _write_output(
            lambda: tables.export_table(open_run(run_location), output, to=to.value, level=level.value), "-o/--output:"
        )
    )
    typer.echo(f"wrote {rows} {level.value[:-1]} rows to {output}")


def _stop_early(signum: int, frame: object) -> None:
    # Until a command installs its own handling (a run's graceful stop), a signal ends the process
    # at once with the retryable code: nothing is held yet that needs cleaning up.
    raise SystemExit(int(ExitCode.RETRYABLE))


def main() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_early)
    # A shard worker starts with both blocked (sharded.local_job); from here they are handled.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    app()


if __name__ == "__main__":
    main()
