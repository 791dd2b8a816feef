"""The command-line options every command shares, and the argparse value types."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    # What ``add_subparsers`` returns: each command module adds its parser to it.
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

JSON_HELP = "one JSON document on stdout (logs stay on stderr)"
TIER_HELP = "only this tier (a [destination] or [[tiers]] name; default: every tier)"
DAEMON_URL_HELP = (
    "the daemon: http://host:port (with the [http] token) or unix:/path (default: the "
    "control socket, http.listen, else metrics.listen)"
)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type for an int >= ``minimum``; anything else is bad usage (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_common(parser: argparse.ArgumentParser, log_level: str = "warning") -> None:
    """Options every command has. One-shot commands print their result on stdout and log
    only problems by default (a JSON line beside the human one said everything twice);
    the daemons (run, exec) log their work at info."""
    parser.add_argument(
        "--config", type=Path, default=None, help="TOML config (default /etc/ckptd/ckptd.toml)"
    )
    parser.add_argument(
        "--dest",
        default=None,
        help="destination URL (s3://bucket/prefix, gs://bucket/prefix, az://container/prefix "
        "or file:///path)",
    )
    parser.add_argument(
        "--endpoint-url",
        default=None,
        help="S3-compatible endpoint, e.g. http://127.0.0.1:8333 (gs://: a GCS endpoint or "
        "emulator; az://: the account's blob endpoint)",
    )
    parser.add_argument(
        "--log-level",
        default=log_level,
        choices=["debug", "info", "warning", "error"],
        help="least severe log line written to stderr (default %(default)s)",
    )


def add_watch(parser: argparse.ArgumentParser) -> None:
    """The flags that stand for one ``[[watch]]`` entry and ``[state] dir`` (``run``, and
    ``config check``, which must check what ``run`` with the same flags would use)."""
    parser.add_argument("--watch", type=Path, default=None, help="local checkpoint dir (one run)")
    parser.add_argument(
        "--run", dest="run_id", default=None, help="run id for --watch (default: its basename)"
    )
    parser.add_argument("--layout", default=None, help="completion rule for --watch (default auto)")
    parser.add_argument("--state-dir", type=Path, default=None, help="journal directory")
