"""The one base of every error a user can cause or meet.

The rule: such an error derives from ``CkptdError``; its message is the one line a user
needs (the thing at fault and what to do about it); and its class says the process's exit
code (docs/design.md, "CLI"), which ``ckptd.cli.main.main`` returns after printing ``ckptd: <message>``.
An exception that is not a ``CkptdError`` is a bug, or internal control flow caught
before it reaches a user. Pure: imports nothing from ckptd, so any module may import it.
"""

from __future__ import annotations

from typing import ClassVar

EXIT_FAILED = 1
EXIT_USAGE = 2


class CkptdError(Exception):
    """An error a user can cause or meet; ``exit_code`` is what ``ckptd`` exits with."""

    exit_code: ClassVar[int] = EXIT_FAILED


# `ckptd exec` (docs/design.md, "Supervised training"): codes a launcher can act on. Clear of
# 1/2 (ckptd's own), 126/127 (the shell's) and 128+N (death by signal N).
EXIT_FLUSH_FAILED = 75  # preempted, and the emergency checkpoint was not committed
EXIT_GAVE_UP = 76  # the trainer kept failing: gave up after the restarts allowed
