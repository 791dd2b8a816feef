"""``ckptd config check``: validate the configuration (the file, ``CKPTD_*`` and the flags
``run`` takes) and, once valid, print the effective one."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ckptd.cli.errors import EXIT_OK
from ckptd.cli.invocation import settings_of
from ckptd.cli.options import add_common, add_watch
from ckptd.config import (
    DEFAULT_CONFIG_PATH,
    render_effective_config,
    require_destination,
    require_watch,
)
from ckptd.config.control import meaning_changes, read_token
from ckptd.config.peers import read_peer_token

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers


def add_parser(sub: Subparsers) -> None:
    config = sub.add_parser("config", help="configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check", help="validate, then print the effective config (what `run` would use)"
    )
    add_common(check)
    add_watch(check)


def handle(args: argparse.Namespace) -> int:
    if args.config is None and not DEFAULT_CONFIG_PATH.exists():
        sys.stderr.write(
            f"ckptd: note: no config file ({DEFAULT_CONFIG_PATH} does not exist, no --config): "
            "defaults and CKPTD_* variables only\n"
        )
    settings = settings_of(args)
    read_token(settings.http)  # a token file `run` could not read fails here too
    if settings.peers.enabled:
        read_peer_token(settings.peers)  # and the cluster's, for the peer port
    # Valid is what `ckptd run` accepts: the same settings must not pass here and fail there.
    # Printed only once valid: stdout holds a config `run` takes, or nothing.
    require_destination(settings)
    require_watch(settings)
    sys.stdout.write(render_effective_config(settings))
    for line in meaning_changes(settings):
        sys.stderr.write(f"ckptd: note: {line}\n")
    return EXIT_OK
