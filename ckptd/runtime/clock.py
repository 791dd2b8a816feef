"""The daemon's one source of time, injected wherever time is read.

Two readings, because they answer different questions: ``time()`` is wall-clock seconds
since the epoch (what a log line, a manifest, an mtime or a notice's deadline is
compared with); ``monotonic()`` only ever moves forward (what backoffs, timeouts and
durations are measured in, immune to the wall clock being stepped). Tests pass a
``ManualClock`` and move it by hand.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        ...


class SystemClock:
    """The process's real clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to: both readings advance together."""

    def __init__(self, wall: float = 1_800_000_000.0, monotonic: float = 1000.0) -> None:
        self._wall = wall
        self._monotonic = monotonic

    def time(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> None:
        self._wall += seconds
        self._monotonic += seconds


SYSTEM_CLOCK = SystemClock()
