"""Retries with exponential backoff and full jitter, around any Storage.

Only ``StorageError(transient=True)`` is retried. Every retry is reported to
``on_retry`` (metrics and logs attach there), and the backoff wait ends early when
``stop`` is set, so a daemon told to exit is not held by a sleeping retry.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TypeVar

from ckptd.storage.base import Storage, StorageError
from ckptd.storage.wrapper import StorageWrapper

T = TypeVar("T")

RetryHook = Callable[[str, StorageError, int, float], None]  # operation, error, attempt, delay

# A health probe (``probe``) tries a few times, quickly: one dropped connection does not
# mark a store down, yet a store that is down is known in about a second, not after the
# ~25 s an operation's retries take (its caller asks again a few seconds later).
PROBE_ATTEMPTS = 3
PROBE_MAX_DELAY = 0.5


class RetryingStorage(StorageWrapper):
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
        super().__init__(inner)
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.on_retry = on_retry
        self.stop = stop or threading.Event()
        self._rng = rng or random.Random()

    def _run(self, operation: str, fn: Callable[[], T], *, sends: int | None = None) -> T:
        return self._retry(operation, fn, self.max_attempts, self.max_delay)

    def probe(self) -> None:
        """``check`` as a health probe (``PROBE_ATTEMPTS``, at most ``PROBE_MAX_DELAY``
        between them)."""
        self._retry(
            "check",
            self.inner.check,
            min(self.max_attempts, PROBE_ATTEMPTS),
            min(self.max_delay, PROBE_MAX_DELAY),
        )

    def _retry(self, operation: str, fn: Callable[[], T], max_attempts: int, max_delay: float) -> T:
        attempt = 1
        while True:
            try:
                return fn()
            except StorageError as exc:
                if not exc.transient or attempt >= max_attempts or self.stop.is_set():
                    raise
                # Full jitter (AWS Architecture Blog, "Exponential Backoff And Jitter"):
                # spreads retries of many parts so they do not hit a throttled store together.
                cap = min(max_delay, self.base_delay * (2 ** (attempt - 1)))
                delay = self._rng.uniform(0, cap)
                if self.on_retry is not None:
                    self.on_retry(operation, exc, attempt, delay)
                if self.stop.wait(delay):
                    raise
                attempt += 1
