"""Verified, atomic restore: a committed checkpoint appears as ``DIR/NAME`` whole, or not at all.

The order, and why:

1. resolve the manifest (``--latest``: LATEST, else the newest committed one) and check
   it names only safe relative paths (``ckptd.core.manifest`` rejects absolute paths, ``..``,
   empty components; a manifest that does not parse is a ``ManifestError``);
2. list the checkpoint's objects once: one that is missing or of another size than the
   manifest says (larger included) refuses the restore before a byte is written;
3. download into a hidden staging dir beside the target, ``DIR/.ckptd-restore-NAME/``:
   ranged GETs of ``chunk_bytes`` in a pool of ``concurrency`` threads, each streamed in
   1 MiB pieces (memory stays near concurrency x piece), CRC-32C'd as written, its
   writeback started at once (``ckptd.runtime.writeback``) so the final fsync does not write the
   whole checkpoint while the caller waits, and the chunk values folded into the file's
   (``checksum.combine_parts``); a file whose size or CRC-32C differs from the manifest
   is deleted, never kept;
4. fsync every file and directory, then rename ``staging/data`` to ``DIR/NAME`` (one
   ``rename(2)`` inside ``DIR``) and fsync ``DIR``.

A failed or interrupted restore leaves nothing at ``DIR/NAME``, only the hidden staging
dir, holding nothing but verified files and ``state.jsonl``: one line per file recorded
*after* that file was fsynced (path, size, crc32c). A rerun reuses a staged file only if
the record matches the manifest and the file's size still matches (no re-hash: the
record is only written once the bytes are durable). A staging dir made for another
manifest, or holding anything but plain files and directories, is discarded whole.

Nothing is written outside ``DIR``: every file is created relative to an open
directory descriptor, each level opened with ``O_NOFOLLOW`` and the file with
``O_CREAT | O_EXCL | O_NOFOLLOW``, so a symlink planted in the staging dir cannot
redirect a write; every path is also checked with ``realpath``/``commonpath`` before
anything is created. An existing ``DIR/NAME`` is never written into or replaced.

Single-file checkpoints (Lightning ``*.ckpt``: one file whose path is the checkpoint's
name) are restored as the file ``DIR/NAME``, not ``DIR/NAME/NAME``, the way the trainer
wrote it. (A directory checkpoint holding only a file of its own name would be restored
as a file too; no framework writes one.)

``if_missing`` (``restore --latest --to DIR --if-missing``) returns at once when
``DIR/NAME`` exists and every manifest file is there, a regular file (no symlink on the
way) of the manifest's size: sizes only, no re-hash, so it costs two small GETs (LATEST,
manifest) and some ``lstat``s; the bytes were verified when it was restored. Restores
into one ``DIR`` take turns (``flock`` on ``DIR``): the ranks of a node that all ask for
the same checkpoint at start-up cause one download.

A checkpoint committed by many nodes is restored whole by default (DCP and ZeRO loaders
read shards other ranks wrote). ``part=RANK`` restores only the files of that node's part
(``ckptd.part-<rank>.json``), each of which must be in the global manifest with the same
size and CRC-32C; the global manifest's entries are what is downloaded and verified.

Authenticated checkpoints (``keys``, from ``[authentication]``): before anything is
written the manifest's signature must hold (``KeyRing.check``: unsigned, unknown key id
or altered is refused), and each file's bytes are held to its digest as they are
written, from the same buffers as the CRC-32C, in 1 MiB blocks (ranges start on a
block, so each range's digests fold into the file's: ``ckptd.core.digest``). A file whose
digest differs is deleted like one whose CRC-32C does, so nothing unverified is ever
renamed into place. Without ``keys`` the digests a manifest carries are not checked:
without a key they prove nothing a CRC-32C does not (an attacker rewrites both).

While it runs, a restore holds a lease (``ckptd.store.repository``) so retention on another
node does not delete the checkpoint under it; taking it is best effort (a node with
read-only credentials restores without one).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core import checksum, digest
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import Manifest, ManifestError, ManifestFile, check_relative_path
from ckptd.core.signing import KeyRing
from ckptd.runtime import writeback
from ckptd.storage.base import Storage, StorageError
from ckptd.store.repository import (
    RANGE_BYTES,
    FileProblem,
    RangeCrc,
    Repository,
    chunk_ranges,
    object_key,
)

STAGING_PREFIX = ".ckptd-restore-"
STATE_NAME = "state.jsonl"
DATA_NAME = "data"
# Versions that decide whether a checkpoint loads (and loads the same) on this node.
ENVIRONMENT_KEYS = ("python", "torch", "cuda", "transformers", "lightning", "deepspeed", "jax")
PROGRESS_LOG_SECONDS = 10.0

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class RestoreError(CkptdError):
    """A restore that did not complete; ``problems`` names the files at fault."""

    def __init__(self, message: str, problems: Sequence[FileProblem] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did; ``skipped`` is True when ``if_missing`` found it in place."""

    run_id: str
    checkpoint: str
    step: int | None
    path: Path
    files: int
    total_bytes: int
    downloaded_bytes: int
    reused_bytes: int
    seconds: float
    skipped: bool = False
    environment_differences: dict[str, tuple[str, str | None]] = field(default_factory=dict)


