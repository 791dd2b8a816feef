"""The staging dir beside the target, ``DIR/.ckptd-restore-NAME/``: where a restore writes,
what a rerun may trust in it, and the one rename that puts it in place.

A failed or interrupted restore leaves nothing at ``DIR/NAME``, only the hidden staging
dir, holding nothing but verified files and ``state.jsonl``: one line per file (path,
size, crc32c) recorded only *after* that file's bytes were made durable, by a
``syncfs`` of the staging filesystem that began after the file was closed, or by the
file's own ``fsync`` (``ckptd.store.restore.durability`` says which, and when). A
verified file not yet synced has no line. A rerun reuses a staged file only if the
record matches the manifest and the file's size still matches (no re-hash: the record
is only written once the bytes are durable); a file without a line is fetched again. A
staging dir made for another manifest, or holding anything but plain files and
directories, is discarded whole.

Nothing is written outside ``DIR``: every file is created relative to an open
directory descriptor, each level opened with ``O_NOFOLLOW`` and the file with
``O_CREAT | O_EXCL | O_NOFOLLOW``, so a symlink planted in the staging dir cannot
redirect a write; every path is also checked with ``realpath``/``commonpath`` before
anything is created. An existing ``DIR/NAME`` is never written into or replaced.

Single-file checkpoints (Lightning ``*.ckpt``: one file whose path is the checkpoint's
name) are restored as the file ``DIR/NAME``, not ``DIR/NAME/NAME``, the way the trainer
wrote it. (A directory checkpoint holding only a file of its own name would be restored
as a file too; no framework writes one.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptd.core import checksum
from ckptd.core.manifest import Manifest, ManifestFile, check_relative_path
from ckptd.store.restore.request import RestoreError

STAGING_PREFIX = ".ckptd-restore-"
STATE_NAME = "state.jsonl"
DATA_NAME = "data"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

Records = dict[str, tuple[int, str]]
"""Verified files a staging dir holds, from its ``state.jsonl``: ``path -> (size, crc32c)``."""


# -- what goes where ---------------------------------------------------------------------


def is_single_file(manifest: Manifest) -> bool:
    """Whether the checkpoint is one file named like the checkpoint (Lightning ``*.ckpt``)."""
    return len(manifest.files) == 1 and manifest.files[0].path == manifest.local_name


def staged_parts(manifest: Manifest, path: str) -> tuple[str, ...]:
    """Where a manifest file lives in the staging dir, as path components."""
    if is_single_file(manifest):
        return (DATA_NAME,)
    return (DATA_NAME, *check_relative_path(path).split("/"))


def manifest_identity(manifest: Manifest, *, digests: bool = False) -> str:
    """A short digest of what a staging dir holds: run, name and every (path, size, crc);
    with ``digests`` (files checked against them) every digest too, so files staged
    without that check are never reused by a restore that demands it."""
    doc: list[Any] = [
        manifest.run_id,
        manifest.checkpoint,
        [(f.path, f.size, f.crc32c) for f in manifest.files],
    ]
    if digests:
        doc.append([f.digest for f in manifest.files])
    return checksum.to_hex(checksum.crc32c(json.dumps(doc).encode()))


def inside(base: str, parts: Sequence[str]) -> bool:
    """Whether ``base/parts...`` stays under ``base`` once every symlink is resolved."""
    real = os.path.realpath(os.path.join(base, *parts))
    return os.path.commonpath([real, base]) == base


def first_outside(base: str, paths: Sequence[tuple[str, ...]]) -> int | None:
    """The index of the first of ``paths`` not ``inside`` ``base``, or None. The same
    answer as ``inside`` for each, with each directory resolved once (a checkpoint of
    100,000 files has few directories) and only the last component looked at per file."""
    dirs: dict[tuple[str, ...], str] = {}
    for index, parts in enumerate(paths):
        parent = parts[:-1]
        real_dir = dirs.get(parent)
        if real_dir is None:
            real_dir = dirs[parent] = os.path.realpath(os.path.join(base, *parent))
        real = os.path.join(real_dir, parts[-1])
        if os.path.islink(real):
            real = os.path.realpath(real)
        if os.path.commonpath([real, base]) != base:
            return index
    return None


# -- the tree ------------------------------------------------------------------------------


class StagingTree:
    """Directories and files under one directory, reached only through descriptors opened
    with ``O_NOFOLLOW`` at every level: a symlink anywhere below cannot redirect a write.
    Used from one thread."""

    def __init__(self, root_fd: int) -> None:
        self._fds: dict[tuple[str, ...], int] = {(): root_fd}

    def dir(self, parts: tuple[str, ...], *, create: bool) -> int:
        fd = self._fds.get(parts)
        if fd is not None:
            return fd
        parent = self.dir(parts[:-1], create=create)
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(parts[-1], 0o755, dir_fd=parent)
        fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
        self._fds[parts] = fd
        return fd

    def lstat(self, parts: tuple[str, ...]) -> os.stat_result | None:
        try:
            parent = self.dir(parts[:-1], create=False)
            return os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except OSError:
            return None  # absent, or ELOOP/ENOTDIR: a symlink or file on the way

    def create(self, parts: tuple[str, ...]) -> int:
        parent = self.dir(parts[:-1], create=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(parts[-1], dir_fd=parent)  # a stale, unverified copy
        return os.open(parts[-1], _NEW_FILE_FLAGS, 0o644, dir_fd=parent)

    def unlink(self, parts: tuple[str, ...]) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(parts[-1], dir_fd=self.dir(parts[:-1], create=False))

    def prune(
        self, parts: tuple[str, ...], files: set[tuple[str, ...]], dirs: set[tuple[str, ...]]
    ) -> None:
        """Remove every entry below ``parts`` that is not in ``files`` or ``dirs``."""
        fd = self.dir(parts, create=False)
        with os.scandir(fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for name, is_dir in names:
            child = (*parts, name)
            if is_dir and child in dirs:
                self.prune(child, files, dirs)
            elif is_dir:
                shutil.rmtree(name, dir_fd=fd)
            elif child not in files:
                os.unlink(name, dir_fd=fd)

    def fsync_dirs(self) -> None:
        """fsync every directory opened, deepest first, so each entry is durable."""
        for parts in sorted(self._fds, key=len, reverse=True):
            os.fsync(self._fds[parts])

    def close(self) -> None:
        """Close every descriptor, the root's included."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _is_plain_tree(fd: int) -> bool:
    """True when everything below ``fd`` is a directory or a regular file."""
    with os.scandir(fd) as entries:
        found = [
            (e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False))
            for e in entries
        ]
    for name, is_dir, is_file in found:
        if is_dir:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            try:
                if not _is_plain_tree(child):
                    return False
            finally:
                os.close(child)
        elif not is_file:
            return False
    return True


