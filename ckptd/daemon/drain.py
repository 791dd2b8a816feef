"""The flush before the daemon goes away: after SIGTERM (or, for ``ckptd exec``, its
trainer's end) keep shipping until all is committed and quiet, then the retention pass
the flush's commits skipped, all within the stop's time (``shutdown_timeout``)."""

from __future__ import annotations

import asyncio
from typing import Any

from ckptd.daemon.tier_set import TierSet
from ckptd.runtime.clock import Clock

# After SIGTERM: exit once nothing is pending, uploading or being written for this long.
DRAIN_QUIET_SECONDS = 2.0
# After a SIGTERM's flush, the retention pass its commits skipped gets at most this long.
RETAIN_AT_STOP_SECONDS = 10.0


class Drain:
    """The daemon's flush before it exits (module doc).

    Invariant: ``run`` returns only when the first tier's pipeline has been idle (and,
    with many nodes, awaits no emergency announcement) for ``DRAIN_QUIET_SECONDS``, or
    the first tier's destination refuses this node, or a stop was asked for, or
    ``timeout`` ran out; retention (every tier's) runs only after a quiet flush, and
    never past the flush's deadline nor longer than ``RETAIN_AT_STOP_SECONDS``."""

    def __init__(
        self, tiers: TierSet, stop: asyncio.Event, *, timeout: float, clock: Clock, log: Any
    ) -> None:
        # The first tier's pipeline and health are waited for; retention runs in all.
        self.pipeline, self.destination = tiers.first.pipeline, tiers.first.health
        self.tiers = tiers
        self.stop = stop  # a stop asked for (SIGINT, a second SIGTERM) ends the flush
        self.timeout = timeout
        self.clock = clock
        self.log = log

    async def run(self, why: str = "sigterm") -> None:
        """Keep shipping (the trainer may be saving its emergency checkpoint right now),
        and return once all is committed and quiet, or when ``timeout`` runs out (the
        journal then keeps finished parts). ``why`` names the cause in the log
        (``ckptd exec``: "trainer_exit", its trainer ended)."""
        flushed = "flushed_on_sigterm" if why == "sigterm" else f"flushed_after_{why}"
        deadline = self.clock.monotonic() + self.timeout
        quiet_since: float | None = None
        while self.clock.monotonic() < deadline and not self.stop.is_set():
            if self.destination.refusal is not None:
                # Nothing can be flushed to a destination that refuses us (credentials,
                # no bucket); the journal keeps what was sent, and waiting out the grace
                # period helps no one. A store that is merely unreachable may come back
                # within it: that one is waited for.
                self.log.error(f"{why}_flush_impossible", error=self.destination.error)
                return
            # With many nodes, this node's share of an emergency save is idle until the
            # node with the commit record announces it: wait for that too.
            if self.pipeline.idle() and not self.pipeline.awaiting_emergency():
                quiet_since = quiet_since or self.clock.monotonic()
                if self.clock.monotonic() - quiet_since >= DRAIN_QUIET_SECONDS:
                    self.log.info(flushed)
                    await self._retain(deadline)
                    return
            else:
                quiet_since = None
            await asyncio.sleep(0.1)
        if not self.stop.is_set():
            self.log.warning(f"{why}_flush_timeout", seconds=self.timeout)

    async def _retain(self, deadline: float) -> None:
        """The retention pass the flush's commits skipped (a notice's seconds go to
        commits, not deletes), so the store holds what the policy keeps when the daemon
        is gone; within ``RETAIN_AT_STOP_SECONDS`` and what is left of the flush's time."""
        left = min(RETAIN_AT_STOP_SECONDS, deadline - self.clock.monotonic())
        if left <= 0:
            return
        try:
            await asyncio.wait_for(self.tiers.retain(), timeout=left)
        except TimeoutError:
            self.log.warning("retention_at_stop_timeout", seconds=round(left, 1))
