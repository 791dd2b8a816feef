"""The health monitor (``ckptd.health``) wired into the daemon: how a health event makes
the trainer save, reusing the responder rather than a second way to signal it.

- ``save``: a notice of source ``health`` and kind ``health-save`` goes to the responder,
  as a drill's does: the notice file (with ``detail.action = "save"``), the trainer's
  signal, the cluster's NOTICE (every node saves), emergency mode (that checkpoint ships
  first). Unlike a notice, the daemon then leaves emergency mode once that checkpoint
  committed, or after ``[health] save_timeout_seconds``, and the trainer trains on.
- ``save-and-stop``: a notice of kind ``health-stop`` from ``HealthNoticeSource``, one more
  notice source beside the cloud's: through the notice loop to the lifecycle, as any
  notice (``ckptd exec`` flushes and exits with the code launchers act on); the run
  ledger records it with source ``health``.
- ``report``: the log line, the metrics, the condition file.

Invariant: the monitor decides, this module only carries out; a save is never started
while the responder acts on a notice or the first tier's pipeline is not idle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ckptd.health.model import HealthEvent
from ckptd.health.monitor import HealthMonitor, RunView
from ckptd.notices.model import Notice, format_time
from ckptd.notices.responder import find_trainer_pids

SOURCE = "health"
# The store is probed at least this often with [health] on (at most every second).
PROBE_SECONDS = 10.0


def health_notice(event: HealthEvent, kind: str, now: datetime, seconds: float) -> Notice:
    """The notice a health event's save or stop is carried by."""
    return Notice(
        source=SOURCE,
        kind=kind,
        id=f"health:{event.kind}:{format_time(now)}",
        noticed_at=now,
        deadline=now + timedelta(seconds=seconds),
        detail={
            "action": "save" if kind == "health-save" else "save-and-stop",
            "event": event.kind,
            "severity": event.severity,
            "message": event.message,
        },
    )


class HealthNoticeSource:
    """The notices of ``save-and-stop`` events, for the notice loop."""

    name = SOURCE

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Notice] = asyncio.Queue()

    async def watch(self) -> AsyncIterator[Notice]:
        while True:
            yield await self.queue.get()

    async def acknowledge(self, notice: Notice) -> None:
        return None


class DaemonActions:
    """``ckptd.health.monitor.Actions`` on a built daemon (``ckptd.daemon.service``)."""

    def __init__(self, service: Any, source: HealthNoticeSource) -> None:
        self.service = service
        self.source = source
        health = service.settings.health
        self.timeout = health.save_timeout_seconds
        # The store is asked this often at least, so that an idle daemon (no request to
        # fail) learns of an outage well within ``unreachable_seconds``.
        self.probe_every = min(PROBE_SECONDS, health.unreachable_seconds / 3)
        self.asked = service.clock.monotonic()

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.service.clock.time(), UTC)

    def saving(self) -> bool:
        return self.service.responder.current is not None or not self.service.pipeline.idle()

    def trainer_pids(self) -> list[int]:
        trainer = self.service.settings.trainer
        with contextlib.suppress(OSError):
            return find_trainer_pids(trainer.pidfile, trainer.match)
        return []

    def store(self) -> tuple[bool, str]:
        destination = self.service.destination
        now = self.service.clock.monotonic()
        if now - self.asked >= self.probe_every:
            self.asked = now
            # The tier set's rechecks probe a suspected store at their next round
            # (``ckptd.daemon.tier_set``): no second way to ask it.
            destination.suspected.set()
        return bool(destination.ok), str(destination.error or "")

    def runs(self) -> dict[str, RunView]:
        out = {}
        for run_id, state in self.service.pipeline.runs.items():
            last = state.last_committed or {}
            size = last.get("bytes")
            out[run_id] = RunView(Path(state.dir), size if isinstance(size, int) else None)
        return out

    async def save(self, event: HealthEvent) -> bool:
        responder = self.service.responder
        response = await responder.handle(
            health_notice(event, "health-save", self._now(), self.timeout)
        )
        if response is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(response.done.wait(), timeout=self.timeout)
        if responder.current is response:
            responder.clear()  # the trainer trains on: the notice file goes
        return response.committed is not None

    async def stop(self, event: HealthEvent) -> None:
        self.source.queue.put_nowait(health_notice(event, "health-stop", self._now(), self.timeout))


def build_health(service: Any) -> tuple[HealthMonitor | None, HealthNoticeSource | None]:
    """The monitor and its notice source for ``service``; (None, None) with ``[health]``
    off."""
    settings = service.settings
    if not settings.health.enabled:
        return None, None
    source = HealthNoticeSource()
    monitor = HealthMonitor(
        settings.health,
        settings.health.condition_path(Path(settings.state.dir)),
        DaemonActions(service, source),
        service.metrics,
        wall=service.clock.time,
        log=service.log,
    )
    return monitor, source
