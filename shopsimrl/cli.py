"""``shopsimrl`` command line: plan, run, summarize, wait-ready, testbed.

Exit codes are those of :mod:`shopsimrl.exitcodes` (0 done, 1 some episodes failed, 2 bad input,
3 interrupted/retryable, 42 the run exists with another fingerprint).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer

from shopsimrl.config import ConfigError, ExperimentConfig, WorkerSettings, load_experiment_config
from shopsimrl.exitcodes import ExitCode
from shopsimrl.logs import configure_logging
from shopsimrl.manifest import FingerprintMismatchError, ManifestError
from shopsimrl.schemas import fingerprint

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Frozen, resumable rollouts of shopping agents on ShopSimulator.")
testbed_app = typer.Typer(no_args_is_help=True, help="Local stand-ins: a ShopSimulator-compatible shop and a heuristic policy model.")
app.add_typer(testbed_app, name="testbed")


def _fail(code: ExitCode, message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(int(code))


def _load(config_path: Path) -> ExperimentConfig:
    try:
        return load_experiment_config(config_path).with_overrides(WorkerSettings())
    except ConfigError as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))


def _prepare(config: ExperimentConfig, final_test: bool) -> Any:
    from shopsimrl.experiment import prepare
    from shopsimrl.model import ModelConfigError
    from shopsimrl.planning import PlanError
    from shopsimrl.prompts import PromptError
    from shopsimrl.skills import SkillBankError
    from shopsimrl.tasks import SplitError

    try:
        return prepare(config, final_test=final_test)
    except (ConfigError, SplitError, PlanError, SkillBankError, PromptError, ModelConfigError) as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))


FINAL_TEST = typer.Option(False, "--final-test", help="Allow running the held-out test split (requires skills.path: null).")


@app.command()
def plan(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="Experiment YAML."),
    final_test: bool = FINAL_TEST,
    check: bool = typer.Option(False, "--check", help="Also probe the model's /models and the environment's /healthz."),
) -> None:
    """Show the frozen plan (episodes, seeds, fingerprint, identities) without running anything."""
    from shopsimrl.store import LocalRunStore

    configure_logging()
    config = _load(config_path)
    prepared = _prepare(config, final_test)
    semantic = prepared.plan()
    plan_fp = fingerprint(semantic)
    store = LocalRunStore(config.run_dir)
    try:
        existing = store.read_manifest()
        manifest_state = (
            "none" if existing is None else ("matches" if existing["plan_fingerprint"] == plan_fp else "CONFLICTS (run would exit 42)")
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
    if check:
        from shopsimrl.experiment import check_services

        result = asyncio.run(check_services(prepared))
        report["services"] = {"ready": result.ready, "reason": result.reason, "detail": result.detail}
    typer.echo(json.dumps(report, ensure_ascii=False, indent=2))
    if check and not report["services"]["ready"]:
        raise typer.Exit(int(ExitCode.RETRYABLE))


@app.command()
def run(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="Experiment YAML."),
    final_test: bool = FINAL_TEST,
    retry_failed: bool = typer.Option(
        True, "--retry-failed/--no-retry-failed", help="Give episodes that failed in earlier invocations a fresh set of attempts."
    ),
    max_episode_retries: Optional[int] = typer.Option(None, min=0, help="Extra attempts per episode for infrastructure failures (default: runtime.max_episode_retries)."),
    concurrency: Optional[int] = typer.Option(None, min=1, help="Episodes in flight (default: experiment.concurrency)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a live progress bar."),
) -> None:
    """Run (or resume) every episode of the plan in this process, then write summary.json."""
    from shopsimrl.evaluation import ConcurrencyLimitedModel, Evaluator
    from shopsimrl.model import ModelConfigError
    from shopsimrl.progress import RunProgress
    from shopsimrl.store import LocalRunStore, RunLockedError

    configure_logging()
    config = _load(config_path)
    if concurrency:
        config = config.model_copy(update={"experiment": config.experiment.model_copy(update={"concurrency": concurrency})})
    prepared = _prepare(config, final_test)
    try:
        prepared.model().check_api_key()
    except ModelConfigError as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))

    store = LocalRunStore(config.run_dir)
    try:
        store.acquire()
    except RunLockedError as exc:
        _fail(ExitCode.RETRYABLE, str(exc))
    try:
        try:
            if not config.experiment.resume and store.read_manifest() is not None:
                _fail(ExitCode.BAD_INPUT, f"{config.run_dir} already holds a run and experiment.resume is false")
            store.initialize(prepared.plan(), prepared.execution())
        except FingerprintMismatchError as exc:
            _fail(ExitCode.FINGERPRINT_MISMATCH, str(exc))
        except ManifestError as exc:
            _fail(ExitCode.BAD_INPUT, str(exc))
        index = store.load_index()
        completed = {eid for eid, state in index.episodes.items() if state.completed}
        prior = {eid: state.attempts for eid, state in index.episodes.items()}
        todo = sum(1 for job in prepared.jobs if job.episode_id not in completed)
        typer.echo(
            f"run {config.name}: {len(prepared.jobs)} episodes, {len(prepared.jobs) - todo} already completed, "
            f"{todo} to run → {config.run_dir}",
            err=True,
        )

        async def execute() -> None:
            model = prepared.model()
            environment = prepared.environment()
            limited = ConcurrencyLimitedModel(model, config.model.max_concurrent_requests or config.experiment.concurrency)
            try:
                with RunProgress(todo, enabled=progress and sys.stderr.isatty()) as bar:
                    evaluator = Evaluator(
                        prepared.runtime(limited, environment),
                        store,
                        concurrency=config.experiment.concurrency,
                        max_episode_retries=(
                            config.runtime.max_episode_retries if max_episode_retries is None else max_episode_retries
                        ),
                        retry_failed=retry_failed,
                        on_trace=bar.on_trace,
                    )
                    await evaluator.run(prepared.jobs, completed=completed, prior_attempts=prior)
            finally:
                await model.aclose()
                await environment.aclose()

        try:
            asyncio.run(execute())
        except KeyboardInterrupt:
            _fail(ExitCode.RETRYABLE, "interrupted; finished episodes are saved, rerun the same command to resume")
        except OSError as exc:
            _fail(ExitCode.RETRYABLE, f"cannot persist traces in {config.run_dir}: {exc}")
        summary = _summarize_local(store, [job.episode_id for job in prepared.jobs])
    finally:
        store.release()
    _print_summary(summary, store.summary_path)
    _exit_for(summary)


def _summarize_local(store: Any, requested_ids: list[str] | None, requested: int | None = None) -> dict[str, Any]:
    from shopsimrl.metrics import SummaryAccumulator

    accumulator = SummaryAccumulator(requested_episode_ids=set(requested_ids) if requested_ids is not None else None, requested=requested)
    index = store.load_index()
    for is_latest, record in store.iter_records(index):
        if is_latest:
            accumulator.add(record)
        else:
            accumulator.note_superseded_attempt(record)
    summary = accumulator.result()
    summary.setdefault("counts", {})["unreadable_lines"] = index.bad_lines
    store.write_summary(summary)
    return summary


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
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A local run directory (manifest.json + traces.jsonl)."),
    requested: Optional[int] = typer.Option(None, help="Requested episode count when the run has no manifest."),
) -> None:
    """Recompute summary.json from the traces of a run directory (also traces of the earlier format)."""
    from shopsimrl.store import LocalRunStore

    configure_logging()
    store = LocalRunStore(run_dir)
    if not store.traces_path.exists():
        _fail(ExitCode.BAD_INPUT, f"{store.traces_path} does not exist")
    try:
        manifest = store.read_manifest()
    except ManifestError as exc:
        _fail(ExitCode.BAD_INPUT, str(exc))
    requested_ids = None
    if manifest is not None and requested is None:
        from shopsimrl.schemas import EpisodeJob

        requested_ids = [EpisodeJob.from_dict(job).episode_id for job in manifest["plan"]["jobs"]]
    summary = _summarize_local(store, requested_ids, requested)
    _print_summary(summary, store.summary_path)


@app.command("wait-ready")
def wait_ready(
    config_path: Path = typer.Option(..., "--config", envvar="SHOPSIMRL_CONFIG", help="Experiment YAML."),
    timeout: float = typer.Option(600.0, min=0, help="Give up after this many seconds."),
    interval: float = typer.Option(5.0, min=0.1, help="Seconds between probes."),
) -> None:
    """Wait until the model lists the served model and the environment says ready (exit 3 on timeout)."""
    from shopsimrl.experiment import check_services

    configure_logging()
    config = _load(config_path)
    # Readiness does not depend on the split guard: probe with the test guard satisfied.
    prepared = _prepare(config, final_test=_is_test_split(config))
    result = asyncio.run(check_services(prepared, timeout=timeout, interval=interval))
    if not result.ready:
        _fail(ExitCode.RETRYABLE, f"{result.reason}: {result.detail}")
    typer.echo(f"ready: {result.detail}")


def _is_test_split(config: ExperimentConfig) -> bool:
    from shopsimrl.tasks import SplitError, load_task_split

    try:
        return load_task_split(config.resolve(config.tasks.split_file), config.tasks.split).is_test and config.skills.path is None
    except SplitError:
        return False


# ----------------------------------------------------------------------------- testbed


@testbed_app.command("shop")
def testbed_shop(
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(5700, help="Port."),
) -> None:
    """Serve the ShopSimulator-compatible shop (POST /api/shop_agent, GET /healthz)."""
    from shopsimrl.testbed.shop.server import serve

    serve(host=host, port=port)


@testbed_app.command("policy")
def testbed_policy(
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8000, help="Port."),
) -> None:
    """Serve the heuristic policy as an OpenAI-compatible model (POST /v1/chat/completions)."""
    from shopsimrl.testbed.policy import serve

    serve(host=host, port=port)


@testbed_app.command("up")
def testbed_up(
    host: str = typer.Option("127.0.0.1", help="Bind address of both services."),
    shop_port: int = typer.Option(5700, help="Shop port."),
    policy_port: int = typer.Option(8000, help="Policy port."),
) -> None:
    """Serve both testbed services until Ctrl-C."""
    from shopsimrl.testbed.up import serve_both

    serve_both(host=host, shop_port=shop_port, policy_port=policy_port)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
