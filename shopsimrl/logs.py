"""structlog set-up: readable console lines locally, JSON lines in pods.

The one place that reads ``SHOPSIMRL_LOG_FORMAT`` (``console`` or ``json``) and
``SHOPSIMRL_LOG_LEVEL`` (``debug``, ``info``, ``warning``, ``error``); a command's ``-q``/``-v``
overrides the level. Context (run, shard, episode_id) is bound with structlog's contextvars, so
every line an episode produces carries it. Logs go to stderr; stdout stays free for command output.

While a live progress bar is on screen, log lines are printed through the bar's console
(:func:`live_console`): rich then clears the bar, prints the line above it and redraws the bar,
instead of the line landing inside the bar.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import structlog
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console
from rich.text import Text

__all__ = ["LogSettings", "configure_logging", "current_settings", "level", "live_console", "log_format", "print_line"]

LevelName = Literal["debug", "info", "warning", "error"]


class LogSettings(BaseSettings):
    """``SHOPSIMRL_LOG_FORMAT`` and ``SHOPSIMRL_LOG_LEVEL``; a bad value is a ValidationError."""

    model_config = SettingsConfigDict(env_prefix="SHOPSIMRL_", extra="ignore")

    log_format: Literal["console", "json"] = "console"
    log_level: LevelName = "info"
    log_fallback_fd: int | None = Field(default=None, ge=3)
    """Set by a sharded run's coordinator for its workers (``SHOPSIMRL_LOG_FALLBACK_FD``): a copy
    of the coordinator's own stderr. Their stderr is a pipe the coordinator reads; if it dies,
    they write there instead, so their last lines (stopping, releasing leases) are not lost."""

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value


class _Terminal:
    """Where rendered lines go: the live bar's console while one is shown, else stderr.

    stderr is looked up at each write (test runners and rich swap it). When its reader is gone
    (a closed pipe), stderr becomes the fallback descriptor if there is one, for every later
    write of the process, tracebacks included; without one, or when that fails too, the line is
    dropped: logging must never stop a process that is saving traces and releasing leases."""

    def __init__(self) -> None:
        self.console: Console | None = None
        self.fallback_fd: int | None = None
        self._lock = threading.Lock()

    def write_line(self, line: str) -> None:
        console = self.console
        try:
            if console is not None:
                console.print(Text.from_ansi(line), soft_wrap=True)
                return
            with self._lock:
                try:
                    self._write(line)
                except BrokenPipeError:
                    if self.fallback_fd is None:
                        raise
                    fallback, self.fallback_fd = self.fallback_fd, None
                    os.dup2(fallback, sys.stderr.fileno())
                    self._write(line)
        except (OSError, ValueError):  # ValueError: stderr already closed at exit
            pass

    @staticmethod
    def _write(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


_TERMINAL = _Terminal()
_current = LogSettings.model_construct(log_format="console", log_level="info")


class _TerminalLogger:
    """structlog's wrapped logger: every level prints one rendered line through :data:`_TERMINAL`."""

    def msg(self, message: str) -> None:
        _TERMINAL.write_line(message)

    log = debug = info = warn = warning = error = err = critical = fatal = exception = failure = msg


def _terminal_logger(*_args: Any) -> _TerminalLogger:
    return _TerminalLogger()


def configure_logging(verbosity: int = 0, *, settings: LogSettings | None = None) -> LogSettings:
    """Configure structlog from the environment; ``verbosity`` -1 (``-q``) shows warnings and
    errors only, +1 (``-v``) debug lines too, 0 keeps ``SHOPSIMRL_LOG_LEVEL``. ``settings``
    instead of the environment: what a parent process uses (:func:`current_settings`).

    Raises pydantic's ValidationError when a variable has a value outside its choices."""
    global _current
    settings = settings or LogSettings()
    if verbosity:
        settings = settings.model_copy(update={"log_level": "debug" if verbosity > 0 else "warning"})
    _current = settings
    _TERMINAL.fallback_fd = settings.log_fallback_fd
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(ensure_ascii=False)
        if settings.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(settings.log_level.upper())),
        logger_factory=_terminal_logger,
        cache_logger_on_first_use=False,
    )
    # httpx logs every request at INFO; that is noise at rollout volume.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return settings


def current_settings() -> LogSettings:
    """What :func:`configure_logging` set up, for a child process to log the same way (less the
    fallback descriptor, which a child does not inherit)."""
    return _current.model_copy(update={"log_fallback_fd": None})


def log_format() -> Literal["console", "json"]:
    """The format :func:`configure_logging` set up (``console`` before it ran)."""
    return _current.log_format


def level() -> LevelName:
    """The level :func:`configure_logging` set up (``info`` before it ran)."""
    return _current.log_level


def print_line(line: str) -> None:
    """Print a line that is not a log record (a child process's raw output) where logs go."""
    _TERMINAL.write_line(line)


@contextmanager
def live_console(console: Console) -> Iterator[None]:
    """Route log lines through ``console`` (a live progress display's) inside the block."""
    _TERMINAL.console = console
    try:
        yield
    finally:
        _TERMINAL.console = None
