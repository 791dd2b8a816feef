"""A node-wide upload bandwidth cap, around any Storage.

One limiter is shared by every transfer of the daemon, so ``max_upload_mib_per_s`` caps
the node, not each part. It reserves before sending (as Go's ``rate.Limiter.Reserve``):
a part larger than the burst simply waits longer, and the long-run rate holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ckptd.storage.base import ObjectInfo, PartBody, PartInfo, RangeSink, Storage


class RateLimiter:
    """Thread-safe token bucket in bytes per second; 0 means unlimited."""

    def __init__(
        self,
        bytes_per_second: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        self.rate = float(bytes_per_second)
        self.burst = self.rate  # one second's worth
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` of budget now; returns how long the caller must wait first."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            return max(0.0, -self._tokens / self.rate)

    def acquire(self, nbytes: int) -> None:
        """Block until ``nbytes`` may be sent."""
        wait = self.reserve(nbytes)
        if wait > 0:
            self._sleep(wait)


class LimitedStorage:
    """Storage whose uploads (puts and parts) share one RateLimiter."""

    def __init__(self, inner: Storage, limiter: RateLimiter) -> None:
        self.inner = inner
        self.url = inner.url
        self.limiter = limiter

    def put_bytes(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        self.limiter.acquire(len(data))
        return self.inner.put_bytes(key, data, crc32c=crc32c)

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        self.limiter.acquire(len(data))
        return self.inner.put_if_absent(key, data, crc32c=crc32c)

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: PartBody, *, crc32c: int
    ) -> PartInfo:
        self.limiter.acquire(len(data))
        return self.inner.upload_part(key, upload_id, number, offset, data, crc32c=crc32c)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        self.inner.stream_range(key, start, length, sink)

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list_objects(prefix)

    def list_children(self, prefix: str) -> list[str]:
        return self.inner.list_children(prefix)

    def delete(self, keys: list[str]) -> None:
        self.inner.delete(keys)

    def copy(self, src_key: str, dst_key: str) -> ObjectInfo:
        return self.inner.copy(src_key, dst_key)

    def check(self) -> None:
        self.inner.check()

    def create_upload(self, key: str) -> str:
        return self.inner.create_upload(key)

    def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]] | None:
        return self.inner.list_parts(key, upload_id)

    def complete_upload(self, key: str, upload_id: str, parts: list[PartInfo]) -> ObjectInfo:
        return self.inner.complete_upload(key, upload_id, parts)

    def abort_upload(self, key: str, upload_id: str) -> None:
        self.inner.abort_upload(key, upload_id)

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        return self.inner.list_uploads(prefix)

    def expected_checksum(self, parts: list[PartInfo], whole_crc32c: int) -> str:
        return self.inner.expected_checksum(parts, whole_crc32c)
