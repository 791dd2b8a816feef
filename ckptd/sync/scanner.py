"""The I/O side of completion: list a watch dir, snapshot one checkpoint, find writers.

What this module hands to the completion rules (``ckptd.layouts``) is a snapshot, never a
promise: the trainer keeps writing, renaming and deleting while we walk. A file that
vanishes between ``readdir`` and ``stat`` is reported among the files being written (the
tree changed under us, so no rule may call it quiet); a checkpoint that vanishes, or is
replaced, while we walk it gives ``None``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckptd.core import saves
from ckptd.core.manifest import unstorable_name
from ckptd.layouts import TRACKER_FILES, is_checkpoint_candidate
from ckptd.layouts.base import CheckpointListing, FileEntry, step_of

#: Tracker files are a step number or a tag; anything longer is not one.
TRACKER_MAX_BYTES = 4096

_PROC = "/proc"


def list_candidates(watch_dir: Path) -> list[str]:
    """Names of the watch dir's children that may be checkpoints, sorted; [] if it is absent."""
    names: list[str] = []
    try:
        with os.scandir(watch_dir) as entries:
            for entry in entries:
                try:
                    # Symlinks are never data: following one could ship files from outside
                    # the watch dir (and Lightning's last.ckpt link would ship a copy).
                    if entry.is_symlink():
                        continue
                    is_dir = entry.is_dir(follow_symlinks=False)
                    if not is_dir and not entry.is_file(follow_symlinks=False):
                        continue  # sockets, fifos, devices
                except FileNotFoundError:
                    continue  # gone since readdir
                if is_checkpoint_candidate(entry.name, is_dir):
                    names.append(entry.name)
    except FileNotFoundError:
        return []  # the trainer has not created it yet
    return sorted(names)


def snapshot(watch_dir: Path, name: str) -> CheckpointListing | None:
    """A listing of child ``name`` of ``watch_dir``; None if it is gone, replaced mid-walk,
    or neither a regular file nor a directory. Other OSErrors (EACCES) propagate."""
    root = watch_dir / name
    try:
        before = os.lstat(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    vanished: list[str] = []
    # A checkpoint whose own name no key can hold is never committed (said, not skipped).
    unshippable: list[str] = [name] if unstorable_name(name) is not None else []
    if stat.S_ISREG(before.st_mode):
        is_dir = False
        files: tuple[FileEntry, ...] = (
            FileEntry(path=name, size=before.st_size, mtime_ns=before.st_mtime_ns),
        )
    elif stat.S_ISDIR(before.st_mode):
        is_dir = True
        walked = _walk(root, vanished, unshippable)
        if walked is None:
            return None
        files = walked
    else:
        return None
    writers = open_files_for_write(root)
    # Taken after the walk: a checkpoint deleted (save_total_limit rotation) or replaced
    # by a new one of the same name while we walked must not pass for the old one.
    try:
        after = os.lstat(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        return None
    if vanished:
        writers = (writers or frozenset()) | frozenset(vanished)
    saved_at = saves.saved_at_ns(
        saves.read_reports(watch_dir),
        name,
        step_of(name),
        min((f.mtime_ns for f in files), default=0),
    )
    return CheckpointListing(
        name=name,
        is_dir=is_dir,
        files=files,
        trackers=_read_trackers(watch_dir),
        siblings=_children(watch_dir),
        open_for_write=writers,
        unshippable=tuple(sorted(unshippable)),
        saved_at_ns=saved_at,
    )


def _walk(root: Path, vanished: list[str], unshippable: list[str]) -> tuple[FileEntry, ...] | None:
    """Regular files under ``root``; None if ``root`` itself is gone.

    A symlink to a regular file counts as that file (as ``cp -L`` would copy it; the
    upload opens the path and reads the target). Dangling symlinks, symlinks to
    directories (never followed), special files and names no key can hold faithfully
    (``manifest.unstorable_name``) go to ``unshippable``. Paths that
    disappear mid-walk are appended to ``vanished``.
    """
    found: list[FileEntry] = []
    pending: list[tuple[str, str]] = [(str(root), "")]
    while pending:
        directory, prefix = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            if not prefix:
                return None
            vanished.append(prefix.rstrip("/"))
            continue
        for entry in entries:
            rel = prefix + entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, rel + "/"))
                    continue
                if entry.is_symlink():
                    try:
                        st = os.stat(entry.path)  # the target
                    except (FileNotFoundError, NotADirectoryError):
                        unshippable.append(rel)  # dangling
                        continue
                else:
                    st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                vanished.append(rel)
                continue
            if unstorable_name(rel) is not None:
                unshippable.append(rel)  # no key can hold its name faithfully
            elif stat.S_ISREG(st.st_mode):
                found.append(FileEntry(path=rel, size=st.st_size, mtime_ns=st.st_mtime_ns))
            else:
                unshippable.append(rel)  # a link to a directory, a fifo, a socket
    found.sort(key=lambda f: f.path)
    return tuple(found)


def _read_trackers(watch_dir: Path) -> dict[str, str]:
    trackers: dict[str, str] = {}
    for tracker in TRACKER_FILES:
        path = watch_dir / tracker
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            with open(path, "rb") as f:
                raw = f.read(TRACKER_MAX_BYTES)
        except OSError:
            continue  # absent, or unreadable: the rules then wait, as for a missing tracker
        trackers[tracker] = raw.decode("utf-8", errors="replace").strip()
    return trackers


def _children(watch_dir: Path) -> frozenset[str]:
    try:
        return frozenset(os.listdir(watch_dir))
    except FileNotFoundError:
        return frozenset()


def open_files_for_write(root: Path) -> frozenset[str] | None:
    """Paths under ``root`` (relative, '/'-separated; a file root gives its own name) that
    some process holds open for writing, from /proc; None when /proc cannot tell."""
    if not os.path.isdir(os.path.join(_PROC, "self", "fd")):
        return None
    # /proc/<pid>/fd links hold resolved paths, so compare against the resolved root.
    real = os.path.realpath(root)
    prefix = real.rstrip("/") + "/"
    found: set[str] = set()
    try:
        pids = [p for p in os.listdir(_PROC) if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        fd_dir = os.path.join(_PROC, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # exited, or not ours to read (another user, no CAP_SYS_PTRACE)
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue  # closed since listdir
            if target.endswith(" (deleted)"):
                continue  # unlinked: no longer part of any checkpoint
            if target == real:
                rel = Path(root).name
            elif target.startswith(prefix):
                rel = target[len(prefix) :]
            else:
                continue
            if _opened_for_write(os.path.join(_PROC, pid, "fdinfo", fd)):
                found.add(rel)
    return frozenset(found)


def _opened_for_write(fdinfo: str) -> bool:
    """Whether the fd described by /proc/<pid>/fdinfo/<fd> was opened O_WRONLY or O_RDWR."""
    try:
        with open(fdinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags:"):
                    flags = int(line.split()[1], 8)
                    return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    except (OSError, ValueError, IndexError):
        pass  # closed since readlink, or unreadable: no evidence of a writer
    return False
