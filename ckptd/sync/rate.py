"""The measured upload rate: bytes per second over a sliding window.

Fed from the I/O worker threads and read on the event loop, hence the lock; adding is
O(1) amortised. Time is monotonic seconds from the injected clock, or passed in (tests).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class RateMeter:
    """Bytes per second over the last ``window`` seconds."""

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        cutoff = now - self.window
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()

    def add(self, nbytes: int, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        with self._lock:
            self._samples.append((now, nbytes))
            self._expire(now)

    def rate(self, now: float | None = None) -> float | None:
        """Bytes per second, or None before anything was measured."""
        now = self._clock() if now is None else now
        with self._lock:
            self._expire(now)
            if len(self._samples) < 2:
                return None
            span = max(now - self._samples[0][0], 0.5)
            return sum(n for _, n in self._samples) / span
