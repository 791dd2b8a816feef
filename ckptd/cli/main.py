"""The ``ckptd`` entry point: parse, dispatch to the command, and turn its errors into
one line and an exit code.

Exit codes (docs/design.md, "CLI"): 0 success; 1 the operation failed (mismatch, daemon
unreachable, nothing committed); 2 bad usage or invalid config, with the key named.
A command returns 0 or 1 for what it checked, and raises a ``CkptdError`` for what went
wrong; ``main`` alone turns that into ``ckptd: <message>`` on stderr and the error's exit
code. ``--json`` prints one JSON document on stdout; logs go to stderr.
The commands themselves are in ``ckptd.cli.commands``, one module each.
Fast exit: the process's entry (``entry``: ``python -m ckptd``, the ``ckptd`` script; never
``main`` called in-process) ends a finished ``restore`` or ``run --once`` with ``os._exit``
once stdout, stderr and the logs are flushed, skipping the interpreter's teardown.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from ckptd.cli.errors import EXIT_INTERRUPTED, DaemonUnreachableError, UsageError
from ckptd.cli.parser import COMMANDS, build_parser
from ckptd.core.errors import CkptdError
from ckptd.runtime import logs

# Files at fault named in a restore's one line; the rest are counted.
NAMED_PROBLEMS = 3


def error_line(exc: CkptdError, command: str) -> str:
    """What stderr shows for ``exc`` raised by ``command``, after "ckptd: ": one line,
    a failed restore's files at fault included (the first few by name)."""
    if isinstance(exc, UsageError):
        return f"error: {exc}"  # argparse's own wording, after the usage line
    if command == "restore":
        from ckptd.core.manifest import ManifestError
        from ckptd.store.restore import RestoreError  # loaded already: the command imported it

        if isinstance(exc, RestoreError):
            named = [f"{p.path}: {p.problem}" for p in exc.problems[:NAMED_PROBLEMS]]
            if len(exc.problems) > NAMED_PROBLEMS:
                named.append(f"and {len(exc.problems) - NAMED_PROBLEMS} more")
            return f"restore failed: {exc}" + (f" ({'; '.join(named)})" if named else "")
        if isinstance(exc, ManifestError):
            return f"restore refused: {exc}"
    if command == "verify":
        from ckptd.core.signing import AuthenticationError

        if isinstance(exc, AuthenticationError):
            return f"verify refused: {exc}"
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every exit code but a command's own 0/1 result is decided here."""
    return _run(argv)[0]


def _run(argv: Sequence[str] | None) -> tuple[int, argparse.Namespace | None]:
    """``main``'s exit code, and the command's arguments when its handler returned (None
    when it raised: what it started may still be stopping)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on bad usage
    logs.configure(args.log_level)
    try:
        return COMMANDS[args.command].handle(args), args
    except CkptdError as exc:
        if isinstance(exc, UsageError):
            parser.print_usage(sys.stderr)
        print(f"ckptd: {error_line(exc, args.command)}", file=sys.stderr)
        return exc.exit_code, None
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED, None


def exits_fast(args: argparse.Namespace) -> bool:
    """Whether the process may end with ``os._exit`` once this command has returned: a
    one-shot command whose results are durable when it returns (a restore made durable
    before its rename; ``run --once``, its journal and locks closed by the daemon's stop)."""
    return args.command == "restore" or (args.command == "run" and bool(args.once))


def entry() -> NoReturn:
    """The process's entry point: ``main``, then, after a one-shot command that returned
    (``exits_fast``) with no other thread left to finish, ``os._exit`` once stdout,
    stderr and the logging handlers are flushed. The interpreter's teardown (freeing every
    module and object, 0.1-0.2 s after a restore) has nothing left to do for anyone;
    atexit hooks are skipped with it, which is why only these commands, only here, and
    never ``main`` called in-process (the tests) end so."""
    code, args = _run(None)
    if args is not None and exits_fast(args) and threading.active_count() == 1:
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            raise SystemExit(code) from None  # a closed pipe: said as Python says it
        os._exit(code)
    raise SystemExit(code)


__all__ = ["DaemonUnreachableError", "UsageError", "build_parser", "entry", "error_line", "main"]

if __name__ == "__main__":
    entry()
