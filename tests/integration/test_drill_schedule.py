"""The drill's schedule (``ckptd.drill.schedule``) with a manual clock, a real responder, a
real cadence advisor and a real directory store: a drill fires at its due time and not
before, once per period; it waits while a save is in progress and while a real notice is
active, and fires once they are over; two nodes of one run looking at the same instant
make one drill, the store's conditional write deciding."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ckptd.cadence.advisor import CadenceAdvisor
from ckptd.cli.drillview import drill_line
from ckptd.config import Settings
from ckptd.drill.model import compact_time
from ckptd.drill.schedule import DrillScheduler, daemon_blockers, next_save_of
from ckptd.notices.model import Notice
from ckptd.notices.responder import Responder
from ckptd.repository import Repository, drill_claim_key
from ckptd.runtime.clock import ManualClock
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_storage

HOUR = 3600.0


class Pipeline:
    """The first tier's pipeline as the schedule sees it: its runs, and whether it is busy
    (a checkpoint written, waiting or shipping). Emergency mode as the responder drives it."""

    def __init__(self) -> None:
        self.runs = {"run1": object()}
        self.saving = False
        self.emergency = False

    def idle(self) -> bool:
        return not self.saving

    def watch_dirs(self) -> list[Path]:
        return []

    def enter_emergency(self, deadline: datetime | None, since: float | None = None) -> None:
        self.emergency = True

    def leave_emergency(self) -> None:
        self.emergency = False


class Runner:
    """Stands for the drill runner: records each drill the schedule starts."""

    host = "node-a"

    def __init__(self) -> None:
        self.drills: list[dict[str, Any]] = []
        self.busy = False

    async def drill(self, deadline: float, *, trigger: str, period: float) -> dict[str, Any]:
        self.drills.append({"deadline": deadline, "trigger": trigger, "period": period})
        return {}


def settings(**drill: Any) -> Settings:
    return Settings(
        drill={"every": "1h", "jitter": 0.5, "margin_seconds": 0, "deadline_seconds": 30, **drill}
    )


@dataclass
class Node:
    """One daemon's drill schedule and the parts it reads."""

    scheduler: DrillScheduler
    runner: Runner
    pipeline: Pipeline
    responder: Responder
    advisor: CadenceAdvisor


def node(tmp_path: Path, clock: ManualClock, config: Settings) -> Node:
    metrics = Metrics()
    pipeline = Pipeline()
    responder = Responder(config, metrics, pipeline, clock=clock)
    repo = Repository(open_storage(f"file://{tmp_path / 'store'}"))
    advisor = CadenceAdvisor(config, repo, metrics, {"run1": tmp_path / "run1"}, clock=clock)
    runner = Runner()
    scheduler = DrillScheduler(
        config,
        runner,  # type: ignore[arg-type]
        repo,
        run="run1",
        blockers=daemon_blockers(responder, pipeline, advisor, "run1"),
        clock=clock,
        log=get_logger(),
    )
    return Node(scheduler, runner, pipeline, responder, advisor)


async def test_a_scheduled_drill_fires_at_its_time_and_waits_out_a_save_and_a_notice(
    tmp_path: Path,
) -> None:
    clock = ManualClock(wall=1_800_000_000.0)
    config = settings()
    n = node(tmp_path, clock, config)
    scheduler, runner, pipeline, responder = n.scheduler, n.runner, n.pipeline, n.responder
    repo = scheduler.repo

    # Started mid-period: this period's due time may have passed before we looked; the
    # next period's drill is the first, at its due time and not a second before.
    first = scheduler.schedule.period_of(clock.time()) + HOUR
    due = scheduler.schedule.due(first)
    assert first <= due < first + 0.5 * HOUR  # within the period's first `jitter` share
    assert (await scheduler.look()).action == "wait"
    clock.advance(due - 1 - clock.time())
    assert (await scheduler.look()).action == "wait"
    assert runner.drills == []
    clock.advance(1)
    look = await scheduler.look()
    assert look.action == "drill"
    assert runner.drills == [{"deadline": 30.0, "trigger": "schedule", "period": first}]
    claim = repo.storage.get_bytes(drill_claim_key("run1", compact_time(first)))
    assert b'"host": "node-a"' in claim
    # Once per period.
    clock.advance(60)
    assert (await scheduler.look()).action == "wait"
    assert len(runner.drills) == 1

    # The next period: a save in progress holds the drill back, for as long as it lasts.
    second = first + HOUR
    clock.advance(scheduler.schedule.due(second) - clock.time())
    pipeline.saving = True
    look = await scheduler.look()
    assert (look.action, look.reason) == ("skip", "a save is in progress")
    clock.advance(5)
    assert (await scheduler.look()).action == "skip"
    assert scheduler.status()["skipping"] == "a save is in progress"
    pipeline.saving = False
    # ... and so does a real notice, until it is gone.
    now = datetime.fromtimestamp(clock.time(), UTC)
    spot = Notice("aws", "spot", "i-1", noticed_at=now, deadline=now + timedelta(seconds=120))
    assert await responder.handle(spot) is not None
    look = await scheduler.look()
    assert (look.action, look.reason) == ("skip", "a notice is active (aws spot)")
    assert len(runner.drills) == 1
    responder.clear()
    clock.advance(1)
    assert (await scheduler.look()).action == "drill"
    assert [d["period"] for d in runner.drills] == [first, second]


