"""Our own SIGTERM as a notice: under Kubernetes it is the preemption notice.

When a pod is deleted (node drain, GKE Spot preemption, scale-down) the kubelet sends
SIGTERM and waits ``terminationGracePeriodSeconds`` (30 s by default; on GKE Spot nodes
pods get at most 15 s of the node's 30 s) before SIGKILL. A sidecar that is told to stop
must flush first and exit last, so its SIGTERM is a notice with that grace as deadline.
https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-termination
https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms#termination-graceful-shutdown
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from types import FrameType
from typing import Any

import structlog

from ckptd.notices.model import Clock, Notice, utc_now

log = structlog.get_logger("ckptd.notices.sigterm")

_Handler = Callable[[int, FrameType | None], Any] | int | None


class SigtermSource:
    """Yields one ``sigterm`` notice when the process gets SIGTERM.

    The handler only records the time and sets an event (uvicorn's rule: a signal
    handler sets a flag, the main loop acts). It stays installed after the first signal,
    so a second SIGTERM cannot kill the daemon mid-flush: it calls ``on_repeat`` instead
    (when given), which should only set a flag too. ``close()`` (or the end of
    ``watch()``) restores the handler that was there before.
    """

    name = "sigterm"

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        grace: float = 30.0,
        *,
        signum: int = signal.SIGTERM,
        clock: Clock = utc_now,
        on_repeat: Callable[[], None] | None = None,
    ) -> None:
        self.grace = timedelta(seconds=grace)
        self.signum = signum
        self._loop = loop
        self._clock = clock
        self._event = asyncio.Event()
        self._received_at: datetime | None = None
        self.count = 0
        self._on_repeat = on_repeat
        self._installed_on: asyncio.AbstractEventLoop | None = None
        self._previous: _Handler = None

    @property
    def installed(self) -> bool:
        """True while our handler is in place."""
        return self._installed_on is not None

    def install(self) -> None:
        """Install the handler now (idempotent); call early to close the window."""
        if self._installed_on is not None:
            return
        loop = self._loop or asyncio.get_running_loop()
        self._previous = signal.getsignal(self.signum)
        loop.add_signal_handler(self.signum, self._on_signal)
        self._installed_on = loop

    def close(self) -> None:
        """Remove our handler and put back the previous one."""
        loop, self._installed_on = self._installed_on, None
        if loop is None:
            return
        loop.remove_signal_handler(self.signum)
        if self._previous is not None:
            signal.signal(self.signum, self._previous)

    def _on_signal(self) -> None:
        self.count += 1
        if self._received_at is None:
            self._received_at = self._clock()
        elif self._on_repeat is not None:
            self._on_repeat()  # e.g. the daemon's "stop now": only sets a flag
        self._event.set()

    async def acknowledge(self, notice: Notice) -> None:
        """Nothing to acknowledge."""

    async def watch(self) -> AsyncIterator[Notice]:
        """Yield one notice on the first SIGTERM, then wait until cancelled."""
        self.install()
        try:
            await self._event.wait()
            noticed_at = self._received_at or self._clock()
            notice = Notice(
                source="sigterm",
                kind="sigterm",
                id=f"sigterm:{noticed_at.isoformat()}",
                noticed_at=noticed_at,
                deadline=noticed_at + self.grace,
                detail={"signal": signal.Signals(self.signum).name},
            )
            # Whether it is a preemption is the daemon's decision (ckptd.notices.shutdown).
            log.warning("sigterm_received", id=notice.id)
            yield notice
            # One notice per process; later signals are absorbed while the flush runs.
            await asyncio.Event().wait()
        finally:
            self.close()
