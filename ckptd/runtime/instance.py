"""One daemon per state dir and per watch dir.

A second daemon started by mistake on the same journal would resume the first one's
uploads under its feet; on the same watch dir it would ship every checkpoint twice and
run retention twice. Each daemon therefore holds an ``flock`` on ``<state dir>/ckptd.lock``
and on ``<watch dir>/.ckptd/daemon.lock`` (for each watch dir that exists at start-up),
and the second one stops with one line naming the first one's PID. The kernel drops an
flock when its process ends, however it ends (``kill -9`` included), so a lock never
outlives its daemon and never blocks a restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from ckptd.core import handoff
from ckptd.core.errors import CkptdError

STATE_LOCK = "ckptd.lock"
WATCH_LOCK = handoff.DAEMON_LOCK


class AlreadyRunningError(CkptdError):
    """Another daemon holds the lock (exit 1: under systemd's Restart=on-failure the
    unit tries again, and starts once the other one has stopped)."""


class InstanceLocks:
    """The locks this daemon holds; ``release`` (or process exit) lets them go."""

    def __init__(self) -> None:
        self._held: list[int] = []

    def acquire(self, path: Path, what: str, fix: str) -> bool:
        """Lock ``path`` (created if need be); False when it cannot even be created
        (a read-only dir: nothing to coordinate through, the caller warns).
        AlreadyRunningError when another process holds it."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AlreadyRunningError(
                f"another ckptd (pid {holder}) already uses {what}; stop it first, {fix}"
            ) from None
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._held.append(fd)
        return True

    def release(self) -> None:
        for fd in self._held:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the last descriptor drops the flock
        self._held.clear()
