"""The one table from an exception to its exit code and its ``error: …`` line, and the handler
every command runs under (:class:`HandledGroup`, the root command group).

Commands let these exceptions propagate; nothing else in the CLI decides an exit code for an
exception. A command returns its result's code with ``typer.Exit`` (0 done, 1 episodes failed).

An entry names its class as ``"module:Class"`` and is resolved only when an exception is being
handled and that module is already imported (an instance of a class implies its module is), so
the table imports nothing: not the runner, not an optional part that may not be installed.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from shopsimrl.exitcodes import ExitCode

__all__ = [
    "READ_FAILED",
    "RULES",
    "BadInputError",
    "HandledGroup",
    "PartMissingError",
    "Rule",
    "TryAgainError",
    "context",
    "exit_for",
    "import_part",
    "install_hint",
]


class BadInputError(Exception):
    """A command's own refusal of its flags or arguments (exit 2); the message is the line."""


class TryAgainError(Exception):
    """A command's own "not now" (exit 3): a service not ready in time, shards still running."""


class PartMissingError(Exception):
    """A module of an optional part (an extra, or a distribution) is not installed here."""

    def __init__(self, module: str, extra: str, missing: str | None) -> None:
        super().__init__(install_hint(module, extra, missing))
        self.module, self.extra, self.missing = module, extra, missing


def install_hint(module: str, extra: str, missing: str | None) -> str:
    """What to install to get ``module`` (the one place this text is written)."""
    return f"{module} is not installed here ({missing} missing): pip install 'shopsimrl[{extra}]', or use the shopsimrl-{extra} image"


