"""A node-wide upload bandwidth cap, around any Storage.

One limiter is shared by every transfer of the daemon, so ``max_upload_mib_per_s`` caps
the node, not each part. It reserves before sending (as Go's ``rate.Limiter.Reserve``):
a part larger than the burst simply waits longer, and the long-run rate holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ckptd.storage.base import Storage
from ckptd.storage.wrapper import StorageWrapper

T = TypeVar("T")


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


class LimitedStorage(StorageWrapper):
    """Storage whose uploads (puts and parts) share one RateLimiter."""

    def __init__(self, inner: Storage, limiter: RateLimiter) -> None:
        super().__init__(inner)
        self.limiter = limiter

    def _run(self, operation: str, fn: Callable[[], T], *, sends: int | None = None) -> T:
        if sends is not None:
            self.limiter.acquire(sends)
        return fn()
