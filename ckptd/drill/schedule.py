"""The drill's schedule on the running daemon (``[drill] every``): start each period's
drill at its due time, unless something blocks it, and only on one node of the run.

The times and the decision are ``ckptd.drill.model``'s (``Schedule``, ``decide``,
``blocked_reason``); here they meet the daemon. What blocks a drill is read at each
look: the responder's notice (a real one, or another node's drill followed here), the
pipeline (a checkpoint being written, complete but not committed, or uploading), the
cadence advice (the run's advised next save within ``margin_seconds``, and its last
routine save) and the runner (a drill by hand running). The pipeline and the advice only
hold a due drill back, for at most ``hold_seconds`` (so a run whose saves are always
near never starves its drill); a notice and a running drill block it. A held drill is
logged once per due time (``drill_skipped``, with the first reason).

A period that ends with its due drill never started (a notice, a running drill or a store
that refused the claim for the rest of the period) is a missed period: logged
(``drill_period_missed``, with the last reason), counted in a row in
``ckptd_drill_periods_missed{run}`` and ``/v1/status`` until a period's drill starts
(here, or on the node that claimed it), and alerted on (``CkptdDrillScheduleMissed``).

One drill per run and period across a cluster: before it starts, the node writes the
period's claim ``<run>/DRILL-PERIOD.<period>.json`` with the store's conditional write
(``Repository.claim_drill_period``), keyed by the first watched run; a node whose write
finds another's claim does not drill that period. Every node computes the same due time
(the seed is the run id), so they race for the claim, and the store decides.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ckptd.cadence.advisor import CadenceAdvisor
from ckptd.config import Settings
from ckptd.core.manifest import utc_timestamp
from ckptd.drill.model import (
    Look,
    Schedule,
    SkipLog,
    advised_next_save,
    blocked_reason,
    compact_time,
    decide,
    hold_seconds,
)
from ckptd.drill.runner import DrillBusyError, DrillRunner
from ckptd.notices.responder import Responder
from ckptd.repository import Repository
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import Storage, StorageError

# How often the scheduler looks while a due drill is blocked (and at most between looks).
LOOK_SECONDS = 1.0


class Pipeline(Protocol):
    """What the schedule asks of the first tier's pipeline: its runs, and whether a
    checkpoint is being written, waits to be shipped, or ships (not ``idle``)."""

    @property
    def runs(self) -> Mapping[str, Any]: ...

    def idle(self) -> bool: ...


def last_routine_save_of(advisor: CadenceAdvisor, run: str) -> float | None:
    """When ``run``'s last committed routine save was complete, or None (none seen)."""
    state = advisor.runs.get(run)
    if state is None:
        return None
    return max((s.at for s in state.view().saves if not s.emergency), default=None)


def next_save_of(advisor: CadenceAdvisor, run: str) -> float | None:
    """When ``run``'s next routine save is expected (the cadence advice), or None."""
    state = advisor.runs.get(run)
    if state is None:
        return None
    advice = state.advice or advisor.refresh(run)
    return advised_next_save(last_routine_save_of(advisor, run), advice.interval_seconds)


