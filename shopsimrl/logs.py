"""structlog set-up: readable console lines locally, JSON lines in pods (``SHOPSIMRL_LOG_FORMAT=json``).

Context (run, shard, episode_id) is bound with structlog's contextvars, so every line an
episode produces carries it. Logs go to stderr; stdout stays free for command output.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import structlog

__all__ = ["configure_logging"]


def configure_logging(log_format: Literal["console", "json"] | None = None, level: str = "INFO") -> None:
    log_format = log_format or ("json" if os.environ.get("SHOPSIMRL_LOG_FORMAT", "").lower() == "json" else "console")
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(ensure_ascii=False)
        if log_format == "json"
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
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # httpx logs every request at INFO; that is noise at rollout volume.
    logging.getLogger("httpx").setLevel(logging.WARNING)
