"""Sharded runs: ``worker`` (one shard, one pod of an Indexed Job) and ``reduce``, and what
``plan --shards``, ``run --shards`` and ``gate run --shards`` share: freezing the plan, running
N local workers, reducing and reporting."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from shopsimrl.cli.common import (
    FINAL_TEST,
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
from shopsimrl.cli.errors import BadInputError, TryAgainError, import_part
from shopsimrl.config import ConfigOverride, TrackingSection
from shopsimrl.exitcodes import ExitCode

app = typer.Typer(rich_markup_mode=None)


def freeze_sharded_plan(prepared: Any, run_uri: str, shards: int) -> tuple[dict[str, Any], list[int]]:
    """Write or verify the frozen sharded plan; returns its part of `plan`'s report and every shard's job count."""
    from shopsimrl.runner.worker import plan_run
    from shopsimrl.storage.sharded import ShardedRunStore

    store = ShardedRunStore(run_uri)
    manifest, shard_map = plan_run(prepared, store, shards)
    jobs_per_shard = [len(ids) for ids in shard_map.episode_ids]
    report = {
        "run": store.display_uri,
        "plan_fingerprint": manifest.plan_fingerprint,
        "shards": shard_map.count,
        "jobs_per_shard": jobs_per_shard[:16],
    }
    return report, jobs_per_shard


def run_sharded(
    config_path: Path,
    run_uri: str | None,
    shards: int,
    final_test: bool,
    backoff_limit: int,
    overrides: list[ConfigOverride],
    retry_failed: bool,
    reroll_failed: bool,
    progress: bool,
    track: list[str] | None = None,
) -> None:
    from shopsimrl.runner.local_job import run_indexed
    from shopsimrl.runner.progress import ShardedRunProgress

    config = load(config_path, overrides)
    tracking = tracking_settings(track, config)
    prepared = prepare(config, final_test)
    uri = str(config.run_dir) if run_uri is None else run_uri
    frozen, jobs_per_shard = freeze_sharded_plan(prepared, uri, shards)
    typer.echo(f"run {config.name}: {len(prepared.jobs)} episodes in {shards} shards → {frozen['run']}", err=True)
    with ShardedRunProgress(jobs_per_shard, enabled=progress and sys.stderr.isatty()) as bar:
        result = run_indexed(
            uri,
            config_path.resolve(),
            shards,
            backoff_limit_per_index=backoff_limit,
            final_test=final_test,
            retry_failed=retry_failed,
            reroll_failed=reroll_failed,
            # Every worker plans from the config with the same overrides (or it would exit 42).
            settings=[override.as_set_option() for override in overrides],
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
    code = reduce_and_report(uri, wait=False, timeout=0.0, include_uncommitted=False, tracking=tracking)
    raise typer.Exit(int(max(code, result.exit_code, key=_severity)))


def _severity(code: ExitCode) -> int:
    return {
        ExitCode.OK: 0,
        ExitCode.EPISODES_FAILED: 1,
        ExitCode.RETRYABLE: 2,
        ExitCode.BAD_INPUT: 3,
        ExitCode.FINGERPRINT_MISMATCH: 4,
    }[ExitCode(code)]


def reduce_and_report(
    uri: str,
    *,
    wait: bool,
    timeout: float,
    include_uncommitted: bool,
    partial_on_timeout: bool = False,
    worker_job: str | None = None,
    namespace: str | None = None,
    tracking: TrackingSection | None = None,
) -> ExitCode:
    from shopsimrl.metrics import format_summary_table
    from shopsimrl.runner.reduce import reduce_run, wait_for_markers
    from shopsimrl.storage.sharded import ShardedRunStore

    store = ShardedRunStore(uri)
    waited = None
    if wait:
        give_up = _failed_indexes_of(worker_job, namespace or "default") if worker_job else None
        waited = wait_for_markers(store, timeout=timeout, interval=min(5.0, max(0.2, timeout / 20)), give_up=give_up)
        # Shards the worker Job has given up on will never commit: waiting longer cannot help.
        if waited.pending and not (partial_on_timeout or waited.why):
            raise TryAgainError(f"timed out after {timeout:g} s; shards without a commit marker: {waited.pending[:20]}")
        if waited.pending:
            warn(f"{waited.reason}: {waited.pending[:20]}; writing a partial summary")
    summary = reduce_run(
        store,
        include_uncommitted=include_uncommitted,
        incomplete_reason=waited.reason if waited and waited.pending else None,
        missing_why=waited.why if waited else None,
    )
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
    track_summary(uri, summary, tracking)
    counts = summary.get("counts", {})
    incomplete = report["uncommitted"] or report["corrupt"] or counts.get("failed") or counts.get("missing")
    return ExitCode.EPISODES_FAILED if incomplete else ExitCode.OK


def _failed_indexes_of(job: str, namespace: str) -> Any:
    """A ``give_up`` for :func:`~shopsimrl.runner.reduce.wait_for_markers` that watches the worker Job."""
    kube = import_part("shopsimrl.runner.kube", "kube")
    return kube.give_up_on_failed_indexes(job, namespace, warn=warn)


@app.command("worker")
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
    sets: list[str] | None = SET,
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
    setup_logging(quiet, verbose)
    check_rerun_flags(retry_failed, reroll_failed)
    index = shard_index if shard_index is not None else settings.shard_index
    if run_uri is None or config_path is None or index is None:
        raise BadInputError(
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
            overrides=command_line_overrides(sets),
        )
    )
    if succeed_once_committed and code == ExitCode.EPISODES_FAILED:
        # run_worker answers EPISODES_FAILED only once the shard's commit marker is written.
        code = ExitCode.OK
    raise typer.Exit(int(code))


@app.command("reduce")
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
    track: list[str] | None = TRACK,
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Merge committed shards into summary.json: de-duplicated by episode_id, checksums verified."""
    setup_logging(quiet, verbose)
    tracking = tracking_settings(track)
    if (partial_on_timeout or worker_job) and not wait:
        raise BadInputError("--partial-on-timeout and --worker-job need --wait")
    code = reduce_and_report(
        run_uri,
        wait=wait,
        timeout=timeout,
        include_uncommitted=include_uncommitted,
        partial_on_timeout=partial_on_timeout,
        worker_job=worker_job,
        namespace=namespace,
        tracking=tracking,
    )
    raise typer.Exit(int(code))
