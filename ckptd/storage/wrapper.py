"""The one forwarding base for wrappers around a Storage (retries, a bandwidth cap).

A wrapper has a capability exactly when the storage it wraps has it: constructing one
composes its class with the forwarders of the inner storage's capabilities, so
``isinstance(wrapper, PartListing)`` gives the backend's own answer through any stack
of wrappers. Every forwarded call goes through ``_run``, the one method a wrapper
overrides to add its concern to every operation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from ckptd.storage.base import (
    ConditionalWrite,
    MultipartUpload,
    ObjectInfo,
    PartBody,
    PartInfo,
    PartListing,
    RangeSink,
    ServerSideCopy,
    Storage,
    StoreChecksums,
)

T = TypeVar("T")
W = TypeVar("W", bound="StorageWrapper")


class StorageWrapper:
    """Forwards the core of Storage, and each capability the inner storage has, through
    ``_run``. The operation names given to ``_run`` label retry metrics and logs. A
    subclass overrides ``_run`` only: a capability method defined on it would claim that
    capability whatever it wraps."""

    def __new__(cls: type[W], inner: Storage, *args: Any, **kwargs: Any) -> W:
        forwarders = tuple(f for kind, f in _FORWARDERS if isinstance(inner, kind))
        wrapper: W = object.__new__(_with_forwarders(cls, forwarders))
        return wrapper

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url

    def _run(self, operation: str, fn: Callable[[], T], *, sends: int | None = None) -> T:
        """Run one operation on the inner storage; ``sends`` is the number of bytes it
        uploads (None for an operation that uploads nothing)."""
        return fn()

    def put_bytes(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        return self._run(
            "put", lambda: self.inner.put_bytes(key, data, crc32c=crc32c), sends=len(data)
        )

    def get_bytes(self, key: str) -> bytes:
        return self._run("get", lambda: self.inner.get_bytes(key))

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        self._run("get", lambda: self.inner.stream_range(key, start, length, sink))

    def head(self, key: str) -> ObjectInfo | None:
        return self._run("head", lambda: self.inner.head(key))

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        # Materialised inside the operation, so a failure half-way through a listing
        # fails (and is retried as) the whole listing.
        return iter(self._run("list", lambda: list(self.inner.list_objects(prefix))))

    def list_children(self, prefix: str) -> list[str]:
        return self._run("list", lambda: self.inner.list_children(prefix))

    def delete(self, keys: list[str]) -> None:
        self._run("delete", lambda: self.inner.delete(keys))

    def check(self) -> None:
        self._run("check", self.inner.check)


# -- one forwarder per capability; mixed into a wrapper's class only where inner has it --


class _ConditionalWriteForwarder(StorageWrapper):
    def put_if_absent(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        inner = cast(ConditionalWrite, self.inner)
        return self._run(
            "put_if_absent",
            lambda: inner.put_if_absent(key, data, crc32c=crc32c),
            sends=len(data),
        )


class _ServerSideCopyForwarder(StorageWrapper):
    def copy(self, src_key: str, dst_key: str) -> ObjectInfo:
        inner = cast(ServerSideCopy, self.inner)
        return self._run("copy", lambda: inner.copy(src_key, dst_key))


class _MultipartUploadForwarder(StorageWrapper):
    def create_upload(self, key: str) -> str:
        inner = cast(MultipartUpload, self.inner)
        return self._run("create_upload", lambda: inner.create_upload(key))

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: PartBody, *, crc32c: int
    ) -> PartInfo:
        inner = cast(MultipartUpload, self.inner)
        return self._run(
            "upload_part",
            lambda: inner.upload_part(key, upload_id, number, offset, data, crc32c=crc32c),
            sends=len(data),
        )

    def complete_upload(self, key: str, upload_id: str, parts: list[PartInfo]) -> ObjectInfo:
        inner = cast(MultipartUpload, self.inner)
        return self._run("complete_upload", lambda: inner.complete_upload(key, upload_id, parts))

    def abort_upload(self, key: str, upload_id: str) -> None:
        inner = cast(MultipartUpload, self.inner)
        self._run("abort_upload", lambda: inner.abort_upload(key, upload_id))

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        inner = cast(MultipartUpload, self.inner)
        return self._run("list_uploads", lambda: inner.list_uploads(prefix))


class _PartListingForwarder(StorageWrapper):
    def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        inner = cast(PartListing, self.inner)
        return self._run("list_parts", lambda: inner.list_parts(key, upload_id))


class _StoreChecksumsForwarder(StorageWrapper):
    def expected_checksum(self, parts: list[PartInfo], whole_crc32c: int) -> str:
        # A computation, not a request: nothing to retry or to limit.
        return cast(StoreChecksums, self.inner).expected_checksum(parts, whole_crc32c)


_FORWARDERS: tuple[tuple[type, type[StorageWrapper]], ...] = (
    (ConditionalWrite, _ConditionalWriteForwarder),
    (ServerSideCopy, _ServerSideCopyForwarder),
    (MultipartUpload, _MultipartUploadForwarder),
    (PartListing, _PartListingForwarder),
    (StoreChecksums, _StoreChecksumsForwarder),
)


# (wrapper class, forwarders) -> the composed class: one class per combination, so
# ``type(a) is type(b)`` for two wrappers of the same kind of backend.
_COMPOSED: dict[tuple[type, tuple[type, ...]], type] = {}


def _with_forwarders(cls: type[W], forwarders: tuple[type[StorageWrapper], ...]) -> type[W]:
    """``cls`` with ``forwarders`` mixed in after it, so its own ``_run`` comes first."""
    if not forwarders:
        return cls
    composed = _COMPOSED.get((cls, forwarders))
    if composed is None:
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        composed = _COMPOSED.setdefault(
            (cls, forwarders), type(cls.__name__, (cls, *forwarders), namespace)
        )
    return cast(type[W], composed)
