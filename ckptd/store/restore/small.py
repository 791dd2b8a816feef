"""The small files of a restore in few hand-offs: lanes that each fetch and verify one file
after another.

A file of at most ``SMALL_FILE_MAX`` bytes is one GET. Fetched as a pool task with a
queue event or two each (``ckptd.store.restore.download``, the way of large files), a
checkpoint of thousands of them spends more CPU in hand-offs between threads than in
its requests. Here ``lanes`` threads (``ckptd.core.concurrency``: 32 at the default
concurrency of 8) each take the next file, create it in its staging directory (opened
by the calling thread beforehand, ``O_NOFOLLOW`` at every level, as ``StagingTree``
does), write what the GET streams with ``pwrite``, CRC-32C it (and digest it, with
keys) from the same buffers, give it the restore's one mtime, start its writeback
(``ckptd.runtime.writeback``: the disk writes it while the next files download) and close
it (fsyncing it instead only where the staging filesystem cannot be trusted to one
``syncfs``: ``ckptd.store.restore.durability``). The calling thread alone hands what the lanes verified to ``Durability`` (which records it
once it is durable) and touches the progress bar, in batches.

Invariant, as for large files: only a file whose size and CRC-32C (and digest) are the
manifest's is handed on to be recorded; a file that differs is deleted, never kept; a
local error (ENOSPC, EIO) stops every lane and is raised.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ckptd.core import checksum, digest
from ckptd.core.manifest import Manifest, ManifestFile
from ckptd.repository import FileProblem, RangeCrc, object_key
from ckptd.runtime import writeback
from ckptd.storage.base import Storage, StorageError
from ckptd.store.restore.durability import Durability
from ckptd.store.restore.progress import RestoreProgress
from ckptd.store.restore.request import RestoreError, RestoreRequest
from ckptd.store.restore.staging import StagingTree, staged_parts

_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# How long the calling thread waits for news before it ticks the progress bar.
_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class _File:
    entry: ManifestFile
    key: str
    parts: tuple[str, ...]
    dir_fd: int  # its staging directory, opened by the calling thread


class SmallDownloads:
    """Fetches a restore's small files through lanes (module doc)."""

    def __init__(
        self,
        storage: Storage,
        manifest: Manifest,
        tree: StagingTree,
        durable: Durability,
        request: RestoreRequest,
        log: Any,
        *,
        lanes: int,
        fresh: bool,
        mtime_ns: int,
    ) -> None:
        self.storage = storage
        self.manifest = manifest
        self.tree = tree
        self.durable = durable
        self.fsync_each = durable.per_file
        self.request = request
        self.log = log
        self.lanes = lanes
        # A staging dir made just now holds no stale copy to unlink first.
        self.fresh = fresh
        self.mtime_ns = mtime_ns
        self.downloaded = 0
        self.failed: list[FileProblem] = []
        self.fatal: BaseException | None = None
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._news: deque[tuple[_File, BaseException | None]] = deque()

    def run(self, todo: Sequence[ManifestFile], bar: RestoreProgress) -> None:
        """Fetch ``todo``; ``downloaded``, ``failed`` and ``fatal`` say how it went."""
        files = []
        for f in todo:
            parts = staged_parts(self.manifest, f.path)
            key = object_key(self.manifest.run_id, self.manifest.checkpoint, f.path)
            files.append(_File(f, key, parts, self.tree.dir(parts[:-1], create=True)))
        if not files:
            return
        with ThreadPoolExecutor(self.lanes, thread_name_prefix="ckptd-restore-small") as pool:
            lanes = [pool.submit(self._lane, files) for _ in range(min(self.lanes, len(files)))]
            pending = set(lanes)
            while pending:
                _, pending = wait(pending, timeout=_POLL_SECONDS, return_when=FIRST_EXCEPTION)
                self._drain(bar)
                self.durable.tick()
                bar.tick()
            for lane in lanes:
                error = lane.exception()
                if error is not None and self.fatal is None:
                    self.fatal = error
        self._drain(bar)

    def _take(self, count: int) -> int | None:
        with self._lock:
            if self._next >= count or self._stop.is_set():
                return None
            index = self._next
            self._next += 1
            return index

    def _lane(self, files: Sequence[_File]) -> None:
        while (index := self._take(len(files))) is not None:
            f = files[index]
            try:
                self._fetch(f)
            except (RestoreError, StorageError) as exc:
                self._news.append((f, exc))  # this file only: the others go on
            except BaseException as exc:
                # A local failure (ENOSPC, EIO) will hit every file: stop, keep what verified.
                self._stop.set()
                self._news.append((f, exc))
                raise
            else:
                self._news.append((f, None))

    def _fetch(self, f: _File) -> None:
        name, size = f.parts[-1], f.entry.size
        if not self.fresh:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=f.dir_fd)  # a stale, unverified copy
        fd = os.open(name, _NEW_FILE_FLAGS, 0o644, dir_fd=f.dir_fd)
        try:
            crc = RangeCrc()
            sums = digest.RangeDigest() if self.request.keys is not None else None

            def write(pos: int, piece: bytes) -> None:
                if pos + len(piece) > size:
                    # Never write more than the manifest's size.
                    raise RestoreError(f"GET returned more than {size} bytes")
                view = memoryview(piece)
                done = 0
                while done < len(piece):
                    done += os.pwrite(fd, view[done:], pos + done)
                crc.update(pos, piece)
                if sums is not None:
                    sums.update(pos, piece)

            if size:
                self.storage.stream_range(f.key, 0, size, write)
            found = checksum.to_hex(crc.value)
            if found != f.entry.crc32c:
                raise RestoreError(f"crc32c {found}, manifest says {f.entry.crc32c}")
            if sums is not None and digest.file_digest(size, sums.finish()) != f.entry.digest:
                raise RestoreError(
                    "digest differs from the signed manifest's: the object was replaced"
                )
            os.utime(fd, ns=(self.mtime_ns, self.mtime_ns))  # one for all (staging.finalise)
            if self.fsync_each:
                os.fsync(fd)
            else:
                # The disk writes this file while the next ones download, so the syncfs
                # that makes it durable finds little of ours left to write.
                writeback.start(fd, 0, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=f.dir_fd)  # never keep bytes that did not verify
            raise
        os.close(fd)

    def _drain(self, bar: RestoreProgress) -> None:
        """Hand on what the lanes finished since the last call (this thread only)."""
        verified: list[ManifestFile] = []
        while self._news:
            f, error = self._news.popleft()
            if error is None:
                verified.append(f.entry)
            elif isinstance(error, RestoreError | StorageError):
                self.failed.append(FileProblem(f.entry.path, str(error)))
                self.log.info("restore_file_failed", path=f.entry.path, error=str(error))
        if verified:
            done = sum(f.size for f in verified)
            self.downloaded += done
            bar.advance(done)
            self.durable.verified(verified)


__all__ = ["SmallDownloads"]
