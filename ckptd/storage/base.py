"""The storage interface: a core every backend implements, capabilities a backend may
add, and the one error type it raises. This docstring is the contract.

Keys are '/'-separated and relative to the destination root (``s3://bucket/prefix`` or
``file:///mnt/shared/ckpt``); backends add the root. Every method is blocking and
thread-safe: the pipeline runs them in worker threads.

Core (``Storage``): put and get whole objects, stream a range, head, list, delete, check
the destination, and ``url``. Every backend implements all of it.

Capabilities, each a small ``runtime_checkable`` Protocol (as rclone's optional
features): a backend implements one only where its store keeps that promise, and
never answers one it lacks with a sentinel; it simply does not have the method.

    ConditionalWrite  put_if_absent          a manifest is committed exactly once
    ServerSideCopy    copy                   an unchanged file is re-used, not re-sent
    MultipartUpload   create_upload ...      large files in parts that survive restarts
    PartListing       list_parts             the store says which parts it holds
    StoreChecksums    expected_checksum      the store reports a checksum to verify

Callers ask with ``capability(storage, Kind)``, None when absent, and do what they did
without it: with no PartListing the journal is the record of finished parts, with no
StoreChecksums an object is verified by its size, with no ServerSideCopy a file is
uploaded. Where nothing can stand in (a commit needs ConditionalWrite, a file larger
than one PUT needs MultipartUpload), ``require_capability`` raises a permanent
StorageError naming the destination and what it lacks. A wrapper (``storage.wrapper``) has exactly the capabilities of what it
wraps, so ``isinstance`` answers for the backend through any stack of wrappers.

Errors: a backend raises ``StorageError`` only, classified once, here in the backend
that understands its own failures: ``transient=True`` for what a later attempt may fix
(5xx, SlowDown/throttling, RequestTimeout, connection resets, timeouts) and
``transient=False`` for what it never will (AccessDenied, NoSuchBucket, ENOSPC, EACCES).
``storage.retrying.RetryingStorage`` retries the first kind; the second surfaces. The
backend also sets ``destination_unusable`` when the destination as configured can never
work (no such bucket, access denied, bad or missing credentials, a root directory that
cannot be made or written): callers read that flag, never the backend's error codes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from ckptd.core.errors import CkptdError


class StorageError(CkptdError):
    """A storage operation failed; ``transient`` says whether retrying may help, and
    ``destination_unusable`` whether the destination as configured can never work."""

    def __init__(
        self, message: str, *, transient: bool, code: str = "", destination_unusable: bool = False
    ) -> None:
        super().__init__(message)
        self.transient = transient
        self.code = code
        self.destination_unusable = destination_unusable


# Codes by which a backend says it is full (a file system's errno names; S3 has none:
# a bucket has no size limit, and a quota is an AccessDenied).
NO_SPACE_CODES = frozenset({"ENOSPC", "EDQUOT"})
# Codes by which a backend says the bytes it holds are not the bytes sent.
VERIFY_CODES = frozenset({"BadDigest", "VerifyFailed", "IncompleteBody"})


def storage_error_kind(exc: StorageError) -> str:
    """The closed set a metric label can carry: unusable, verify, transient, permanent."""
    if exc.destination_unusable:
        return "unusable"
    if exc.code in VERIFY_CODES:
        return "verify"
    return "transient" if exc.transient else "permanent"


class NotFoundError(StorageError):
    """The key (or multipart upload) does not exist."""

    def __init__(self, message: str, code: str = "NotFound") -> None:
        super().__init__(message, transient=False, code=code)


class ShortObjectError(StorageError):
    """The object ends before the range asked for: no retry will change that."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False, code="ShortObject")


class PreconditionFailedError(StorageError):
    """A conditional write lost: the key already exists."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False, code="PreconditionFailed")


@dataclass(frozen=True)
class ObjectInfo:
    """What the store reports about one object."""

    key: str
    size: int
    # The store's own checksum, in S3's form: base64 CRC-32C, "<b64>-<parts>" for a
    # composite multipart value; "" when the store reports none.
    checksum: str = ""
    etag: str = ""
    # When the store last wrote it, by the store's clock (Unix seconds; 0 when the call
    # that made this ObjectInfo does not say). Only ``head`` must fill it in.
    modified: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class PartInfo:
    """One finished part of a multipart upload."""

    number: int
    size: int
    etag: str
    crc32c: int  # of this part's bytes, as computed by ckptd and confirmed by the store


class RangeReader:
    """A file-like view of ``length`` bytes of an open file from ``offset``, read with
    ``pread`` as the HTTP client sends it; seekable, so a signer or a retry can rewind."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def __len__(self) -> int:
        return self._length

    def read(self, size: int = -1) -> bytes:
        left = self._length - self._pos
        # Exactly what was asked: awscrt's stream adapter copies into a buffer of that size.
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        data = os.pread(self._fd, n, self._offset + self._pos)
        if not data:
            raise OSError(f"file shrank while sent: no bytes at offset {self._offset + self._pos}")
        self._pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


