"""``ckptd run``'s run ledger: a ``ckptd.goodput.sidecar.SidecarLedger`` per watched run,
polled beside the main loop, told of notices, shipped every ``SHIP_SECONDS`` and at the
daemon's stop; its summary in ``/v1/status`` and the goodput metrics. ``ledger_for`` makes
it for a daemon (``ckptd.daemon.service``), or a stand-in that does nothing where the
daemon keeps no such ledger (``run --once``; ``ckptd exec``, whose recorder follows its
child instead), so the service calls it the same way either way.

Invariant: the ledger never holds the daemon back: an error while recording is logged and
the next poll goes on; the store is written by the ledger's own best-effort shipping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckptd.config import Settings
from ckptd.goodput.model import DAY_SECONDS
from ckptd.goodput.sidecar import POLL_SECONDS, SHIP_SECONDS, SidecarLedger, TrainerView
from ckptd.repository import Repository
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics

__all__ = ["NoLedger", "SidecarGoodput", "ledger_for"]


class SidecarGoodput:
    """Every watched run's ledger as the daemon beside the trainer sees it (module doc)."""

    def __init__(
        self,
        settings: Settings,
        watch_dirs: Mapping[str, Path],
        repo: Repository,
        host: str,
        *,
        emergency_committed: Callable[[], bool],
        last_committed: Callable[[str], dict[str, Any] | None],
        metrics: Metrics,
        clock: Clock,
        log: Any,
    ) -> None:
        self.metrics, self.clock, self.log = metrics, clock, log
        # With several runs a process cannot be told to one: their step reports say.
        one = len(watch_dirs) == 1
        self.ledgers = {
            run_id: SidecarLedger(
                run_id,
                watch_dir,
                repo,
                Path(settings.state.dir),
                host,
                TrainerView(
                    pidfile=settings.trainer.pidfile if one else "",
                    match=settings.trainer.match if one else "",
                    emergency_committed=emergency_committed,
                    last_committed=lambda run=run_id: last_committed(run),  # type: ignore[misc]
                ),
                clock=clock,
            )
            for run_id, watch_dir in watch_dirs.items()
        }
        self.started = False
        self.task: asyncio.Task[None] | None = None

    def begin(self) -> None:
        """Start looking, beside the main loop, until ``finish``."""
        self.task = asyncio.create_task(self.run(), name="goodput")

    async def finish(self) -> None:
        """Stop looking; mark the daemon's stop in each ledger and ship it."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.stop()

    def annotate(self, body: dict[str, Any]) -> None:
        """``/v1/status``: ``goodput`` with one watched run (``status``)."""
        goodput = self.status()
        if goodput is not None:
            body["goodput"] = goodput

    async def run(self) -> None:
        """Read each run's ledger, then look every ``POLL_SECONDS`` until cancelled."""
        for ledger in self.ledgers.values():
            await ledger.start()
        self.started = True
        shipped = self.clock.monotonic()
        while True:
            for run_id, ledger in self.ledgers.items():
                try:
                    ledger.poll()
                except OSError as exc:
                    self.log.warning("goodput_record_failed", run=run_id, error=str(exc))
            if self.clock.monotonic() - shipped >= SHIP_SECONDS:
                shipped = self.clock.monotonic()
                for ledger in self.ledgers.values():
                    await ledger.ship()
            await asyncio.sleep(POLL_SECONDS)

    def noticed(self, at: float, source: str) -> None:
        if self.started:
            for ledger in self.ledgers.values():
                ledger.noticed(at, source)

    async def stop(self) -> None:
        """The daemon stops: each ledger marks it and ships."""
        if not self.started:
            return
        for run_id, ledger in self.ledgers.items():
            try:
                ledger.poll()
                await ledger.stop()
            except OSError as exc:
                self.log.warning("goodput_record_failed", run=run_id, error=str(exc))

    def status(self) -> dict[str, Any] | None:
        """``/v1/status``'s ``goodput`` (the run and the last day) with one watched run, as
        ``ckptd exec``'s; every run's goodput metrics."""
        if not self.started:
            return None
        body = None
        now = self.clock.time()
        for run_id, ledger in self.ledgers.items():
            run = ledger.rec.summary()
            for cause, seconds in run.seconds.items():
                self.metrics.badput_seconds.labels(run=run_id, cause=cause).set(seconds)
            if run.ratio is not None:
                self.metrics.goodput_ratio.labels(run=run_id).set(run.ratio)
            if len(self.ledgers) == 1:
                day = ledger.rec.summary(since=now - DAY_SECONDS)
                body = {"run": run.to_json(), "last_24h": day.to_json()}
        return body


class NoLedger:
    """Where the daemon keeps no ledger of its own (module doc): every call does nothing."""

    def begin(self) -> None:
        pass

    async def finish(self) -> None:
        pass

    def noticed(self, at: float, source: str) -> None:
        pass

    def annotate(self, body: dict[str, Any]) -> None:
        pass


def ledger_for(service: Any, *, once: bool) -> SidecarGoodput | NoLedger:
    """The ledger of ``service`` (a ``ckptd.daemon.service.Service``, built): each watched
    run's, unless it runs ``--once`` or it says it does not observe its trainer from
    outside (``OBSERVES_TRAINER = False``: ``ckptd exec``'s)."""
    if once or not getattr(service, "OBSERVES_TRAINER", True):
        return NoLedger()
    runs, cluster, advisor = service.pipeline.runs, service.settings.cluster, service.advisor

    def emergency_committed() -> bool:
        current = service.responder.current
        return bool(current is not None and current.done.is_set())

    return SidecarGoodput(
        service.settings,
        {run_id: state.dir for run_id, state in runs.items()},
        advisor.repo,
        advisor.host if cluster.nodes == 1 else f"{advisor.host}#{cluster.rank}",
        emergency_committed=emergency_committed,
        last_committed=lambda run_id: runs[run_id].last_committed,
        metrics=service.metrics,
        clock=service.clock,
        log=service.log,
    )
