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

The store's reachability is the monitor's own probe (``StoreProbe``), not the tier set's
checks, whose answer waits for the client's timeouts. With ``[peers]`` on, the run's
peers are probed the same way (``ask_peers``: each fresh announced peer's signed
``/v1/peer/hello``): none answering for ``unreachable_seconds`` is this node cut off from
its cluster network (``peers-unreachable``), whose collectives are about to fail.

Invariant: the monitor decides, this module only carries out; a save is never started
while the responder acts on a notice or the first tier's pipeline is not idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ckptd.health.model import HealthEvent
from ckptd.health.monitor import HealthMonitor, RunView
from ckptd.notices.model import Notice, format_time
from ckptd.notices.responder import find_trainer_pids

SOURCE = "health"
# The store is probed this often with [health] on (more often with a shorter
# unreachable_seconds), and a probe unanswered as long is an outage.
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


class StoreProbe:
    """The store asked by the health monitor itself, one probe at a time, each in a thread
    of its own: a probe with no answer within ``every`` seconds is the store unreachable,
    whatever the client's own timeouts. A store that vanishes (no FIN, no RST) leaves a
    request on a kept-alive connection waiting for its read timeout, a minute or more, and
    the daemon's own checks waiting with it; the answer here comes within ``every``.

    Daemon threads: one still waiting when the daemon stops does not hold its exit.
    """

    def __init__(self, probe: Callable[[], None], every: float, monotonic: Callable[[], float]):
        self.probe, self.every, self.monotonic = probe, every, monotonic
        self.ok, self.error = True, ""
        self.asked = monotonic()
        self.started: float | None = None  # the probe in flight, since
        self.answer: tuple[bool, str] | None = None  # its answer, once it came
        self.lock = threading.Lock()

    def _run(self) -> None:
        try:
            self.probe()
            answer = (True, "")
        except Exception as exc:  # noqa: BLE001 - any failure is the store not answering
            answer = (False, str(exc) or type(exc).__name__)
        with self.lock:
            self.answer = answer

    def reading(self) -> tuple[bool, str]:
        """(reachable, why not) as of now; starts the next probe when one is due."""
        now = self.monotonic()
        with self.lock:
            answer, self.answer = self.answer, None
        if answer is not None:
            (self.ok, self.error), self.started = answer, None
        if self.started is None and now - self.asked >= self.every:
            self.asked = self.started = now
            threading.Thread(target=self._run, name="health-probe", daemon=True).start()
        if self.started is not None and now - self.started > self.every:
            return False, f"no answer to a probe within {self.every:g} s"
        return self.ok, self.error


class DaemonActions:
    """``ckptd.health.monitor.Actions`` on a built daemon (``ckptd.daemon.service``)."""

    def __init__(self, service: Any, source: HealthNoticeSource) -> None:
        self.service = service
        self.source = source
        health = service.settings.health
        self.timeout = health.save_timeout_seconds
        # The store is asked this often, so that an idle daemon (no request to fail)
        # learns of an outage well within ``unreachable_seconds``; a probe unanswered as
        # long is the store unreachable.
        every = min(PROBE_SECONDS, health.unreachable_seconds / 3)
        self.probe = StoreProbe(service.storage.probe, every, service.clock.monotonic)
        self.peer_addresses: list[str] = []  # the fresh announced peers, as of the last poll
        self.peer_probe = StoreProbe(self._ask_peers, every, service.clock.monotonic)

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.service.clock.time(), UTC)

    def saving(self) -> bool:
        return self.service.responder.current is not None or not self.service.pipeline.idle()

    def trainer_pids(self) -> list[int]:
        own = self.service.responder.trainer_pids  # ``ckptd exec``: its child's tree
        if own is not None:
            return list(own())
        trainer = self.service.settings.trainer
        with contextlib.suppress(OSError):
            return find_trainer_pids(trainer.pidfile, trainer.match)
        return []

    def notice_committed(self) -> bool:
        current = self.service.responder.current
        return current is None or current.done.is_set()

    def store(self) -> tuple[bool, str]:
        return self.probe.reading()

    def peers(self) -> tuple[bool, str] | None:
        peering = self.service.peering
        if peering is None:
            return None
        self.peer_addresses = peering.peer_addresses()  # read here, on the event loop
        return self.peer_probe.reading() if self.peer_addresses else None

    def _ask_peers(self) -> None:
        """Every peer's ``/v1/peer/hello``, signed, at once; returns at the first answer,
        raises when none answered (in the probe's thread)."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from ckptd.peers.liveness import CONNECT_SECONDS
        from ckptd.peers.source import PeerReader

        reader = PeerReader(self.service.peering.token)

        def hello(address: str) -> str:
            try:
                response = reader.request(address, "/v1/peer/hello", timeout=CONNECT_SECONDS)
                response.read()
                return "" if response.status == 200 else f"{address} answered {response.status}"
            except Exception as exc:  # noqa: BLE001 - any failure is that peer not answering
                return str(exc) or type(exc).__name__
            finally:
                reader.drop(address)

        addresses = list(self.peer_addresses)
        errors = []
        with ThreadPoolExecutor(max_workers=min(16, len(addresses) or 1)) as pool:
            for done in as_completed([pool.submit(hello, a) for a in addresses]):
                if not done.result():
                    return
                errors.append(done.result())
        raise OSError("no peer answered: " + "; ".join(errors[:3]))

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