@dataclass(frozen=True)
class FileRange:
    """A part's bytes as a range of an open file: streamed when sent, never held whole
    in memory, so memory stays bounded by concurrency x a small buffer."""

    fd: int
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length

    def reader(self) -> RangeReader:
        """A fresh reader positioned at the start (one per attempt)."""
        return RangeReader(self.fd, self.offset, self.length)


PartBody = bytes | FileRange

# A reader of a ranged GET; see Storage.stream_range.
RangeSink = Callable[[int, bytes], None]
# Large enough that per-call overhead vanishes, small enough to stay in the allocator's
# reused memory (no fresh pages faulted in per read, as with a whole 16 MiB range).
STREAM_PIECE = 1024 * 1024


def stream_body(
    read: Callable[[int], bytes], sink: RangeSink, length: int, start: int, what: str
) -> None:
    """``length`` bytes of a ranged GET's body, read in ``STREAM_PIECE`` pieces into
    ``sink`` at their offsets; a body that ends early is a transient ``IncompleteBody``."""
    pos = 0
    while pos < length:
        piece = read(min(STREAM_PIECE, length - pos))
        if not piece:
            raise StorageError(
                f"{what}: {pos} of {length} bytes at {start}, then the body ended",
                transient=True,
                code="IncompleteBody",
            )
        sink(pos, piece)
        pos += len(piece)


@runtime_checkable
class Storage(Protocol):
    """A durable destination for checkpoint objects: what every backend implements."""

    url: str

    def put_bytes(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        """Write ``data`` at ``key`` (replacing); the store checks it against ``crc32c``."""
        ...

    def get_bytes(self, key: str) -> bytes:
        """The whole object; NotFoundError if absent."""
        ...

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        """``length`` bytes from ``start``, handed to ``sink(pos, piece)`` in order, in
        pieces of at most ``STREAM_PIECE`` bytes (``pos`` counts from ``start``), so a
        reader holds one piece, never the whole range. An object that ends inside the
        range is a ShortObjectError. A retry calls the sink again from ``pos == 0``."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """Size (and the store's checksum, if it reports one) of ``key``, or None if absent."""
        ...

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, recursively."""
        ...

    def list_children(self, prefix: str) -> list[str]:
        """Names of the 'directories' directly under ``prefix`` (which ends with '/')."""
        ...

    def delete(self, keys: list[str]) -> None:
        """Remove ``keys``; absent keys are not an error."""
        ...

    def check(self) -> None:
        """Raise StorageError if the destination is unreachable or misconfigured."""
        ...


@runtime_checkable
class ConditionalWrite(Protocol):
    """Writes that succeed only where the key is absent, atomically."""

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        """Write only if ``key`` does not exist (If-None-Match: *); else PreconditionFailedError."""
        ...


@runtime_checkable
class ServerSideCopy(Protocol):
    """Copies made by the store, with no object bytes passing through this node."""

    def copy(self, src_key: str, dst_key: str) -> ObjectInfo:
        """Copy ``src_key`` to ``dst_key``, checked against the source as far as the store
        can tell (size, checksum)."""
        ...


@runtime_checkable
class MultipartUpload(Protocol):
    """Large objects sent in numbered parts, resumable after a restart."""

    def create_upload(self, key: str) -> str:
        """Start a multipart upload of ``key``; returns its id."""
        ...

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: PartBody, *, crc32c: int
    ) -> PartInfo:
        """Send part ``number`` (1-based; its bytes start at ``offset`` in the file),
        given as bytes or as a range of an open file to stream. NotFoundError if the
        upload no longer exists."""
        ...

    def complete_upload(self, key: str, upload_id: str, parts: list[PartInfo]) -> ObjectInfo:
        """Assemble the parts into the object at ``key``."""
        ...

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Discard an upload and its parts; an unknown upload is not an error."""
        ...

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """Unfinished uploads under ``prefix`` as (key, upload_id)."""
        ...


@runtime_checkable
class PartListing(Protocol):
    """The store can say which parts of a multipart upload it holds."""

    def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        """Parts the store holds for an upload, number -> (size, etag). NotFoundError if
        the upload no longer exists."""
        ...


@runtime_checkable
class StoreChecksums(Protocol):
    """The store reports a checksum of each object (``ObjectInfo.checksum``) to verify."""

    def expected_checksum(self, parts: list[PartInfo], whole_crc32c: int) -> str:
        """What ``head().checksum`` should say for an object sent as ``parts`` (an empty
        list: sent with put_bytes). No I/O."""
        ...


C = TypeVar("C")


def capability(storage: Storage, kind: type[C]) -> C | None:
    """``storage`` as a ``kind`` (ConditionalWrite, PartListing, ...) if it has that
    capability, else None."""
    return storage if isinstance(storage, kind) else None


def require_capability(storage: Storage, kind: type[C], purpose: str) -> C:
    """``storage`` as a ``kind``; a permanent StorageError, naming the destination and
    what it lacks, if it has no such capability."""
    found = capability(storage, kind)
    if found is None:
        what = (kind.__doc__ or "").strip().split("\n")[0].rstrip(".").lower()
        raise StorageError(
            f"destination {storage.url} cannot {purpose}: it lacks {kind.__name__} ({what})",
            transient=False,
            code="Unsupported",
            destination_unusable=True,
        )
    return found
