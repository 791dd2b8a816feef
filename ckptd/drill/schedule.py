"""The drill's schedule on the running daemon (``[drill] every``): start each period's
drill at its due time, unless something blocks it, and only on one node of the run.

The times and the decision are ``ckptd.drill.model``'s (``Schedule``, ``decide``,
``blocked_reason``); here they meet the daemon. What blocks a drill is read at each
look: the responder's notice (a real one, or another node's drill followed here), the
pipeline (a checkpoint being written, complete but not committed, or uploading), the
cadence advice (the run's advised next save within ``margin_seconds``) and the runner (a
drill by hand running). Each skip is logged once per period and reason.

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


def next_save_of(advisor: CadenceAdvisor, run: str) -> float | None:
    """When ``run``'s next routine save is expected (the cadence advice), or None."""
    state = advisor.runs.get(run)
    if state is None:
        return None
    routine = [s.at for s in state.view().saves if not s.emergency]
    advice = state.advice or advisor.refresh(run)
    return advised_next_save(max(routine, default=None), advice.interval_seconds)


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

    def blocked(self, now: float) -> str | None:
        """What stops a drill at ``now`` (``blocked_reason``), from the daemon's state."""
        state = self.blockers()
        return blocked_reason(
            now,
            notice=state.get("notice"),
            saving=bool(state.get("saving")),
            next_save_at=state.get("next_save_at"),
            margin=self.config.margin_seconds,
            drilling=self.runner.busy,
        )

    async def look(self) -> Look:
        """One look: wait, skip (logged once per period and reason), or drill."""
        now = self.clock.time()
        look = decide(
            self.schedule,
            now,
            since=self.since,
            handled=self.handled,
            blocked=self.blocked(now),
            retry=LOOK_SECONDS,
        )
        self.last = look
        if look.action == "skip" and self.skips.first(look.period, look.reason):
            self.log.info(
                "drill_skipped", run=self.run_id, due=utc_timestamp(look.due), why=look.reason
            )
        if look.action == "drill":
            await self._drill(look)
        return look

    async def _drill(self, look: Look) -> None:
        period = compact_time(look.period)
        claim = json.dumps(
            {"node_rank": self.rank, "host": self.runner.host, "at": self.clock.time()}
        ).encode()
        try:
            mine = await asyncio.to_thread(self.repo.claim_drill_period, self.run_id, period, claim)
        except StorageError as exc:
            self.log.warning("drill_claim_failed", run=self.run_id, period=period, error=str(exc))
            return  # the next look tries again, within the period
        self.handled = look.period
        if not mine:
            self.log.info("drill_claimed_elsewhere", run=self.run_id, period=period)
            return
        self.log.info("drill_starting", run=self.run_id, period=period, trigger="schedule")
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
        settings, runner, Repository(storage), run=runs[0], blockers=blockers, clock=clock, log=log
    )
    return runner, scheduler


__all__ = ["LOOK_SECONDS", "DrillScheduler", "build_drills", "daemon_blockers", "next_save_of"]
