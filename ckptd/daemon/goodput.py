"""``ckptd run``'s run ledger: a ``ckptd.goodput.sidecar.SidecarLedger`` per watched run,
polled beside the main loop, told of notices, shipped every ``SHIP_SECONDS`` and at the
daemon's stop; its summary in ``/v1/status`` and the goodput metrics. ``ledger_for`` makes
it for a daemon (``ckptd.daemon.service``), or a stand-in that does nothing where the
daemon keeps no such ledger (``run --once``; ``ckptd exec``, whose recorder follows its
child instead), so the service calls it the same way either way.

Invariant: the ledger never holds the daemon back: an error while reading, recording or
shipping a ledger (the state dir read-only or full, the store down) is logged
(``goodput_record_failed``), counted (``ckptd_task_failures_total{task="goodput"}``) and
tried again at the next turn, and the task runs under ``ckptd.runtime.tasks.supervise``
besides; the store is written by the ledger's own best-effort shipping. So a ledger
chunk is shipped again once the fault passes, and the daemon's stop is never failed by it.
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
from ckptd.runtime.tasks import supervise

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
        drill_noticed: Callable[[], float | None] = lambda: None,
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
                    drill_noticed=drill_noticed,
                ),
                clock=clock,
            )
            for run_id, watch_dir in watch_dirs.items()
        }
        self.running: dict[str, SidecarLedger] = {}  # the ledgers read (started)
        self.task: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return bool(self.running)

    def begin(self) -> None:
        """Start looking, beside the main loop, until ``finish``."""
        self.task = asyncio.create_task(
            supervise("goodput", self.run, metrics=self.metrics, log=self.log), name="goodput"
        )

    def _failed(self, what: str, run_id: str, exc: Exception) -> None:
        self.metrics.task_failures.labels(task="goodput").inc()
        self.log.warning("goodput_record_failed", run=run_id, step=what, error=repr(exc))

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
        """Read each run's ledger, then look every ``POLL_SECONDS`` until cancelled; a
        ledger that could not be read is tried again at each shipping (module doc)."""
        await self._start_waiting()
        shipped = self.clock.monotonic()
        while True:
            for run_id, ledger in self.running.items():
                try:
                    ledger.poll()
                except Exception as exc:  # noqa: BLE001 - the module's invariant
                    self._failed("poll", run_id, exc)
            if self.clock.monotonic() - shipped >= SHIP_SECONDS:
                shipped = self.clock.monotonic()
                await self._start_waiting()
                for run_id, ledger in self.running.items():
                    try:
                        await ledger.ship()
                    except Exception as exc:  # noqa: BLE001 - the module's invariant
                        self._failed("ship", run_id, exc)
            await asyncio.sleep(POLL_SECONDS)

    async def _start_waiting(self) -> None:
        """Read the ledger of each run not read yet."""
        for run_id, ledger in self.ledgers.items():
            if run_id in self.running:
                continue
            try:
                await ledger.start()
            except Exception as exc:  # noqa: BLE001 - the module's invariant
                self._failed("start", run_id, exc)
                continue
            self.running[run_id] = ledger

    def noticed(self, at: float, source: str) -> None:
        for run_id, ledger in self.running.items():
            try:
                ledger.noticed(at, source)
            except Exception as exc:  # noqa: BLE001 - the module's invariant
                self._failed("notice", run_id, exc)

    async def stop(self) -> None:
        """The daemon stops: each ledger marks it and ships."""
        for run_id, ledger in self.running.items():
            try:
                ledger.poll()
                await ledger.stop()
            except Exception as exc:  # noqa: BLE001 - the module's invariant
                self._failed("stop", run_id, exc)

    def status(self) -> dict[str, Any] | None:
        """``/v1/status``'s ``goodput`` (the run and the last day) with one watched run, as
        ``ckptd exec``'s; every run's goodput metrics."""
        if not self.started:
            return None
        body = None
        now = self.clock.time()
        for run_id, ledger in self.running.items():
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
        drill_noticed=lambda: service.responder.drill_noticed,
        metrics=service.metrics,
        clock=service.clock,
        log=service.log,
    )
