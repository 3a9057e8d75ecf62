"""What every command module shares: help style, -q/-v and logging, the worker's settings,
loading and preparing an experiment config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from shopsimrl.cli.errors import BadInputError
from shopsimrl.config import ExperimentConfig, WorkerSettings, describe_settings_error, load_experiment_config
from shopsimrl.logs import configure_logging

__all__ = [
    "FINAL_TEST",
    "HELP_STYLE",
    "QUIET",
    "REROLL_FAILED",
    "RETRY_FAILED",
    "VERBOSE",
    "check_rerun_flags",
    "load",
    "prepare",
    "setup_logging",
    "warn",
    "worker_settings",
]

# Plain (click) help, not rich panels: rich's option table crops long option names at 80
# columns and shows a type for every flag; click's layout wraps the help text instead.
HELP_STYLE: dict[str, Any] = {"rich_markup_mode": None, "no_args_is_help": True}

QUIET = typer.Option(False, "-q", "--quiet", help="Log warnings and errors only.")
VERBOSE = typer.Option(
    False, "-v", "--verbose", help="Also log debug lines (a run: one per episode). Default level: SHOPSIMRL_LOG_LEVEL, else info."
)
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


def warn(line: str) -> None:
    typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)


def setup_logging(quiet: bool, verbose: bool) -> None:
    """Logging from SHOPSIMRL_LOG_FORMAT/SHOPSIMRL_LOG_LEVEL and the command's -q/-v."""
    if quiet and verbose:
        raise BadInputError("-q/--quiet and -v/--verbose exclude each other")
    try:
        configure_logging(1 if verbose else -1 if quiet else 0)
    except ValidationError as exc:
        # Not in the table: a ValidationError elsewhere is no settings error; this one is.
        raise BadInputError(describe_settings_error(exc)) from exc


def worker_settings() -> WorkerSettings:
    """Settings from SHOPSIMRL_* / JOB_COMPLETION_INDEX; a malformed variable is bad input (exit 2)."""
    try:
        return WorkerSettings()
    except ValidationError as exc:
        raise BadInputError(describe_settings_error(exc)) from exc  # as in setup_logging


def load(config_path: Path) -> ExperimentConfig:
    return load_experiment_config(config_path).with_overrides(worker_settings())


def prepare(config: ExperimentConfig, final_test: bool) -> Any:
    from shopsimrl.runner.experiment import prepare

    return prepare(config, final_test=final_test)


def check_rerun_flags(retry_failed: bool, reroll_failed: bool) -> None:
    if reroll_failed and not retry_failed:
        raise BadInputError("--reroll-failed and --no-retry-failed contradict each other")
