"""When a restore's staged files count as durable: after one ``syncfs(2)`` of the staging
filesystem that covers a batch of them, or, where syncfs cannot be trusted, after each
file's own ``fsync``.

Invariant (the promise of the state log, ``ckptd.store.restore.staging``): a file is
recorded in ``state.jsonl`` only after a ``syncfs`` that began once the file was written
and closed returned success, or after that file's own ``fsync`` did; so a line that
survives a crash always speaks of durable bytes, and a file written but not yet covered
by a sync has no line and is fetched again by a rerun. The last ``syncfs`` (``seal``)
comes after every file was verified and given its mtime and before the rename into
place: it makes the bytes, the inodes and the directory entries durable at once, as an
``fsync`` of every file and directory did.

Why not one ``fsync`` per file: thousands of small files cost thousands of fsyncs, each
waited for by a lane (on a journaled filesystem, each a journal commit), where one
``syncfs`` writes them in one. Files are
recorded in batches, each after a ``syncfs``: once ``FLUSH_BYTES`` are pending, once the
oldest pending file waited ``FLUSH_SECONDS``, or once no file was verified for
``IDLE_SECONDS`` (a stalled GET), so a crash costs a rerun at most one batch, never the
whole restore.

``syncfs`` is used only where it reports what an ``fsync`` would: Linux 5.8 or later
(earlier kernels dropped writeback errors from ``syncfs``) and a local filesystem whose
``syncfs`` writes everything through (``SYNCFS_FILESYSTEMS``: ext2/3/4, XFS, Btrfs,
F2FS, tmpfs). Anywhere else (NFS, Lustre, FUSE, overlayfs, another OS, no ``syncfs`` in
libc) every file is fsynced as it is verified and recorded at once, and the directories
are fsynced before the rename. Python's ``os`` has no ``syncfs``, hence ``ctypes``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from ckptd.core.manifest import ManifestFile
from ckptd.store.restore.staging import StagingTree, StateLog

FLUSH_BYTES = 1 << 30
FLUSH_SECONDS = 5.0
IDLE_SECONDS = 1.0
SYNCFS_SINCE = (5, 8)  # syncfs reports writeback errors (errseq on the superblock)
SYNCFS_FILESYSTEMS = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xF2F52010: "f2fs",
    0x01021994: "tmpfs",
}


def _libc_call(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """libc's ``name`` (returning an int, errno kept), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return cast(Callable[..., int], fn)


_syncfs = _libc_call("syncfs", ctypes.c_int)
_fstatfs = _libc_call("fstatfs", ctypes.c_int, ctypes.c_void_p)


def kernel_at_least(release: str, least: tuple[int, int]) -> bool:
    """Whether a ``uname -r`` string names a kernel of at least ``least`` (major, minor)."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return found is not None and (int(found[1]), int(found[2])) >= least


def filesystem_type(fd: int) -> int | None:
    """``f_type`` of the filesystem holding ``fd`` (``fstatfs(2)``), or None if unknown."""
    if _fstatfs is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF  # f_type, the first field


def syncfs_trusted(fd: int) -> bool:
    """Whether one ``syncfs`` of ``fd``'s filesystem makes durable what an ``fsync`` of
    each file there would (module doc)."""
    return (
        _syncfs is not None
        and kernel_at_least(platform.release(), SYNCFS_SINCE)
        and filesystem_type(fd) in SYNCFS_FILESYSTEMS
    )


def syncfs(fd: int) -> None:
    """``syncfs(2)`` of the filesystem holding ``fd``; OSError (with its errno) on failure:
    a writeback error since the last call, which no record may hide."""
    if _syncfs is None:
        raise OSError(0, "syncfs is not available here")
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs of the staging filesystem failed: {os.strerror(err)}")


class Durability:
    """Records verified files in the state log once they are durable (module doc).

    ``per_file``: each file is fsynced by whoever wrote it (the lanes, the range
    workers) before ``verified``; else nobody fsyncs a file and a ``syncfs`` of the
    staging filesystem covers each batch. Used from the restore's calling thread only.
    """

    def __init__(
        self,
        staging_fd: int,
        state: StateLog,
        on_file: Callable[[str], None] | None = None,
        *,
        on_verified: Callable[[str], None] | None = None,
        per_file: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.staging_fd = staging_fd
        self.state = state
        self.on_file = on_file
        self.on_verified = on_verified
        self.per_file = not syncfs_trusted(staging_fd) if per_file is None else per_file
        self.syncs = 0
        self._clock = clock
        self._pending: list[ManifestFile] = []
        self._pending_bytes = 0
        self._since = self._last = 0.0

    def verified(self, entries: Sequence[ManifestFile]) -> None:
        """``entries`` were written whole, verified and closed (and, ``per_file``, fsynced)."""
        if not entries:
            return
        if self.on_verified is not None:
            for entry in entries:
                self.on_verified(entry.path)
        if self.per_file:
            self._record(entries)
            return
        self._last = self._clock()
        if not self._pending:
            self._since = self._last
        self._pending.extend(entries)
        self._pending_bytes += sum(e.size for e in entries)
        if self._pending_bytes >= FLUSH_BYTES:
            self.flush()

    def tick(self) -> None:
        """Flush a batch that waited ``FLUSH_SECONDS``, or any batch once no file was
        verified for ``IDLE_SECONDS`` (a stalled download holds no record back)."""
        if self._pending:
            now = self._clock()
            if now - self._since >= FLUSH_SECONDS or now - self._last >= IDLE_SECONDS:
                self.flush()

    def flush(self) -> None:
        """One ``syncfs``, then the records of every file it covered."""
        if not self._pending:
            return
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        self._sync()
        self._record(batch)

    def seal(self, tree: StagingTree) -> None:
        """Before the rename: every staged file, inode (mtimes) and directory durable."""
        if self.per_file:
            tree.fsync_dirs()
            return
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        self._sync()
        self._record(batch)

    def _sync(self) -> None:
        syncfs(self.staging_fd)
        self.syncs += 1

    def _record(self, entries: Sequence[ManifestFile]) -> None:
        self.state.verified_many(entries)
        if self.on_file is not None:
            for entry in entries:
                self.on_file(entry.path)


__all__ = [
    "FLUSH_BYTES",
    "FLUSH_SECONDS",
    "IDLE_SECONDS",
    "SYNCFS_FILESYSTEMS",
    "Durability",
    "filesystem_type",
    "kernel_at_least",
    "syncfs",
    "syncfs_trusted",
]
