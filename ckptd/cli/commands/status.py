"""``ckptd status``: ask the running daemon, and show its answer as a table."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ckptd.cli.daemon_client import daemon_request
from ckptd.cli.errors import EXIT_OK
from ckptd.cli.invocation import print_json
from ckptd.cli.options import DAEMON_URL_HELP, JSON_HELP, add_common

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers


def add_parser(sub: Subparsers) -> None:
    status = sub.add_parser("status", help="ask the running daemon")
    add_common(status)
    status.add_argument("--json", action="store_true", help=JSON_HELP)
    status.add_argument("--url", default=None, help=DAEMON_URL_HELP)


def handle(args: argparse.Namespace) -> int:
    _base, doc = daemon_request(args, "/v1/status", failure="status failed")
    if args.json:
        print_json(doc)
        return EXIT_OK
    # rich's table is loaded only here: every other command starts without it.
    from rich.console import Console

    from ckptd.cli.statusview import render_status

    # Off a terminal (a pipe, a log, a script's grep) a line is never broken mid-word at
    # an assumed 80 columns: how long a line is depends on what it says (an age, a cause).
    render_status(doc, Console(soft_wrap=not sys.stdout.isatty()))
    return EXIT_OK