# -- the state log -------------------------------------------------------------------------


def _read_state(staging_fd: int, identity: str) -> Records | None:
    """Verified files recorded in ``state.jsonl``, or None if it belongs to another
    manifest (or is missing or unreadable: then nothing in the staging dir is trusted)."""
    try:
        fd = os.open(STATE_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=staging_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        lines = fh.read().splitlines()
    try:
        header = json.loads(lines[0]) if lines else None
    except ValueError:
        return None
    if not isinstance(header, dict) or header.get("identity") != identity:
        return None
    records: Records = {}
    for line in lines[1:]:
        try:
            doc = json.loads(line)
            records[str(doc["path"])] = (int(doc["size"]), str(doc["crc32c"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash: its file is simply not trusted
    return records


class StateLog:
    """Appends one line per verified file to ``state.jsonl``.

    The caller writes a line only once its file is durable (``Durability``: after a
    ``syncfs`` that covered it, or its ``fsync``), so a line that survives a crash always
    speaks of durable bytes. The log itself needs no fsync: a line lost with the page
    cache only means that file is downloaded again.
    """

    def __init__(self, staging_fd: int, identity: str, *, fresh: bool) -> None:
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        if fresh:
            flags |= os.O_TRUNC
        self._fd = os.open(STATE_NAME, flags, 0o644, dir_fd=staging_fd)
        if fresh:
            self._append({"identity": identity})
        else:
            size = os.fstat(self._fd).st_size
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                os.write(self._fd, b"\n")  # end a line a crash cut short, so ours parse

    def _append(self, doc: Mapping[str, Any]) -> None:
        os.write(self._fd, (json.dumps(doc) + "\n").encode())

    def verified(self, entry: ManifestFile) -> None:
        self._append({"path": entry.path, "size": entry.size, "crc32c": entry.crc32c})

    def verified_many(self, entries: Sequence[ManifestFile]) -> None:
        """``verified`` for many files (each durable already), in one write."""
        lines = "".join(
            json.dumps({"path": e.path, "size": e.size, "crc32c": e.crc32c}) + "\n" for e in entries
        )
        os.write(self._fd, lines.encode())

    def close(self) -> None:
        os.close(self._fd)


# -- opening, reusing, finishing -----------------------------------------------------------


def open_staging(target_fd: int, name: str, identity: str, log: Any) -> tuple[int, Records | None]:
    """Open (or make) the staging dir; returns its fd and the trusted records, None if fresh."""
    staging = STAGING_PREFIX + name
    try:
        st: os.stat_result | None = os.stat(staging, dir_fd=target_fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        # A symlink or file where our staging dir goes is not ours: unlink it (the link,
        # never what it points at) and start clean.
        log.warning("restore_staging_discarded", reason="not a directory")
        os.unlink(staging, dir_fd=target_fd)
        st = None
    if st is not None:
        fd = os.open(staging, _DIR_FLAGS, dir_fd=target_fd)
        records = _read_state(fd, identity)
        if records is not None and _is_plain_tree(fd):
            return fd, records
        os.close(fd)
        log.warning("restore_staging_discarded", reason="another manifest or foreign entries")
        shutil.rmtree(staging, dir_fd=target_fd)  # unlinks symlinks, never follows them
    os.mkdir(staging, 0o755, dir_fd=target_fd)
    return os.open(staging, _DIR_FLAGS, dir_fd=target_fd), None


def discard_leftover(target_fd: int, name: str, log: Any) -> None:
    """Remove ``DIR/.ckptd-restore-NAME`` once ``DIR/NAME`` is in place: a restore killed
    between its rename and its clean-up leaves one, and no restore can use it now (none
    replaces an existing ``DIR/NAME``). A symlink there is unlinked, never followed."""
    staging = STAGING_PREFIX + name
    try:
        st = os.stat(staging, dir_fd=target_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(staging, dir_fd=target_fd)
    else:
        os.unlink(staging, dir_fd=target_fd)
    os.fsync(target_fd)
    log.info("restore_staging_discarded", reason="the checkpoint is in place")


def still_to_fetch(
    manifest: Manifest, tree: StagingTree, records: Records | None
) -> tuple[list[ManifestFile], int]:
    """The files a rerun must fetch again, and the bytes it reuses: a staged file is
    reused only when its record matches the manifest and its size still does."""
    if records is None:
        return list(manifest.files), 0  # a fresh staging dir: nothing to reuse
    todo: list[ManifestFile] = []
    reused = 0
    for f in manifest.files:
        st = tree.lstat(staged_parts(manifest, f.path))
        if (
            records is not None
            and records.get(f.path) == (f.size, f.crc32c)
            and st is not None
            and stat.S_ISREG(st.st_mode)
            and st.st_size == f.size
        ):
            reused += f.size
        else:
            todo.append(f)
    return todo, reused


def staged_bytes(staging: str) -> int:
    """Bytes already under a staging dir (a rerun reuses what verifies); symlinks and
    special files count nothing (they are discarded, never followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(staging):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def finalise(
    manifest: Manifest,
    tree: StagingTree,
    target_fd: int,
    name: str,
    seal: Callable[[StagingTree], None],
    mtime_ns: int,
) -> None:
    """Drop strays, give every file ``mtime_ns`` (those downloaded now have it already:
    the lanes and workers set it as they close each file), ``seal`` (every file, inode
    and directory durable: ``Durability.seal``), rename ``data`` to ``NAME`` and fsync
    ``DIR``."""
    files = {staged_parts(manifest, f.path) for f in manifest.files}
    dirs = {p[:i] for p in files for i in range(1, len(p))}
    if not is_single_file(manifest):
        tree.dir((DATA_NAME,), create=True)  # a checkpoint with no files is an empty dir
        for d in sorted(dirs, key=len):
            tree.dir(d, create=False)
        tree.prune((DATA_NAME,), files, dirs)
    # One mtime for every file: the order downloads happened to finish in is no write
    # order, and a completion rule that reads mtimes (DCP: no shard newer than .metadata)
    # must judge the restored checkpoint complete, as it was when committed. A file an
    # earlier run staged (reused) has that run's.
    for parts in files:
        st = tree.lstat(parts)
        if st is None or not stat.S_ISREG(st.st_mode):
            what = name if is_single_file(manifest) else "/".join(parts[1:])
            raise RestoreError(f"staged {what} vanished before the rename")
        if st.st_mtime_ns != mtime_ns:
            os.utime(
                parts[-1],
                ns=(mtime_ns, mtime_ns),
                dir_fd=tree.dir(parts[:-1], create=False),
                follow_symlinks=False,
            )
    seal(tree)
    try:
        os.stat(name, dir_fd=target_fd, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        raise RestoreError(f"{name} appeared in the target while restoring; not replacing it")
    os.rename(DATA_NAME, name, src_dir_fd=tree.dir((), create=False), dst_dir_fd=target_fd)
    os.fsync(target_fd)


__all__ = [
    "DATA_NAME",
    "STAGING_PREFIX",
    "STATE_NAME",
    "Records",
    "StagingTree",
    "StateLog",
    "discard_leftover",
    "finalise",
    "first_outside",
    "inside",
    "is_single_file",
    "manifest_identity",
    "open_staging",
    "staged_bytes",
    "staged_parts",
    "still_to_fetch",
]
