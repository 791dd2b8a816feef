"""Retries with exponential backoff and full jitter, around any Storage.

Only ``StorageError(transient=True)`` is retried. Every retry is reported to
``on_retry`` (metrics and logs attach there), and the backoff wait ends early when
``stop`` is set, so a daemon told to exit is not held by a sleeping retry.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ckptd.storage.base import ObjectInfo, PartBody, PartInfo, RangeSink, Storage, StorageError

T = TypeVar("T")

RetryHook = Callable[[str, StorageError, int, float], None]  # operation, error, attempt, delay


class RetryingStorage:
    """Storage whose transient failures are retried up to ``max_attempts`` times."""

    def __init__(
        self,
        inner: Storage,
        *,
        max_attempts: int = 8,
        base_delay: float = 0.2,
        max_delay: float = 20.0,
        on_retry: RetryHook | None = None,
        stop: threading.Event | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.on_retry = on_retry
        self.stop = stop or threading.Event()
        self._rng = rng or random.Random()

    def _run(self, operation: str, fn: Callable[[], T]) -> T:
        attempt = 1
        while True:
            try:
                return fn()
            except StorageError as exc:
                if not exc.transient or attempt >= self.max_attempts or self.stop.is_set():
                    raise
                # Full jitter (AWS Architecture Blog, "Exponential Backoff And Jitter"):
                # spreads retries of many parts so they do not hit a throttled store together.
                cap = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
                delay = self._rng.uniform(0, cap)
                if self.on_retry is not None:
                    self.on_retry(operation, exc, attempt, delay)
                if self.stop.wait(delay):
                    raise
                attempt += 1

    def put_bytes(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        return self._run("put", lambda: self.inner.put_bytes(key, data, crc32c=crc32c))

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        return self._run(
            "put_if_absent", lambda: self.inner.put_if_absent(key, data, crc32c=crc32c)
        )

    def get_bytes(self, key: str) -> bytes:
        return self._run("get", lambda: self.inner.get_bytes(key))

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        self._run("get", lambda: self.inner.stream_range(key, start, length, sink))

    def head(self, key: str) -> ObjectInfo | None:
        return self._run("head", lambda: self.inner.head(key))

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        # Materialised so a failure half-way through a listing is retried whole.
        return iter(self._run("list", lambda: list(self.inner.list_objects(prefix))))

    def list_children(self, prefix: str) -> list[str]:
        return self._run("list", lambda: self.inner.list_children(prefix))

    def delete(self, keys: list[str]) -> None:
        self._run("delete", lambda: self.inner.delete(keys))

    def copy(self, src_key: str, dst_key: str) -> ObjectInfo:
        return self._run("copy", lambda: self.inner.copy(src_key, dst_key))

    def check(self) -> None:
        self._run("check", self.inner.check)

    def create_upload(self, key: str) -> str:
        return self._run("create_upload", lambda: self.inner.create_upload(key))

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: PartBody, *, crc32c: int
    ) -> PartInfo:
        return self._run(
            "upload_part",
            lambda: self.inner.upload_part(key, upload_id, number, offset, data, crc32c=crc32c),
        )

    def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]] | None:
        return self._run("list_parts", lambda: self.inner.list_parts(key, upload_id))

    def complete_upload(self, key: str, upload_id: str, parts: list[PartInfo]) -> ObjectInfo:
        return self._run(
            "complete_upload", lambda: self.inner.complete_upload(key, upload_id, parts)
        )

    def abort_upload(self, key: str, upload_id: str) -> None:
        self._run("abort_upload", lambda: self.inner.abort_upload(key, upload_id))

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        return self._run("list_uploads", lambda: self.inner.list_uploads(prefix))

    def expected_checksum(self, parts: list[PartInfo], whole_crc32c: int) -> str:
        return self.inner.expected_checksum(parts, whole_crc32c)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
