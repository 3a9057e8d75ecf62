"""structlog set-up: readable console lines locally, JSON lines in pods.

The one place that reads ``SHOPSIMRL_LOG_FORMAT`` (``console`` or ``json``) and
``SHOPSIMRL_LOG_LEVEL`` (``debug``, ``info``, ``warning``, ``error``); a command's ``-q``/``-v``
overrides the level. Context (run, shard, episode_id) is bound with structlog's contextvars, so
every line an episode produces carries it. Logs go to stderr; stdout stays free for command output.

While a live progress bar is on screen, log lines are printed through the bar's console
(:func:`live_console`): rich then clears the bar, prints the line above it and redraws the bar,
instead of the line landing inside the bar.

:func:`tap` lets a live display count an event (a model retry) whatever the level shows: an
info line hidden by ``-q`` is still counted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Literal

import structlog
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console
from rich.text import Text

__all__ = [
    "LogSettings",
    "brief",
    "configure_logging",
    "current_settings",
    "level",
    "live_console",
    "log_format",
    "print_line",
    "tap",
]

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


_JSON_BODY = re.compile(r"\{.*\}", re.DOTALL)


def brief(text: str, limit: int = 160) -> str:
    """An error message for a one-line log field: whitespace collapsed, a JSON error body (an
    OpenAI-style ``{"error": {"message": …}}``) reduced to its message, at most ``limit``
    characters. The whole message stays in the trace."""
    match = _JSON_BODY.search(text)
    if match:
        try:
            body = json.loads(match.group(0))
        except ValueError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
        if isinstance(message, str):
            text = text[: match.start()] + message + text[match.end() :]
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


EventCallback = Callable[[dict[str, Any]], None]
_TAPS: dict[str, list[EventCallback]] = {}
_TAPPED_FROM = logging.INFO
"""Events :func:`tap` can see are logged at this level or above; below the configured level
they are dropped after the taps (a processor), not before (the wrapper class)."""
_METHOD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "msg": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def _run_taps(_logger: Any, _method: str, event_dict: Any) -> Any:
    callbacks = _TAPS.get(event_dict.get("event"))
    for callback in list(callbacks or ()):
        with suppress(Exception):  # a broken display must never stop a process that is saving traces
            callback(dict(event_dict))
    return event_dict


class _DropBelow:
    """The configured level, applied after the taps."""

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum

    def __call__(self, _logger: Any, method: str, event_dict: Any) -> Any:
        if _METHOD_LEVELS.get(method, logging.CRITICAL) < self.minimum:
            raise structlog.DropEvent
        return event_dict


@contextmanager
def tap(event: str, callback: EventCallback) -> Iterator[None]:
    """Inside the block, ``callback`` gets the fields of every ``event`` logged at info or above
    in this process, also when the level hides the line. The callback must be quick; it runs
    where the line is logged."""
    _TAPS.setdefault(event, []).append(callback)
    try:
        yield
    finally:
        callbacks = _TAPS.get(event, [])
        if callback in callbacks:
            callbacks.remove(callback)
        if not callbacks:
            _TAPS.pop(event, None)


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
    configured = logging.getLevelName(settings.log_level.upper())
    structlog.configure(
        processors=[
            _run_taps,
            _DropBelow(configured),
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        # Lines below both levels cost nothing (the wrapper's no-op methods); see _TAPPED_FROM.
        wrapper_class=structlog.make_filtering_bound_logger(min(configured, _TAPPED_FROM)),
        logger_factory=_terminal_logger,
        cache_logger_on_first_use=False,
    )
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