async def test_the_advised_next_save_within_the_margin_holds_a_drill_back(
    tmp_path: Path,
) -> None:
    clock = ManualClock(wall=1_800_000_000.0)
    config = settings(margin_seconds=600)
    n = node(tmp_path, clock, config)
    scheduler, runner, advisor = n.scheduler, n.runner, n.advisor
    period = scheduler.schedule.period_of(clock.time()) + HOUR
    clock.advance(scheduler.schedule.due(period) - clock.time())
    assert next_save_of(advisor, "run1") is None  # no routine save seen: nothing to avoid
    # A routine save whose advised successor is due 5 minutes from now: the drill waits.
    advisor.record_save("run1", "checkpoint-1", clock.time() - 4000, 2.0, 3.0, False)
    interval = advisor.refresh("run1").interval_seconds
    advisor.record_save("run1", "checkpoint-2", clock.time() + 300 - interval, 2.0, 3.0, False)
    assert next_save_of(advisor, "run1") == clock.time() + 300
    look = await scheduler.look()
    assert look.action == "skip" and "advised next save is due within 600 s" in look.reason
    # Once that save is more than the margin behind us, the drill goes ahead.
    clock.advance(300 + 601)
    assert (await scheduler.look()).action == "drill"
    assert len(runner.drills) == 1


async def test_two_nodes_looking_at_once_make_one_drill(tmp_path: Path) -> None:
    clock = ManualClock(wall=1_800_000_000.0)
    config = settings()
    first, second = node(tmp_path, clock, config), node(tmp_path, clock, config)
    a, drills_a, b, drills_b = first.scheduler, first.runner, second.scheduler, second.runner
    drills_b.host = "node-b"
    period = a.schedule.period_of(clock.time()) + HOUR
    assert b.schedule.due(period) == a.schedule.due(period)  # the same instant on each node
    clock.advance(a.schedule.due(period) - clock.time())
    looks = [await a.look(), await b.look()]
    assert [look.action for look in looks] == ["drill", "drill"]
    assert len(drills_a.drills) + len(drills_b.drills) == 1
    # Neither tries again this period.
    clock.advance(10)
    assert [(await a.look()).action, (await b.look()).action] == ["wait", "wait"]
    assert len(drills_a.drills) + len(drills_b.drills) == 1