class DrillScheduler:
    """Starts the drills ``[drill] every`` asks for (module doc)."""

    def __init__(
        self,
        settings: Settings,
        runner: DrillRunner,
        repo: Repository,
        *,
        run: str,
        blockers: Callable[[], dict[str, Any]],
        clock: Clock,
        log: Any,
        metrics: Metrics | None = None,
    ) -> None:
        config = settings.drill
        self.config = config
        self.runner = runner
        self.repo = repo
        self.run_id = run
        self.blockers = blockers
        self.clock = clock
        self.log = log
        self.rank = settings.cluster.rank
        self.schedule = Schedule(config.every_seconds, config.jitter, run)
        self.since = clock.time()
        self.handled: float | None = None
        self.skips = SkipLog()
        self.last: Look | None = None
        # The period whose due drill has not started yet, and the last reason it waited.
        self.pending: tuple[float, float, str] | None = None
        self.missed = 0
        self.last_missed: dict[str, Any] | None = None
        self.missed_gauge = (
            None if metrics is None else metrics.drill_periods_missed.labels(run=run)
        )
        if self.missed_gauge is not None:
            self.missed_gauge.set(0)

    def blocked(self, now: float, due: float) -> str | None:
        """What stops the drill due at ``due`` at ``now`` (``blocked_reason``), from the
        daemon's state."""
        state = self.blockers()
        return blocked_reason(
            now,
            due=due,
            notice=state.get("notice"),
            saving=bool(state.get("saving")),
            next_save_at=state.get("next_save_at"),
            last_routine_save=state.get("last_routine_save"),
            margin=self.config.margin_seconds,
            hold=hold_seconds(self.schedule, due, self.config.max_wait_seconds),
            drilling=self.runner.busy,
        )

    async def look(self) -> Look:
        """One look: wait, skip (logged once per due time), or drill; a period that ended
        with its drill never started counted as missed."""
        now = self.clock.time()
        due = self.schedule.due(self.schedule.period_of(now))
        look = decide(
            self.schedule,
            now,
            since=self.since,
            handled=self.handled,
            blocked=self.blocked(now, due),
            retry=LOOK_SECONDS,
        )
        self.last = look
        self._count_missed(look)
        if look.action == "skip":
            self.pending = (look.period, look.due, look.reason)
            if self.skips.first(look.period):
                self.log.info(
                    "drill_skipped", run=self.run_id, due=utc_timestamp(look.due), why=look.reason
                )
        if look.action == "drill":
            await self._drill(look)
        return look

    def _count_missed(self, look: Look) -> None:
        """The pending period is missed once a look belongs to a later one."""
        if self.pending is None or look.period == self.pending[0]:
            return
        period, due, why = self.pending
        self.pending = None
        if self.handled == period:
            return
        self.missed += 1
        self.last_missed = {"due": utc_timestamp(due), "why": why}
        if self.missed_gauge is not None:
            self.missed_gauge.set(self.missed)
        self.log.error(
            "drill_period_missed",
            run=self.run_id,
            due=utc_timestamp(due),
            why=why,
            missed_in_a_row=self.missed,
        )

    def _handled(self, period: float) -> None:
        self.handled = period
        self.pending = None
        self.missed = 0
        if self.missed_gauge is not None:
            self.missed_gauge.set(0)

    async def _drill(self, look: Look) -> None:
        period = compact_time(look.period)
        claim = json.dumps(
            {"node_rank": self.rank, "host": self.runner.host, "at": self.clock.time()}
        ).encode()
        try:
            mine = await asyncio.to_thread(self.repo.claim_drill_period, self.run_id, period, claim)
        except StorageError as exc:
            self.log.warning("drill_claim_failed", run=self.run_id, period=period, error=str(exc))
            # The next look tries again, within the period.
            self.pending = (look.period, look.due, f"the claim was not written: {exc}")
            return
        self._handled(look.period)
        if not mine:
            self.log.info("drill_claimed_elsewhere", run=self.run_id, period=period)
            return
        held = self.blockers()
        despite = "a save is in progress" if held.get("saving") else ""
        self.log.info(
            "drill_starting",
            run=self.run_id,
            period=period,
            trigger="schedule",
            **({"despite": despite} if despite else {}),
        )
        try:
            await self.runner.drill(
                self.config.deadline_seconds, trigger="schedule", period=look.period
            )
        except DrillBusyError:
            self.log.info("drill_skipped", run=self.run_id, why="a drill is running")

    async def run(self) -> None:
        """Look until cancelled (the main loop's task); a look that fails is logged, and
        the schedule goes on."""
        while True:
            wait = LOOK_SECONDS
            try:
                look = await self.look()
                wait = look.next_look - self.clock.time()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a drill is never worth the daemon
                self.log.error("drill_schedule_failed", run=self.run_id, error=repr(exc))
            await asyncio.sleep(min(LOOK_SECONDS, max(0.05, wait)))

    def status(self) -> dict[str, Any]:
        """The schedule in ``/v1/status``: its period, the next due time, a skip."""
        look = self.last
        return {
            "run": self.run_id,
            "every_seconds": self.schedule.every,
            "next_due": None if look is None else utc_timestamp(look.due),
            "skipping": look.reason if look is not None and look.action == "skip" else None,
            "missed_periods": self.missed,
            "last_missed": self.last_missed,
        }


def daemon_blockers(
    responder: Responder, pipeline: Pipeline, advisor: CadenceAdvisor, run: str
) -> Callable[[], dict[str, Any]]:
    """What a scheduled drill of ``run`` waits for, read from the daemon at each look: the
    responder's notice, the first pipeline's work, the run's advised next save."""

    def blockers() -> dict[str, Any]:
        current = responder.current
        return {
            "notice": None if current is None else f"{current.notice.source} {current.notice.kind}",
            "saving": not pipeline.idle(),
            "next_save_at": next_save_of(advisor, run),
            "last_routine_save": last_routine_save_of(advisor, run),
        }

    return blockers


def build_drills(
    settings: Settings,
    responder: Responder,
    pipeline: Pipeline,
    advisor: CadenceAdvisor,
    storage: Storage,
    metrics: Metrics,
    *,
    clock: Clock,
    log: Any,
    scheduled: bool = True,
) -> tuple[DrillRunner, DrillScheduler | None]:
    """The daemon's drill runner (``ckptd drill``) and, with ``[drill] every`` (and
    ``scheduled``: not ``run --once``), its schedule, keyed by the first watched run."""
    runs = sorted(pipeline.runs)
    host = advisor.host
    host = host if settings.cluster.nodes == 1 else f"{host}#{settings.cluster.rank}"
    runner = DrillRunner(
        settings, responder.drill, storage, metrics, runs=runs, host=host, clock=clock, log=log
    )
    if settings.drill.every_seconds <= 0 or not runs or not scheduled:
        return runner, None

    blockers = daemon_blockers(responder, pipeline, advisor, runs[0])
    scheduler = DrillScheduler(
        settings,
        runner,
        Repository(storage),
        run=runs[0],
        blockers=blockers,
        clock=clock,
        log=log,
        metrics=metrics,
    )
    return runner, scheduler


__all__ = [
    "LOOK_SECONDS",
    "DrillScheduler",
    "build_drills",
    "daemon_blockers",
    "last_routine_save_of",
    "next_save_of",
]
