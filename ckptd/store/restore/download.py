"""The ranged, parallel download of a restore's files into the staging tree.

Ranged GETs of ``chunk_bytes`` run in a pool of ``concurrency`` threads, each streamed
in 1 MiB pieces (memory stays near concurrency x piece) and written with ``pwrite``,
CRC-32C'd as written (and digested, with keys, from the same buffers), its writeback
started at once (``ckptd.runtime.writeback``) so the sync that follows does not write the
whole checkpoint while the caller waits. The chunk values fold into the file's
(``checksum.combine_parts``); a file whose size, CRC-32C or digest differs from the
manifest is deleted, never kept. Only a file that verified is handed to ``Durability``,
which records it in the state log once it is durable (``ckptd.store.restore.durability``:
after a ``syncfs``, or its own ``fsync`` where that is not to be trusted). The workers
report to a queue that the calling thread drains: it alone touches the tree, the state
log and the progress bar.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptd.core import checksum, digest
from ckptd.core.concurrency import SMALL_FILE_MAX, lanes_for
from ckptd.core.manifest import Manifest, ManifestFile
from ckptd.repository import FileProblem, RangeCrc, chunk_ranges, object_key
from ckptd.runtime import writeback
from ckptd.storage.base import Storage, StorageError
from ckptd.store.restore.durability import Durability
from ckptd.store.restore.progress import RestoreProgress
from ckptd.store.restore.request import RestoreError, RestoreRequest
from ckptd.store.restore.small import SmallDownloads
from ckptd.store.restore.staging import STAGING_PREFIX, StagingTree, staged_parts


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

    def __init__(
        self, storage: Storage, concurrency: int, *, fsync_each: bool, mtime_ns: int
    ) -> None:
        self.storage = storage
        self.fsync_each = fsync_each
        self.mtime_ns = mtime_ns
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
        """Check the folded CRC-32C, give the file its mtime, fsync it (``fsync_each``)
        and close it; report the file."""
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
                    os.utime(job.fd, ns=(self.mtime_ns, self.mtime_ns))
                    if self.fsync_each:
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


class _FileDownloads:
    """The calling thread's side: opens files as slots free up, drains the workers'
    events, records each file that verified and deletes each one that did not."""

    def __init__(
        self,
        manifest: Manifest,
        todo: list[ManifestFile],
        tree: StagingTree,
        durable: Durability,
        request: RestoreRequest,
        log: Any,
        downloader: _Downloader,
    ) -> None:
        self.manifest = manifest
        self.tree = tree
        self.durable = durable
        self.request = request
        self.log = log
        self.downloader = downloader
        self.pending = list(reversed(todo))
        # Open files are bounded too: a checkpoint of 10k small files is not 10k descriptors.
        self.max_open = max(16, 2 * request.concurrency)
        self.open_jobs = 0
        self.downloaded = 0
        self.failed: list[FileProblem] = []
        self.fatal: Exception | None = None

    def run(self, bar: RestoreProgress) -> None:
        while self.pending or self.open_jobs:
            self._open_files()
            if self.fatal is not None and not self.open_jobs:
                break
            try:
                kind, value = self.downloader.events.get(timeout=1.0)
            except queue.Empty:
                self.durable.tick()
                bar.tick()
                continue
            if kind == "bytes":
                self.downloaded += value
                bar.advance(value)
                bar.tick()
                continue
            self._file_done(value)
            self.durable.tick()

    def _open_files(self) -> None:
        while self.pending and self.open_jobs < self.max_open and self.fatal is None:
            f = self.pending.pop()
            parts = staged_parts(self.manifest, f.path)
            job = _Job(
                f,
                parts,
                object_key(self.manifest.run_id, self.manifest.checkpoint, f.path),
                chunk_ranges(f.size, self.request.chunk_bytes),
                check_digest=self.request.keys is not None,
            )
            job.fd = self.tree.create(parts)
            self.open_jobs += 1
            if job.ranges:
                self.downloader.submit(job)
            else:
                self.downloader.finish(job)  # an empty file: nothing to fetch

    def _file_done(self, done: _Job) -> None:
        self.open_jobs -= 1
        if done.error is None:
            self.durable.verified([done.entry])
            return
        self.tree.unlink(done.parts)  # never keep bytes that did not verify
        if isinstance(done.error, RestoreError | StorageError):
            self.failed.append(FileProblem(done.entry.path, str(done.error)))
            self.log.info("restore_file_failed", path=done.entry.path, error=str(done.error))
        elif self.fatal is None:
            # A local failure (ENOSPC, EIO) will hit every file: stop, keep what verified.
            self.fatal = done.error
            self.downloader.stop.set()
            self.pending.clear()


def download(
    storage: Storage,
    manifest: Manifest,
    todo: list[ManifestFile],
    tree: StagingTree,
    durable: Durability,
    request: RestoreRequest,
    *,
    reused: int,
    fresh: bool = False,
    mtime_ns: int,
    log: Any,
) -> int:
    """Fetch and verify ``todo``, handing each file that verified to ``durable``; returns
    the bytes downloaded. Raises RestoreError naming every file that failed, or the first
    local error (ENOSPC, EIO) as it is, once what verified is recorded (a rerun reuses
    it). ``fresh``: the staging dir was made just now (no stale file to remove first).
    ``mtime_ns``: every file's mtime, set as it is closed (``staging.finalise``).
    What verified may still wait for its sync when this returns (``durable.seal``)."""
    bar = RestoreProgress(
        log,
        manifest.total_bytes,
        reused,
        bar=sys.stderr.isatty() if request.progress is None else request.progress,
    )
    bar.begin(f"{manifest.run_id}/{manifest.checkpoint}")
    # Small files first, through lanes (``ckptd.store.restore.small``); then the large
    # ones in ranges.
    small = SmallDownloads(
        storage,
        manifest,
        tree,
        durable,
        request,
        log,
        lanes=lanes_for(request.concurrency),
        fresh=fresh,
        mtime_ns=mtime_ns,
    )
    order = request.order or list
    files = _FileDownloads(
        manifest,
        order([f for f in todo if f.size > SMALL_FILE_MAX]),
        tree,
        durable,
        request,
        log,
        _Downloader(storage, request.concurrency, fsync_each=durable.per_file, mtime_ns=mtime_ns),
    )
    try:
        small.run(order([f for f in todo if f.size <= SMALL_FILE_MAX]), bar)
        if small.fatal is None:
            files.run(bar)
    finally:
        files.downloader.close()
        bar.close()
    fatal = small.fatal or files.fatal
    if fatal is not None:
        with contextlib.suppress(OSError):  # the sync may fail as the writes did
            durable.flush()
        raise fatal
    failed = small.failed + files.failed
    if failed:
        durable.flush()
        raise RestoreError(
            f"{manifest.run_id}/{manifest.checkpoint}: {len(failed)} file(s) failed; "
            f"verified files are kept in {STAGING_PREFIX}{manifest.checkpoint} for a rerun",
            failed,
        )
    return small.downloaded + files.downloaded


__all__ = ["download"]