def import_part(module: str, extra: str) -> Any:
    """A module of an optional part (a pyproject extra; the worker image has none); without it
    the command exits 2 naming what to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise PartMissingError(module, extra, exc.name) from exc


@dataclass(frozen=True)
class Rule:
    error: str
    """``module:Class``; a subclass listed after its base would never match (a test checks)."""
    code: ExitCode | Callable[[Any], ExitCode]
    """The exit code, or how the exception carries it."""
    message: Callable[[Any], str] = str

    def resolve(self, *, load: bool = False) -> type[BaseException] | None:
        """The class, if its module is imported (or ``load``: imported now; None if absent)."""
        module, _, name = self.error.partition(":")
        if load:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError:
                return None
        loaded = sys.modules.get(module)
        found = getattr(loaded, name, None) if loaded is not None else None
        return found if isinstance(found, type) and issubclass(found, BaseException) else None


_BAD = ExitCode.BAD_INPUT
_AGAIN = ExitCode.RETRYABLE

# First match wins: a class before its subclasses' bases never; OSError (the broadest) last.
RULES: tuple[Rule, ...] = (
    # The CLI's own decisions on flags, services and optional parts.
    Rule("shopsimrl.cli.errors:BadInputError", _BAD),
    Rule("shopsimrl.cli.errors:TryAgainError", _AGAIN),
    Rule("shopsimrl.cli.errors:PartMissingError", _BAD),
    # The run exists with another plan: retrying can never help.
    Rule("shopsimrl.manifest:FingerprintMismatchError", ExitCode.FINGERPRINT_MISMATCH),
    # Codes the exception carries: a stopped run (signal, lost store), a failed write.
    Rule("shopsimrl.runner.local:RunStopped", lambda exc: exc.code),
    Rule("shopsimrl.storage.local:RunWriteError", lambda exc: _AGAIN if exc.retryable else _BAD),
    # Services and storage that did not answer: safe to retry.
    Rule("shopsimrl.storage.objectstore:StoreUnavailableError", _AGAIN),
    Rule("shopsimrl.environment:ShopEnvironmentError", _AGAIN),
    Rule("shopsimrl.research.outputs:OutputStorageError", _AGAIN),
    Rule("shopsimrl.training.grpo:TrainingStalledError", _AGAIN),
    # Bad input: configs, splits, plans, prompts, skills, the model's settings.
    Rule("shopsimrl.config:ConfigError", _BAD),
    Rule("shopsimrl.tasks:SplitError", _BAD),
    Rule("shopsimrl.planning:PlanError", _BAD),
    Rule("shopsimrl.skills:SkillBankError", _BAD),
    Rule("shopsimrl.prompts:PromptError", _BAD),
    Rule("shopsimrl.model:ModelConfigError", _BAD),
    # Bad input to training: a curriculum state or its bank, slime's task data.
    Rule("shopsimrl.training.curriculum:CurriculumError", _BAD),
    Rule("shopsimrl.training.task_data:TaskDataError", _BAD),
    # Bad input: runs and records this shopsimrl cannot read, run locations, shard maps.
    Rule("shopsimrl.manifest:ManifestError", _BAD),
    Rule("shopsimrl.records:RecordVersionError", _BAD),
    Rule("shopsimrl.records:RecordFormatError", _BAD),
    Rule("shopsimrl.storage.reading:RunReadError", _BAD),
    Rule("shopsimrl.storage.objectstore:RunLocationError", _BAD),
    Rule("shopsimrl.storage.sharded:ShardMapError", _BAD),
    Rule("shopsimrl.storage.sharded:RunNotPlannedError", _BAD),
    # Bad input to the research tools (each names its file, line or option).
    Rule("shopsimrl.research.outputs:OutputError", _BAD),
    Rule("shopsimrl.research.compare:CompareError", _BAD),
    Rule("shopsimrl.research.export:ExportError", _BAD),
    Rule("shopsimrl.research.redaction:ExportRefusedError", _BAD),
    Rule("shopsimrl.research.labels:LabelsFileError", _BAD),
    Rule("shopsimrl.research.viewer:ViewerError", _BAD),
    Rule("shopsimrl.research.gate.spec:GateSpecError", _BAD),
    Rule("shopsimrl.research.gate.freeze:GatePlanError", _BAD),
    Rule("shopsimrl.research.gate.drafts:DraftError", _BAD),
    Rule("shopsimrl.research.gate.checks:GateCheckError", _BAD),
    Rule("shopsimrl.research.gate.fit:GateFitError", _BAD),
    Rule("shopsimrl.research.judge.config:JudgeConfigError", _BAD),
    Rule("shopsimrl.research.judge.local:JudgeOutputError", _BAD),
    Rule("shopsimrl.research.judge.sharded:JudgePlanError", _BAD),
    Rule("shopsimrl.research.judge.call:JudgeModelError", _BAD),
    Rule("shopsimrl.research.skills.analyst:SkillInputError", _BAD),
    # Any other I/O error once a command is under way (reading a run, writing an output): the
    # storage or the disk failed; safe to retry once it is back.
    Rule("builtins:OSError", _AGAIN),
)


def exit_for(exc: BaseException) -> tuple[ExitCode, str] | None:
    """The exit code and the message (after ``error: ``) of ``exc``; None: not in the table."""
    for rule in RULES:
        cls = rule.resolve()
        if cls is not None and isinstance(exc, cls):
            code = rule.code(exc) if callable(rule.code) else rule.code
            prefix, suffix = getattr(exc, _CONTEXT, ("", ""))
            return ExitCode(code), f"{prefix}{rule.message(exc)}{suffix}"
    return None


_CONTEXT = "_shopsimrl_cli_context"

READ_FAILED = "reading the run or writing the output failed: "
"""The context of an I/O error while a command reads a run or writes an output."""


@contextmanager
def context(*errors: type[BaseException], prefix: str = "", suffix: str = "") -> Iterator[None]:
    """Say where ``errors`` raised in the block come from (``--json ``, the run to rewrite): the
    table's message gets ``prefix`` and ``suffix``. The innermost context of an exception wins."""
    try:
        yield
    except errors as exc:
        if not hasattr(exc, _CONTEXT):
            setattr(exc, _CONTEXT, (prefix, suffix))
        raise


def fail(code: ExitCode, message: str) -> NoReturn:
    """Print ``error: message`` on stderr (red on a terminal) and exit with ``code``."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(int(code))


class HandledGroup(TyperGroup):
    """The root command group: every command runs inside its ``invoke``, so an exception of the
    table ends the process as one ``error: …`` line and its code; any other propagates."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            found = exit_for(exc)
            if found is None:
                raise
            fail(*found)
