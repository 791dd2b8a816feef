"""The errors only the command line raises, and the exit codes it alone returns."""

from __future__ import annotations

from ckptd.core.errors import EXIT_USAGE, CkptdError

EXIT_OK = 0
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a SIGINT


class UsageError(CkptdError):
    """Bad command-line usage (exit 2); ``main`` prints the usage line before it."""

    exit_code = EXIT_USAGE


class DaemonUnreachableError(CkptdError):
    """The running daemon did not answer, or answered with something other than JSON (exit 1)."""
