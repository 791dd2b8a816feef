"""``ckptd run``: the daemon in the foreground (``--once``: what is complete now, then exit)."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

from ckptd.cli.invocation import settings_of
from ckptd.cli.options import add_common, add_watch
from ckptd.config import require_destination, require_watch
from ckptd.runtime import logs

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers


def add_parser(sub: Subparsers) -> None:
    run = sub.add_parser("run", help="run the daemon in the foreground")
    add_common(run, log_level="info")
    add_watch(run)
    run.add_argument(
        "--once", action="store_true", help="ship what is complete now, then exit (1 if any failed)"
    )
    run.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        help="seconds to finish the upload in flight on SIGTERM (default %(default)g)",
    )


def handle(args: argparse.Namespace) -> int:
    from ckptd.daemon.service import Service
    from ckptd.runtime.yielding import lower_this_thread, priority_of  # psutil

    settings = settings_of(args)
    require_destination(settings)
    require_watch(settings)
    # First, while this is the only thread: every thread the daemon starts inherits it.
    # (ckptd exec does not: its trainer would inherit it too; its workers lower themselves.)
    for problem in lower_this_thread(priority_of(settings.resources)):
        logs.get_logger().warning("priority_not_lowered", problem=problem)
    return asyncio.run(
        Service(settings, once=args.once, shutdown_timeout=args.shutdown_timeout).serve()
    )