# -- pure helpers ------------------------------------------------------------------------


def is_single_file(manifest: Manifest) -> bool:
    """Whether the checkpoint is one file named like the checkpoint (Lightning ``*.ckpt``)."""
    return len(manifest.files) == 1 and manifest.files[0].path == manifest.checkpoint


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


def environment_differences(
    recorded: Mapping[str, str], here: Mapping[str, str], keys: Sequence[str] = ENVIRONMENT_KEYS
) -> dict[str, tuple[str, str | None]]:
    """``key -> (version in the manifest, version here or None)`` where they differ."""
    return {
        key: (recorded[key], here.get(key))
        for key in keys
        if key in recorded and recorded[key] != here.get(key)
    }


def _inside(base: str, parts: Sequence[str]) -> bool:
    real = os.path.realpath(os.path.join(base, *parts))
    return os.path.commonpath([real, base]) == base


# -- the local check behind --if-missing --------------------------------------------------


def local_problems(path: Path, manifest: Manifest) -> list[FileProblem]:
    """How ``path`` (an existing ``DIR/NAME``) differs from the manifest, by sizes only.

    Sizes only keeps ``--if-missing`` instant on a multi-GiB checkpoint; contents were
    verified when it was restored. Symlinks count as differences (never followed); extra
    local files are ignored.
    """
    if is_single_file(manifest):
        return _local_file_problem(path, [], manifest.files[0])
    if not _is_real_dir(str(path)):
        return [FileProblem("", "not a directory")]
    problems: list[FileProblem] = []
    for f in manifest.files:
        problems += _local_file_problem(path, f.path.split("/"), f)
    return problems


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)  # lstat: a symlink is not a dir here
    except OSError:
        return False


def _local_file_problem(root: Path, parts: list[str], entry: ManifestFile) -> list[FileProblem]:
    current = str(root)
    for part in parts[:-1]:
        current = os.path.join(current, part)
        if not _is_real_dir(current):
            return [FileProblem(entry.path, "missing (or a symlink on the way)")]
    if parts:
        current = os.path.join(current, parts[-1])
    try:
        st = os.lstat(current)
    except FileNotFoundError:
        return [FileProblem(entry.path, "missing")]
    if not stat.S_ISREG(st.st_mode):
        return [FileProblem(entry.path, "not a regular file")]
    if st.st_size != entry.size:
        return [FileProblem(entry.path, f"size {st.st_size}, manifest says {entry.size}")]
    return []


# -- the staging tree ---------------------------------------------------------------------


class _Tree:
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


