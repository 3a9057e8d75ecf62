"""What every command module shares: help style, -q/-v and logging, the worker's settings,
loading and preparing an experiment config."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from shopsimrl.cli.errors import BadInputError
from shopsimrl.config import (
    TRACKERS,
    ConfigOverride,
    ExperimentConfig,
    TrackingSection,
    WorkerSettings,
    describe_settings_error,
    load_experiment_config,
    parse_set_option,
)
from shopsimrl.logs import configure_logging

__all__ = [
    "CHECKPOINT",
    "EXPERIMENT",
    "FINAL_TEST",
    "HELP_STYLE",
    "MODEL",
    "QUIET",
    "REROLL_FAILED",
    "RETRY_FAILED",
    "SET",
    "TRACK",
    "VERBOSE",
    "check_rerun_flags",
    "command_line_overrides",
    "load",
    "prepare",
    "setup_logging",
    "track_summary",
    "track_with",
    "tracking_settings",
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

SET = typer.Option(
    None,
    "--set",
    metavar="KEY=VALUE",
    help="Override a config key (dotted: model.temperature=0.7, runtime.max_steps=20); the value is read as YAML "
    "(numbers, true/false, null, [lists], {maps}). Repeatable. Validated, planned and fingerprinted as the same edit "
    "of the YAML; wins over SHOPSIMRL_* variables. Relative paths are relative to the current directory.",
)
MODEL = typer.Option(
    None,
    "--model",
    metavar="NAME",
    help="The served model to call: --set model.name=NAME (as text), and model.id=null unless --set gives model.id, "
    "so the run is labelled with the model it calls.",
)
CHECKPOINT = typer.Option(
    None, "--checkpoint", metavar="ID", help="The weights' identity: --set model.checkpoint_id=ID (as text)."
)
EXPERIMENT = typer.Option(
    None,
    "--experiment",
    metavar="NAME",
    help="The run's name (and its directory under experiment.output_dir): --set experiment.name=NAME (as text).",
)

TRACK = typer.Option(
    None,
    "--track",
    metavar="TRACKER",
    help="Also log the results to an experiment tracker: wandb or mlflow (repeatable). Settings: the config's "
    "tracking: block, else the trackers' own variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI and the rest). "
    "Needs shopsimrl[tracking]; a tracker that fails is reported and never changes the exit code.",
)


def command_line_overrides(
    sets: list[str] | None,
    *,
    model: str | None = None,
    checkpoint: str | None = None,
    experiment: str | None = None,
    concurrency: int | None = None,
) -> list[ConfigOverride]:
    """``--set`` and the short forms as overrides; a short form's value is text, never read as YAML
    (a checkpoint id ``0123`` or ``true`` stays what was typed)."""
    overrides = [parse_set_option(text) for text in sets or ()]
    for key, value, flag in (
        ("model.name", model, "--model"),
        ("model.checkpoint_id", checkpoint, "--checkpoint"),
        ("experiment.name", experiment, "--experiment"),
        ("experiment.concurrency", concurrency, "--concurrency"),
    ):
        if value is not None:
            overrides.append(ConfigOverride(key, value, flag))
    if model is not None and not any(override.key == "model.id" for override in overrides):
        # model.id labels the run (its name, the leaderboard): a label the config gave another
        # model would name this run after it.
        overrides.append(ConfigOverride("model.id", None, "--model"))
    return overrides


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


def load(config_path: Path, overrides: list[ConfigOverride] | None = None) -> ExperimentConfig:
    """The config with the command line's ``overrides``, then the ``SHOPSIMRL_*`` ones where the
    command line left the key alone."""
    return load_experiment_config(config_path, overrides=overrides or ()).with_overrides(worker_settings())


def prepare(config: ExperimentConfig, final_test: bool) -> Any:
    from shopsimrl.runner.experiment import prepare

    return prepare(config, final_test=final_test)


def check_rerun_flags(retry_failed: bool, reroll_failed: bool) -> None:
    if reroll_failed and not retry_failed:
        raise BadInputError("--reroll-failed and --no-retry-failed contradict each other")


def tracking_settings(names: Sequence[str] | None, config: ExperimentConfig | None = None) -> TrackingSection | None:
    """The trackers of this invocation: the config's ``tracking:`` block (its ``dir`` relative to
    the YAML) with the ``--track`` names added; None when no tracker is asked for. Checked before
    anything runs, so a misspelt tracker costs no run."""
    for name in names or ():
        if name not in TRACKERS:
            raise BadInputError(f"--track {name}: unknown tracker; choose from {', '.join(TRACKERS)}")
    block = config.tracking if config is not None and config.tracking is not None else TrackingSection()
    settings = block.with_trackers(list(names or ()))
    if not settings.backends:
        return None
    if config is not None and settings.dir is not None:
        settings = settings.model_copy(update={"dir": str(config.resolve(settings.dir))})
    _warn_missing_trackers(settings)
    return settings


def _warn_missing_trackers(settings: TrackingSection) -> None:
    """Say before a run, not only after it, that a tracker asked for is not installed (the run goes on)."""
    from importlib.util import find_spec

    def found(module: str) -> bool:
        try:
            return find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing; a module set to None
            return False

    research = found("shopsimrl.research.tracking")
    missing = [name for name in settings.backends if not research or not found(name)]
    if missing:
        warn(
            f"{', '.join(missing)} not installed: this will not be tracked there (pip install 'shopsimrl[tracking]'); "
            "the run goes on"
        )


def track_summary(location: str, summary: Mapping[str, Any], settings: TrackingSection | None) -> None:
    """Log a written summary and its run to the trackers (``track_evaluation``)."""
    track_with(settings, lambda tracking: tracking.track_evaluation(location, summary, settings))


def track_with(settings: TrackingSection | None, call: Callable[[Any], Any]) -> None:
    """``call(shopsimrl.research.tracking)`` when a tracker is asked for: the module is loaded by
    name (an optional part), and whatever happens only lines go to stderr, never an exception or
    another exit code. ``call`` returns the trackers' outcomes."""
    if settings is None:
        return
    try:
        tracking = importlib.import_module("shopsimrl.research.tracking")
    except ImportError as exc:
        warn(
            f"not tracked in {', '.join(settings.backends)}: the trackers need shopsimrl-research and its tracking extra "
            f"(pip install 'shopsimrl[tracking]'; missing: {exc.name or exc}); the results are unaffected"
        )
        return
    try:
        outcomes = call(tracking)
    except Exception as exc:  # the tracking module guards each tracker; this is the last line of defence
        warn(f"not tracked: {type(exc).__name__}: {tracking.Redactor().text(str(exc))}; the results are unaffected")
        return
    for outcome in outcomes:
        if outcome.ok:  # a failure is already logged (tracker_failed), once
            typer.echo(outcome.line(), err=True)
