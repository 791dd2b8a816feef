"""Pacing what a node sends its peers, so that replication yields to the trainer's traffic.

One ``Pace`` per daemon and kind of push (periodic, emergency), shared by every transfer
of that kind: each chunk waits its turn on a virtual clock advanced by its size over the
rate (a token bucket whose burst is one chunk). A rate of 0 does not pace.

Periodic replicas go at ``[peers] rate_mbit``, chosen well below the node's share of
the link, so a training step's collective traffic keeps its bandwidth; an emergency
checkpoint goes at ``[peers] emergency_rate_mbit`` (0: as fast as the link takes it):
by then the trainer has saved and stopped, and seconds decide whether the part is off
the node before it goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Pace:
    """At most ``bytes_per_second`` through ``take`` (0: no limit)."""

    def __init__(self, bytes_per_second: float, clock: Callable[[], float]) -> None:
        self.rate = bytes_per_second
        self.clock = clock
        self._next = 0.0  # when the next byte may go (monotonic seconds)

    @classmethod
    def of_mbit(cls, mbit: float, clock: Callable[[], float]) -> Pace:
        return cls(mbit * 1e6 / 8, clock)

    async def take(self, n: int) -> None:
        """Wait until ``n`` more bytes may go."""
        if self.rate <= 0:
            return
        now = self.clock()
        start = max(now, self._next)
        self._next = start + n / self.rate
        if start > now:
            await asyncio.sleep(start - now)


__all__ = ["Pace"]