def _read_state(staging_fd: int, identity: str) -> dict[str, tuple[int, str]] | None:
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
    records: dict[str, tuple[int, str]] = {}
    for line in lines[1:]:
        try:
            doc = json.loads(line)
            records[str(doc["path"])] = (int(doc["size"]), str(doc["crc32c"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash: its file is simply not trusted
    return records


class _StateLog:
    """Appends one line per verified file to ``state.jsonl``.

    Each line is written only after its file was fsynced, so a line that survives a
    crash always speaks of durable bytes. The log itself needs no fsync: a line lost
    with the page cache only means that file is downloaded again.
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

    def close(self) -> None:
        os.close(self._fd)


# -- downloads ----------------------------------------------------------------------------


@dataclass
class _Job:
    entry: ManifestFile
    parts: tuple[str, ...]
    key: str
    ranges: list[tuple[int, int]]
    fd: int = -1
    crcs: list[tuple[int, int]] = field(default_factory=list)
    check_digest: bool = False
    blocks: list[list[bytes]] = field(default_factory=list)  # per range, with check_digest
    remaining: int = 0
    error: Exception | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.crcs = [(0, 0)] * len(self.ranges)
        self.blocks = [[] for _ in self.ranges]
        self.remaining = len(self.ranges)


class _Downloader:
    """Ranged GETs in a thread pool; workers write with ``pwrite`` and report to a queue
    the main thread drains (progress, state records, new files)."""

    def __init__(self, storage: Storage, concurrency: int) -> None:
        self.storage = storage
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="ckptd-restore")
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.stop = threading.Event()

    def submit(self, job: _Job) -> None:
        for index in range(len(job.ranges)):
            self.pool.submit(self._chunk, job, index)

    def _chunk(self, job: _Job, index: int) -> None:
        start, length = job.ranges[index]
        try:
            if job.error is None and not self.stop.is_set():
                crc = RangeCrc()
                sums = digest.RangeDigest() if job.check_digest else None

                def write(pos: int, piece: bytes) -> None:
                    if pos + len(piece) > length:
                        # Never write more than the manifest's size.
                        raise RestoreError(f"GET at {start} returned more than {length} bytes")
                    view = memoryview(piece)
                    done = 0
                    while done < len(piece):
                        done += os.pwrite(job.fd, view[done:], start + pos + done)
                    crc.update(pos, piece)
                    if sums is not None:
                        sums.update(pos, piece)

                # Streamed a piece at a time: memory is concurrency x one piece, whatever
                # the range size; each byte is CRC'd from the buffer it is written from.
                self.storage.stream_range(job.key, start, length, write)
                writeback.start(job.fd, start, length)
                job.crcs[index] = (crc.value, length)
                if sums is not None:
                    job.blocks[index] = sums.finish()
                self.events.put(("bytes", length))
            elif job.error is None:
                raise RestoreError("restore stopped")
        except Exception as exc:  # noqa: BLE001 - reported to the main thread
            with job.lock:
                job.error = job.error or exc
        with job.lock:
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self.finish(job)

    def finish(self, job: _Job) -> None:
        """Check the folded CRC-32C, fsync and close; report the file as done."""
        try:
            if job.error is None:
                crc = checksum.to_hex(checksum.combine_parts(job.crcs))
                found = (
                    digest.file_digest(job.entry.size, (b for r in job.blocks for b in r))
                    if job.check_digest
                    else None
                )
                if crc != job.entry.crc32c:
                    job.error = RestoreError(f"crc32c {crc}, manifest says {job.entry.crc32c}")
                elif found != job.entry.digest and job.check_digest:
                    job.error = RestoreError(
                        "digest differs from the signed manifest's: the object was replaced"
                    )
                else:
                    os.fsync(job.fd)
        except OSError as exc:
            job.error = exc
        finally:
            os.close(job.fd)
            job.fd = -1
        self.events.put(("file", job))

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=True)


class _Progress:
    """A rich progress bar on a terminal; otherwise a structlog line every few seconds."""

    def __init__(self, log: Any, total: int, done: int, *, bar: bool) -> None:
        self.log = log
        self.total = total
        self.done = done
        self.started = time.monotonic()
        self.last_log = self.started
        self._bar: Any = None
        self._task: Any = None
        if bar:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                ProgressColumn,
                Task,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.text import Text

            class MiBPerSecond(ProgressColumn):
                """rich's TransferSpeedColumn counts MB/s; the summary line says MiB/s."""

                def render(self, task: Task) -> Text:
                    speed = task.finished_speed or task.speed
                    shown = "?" if speed is None else f"{speed / 2**20:.1f}"
                    return Text(f"{shown} MiB/s", style="progress.data.speed")

            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                MiBPerSecond(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._bar.start()

    def begin(self, name: str) -> None:
        if self._bar is not None:
            self._task = self._bar.add_task(name, total=self.total, completed=self.done)

    def advance(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def tick(self) -> None:
        now = time.monotonic()
        if self._bar is None and now - self.last_log >= PROGRESS_LOG_SECONDS:
            self.last_log = now
            elapsed = max(now - self.started, 1e-9)
            self.log.info(
                "restore_progress",
                bytes_done=self.done,
                bytes_total=self.total,
                mib_per_s=round(self.done / elapsed / 2**20, 1),
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# -- restore ------------------------------------------------------------------------------


def _check_manifest(manifest: Manifest, run_id: str, checkpoint: str | None) -> None:
    # The model validated every path on parsing; these say the manifest is the one asked for.
    if manifest.run_id != run_id:
        raise ManifestError(f"manifest names run {manifest.run_id!r}, expected {run_id!r}")
    if checkpoint is not None and manifest.checkpoint != checkpoint:
        raise ManifestError(
            f"manifest names checkpoint {manifest.checkpoint!r}, expected {checkpoint!r}"
        )
    for f in manifest.files:
        check_relative_path(f.path)


def part_manifest(repo: Repository, manifest: Manifest, rank: int) -> Manifest:
    """``manifest`` narrowed to node ``rank``'s part, checked against it (module doc)."""
    where = f"{manifest.run_id}/{manifest.checkpoint}"
    if manifest.nodes is None:
        raise RestoreError(
            f"{where} was committed by one node and has no part {rank}: restore it whole"
        )
    if not 0 <= rank < manifest.nodes:
        raise RestoreError(
            f"{where} has no part {rank}: it was committed by nodes 0..{manifest.nodes - 1}"
        )
    part = repo.read_part(manifest.run_id, manifest.checkpoint, rank)
    if part is None or part.save != manifest.save:
        raise RestoreError(f"{where} has no part {rank} of the committed save {manifest.save}")
    committed = manifest.file_map()
    problems = [
        FileProblem(f.path, "not in the global manifest, or with other content")
        for f in part.files
        if (g := committed.get(f.path)) is None or (g.size, g.crc32c) != (f.size, f.crc32c)
    ]
    if problems:
        raise RestoreError(f"{where}: part {rank} disagrees with the global manifest", problems)
    files = [committed[f.path] for f in part.files]
    return manifest.model_copy(update={"files": files, "total_bytes": sum(f.size for f in files)})


def _preflight(repo: Repository, manifest: Manifest) -> list[FileProblem]:
    """Objects missing or of another size than the manifest says: refused before a byte
    is written."""
    problems: list[FileProblem] = []
    for m in repo.object_mismatches(manifest):
        if m.found is None:
            problems.append(FileProblem(m.path, "missing"))
        else:
            word = "larger" if m.found > m.expected else "smaller"
            problems.append(
                FileProblem(
                    m.path, f"object is {m.found} bytes, {word} than the manifest's {m.expected}"
                )
            )
    return problems


def _open_staging(
    target_fd: int, name: str, identity: str, log: Any
) -> tuple[int, dict[str, tuple[int, str]] | None]:
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


def restore(
    storage: Storage,
    run_id: str,
    checkpoint: str | None,
    target_dir: Path,
    *,
    if_missing: bool = False,
    concurrency: int = 8,
    chunk_bytes: int = RANGE_BYTES,
    progress: bool | None = None,
    take_lease: bool = True,
    environment: Mapping[str, str] | None = None,
    on_file: Callable[[str], None] | None = None,
    part: int | None = None,
    keys: KeyRing | None = None,
) -> RestoreResult:
    """Restore ``checkpoint`` (None: the newest committed) of ``run_id`` as ``target_dir/NAME``.

    Raises ManifestError (no valid manifest), StorageError (the store failed) or
    RestoreError (an object missing, of the wrong size or content; ``DIR/NAME`` exists
    and does not match; a local I/O error). ``progress`` None draws a bar when stderr is
    a terminal. ``environment`` is this node's (default ``ckptd.runtime.environment.describe()``).
    ``on_file`` is called with each path once it is verified and recorded (tests).
    ``part`` restores only that node's part of a many-node checkpoint (module doc).
    ``keys`` demands a signed manifest and checks every file's digest (module doc); an
    AuthenticationError (a ManifestError) before anything is written if it fails.
    """
    from ckptd.runtime import logs
    from ckptd.runtime.environment import describe

    if concurrency < 1 or chunk_bytes < 1:
        raise ValueError("concurrency and chunk_bytes must be >= 1")
    started = time.monotonic()
    repo = Repository(storage)
    manifest = repo.resolve(run_id, checkpoint)
    _check_manifest(manifest, run_id, checkpoint)
    if keys is not None:
        keys.check(manifest)  # the whole signed manifest, before a part narrows it
        chunk_bytes = digest.aligned_chunk(chunk_bytes)
    if part is not None:
        manifest = part_manifest(repo, manifest, part)
    name = manifest.checkpoint
    log = logs.get_logger(run=run_id, checkpoint=name)

    differences = environment_differences(
        manifest.environment, describe() if environment is None else environment
    )
    if differences:
        log.warning(
            "restore_environment_differs",
            differences={k: {"checkpoint": a, "here": b} for k, (a, b) in differences.items()},
        )
    target_dir.mkdir(parents=True, exist_ok=True)
    target_real = os.path.realpath(target_dir)
    final = Path(target_real) / name
    target_fd = os.open(target_real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _lock(target_fd, log)
        lease: str | None = None
        try:
            if os.path.lexists(final):
                problems = local_problems(final, manifest)
                if if_missing and not problems:
                    log.info("restore_skipped", path=str(final), reason="present, sizes match")
                    return _result(manifest, final, started, differences, 0, 0, skipped=True)
                raise RestoreError(
                    f"{final} already exists"
                    + (" and differs from the manifest" if problems else "")
                    + ": remove it first (ckptd never writes into an existing checkpoint)",
                    problems,
                )
            problems = _preflight(repo, manifest)
            if problems:
                raise RestoreError(
                    f"{run_id}/{name}: {len(problems)} object(s) do not match the manifest; "
                    "nothing was written",
                    problems,
                )
            _check_free_space(target_real, manifest, name)
            if take_lease:
                try:
                    lease = repo.take_lease(run_id, name, now=time.time())
                except StorageError as exc:
                    log.warning("restore_lease_not_taken", error=str(exc))
            downloaded, reused = _restore_into(
                storage,
                manifest,
                target_fd,
                target_real,
                concurrency,
                chunk_bytes,
                progress,
                log,
                on_file,
                check_digests=keys is not None,
            )
        # Info, not error: whoever called says the failure (the CLI's one line, ckptd
        # exec's error); an error here would say it twice.
        except OSError as exc:
            log.info("restore_failed", error=str(exc))
            raise RestoreError(f"local I/O error under {target_real}: {exc}") from exc
        except (RestoreError, StorageError) as exc:
            log.info("restore_failed", error=str(exc))
            raise
        finally:
            if lease is not None:
                try:
                    repo.release_lease(lease)
                except StorageError as exc:
                    log.warning("restore_lease_not_released", key=lease, error=str(exc))
    finally:
        os.close(target_fd)  # also drops the lock
    out = _result(manifest, final, started, differences, downloaded, reused, skipped=False)
    log.info(
        "restore_done",
        path=str(final),
        files=out.files,
        bytes=out.total_bytes,
        downloaded_bytes=downloaded,
        reused_bytes=reused,
        seconds=round(out.seconds, 3),
        mib_per_s=round(downloaded / max(out.seconds, 1e-9) / 2**20, 1),
    )
    return out


def _staged_bytes(staging: str) -> int:
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


def _check_free_space(target_real: str, manifest: Manifest, name: str) -> None:
    """Refuse before the first byte when the target's filesystem cannot hold what is
    left to fetch: otherwise a large restore fails after filling the disk."""
    staging = os.path.join(target_real, f"{STAGING_PREFIX}{name}")
    needed = manifest.total_bytes - (_staged_bytes(staging) if os.path.isdir(staging) else 0)
    fs = os.statvfs(target_real)
    free = fs.f_bavail * fs.f_frsize
    if needed > free:
        raise RestoreError(
            f"{target_real} has {_mib(free)} free, and {manifest.run_id}/{name} needs "
            f"{_mib(needed)} more: free space there or restore elsewhere (nothing was written)"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _result(
    manifest: Manifest,
    final: Path,
    started: float,
    differences: dict[str, tuple[str, str | None]],
    downloaded: int,
    reused: int,
    *,
    skipped: bool,
) -> RestoreResult:
    return RestoreResult(
        run_id=manifest.run_id,
        checkpoint=manifest.checkpoint,
        step=manifest.step,
        path=final,
        files=len(manifest.files),
        total_bytes=manifest.total_bytes,
        downloaded_bytes=downloaded,
        reused_bytes=reused,
        seconds=time.monotonic() - started,
        skipped=skipped,
        environment_differences=differences,
    )


def _lock(target_fd: int, log: Any) -> None:
    """Serialise restores into one DIR: eight ranks that each run ``restore --latest
    --if-missing`` get one download, and seven instant "present" answers."""
    try:
        fcntl.flock(target_fd, fcntl.LOCK_EX)
    except OSError as exc:  # some network filesystems lock no directories
        log.warning("restore_unlocked", error=str(exc))


def _restore_into(
    storage: Storage,
    manifest: Manifest,
    target_fd: int,
    target_real: str,
    concurrency: int,
    chunk_bytes: int,
    progress: bool | None,
    log: Any,
    on_file: Callable[[str], None] | None,
    *,
    check_digests: bool = False,
) -> tuple[int, int]:
    """Steps 3 and 4 of the module doc; returns (bytes downloaded, bytes reused)."""
    name = manifest.checkpoint
    identity = manifest_identity(manifest, digests=check_digests)
    staging_fd, records = _open_staging(target_fd, name, identity, log)
    tree = _Tree(staging_fd)
    # Belt and braces (the descriptors already refuse symlinks): every path must
    # stay inside the staging dir after realpath, checked before any file is made.
    staging_path = os.path.join(target_real, STAGING_PREFIX + name)
    for f in manifest.files:
        if not _inside(staging_path, staged_parts(manifest, f.path)):
            tree.close()
            raise ManifestError(f"unsafe path {f.path!r}: resolves outside {target_real}")
    try:
        state = _StateLog(staging_fd, identity, fresh=records is None)
        try:
            todo: list[ManifestFile] = []
            reused = 0
            for f in manifest.files:
                parts = staged_parts(manifest, f.path)
                st = tree.lstat(parts)
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
            if reused:
                log.info(
                    "restore_resumed",
                    reused_files=len(manifest.files) - len(todo),
                    reused_bytes=reused,
                )
            downloaded = _download(
                storage,
                manifest,
                todo,
                tree,
                state,
                concurrency,
                chunk_bytes,
                progress,
                reused,
                log,
                on_file,
                check_digests,
            )
        finally:
            state.close()
        _finalise(manifest, tree, target_fd, name)
    finally:
        tree.close()
    # The checkpoint is in place; the staging dir holds only state.jsonl now.
    shutil.rmtree(STAGING_PREFIX + name, dir_fd=target_fd)
    os.fsync(target_fd)
    return downloaded, reused


def _download(
    storage: Storage,
    manifest: Manifest,
    todo: list[ManifestFile],
    tree: _Tree,
    state: _StateLog,
    concurrency: int,
    chunk_bytes: int,
    progress: bool | None,
    reused: int,
    log: Any,
    on_file: Callable[[str], None] | None,
    check_digests: bool = False,
) -> int:
    """Fetch and verify ``todo``; raise RestoreError naming every file that failed."""
    bar = _Progress(
        log,
        manifest.total_bytes,
        reused,
        bar=sys.stderr.isatty() if progress is None else progress,
    )
    bar.begin(f"{manifest.run_id}/{manifest.checkpoint}")
    downloader = _Downloader(storage, concurrency)
    # Open files are bounded too: a checkpoint of 10k small files is not 10k descriptors.
    max_open = max(16, 2 * concurrency)
    pending = list(reversed(todo))
    open_jobs = 0
    downloaded = 0
    failed: list[FileProblem] = []
    fatal: Exception | None = None
    try:
        while pending or open_jobs:
            while pending and open_jobs < max_open and fatal is None:
                f = pending.pop()
                parts = staged_parts(manifest, f.path)
                job = _Job(
                    f,
                    parts,
                    object_key(manifest.run_id, manifest.checkpoint, f.path),
                    chunk_ranges(f.size, chunk_bytes),
                    check_digest=check_digests,
                )
                job.fd = tree.create(parts)
                open_jobs += 1
                if job.ranges:
                    downloader.submit(job)
                else:
                    downloader.finish(job)  # an empty file: nothing to fetch
            if fatal is not None and not open_jobs:
                break
            try:
                kind, value = downloader.events.get(timeout=1.0)
            except queue.Empty:
                bar.tick()
                continue
            if kind == "bytes":
                downloaded += value
                bar.advance(value)
                bar.tick()
                continue
            done: _Job = value
            open_jobs -= 1
            if done.error is None:
                state.verified(done.entry)
                if on_file is not None:
                    on_file(done.entry.path)
                continue
            tree.unlink(done.parts)  # never keep bytes that did not verify
            if isinstance(done.error, RestoreError | StorageError):
                failed.append(FileProblem(done.entry.path, str(done.error)))
                log.info("restore_file_failed", path=done.entry.path, error=str(done.error))
            elif fatal is None:
                # A local failure (ENOSPC, EIO) will hit every file: stop, keep what verified.
                fatal = done.error
                downloader.stop.set()
                pending.clear()
    finally:
        downloader.close()
        bar.close()
    if fatal is not None:
        raise fatal
    if failed:
        raise RestoreError(
            f"{manifest.run_id}/{manifest.checkpoint}: {len(failed)} file(s) failed; "
            f"verified files are kept in {STAGING_PREFIX}{manifest.checkpoint} for a rerun",
            failed,
        )
    return downloaded


def _finalise(manifest: Manifest, tree: _Tree, target_fd: int, name: str) -> None:
    """Drop strays, fsync, check containment, rename ``data`` to ``NAME``."""
    files = {staged_parts(manifest, f.path) for f in manifest.files}
    dirs = {p[:i] for p in files for i in range(1, len(p))}
    if is_single_file(manifest):
        st = tree.lstat((DATA_NAME,))
        if st is None or not stat.S_ISREG(st.st_mode):
            raise RestoreError(f"staged {name} vanished before the rename")
    else:
        tree.dir((DATA_NAME,), create=True)  # a checkpoint with no files is an empty dir
        for d in sorted(dirs, key=len):
            tree.dir(d, create=False)
        tree.prune((DATA_NAME,), files, dirs)
        for parts in files:
            st = tree.lstat(parts)
            if st is None or not stat.S_ISREG(st.st_mode):
                raise RestoreError(f"staged {'/'.join(parts[1:])} vanished before the rename")
    # One mtime for every file: the order downloads happened to finish in is no write
    # order, and a completion rule that reads mtimes (DCP: no shard newer than .metadata)
    # must judge the restored checkpoint complete, as it was when committed.
    now_ns = time.time_ns()
    for parts in files:
        os.utime(
            parts[-1],
            ns=(now_ns, now_ns),
            dir_fd=tree.dir(parts[:-1], create=False),
            follow_symlinks=False,
        )
    tree.fsync_dirs()
    try:
        os.stat(name, dir_fd=target_fd, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        raise RestoreError(f"{name} appeared in the target while restoring; not replacing it")
    os.rename(DATA_NAME, name, src_dir_fd=tree.dir((), create=False), dst_dir_fd=target_fd)
    os.fsync(target_fd)


__all__ = [
    "RestoreError",
    "RestoreResult",
    "chunk_ranges",
    "environment_differences",
    "is_single_file",
    "local_problems",
    "manifest_identity",
    "restore",
    "staged_parts",
]
