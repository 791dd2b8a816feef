"""``ckptd doctor``: the preflight before the first job; one line per check (ok, warn,
fail, with the fix), exit 1 when any failed (``ckptd.doctor``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ckptd.cli.errors import EXIT_OK
from ckptd.cli.invocation import print_json, settings_of
from ckptd.cli.options import JSON_HELP, add_common, add_watch
from ckptd.config import DEFAULT_CONFIG_PATH, require_destination
from ckptd.core.errors import EXIT_FAILED

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers


def add_parser(sub: Subparsers) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check the setup before the first job: config, store, notices, trainer, disk, token",
    )
    add_common(doctor)
    add_watch(doctor)
    doctor.add_argument("--json", action="store_true", help=JSON_HELP)


def handle(args: argparse.Namespace) -> int:
    from ckptd.doctor import document, exit_code, run_checks

    # Invalid config is exit 2 naming the key, as everywhere; a missing destination too
    # (there is nothing to check without one).
    settings = settings_of(args)
    require_destination(settings)
    if args.config is not None:
        source = str(args.config)
    elif DEFAULT_CONFIG_PATH.exists():
        source = str(DEFAULT_CONFIG_PATH)
    else:
        source = "defaults, CKPTD_* variables and flags (no config file)"
    findings = run_checks(settings, source=source)
    if args.json:
        print_json(document(findings))
    else:
        for finding in findings:
            print(finding.line())
    return EXIT_FAILED if exit_code(findings) else EXIT_OK
