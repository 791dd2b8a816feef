"""The directory a restore writes into (``--to DIR``, or ``ckptd exec``'s watch dir): made
if need be, opened, and found writable, or refused in one line that names it and the fix.

Every way ``DIR`` can be unusable ends here as a ``RestoreError`` (exit 1), never as an
``OSError`` from deep inside: a regular file (or a path under one), a symlink to nothing,
a place where no directory can be made (``/proc/x``), a directory this user cannot write
or that sits on a read-only filesystem. Nothing is written when ``DIR`` is refused:
``mkdir`` is the only write before these checks, and it either made ``DIR`` (what the
user named) or failed. A dangling symlink is refused rather than followed: making the
directory it points at would write outside what the user named.

Writability is asked only once a download is certain (``require_writable``):
``--if-missing`` on a checkpoint already in place writes nothing, so a read-only
``DIR`` that holds it is fine.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptd.store.restore.request import RestoreError

FIX = "name a directory this user can write (the checkpoint appears inside it as DIR/NAME)"


def _first_non_directory(path: Path) -> Path | None:
    """The nearest ancestor of ``path`` (or ``path``) that exists and is not a directory."""
    for candidate in [*reversed(path.parents), path]:
        try:
            if not os.path.isdir(candidate) and os.path.lexists(candidate):
                return candidate
        except OSError:
            return None
    return None


def _refusal(target: Path, exc: OSError) -> RestoreError:
    """``exc``, raised making or opening ``target``, as one line naming it and the fix."""
    if os.path.islink(target) and not os.path.exists(target):
        return RestoreError(
            f"{target} is a symlink to {os.readlink(target)}, which does not "
            f"exist: create that directory, or {FIX}"
        )
    blocker = _first_non_directory(target)
    if blocker == target:
        return RestoreError(f"{target} is a file, not a directory: {FIX}")
    if blocker is not None:
        return RestoreError(f"{target} is under {blocker}, which is a file, not a directory: {FIX}")
    # ENOENT under /proc, EACCES, EROFS, ENOSPC: the system's own words say which.
    reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
    return RestoreError(f"{target} cannot be made here ({reason}): {FIX}")


def open_target(target: Path) -> tuple[int, str]:
    """Make ``target`` (and its parents) if it does not exist, open it; returns the open
    directory's descriptor and its real path. RestoreError (module doc) when it cannot
    be a directory."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        real = os.path.realpath(target)
        return os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), real
    except OSError as exc:
        raise _refusal(target, exc) from exc


def require_writable(real: str) -> None:
    """RestoreError naming ``real`` unless this process may create entries in it."""
    try:
        read_only = bool(os.statvfs(real).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise RestoreError(f"{real} is on a read-only filesystem: {FIX}")
    if not os.access(real, os.W_OK | os.X_OK):
        raise RestoreError(f"{real} is not writable by this user (uid {os.geteuid()}): {FIX}")


__all__ = ["open_target", "require_writable"]
