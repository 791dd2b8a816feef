"""structlog set-up: JSON lines on stderr when not a terminal (journald, Docker,
Kubernetes collect them), readable console lines on a terminal."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog once for the process; logs always go to stderr."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**bind: Any) -> Any:
    """A bound logger; bind run/checkpoint once per unit of work."""
    return structlog.get_logger("ckptd").bind(**bind)
