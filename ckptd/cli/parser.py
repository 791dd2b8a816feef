"""The ``ckptd`` parser, assembled from the commands' own (``ckptd.cli.commands``), and
the table from a command's name to its handler."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptd import __version__
from ckptd.cli.commands import (
    check,
    config,
    doctor,
    drill,
    prune,
    report,
    restore,
    rm,
    run,
    status,
    verify,
)
from ckptd.cli.commands import exec as exec_command
from ckptd.cli.commands import list as list_command

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers


@dataclass(frozen=True)
class Command:
    """One command: how its parser is added, and what runs it (returning 0 or 1)."""

    add_parser: Callable[[Subparsers], None]
    handle: Callable[[argparse.Namespace], int]


# In the order ``ckptd --help`` lists them.
COMMANDS: dict[str, Command] = {
    "run": Command(run.add_parser, run.handle),
    "exec": Command(exec_command.add_parser, exec_command.handle),
    "list": Command(list_command.add_parser, list_command.handle),
    "verify": Command(verify.add_parser, verify.handle),
    "check": Command(check.add_parser, check.handle),
    "restore": Command(restore.add_parser, restore.handle),
    "prune": Command(prune.add_parser, prune.handle),
    "rm": Command(rm.add_parser, rm.handle),
    "report": Command(report.add_parser, report.handle),
    "status": Command(status.add_parser, status.handle),
    "drill": Command(drill.add_parser, drill.handle),
    "config": Command(config.add_parser, config.handle),
    "doctor": Command(doctor.add_parser, doctor.handle),
}


# Commands that talk to the running daemon, never to a store: a destination flag would be
# accepted and do nothing, so they have none (argparse then says it is unrecognised).
# (``drill`` keeps them for ``--restore-only``, and refuses them without it.)
DAEMON_COMMANDS = ("status",)
_STORE_FLAGS = ("dest", "endpoint_url")


def _without_store_flags(parser: argparse.ArgumentParser) -> None:
    """Take ``--dest`` and ``--endpoint-url`` (``add_common``'s) off ``parser``."""
    for action in [a for a in parser._actions if a.dest in _STORE_FLAGS]:
        parser._remove_action(action)
        for group in parser._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)
        for option in action.option_strings:
            parser._option_string_actions.pop(option, None)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: ``ckptd [-V] COMMAND [options]``."""
    parser = argparse.ArgumentParser(
        prog="ckptd", description="Ship every complete checkpoint off the node, verified."
    )
    parser.add_argument("-V", "--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    for name in DAEMON_COMMANDS:
        _without_store_flags(sub.choices[name])
    return parser