class Log:
    """The scheduler's log lines, as events with their fields."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    warning = error = info

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.lines if name == event]


def logged_node(tmp_path: Path, clock: ManualClock, config: Settings) -> tuple[Node, Log, Metrics]:
    """A node as ``node`` builds it, with its log lines kept and its metrics readable."""
    n = node(tmp_path, clock, config)
    log, metrics = Log(), Metrics()
    n.scheduler = DrillScheduler(
        config,
        n.runner,  # type: ignore[arg-type]
        n.scheduler.repo,
        run="run1",
        blockers=daemon_blockers(n.responder, n.pipeline, n.advisor, "run1"),
        clock=clock,
        log=log,
        metrics=metrics,
    )
    return n, log, metrics


async def test_a_run_that_saves_more_often_than_the_margin_drills_in_every_period(
    tmp_path: Path,
) -> None:
    """Issue 45: with the advised interval under ``margin_seconds`` the advised next save
    is always within the margin; the drill used to wait for ever (0 drills in 3 periods,
    ``drill_skipped`` logged each time the reason flipped). Now it starts right after the
    first routine save committed after its due time, once per period, logged once."""
    clock = ManualClock(wall=1_800_000_000.0)
    n, log, _ = logged_node(tmp_path, clock, settings(margin_seconds=600))
    scheduler, runner, pipeline, advisor = n.scheduler, n.runner, n.pipeline, n.advisor
    saves = 0
    started: list[float] = []
    drill = runner.drill

    async def timed(deadline: float, *, trigger: str, period: float) -> dict[str, Any]:
        started.append(clock.time())
        return await drill(deadline, trigger=trigger, period=period)

    runner.drill = timed  # type: ignore[method-assign]

    def save() -> None:
        """A routine save every 5 s: written and shipped for 1 s, then committed."""
        nonlocal saves
        saves += 1
        advisor.record_save("run1", f"step-{saves}", clock.time() - 1, 0.5, 0.5, False)

    first = scheduler.schedule.period_of(clock.time()) + HOUR
    clock.advance(first - clock.time())
    save()
    assert (interval := advisor.refresh("run1").interval_seconds) < 600, interval
    for _ in range(3 * int(HOUR) // 5):
        pipeline.saving = True
        await scheduler.look()
        clock.advance(1)
        save()
        pipeline.saving = False
        await scheduler.look()
        clock.advance(4)
    assert [d["period"] for d in runner.drills] == [first, first + HOUR, first + 2 * HOUR]
    for period, at in zip((first, first + HOUR, first + 2 * HOUR), started, strict=True):
        # Right after the first routine save committed after the due time (every 5 s).
        assert 0 <= at - scheduler.schedule.due(period) <= 5 + 1, (period, at)
    skipped = log.named("drill_skipped")
    assert len(skipped) <= 3, skipped  # once per due time at most, however the reason flips
    assert len({s["due"] for s in skipped}) == len(skipped)
    assert log.named("drill_period_missed") == []
    assert scheduler.status()["missed_periods"] == 0


async def test_a_save_always_in_progress_holds_a_drill_back_only_so_long(tmp_path: Path) -> None:
    """A pipeline that is never idle (a trainer whose saves overlap their uploads) holds
    the drill back at most ``max_wait_seconds``, and never out of its period."""
    clock = ManualClock(wall=1_800_000_000.0)
    n, log, _ = logged_node(tmp_path, clock, settings(max_wait_seconds=120))
    scheduler, runner, pipeline = n.scheduler, n.runner, n.pipeline
    period = scheduler.schedule.period_of(clock.time()) + HOUR
    due = scheduler.schedule.due(period)
    clock.advance(due - clock.time())
    pipeline.saving = True
    while clock.time() < due + 119:
        look = await scheduler.look()
        assert (look.action, look.reason) == ("skip", "a save is in progress")
        clock.advance(1)
    clock.advance(1)
    assert (await scheduler.look()).action == "drill"
    assert [d["period"] for d in runner.drills] == [period]
    assert len(log.named("drill_skipped")) == 1
    (started,) = log.named("drill_starting")
    assert started["despite"] == "a save is in progress"


async def test_a_period_that_ends_without_its_drill_is_missed_in_status_the_log_and_a_metric(
    tmp_path: Path,
) -> None:
    """A notice for the rest of the period: its drill never starts. The period is counted
    missed (``/v1/status``, ``drill_period_missed``, ``ckptd_drill_periods_missed``) until
    a period's drill starts."""
    clock = ManualClock(wall=1_800_000_000.0)
    n, log, metrics = logged_node(tmp_path, clock, settings())
    scheduler, runner, responder = n.scheduler, n.runner, n.responder

    def missed() -> float | None:
        return metrics.registry.get_sample_value("ckptd_drill_periods_missed", {"run": "run1"})

    assert missed() == 0  # the series exists from the start: an alert can watch it
    period = scheduler.schedule.period_of(clock.time()) + HOUR
    clock.advance(scheduler.schedule.due(period) - clock.time())
    now = datetime.fromtimestamp(clock.time(), UTC)
    spot = Notice("aws", "spot", "i-1", noticed_at=now, deadline=now + timedelta(hours=2))
    assert await responder.handle(spot) is not None
    while clock.time() < period + HOUR:
        look = await scheduler.look()
        clock.advance(max(1.0, min(600.0, look.next_look - clock.time())))
    responder.clear()
    look = await scheduler.look()
    assert runner.drills == []
    assert look.period == period + HOUR
    (line,) = log.named("drill_period_missed")
    assert line["why"] == "a notice is active (aws spot)" and line["missed_in_a_row"] == 1
    status = scheduler.status()
    assert status["missed_periods"] == 1
    assert status["last_missed"]["why"] == "a notice is active (aws spot)"
    assert missed() == 1
    shown = drill_line("run1", {"drills": 0, "passed": 0}, status)  # as `ckptd status` says it
    assert "SCHEDULE MISSED 1 period(s) in a row" in shown and "aws spot" in shown
    # The next period's drill starts: the schedule is met again.
    clock.advance(scheduler.schedule.due(period + HOUR) - clock.time())
    assert (await scheduler.look()).action == "drill"
    assert missed() == 0 and scheduler.status()["missed_periods"] == 0
