"""Moving one file's bytes to the store: checksummed, resumable, verified.

Inside the worker that sends it, each part is first checksummed in 1 MiB ``pread``s (the
read from disk; CRC-32C in native code, ~0.13 CPU-s/GiB), then streamed to the store
from the same file range, now in the page cache, with the CRC-32C in a signed header for
the store to check; the part values fold (``crc32c_combine``) into the whole-file value.
The checksum has to lead the body: S3 takes it after the body only in aws-chunked
encoding, which botocore applies over TLS alone and whose wrapper re-copies its buffer
on every read. Memory is a few MiB per part in flight, whatever the part or checkpoint
size (94 MiB peak RSS for a 4 GiB checkpoint with the defaults). Files up to 8 MiB go in
one PUT from memory (``send_small``; many at a time through ``ckptd.sync.lanes``).

Page cache, too, stays bounded: with ``drop_page_cache`` (the default) each range is
dropped from the cache (``posix_fadvise(DONTNEED)``) once it is sent or hashed, so at
most concurrency x one part of checkpoint data is cached on ckptd's behalf, and
shipping a checkpoint larger than memory leaves the trainer's dataset in the cache.
The pool's threads are the daemon's busiest; ``thread_setup`` (``yielding``) lowers
their CPU and I/O priority as each starts (to ``SCHED_IDLE`` by default, which no
unprivileged thread can leave). While ``is_urgent()`` holds (a preemption notice), leaf
operations go to a second pool, started on first use, whose threads ``urgent_setup``
lowers no further than the daemon's niceness: an emergency checkpoint never waits for
an idle CPU.

With ``digests`` (authenticated checkpoints) the same read pass also yields each 1 MiB
block's BLAKE3 (``ckptd.core.digest``; the pread chunks are those blocks), so the file's
digest costs no extra read. Parts finished before a restart are read again for theirs
(their CRC-32C must still be the journal's); copy candidates get theirs in the pass
that CRCs them, files the journal holds as sent in a pass of their own.

File-level logic runs as coroutines and only leaf operations (one part, one request) in
the pool: a file never waits on a pool slot it holds.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ckptd.core import checksum, digest
from ckptd.layouts.base import FileEntry
from ckptd.runtime.yielding import drop_cached
from ckptd.storage.base import (
    FileRange,
    MultipartUpload,
    NotFoundError,
    ObjectInfo,
    PartInfo,
    PartListing,
    ServerSideCopy,
    Storage,
    StorageError,
    StoreChecksums,
    capability,
    require_capability,
)
from ckptd.sync.journal import Journal, ObjectRecord, UploadRecord

T = TypeVar("T")

# Small enough that concurrency x this stays in a few MiB; large enough to be fast.
_HASH_CHUNK = digest.BLOCK  # one read, one digest block
SINGLE_PUT_MAX = 8 * 1024 * 1024
# S3 takes at most 10,000 parts per upload: a file larger than 10,000 x part_size (a
# 175B model's single files run to hundreds of GiB) goes in parts as large as it needs.
MAX_PARTS = 10_000
_MiB = 1024 * 1024


def part_size_for(size: int, configured: int) -> int:
    """The part size for a file of ``size`` bytes: the configured one, or the smallest
    whole number of MiB that keeps the upload within MAX_PARTS (whole MiB keep the
    parts aligned with the 1 MiB read and digest blocks)."""
    needed = -(-size // MAX_PARTS)
    return max(configured, -(-needed // _MiB) * _MiB)


class CheckpointChangedError(Exception):
    """The local checkpoint changed or vanished while it was being shipped."""


class TransferPausedError(Exception):
    """Stopped to make way for an emergency checkpoint; the journal keeps the progress."""


@dataclass(frozen=True)
class FileResult:
    """A file that is now in the store, verified."""

    path: str
    size: int
    crc32c: int
    how: str  # "uploaded" | "resumed" | "copied" | "skipped" | "early"
    bytes_sent: int = 0
    parts: list[PartInfo] = field(default_factory=list)
    digest: str | None = None  # with ``Transfers.digests`` (``ckptd.core.digest``)


@dataclass
class TransferContext:
    """Who a file belongs to, and how to tell a caller that it should stop."""

    run: str
    checkpoint: str
    cancel: threading.Event = field(default_factory=threading.Event)
    pause: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        """Raise if the caller asked this transfer to stop."""
        if self.pause.is_set():
            raise TransferPausedError(f"{self.checkpoint} paused")
        if self.cancel.is_set():
            raise CheckpointChangedError("cancelled")


def _same_file(st: os.stat_result, entry: FileEntry) -> bool:
    return st.st_size == entry.size and st.st_mtime_ns == entry.mtime_ns


def _record(key: str, entry: FileEntry, crc: int, st: os.stat_result) -> ObjectRecord:
    """The journal row of a verified object, with its file's identity when it was opened
    (``st``): a later change to the file (even to ctime or inode alone) tells it apart."""
    return ObjectRecord(key, entry.path, entry.size, entry.mtime_ns, crc, st.st_ctime_ns, st.st_ino)


class Transfers:
    """Uploads, server-side copies and hashing, bounded by one pool of workers."""

    def __init__(
        self,
        storage: Storage,
        journal: Journal,
        *,
        part_size: int,
        concurrency: int,
        on_bytes: Callable[[str, int], None] | None = None,
        drop_page_cache: bool = True,
        thread_setup: Callable[[], None] | None = None,
        urgent_setup: Callable[[], None] | None = None,
        is_urgent: Callable[[], bool] = lambda: False,
        digests: bool = False,
    ) -> None:
        self.storage = storage
        # Asked once: a runtime Protocol check costs more than a small file's request.
        self._store_checksums = capability(storage, StoreChecksums)
        self.digests = digests
        self.drop_page_cache = drop_page_cache
        self.journal = journal
        self.part_size = part_size
        # Files up to this size go in one PUT, held in memory; larger ones are streamed
        # as multipart, so memory stays small whatever part_size is.
        self.single_put_max = min(part_size, SINGLE_PUT_MAX)
        self.on_bytes = on_bytes or (lambda run, n: None)
        self.pool = ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="ckptd-io", initializer=thread_setup
        )
        self.concurrency = concurrency
        self.is_urgent = is_urgent
        self._urgent_setup = urgent_setup
        self._urgent_pool: ThreadPoolExecutor | None = None

    def _drop(self, fd: int, offset: int, length: int) -> None:
        if self.drop_page_cache:
            drop_cached(fd, offset, length)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._urgent_pool is not None:
            self._urgent_pool.shutdown(wait=True, cancel_futures=True)

    def _pool_now(self) -> ThreadPoolExecutor:
        """The pool a leaf operation starting now runs on (module doc)."""
        if not self.is_urgent():
            return self.pool
        if self._urgent_pool is None:
            self._urgent_pool = ThreadPoolExecutor(
                max_workers=self.concurrency,
                thread_name_prefix="ckptd-io-urgent",
                initializer=self._urgent_setup,
            )
        return self._urgent_pool

    @property
    def can_copy(self) -> bool:
        """Whether the store copies server-side; without it every file is uploaded."""
        return capability(self.storage, ServerSideCopy) is not None

    async def _in_pool(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._pool_now().submit(fn))

    # -- hashing (copy candidates) -------------------------------------------------

    async def crc_of(
        self, local: Path, entry: FileEntry, ctx: TransferContext
    ) -> tuple[int, str | None]:
        """CRC-32C of a local file, which must still match ``entry``, and its digest
        (with ``digests``; else None) from the same read."""

        def work() -> tuple[int, str | None]:
            with open(local, "rb", buffering=0) as fh:
                if not _same_file(os.fstat(fh.fileno()), entry):
                    raise CheckpointChangedError(f"{entry.path} changed")
                value, total = 0, 0
                blocks: list[bytes] = []
                buf = bytearray(_HASH_CHUNK)
                view = memoryview(buf)
                while n := fh.readinto(buf):
                    ctx.check()
                    value = checksum.crc32c(view[:n], value)
                    if self.digests:
                        blocks.append(digest.block_digest(view[:n]))
                    self._drop(fh.fileno(), total, n)
                    total += n
                if total != entry.size:
                    raise CheckpointChangedError(f"{entry.path} changed size while read")
                return value, digest.file_digest(total, blocks) if self.digests else None

        try:
            return await self._in_pool(work)
        except FileNotFoundError as exc:
            raise CheckpointChangedError(f"{entry.path} vanished") from exc

    # -- server-side copy ------------------------------------------------------------

    async def copy(
        self,
        src_key: str,
        dst_key: str,
        entry: FileEntry,
        crc: int,
        ctx: TransferContext,
        file_digest: str | None = None,
        identity: os.stat_result | None = None,
    ) -> FileResult:
        """Copy ``src_key`` to ``dst_key`` for ``entry`` (whose CRC-32C is ``crc``); the
        journal row carries ``identity`` (the file's stat before its CRC was read) when
        given, so a copy made before the checkpoint is complete counts only while the
        file is still that file, as an upload's does."""
        copier = require_capability(self.storage, ServerSideCopy, "copy server-side")

        def work() -> FileResult:
            ctx.check()
            self.journal.touch(ctx.run, ctx.checkpoint)
            copied = copier.copy(src_key, dst_key)  # verified by the backend
            if copied.size != entry.size:
                raise StorageError(
                    f"copy {src_key} -> {dst_key}: {copied.size} bytes, the local file has {entry.size}",
                    transient=True,
                    code="VerifyFailed",
                )
            self.journal.record_object(
                ctx.run,
                ctx.checkpoint,
                ObjectRecord(dst_key, entry.path, entry.size, entry.mtime_ns, crc)
                if identity is None
                else _record(dst_key, entry, crc, identity),
            )
            return FileResult(entry.path, entry.size, crc, "copied", digest=file_digest)

        return await self._in_pool(work)

    # -- uploads ---------------------------------------------------------------------

    async def upload(
        self, key: str, local: Path, entry: FileEntry, ctx: TransferContext
    ) -> FileResult:
        """Ship ``local`` to ``key``, resuming a journalled multipart upload if any."""
        ctx.check()
        try:
            if entry.size <= self.single_put_max:

                def put() -> FileResult:
                    result, record = self.send_small(key, local, entry, ctx)
                    self.journal.record_object(ctx.run, ctx.checkpoint, record)
                    return result

                return await self._in_pool(put)
            return await self._upload_multipart(key, local, entry, ctx)
        except FileNotFoundError as exc:
            raise CheckpointChangedError(f"{entry.path} vanished") from exc

    def send_small(
        self, key: str, local: Path, entry: FileEntry, ctx: TransferContext
    ) -> tuple[FileResult, ObjectRecord]:
        """One PUT of a whole file read into memory, verified by the store's reply; the
        journal row is the caller's to write (one transaction for many: ``lanes``)."""
        if ctx.cancel.is_set():
            raise CheckpointChangedError("cancelled")
        with open(local, "rb", buffering=0) as fh:
            opened = os.fstat(fh.fileno())
            if not _same_file(opened, entry):
                raise CheckpointChangedError(f"{entry.path} changed")
            data = fh.read(entry.size + 1)
            self._drop(fh.fileno(), 0, len(data))
        if len(data) != entry.size:
            raise CheckpointChangedError(f"{entry.path} changed size while read")
        crc = checksum.crc32c(data)
        self.journal.touch(ctx.run, ctx.checkpoint)
        stored = self.storage.put_bytes(key, data, crc32c=crc)
        self.on_bytes(ctx.run, len(data))
        self._verify(key, entry.size, [], crc, reported=stored)
        sums = digest.digest_of_bytes(data) if self.digests else None
        result = FileResult(
            entry.path, entry.size, crc, "uploaded", bytes_sent=len(data), digest=sums
        )
        return result, _record(key, entry, crc, opened)

    def _verify(
        self,
        key: str,
        size: int,
        parts: list[PartInfo],
        whole_crc: int,
        reported: ObjectInfo | None = None,
    ) -> None:
        """Compare what the store reports with what ckptd read and sent: the write's own
        response when it carries the store's checksum (one request saved per file),
        else a HEAD. A store that reports no checksum is checked by size alone."""
        sums = self._store_checksums
        expected = sums.expected_checksum(parts, whole_crc) if sums is not None else ""
        if (
            reported is not None
            and expected
            and reported.checksum
            and reported.size == size
            and checksum.s3_checksums_match(reported.checksum, expected)
        ):
            return
        info = self.storage.head(key)
        if info is None:
            raise StorageError(
                f"verify {key}: object missing after upload", transient=True, code="VerifyFailed"
            )
        if info.size != size or (
            expected and info.checksum and not checksum.s3_checksums_match(info.checksum, expected)
        ):
            raise StorageError(
                f"verify {key}: store reports size {info.size} checksum {info.checksum!r}, "
                f"expected {size} {expected!r}",
                transient=True,
                code="VerifyFailed",
            )

    async def _upload_multipart(
        self, key: str, local: Path, entry: FileEntry, ctx: TransferContext
    ) -> FileResult:
        uploads = require_capability(
            self.storage, MultipartUpload, f"upload files over {self.single_put_max} bytes"
        )
        part_size = part_size_for(entry.size, self.part_size)
        upload_id, done = await self._in_pool(
            lambda: self._resume_or_start(uploads, key, entry, ctx, part_size)
        )
        resumed = bool(done)
        fd = os.open(local, os.O_RDONLY)
        try:
            opened = os.fstat(fd)
            if not _same_file(opened, entry):
                raise CheckpointChangedError(f"{entry.path} changed")
            parts_of = _FileParts(self, uploads, key, upload_id, fd, entry, ctx, part_size, done)
            sent = await self._send_parts(parts_of)
            if not _same_file(os.fstat(fd), entry):
                raise CheckpointChangedError(f"{entry.path} changed while uploaded")
        finally:
            os.close(fd)
        parts = sorted([*done.values(), *sent], key=lambda p: p.number)
        whole = checksum.combine_parts((p.crc32c, p.size) for p in parts)

        def finish() -> None:
            stored = uploads.complete_upload(key, upload_id, parts)
            self._verify(key, entry.size, parts, whole, reported=stored)
            self.journal.record_object(ctx.run, ctx.checkpoint, _record(key, entry, whole, opened))
            self.journal.forget_upload(key)

        await self._in_pool(finish)
        sent_bytes = sum(p.size for p in sent)
        sums = (
            digest.file_digest(entry.size, (b for p in parts for b in parts_of.blocks[p.number]))
            if self.digests
            else None
        )
        return FileResult(
            entry.path,
            entry.size,
            whole,
            "resumed" if resumed else "uploaded",
            sent_bytes,
            parts,
            digest=sums,
        )

    async def _send_parts(self, parts_of: _FileParts) -> list[PartInfo]:
        """Send the parts not yet sent and (with ``digests``) re-read those sent before a
        restart, all in the pool; the first failure stops the parts not yet started."""
        pool = self._pool_now()
        todo = [n for n in parts_of.numbers() if n not in parts_of.done]
        futures = [asyncio.wrap_future(pool.submit(parts_of.send, n)) for n in todo]
        rereads = [
            asyncio.wrap_future(pool.submit(parts_of.reread, n))
            for n in parts_of.done
            if self.digests
        ]
        try:
            sent = await asyncio.gather(*futures)
            await asyncio.gather(*rereads)
        except BaseException:
            parts_of.failed.set()  # parts not yet started give up at once
            await asyncio.gather(*futures, *rereads, return_exceptions=True)
            raise
        return list(sent)

    def _resume_or_start(
        self,
        uploads: MultipartUpload,
        key: str,
        entry: FileEntry,
        ctx: TransferContext,
        part_size: int,
    ) -> tuple[str, dict[int, PartInfo]]:
        """The journalled upload of this very file at ``part_size`` with its finished
        parts, or a new one."""
        rec = self.journal.upload_for(key)
        if rec is not None and rec.upload_id is not None:
            if (rec.size, rec.mtime_ns, rec.part_size) == (
                entry.size,
                entry.mtime_ns,
                part_size,
            ):
                done = self.journal.parts_for(rec.upload_id)
                try:
                    held = self._parts_held(uploads, key, rec.upload_id)
                except NotFoundError:
                    held = {}
                    done = {}
                if held is not None:
                    # The store is the truth: keep only parts it holds with the same size.
                    done = {n: p for n, p in done.items() if n in held and held[n][0] == p.size}
                if held is None or held or done:
                    return rec.upload_id, done
            uploads.abort_upload(key, rec.upload_id)
            self.journal.forget_upload(key)
        elif rec is not None:
            # Intended before a crash, maybe created: abort whatever exists for this key.
            abort_unrecorded_uploads(self.storage, key, keep=set())
            self.journal.forget_upload(key)
        self.journal.intend_upload(
            UploadRecord(
                key,
                None,
                ctx.run,
                ctx.checkpoint,
                entry.path,
                entry.size,
                entry.mtime_ns,
                part_size,
            )
        )
        self.journal.touch(ctx.run, ctx.checkpoint)
        upload_id = uploads.create_upload(key)
        self.journal.record_upload_id(key, upload_id)
        return upload_id, {}

    def _parts_held(
        self, uploads: MultipartUpload, key: str, upload_id: str
    ) -> dict[int, tuple[int, str]] | None:
        """The parts the store holds, number -> (size, etag), or None where it cannot list
        parts (the journal is then the record); NotFoundError if the upload is gone."""
        lister = capability(self.storage, PartListing)
        if lister is not None:
            return lister.list_parts(key, upload_id)
        if (key, upload_id) not in uploads.list_uploads(key):
            raise NotFoundError(f"upload {upload_id} of {key} gone", code="NoSuchUpload")
        return None


class _FileParts:
    """One file's multipart upload while its parts are read and sent: blocking methods,
    run in the pool, on a descriptor the caller opened and closes."""

    def __init__(
        self,
        transfers: Transfers,
        uploads: MultipartUpload,
        key: str,
        upload_id: str,
        fd: int,
        entry: FileEntry,
        ctx: TransferContext,
        part_size: int,
        done: dict[int, PartInfo],
    ) -> None:
        self.transfers = transfers
        self.uploads = uploads
        self.key = key
        self.upload_id = upload_id
        self.fd = fd
        self.entry = entry
        self.ctx = ctx
        self.part_size = part_size
        self.done = done  # sent before a restart: number -> part
        self.failed = threading.Event()
        self.blocks: dict[int, list[bytes]] = {}  # part number -> its blocks' digests

    def numbers(self) -> range:
        return range(1, (self.entry.size + self.part_size - 1) // self.part_size + 1)

    def read_part(self, number: int, length: int) -> int:
        """The part's CRC-32C (and its blocks' digests) in 1 MiB reads."""
        offset = (number - 1) * self.part_size
        crc, done_bytes, part_blocks = 0, 0, []
        while done_bytes < length:
            chunk = os.pread(self.fd, min(_HASH_CHUNK, length - done_bytes), offset + done_bytes)
            if not chunk:
                raise CheckpointChangedError(f"{self.entry.path} shrank while read")
            crc = checksum.crc32c(chunk, crc)
            if self.transfers.digests:
                part_blocks.append(digest.block_digest(chunk))
            done_bytes += len(chunk)
        self.blocks[number] = part_blocks
        return crc

    def reread(self, number: int) -> None:
        """A part sent before a restart: its digest, and proof it is unchanged."""
        self.ctx.check()
        sent = self.done[number]
        if self.read_part(number, sent.size) != sent.crc32c:
            raise CheckpointChangedError(f"{self.entry.path} changed since part {number}")
        self.transfers._drop(self.fd, (number - 1) * self.part_size, sent.size)

    def send(self, number: int) -> PartInfo:
        self.ctx.check()
        if self.failed.is_set():
            raise CheckpointChangedError("cancelled")
        offset = (number - 1) * self.part_size
        length = min(self.part_size, self.entry.size - offset)
        # First pass: the CRC-32C, in small reads (this is the read from disk).
        # The store needs it in a header before the body, so the body is then
        # streamed from the same range (the page cache) rather than held whole:
        # memory stays at concurrency x one buffer, whatever the part size.
        crc = self.read_part(number, length)
        part = self.uploads.upload_part(
            self.key,
            self.upload_id,
            number,
            offset,
            FileRange(self.fd, offset, length),
            crc32c=crc,
        )
        self.transfers._drop(self.fd, offset, length)  # sent: the trainer's pages matter more
        self.transfers.journal.record_part(self.key, self.upload_id, part)
        self.transfers.on_bytes(self.ctx.run, length)
        return part


def abort_unrecorded_uploads(storage: Storage, key: str, keep: set[str]) -> int:
    """Abort multipart uploads of exactly ``key`` whose ids are not in ``keep``."""
    uploads = capability(storage, MultipartUpload)
    if uploads is None:
        return 0  # a store without multipart uploads holds none to abort
    aborted = 0
    for found_key, upload_id in uploads.list_uploads(key):
        if found_key == key and upload_id not in keep:
            uploads.abort_upload(found_key, upload_id)
            aborted += 1
    return aborted


def abort_lost_uploads(storage: Storage, prefix: str, keys: Collection[str]) -> int:
    """Abort every multipart upload under ``prefix`` of one of ``keys``, whose files are
    all complete: such an upload is one whose CreateMultipartUpload took effect while its
    answer was lost (a reset, a timeout), so the retry made another and no one knows
    its id. One listing per checkpoint; returns how many were aborted."""
    uploads = capability(storage, MultipartUpload)
    if uploads is None:
        return 0
    wanted = set(keys)
    aborted = 0
    for key, upload_id in uploads.list_uploads(prefix):
        if key in wanted:
            uploads.abort_upload(key, upload_id)
            aborted += 1
    return aborted


def abort_journalled_upload(storage: Storage, key: str, upload_id: str | None) -> None:
    """Abort an upload the journal holds: by its id, or (``None``: intended, maybe
    created before a crash) every upload of ``key``."""
    uploads = capability(storage, MultipartUpload)
    if uploads is None:
        return  # a store without multipart uploads holds none to abort
    if upload_id is None:
        abort_unrecorded_uploads(storage, key, keep=set())
    else:
        uploads.abort_upload(key, upload_id)
