"""The drill's pure parts (``ckptd.drill.model``, and the first three stages read from the
responder's timings): a record reads back as written and garbage is no record; the
success rate is over the last drills; the first stage that did not hold is where a drill
failed, and nothing after it ran; the schedule's due time is the same on every node and
inside the period's jitter share; the run ledger counts a drill as its own cause."""

from __future__ import annotations

import json

from ckptd.drill.model import (
    DrillRecord,
    Schedule,
    SkipLog,
    StageResult,
    blocked_reason,
    decide,
    drill_id,
    hold_seconds,
    parse_record,
    summarize,
)
from ckptd.drill.runner import notice_stages
from ckptd.goodput.model import Interval, Mark, goodput

T0 = 1_800_000_000.0


def record(started: float, failed: str | None = None, run: str = "run1") -> DrillRecord:
    stages = []
    for name in ("signalled", "complete", "committed", "restored", "verified", "loaded"):
        if failed == name:
            stages.append(StageResult(name, "failed", 0.5, f"{name} went wrong"))
        elif failed is not None and stages and stages[-1].status in ("failed", "not_reached"):
            stages.append(StageResult(name, "not_reached"))
        else:
            stages.append(StageResult(name, "ok", 0.25, ""))
    return DrillRecord(
        run_id=run,
        drill_id=drill_id(started, "node/a b"),
        kind="full",
        trigger="schedule",
        node="node-a",
        started=started,
        finished=started + 3,
        stages=tuple(stages),
        checkpoint="checkpoint-10",
        total_bytes=1234,
        error="" if failed is None else f"{failed} went wrong",
        period=T0,
        deadline_seconds=60.0,
    )


def test_a_record_reads_back_as_written_and_its_id_is_a_safe_time_ordered_key_part() -> None:
    written = record(T0, failed="verified")
    assert written.drill_id == "20270115T080000.000Z.node_a_b"
    back = parse_record(written.to_bytes())
    assert back == written
    assert back.result == "failure" and back.failed_stage == "verified"
    doc = json.loads(written.to_bytes())
    assert [s["after_s"] for s in doc["stages"]] == [0.25, 0.5, 0.75, 1.0, 1.5, None]
    assert drill_id(T0 + 0.5, "x") > drill_id(T0, "x")  # keys sort as time does


def test_anything_but_a_drill_record_is_no_record() -> None:
    good = json.loads(record(T0).to_bytes())
    for bad in (
        b"",
        b"not json",
        b"[]",
        json.dumps({**good, "format": "ckptd.drill/2"}).encode(),
        json.dumps({**good, "kind": "partial"}).encode(),
        json.dumps({**good, "started": -1}).encode(),
        json.dumps({**good, "stages": [{"stage": "teleported", "status": "ok"}]}).encode(),
        json.dumps(
            {**good, "stages": [{"stage": "loaded", "status": "ok", "seconds": "1"}]}
        ).encode(),
        json.dumps({**good, "stages": []}).encode(),
        b" " * (300 * 1024),
    ):
        assert parse_record(bad) is None, bad[:80]


def test_the_success_rate_is_over_the_last_drills() -> None:
    drills = [record(T0 + i * 100, failed="loaded" if i in (1, 4) else None) for i in range(6)]
    summary = summarize(list(reversed(drills)), last=4)  # any order in
    assert (summary.drills, summary.passed, summary.rate) == (4, 3, 0.75)
    assert summary.last == drills[-1]
    assert summary.last_success == drills[5].finished
    assert summary.last_failure == drills[4].finished
    none = summarize([], last=4)
    assert none.rate is None and none.last is None and none.last_success is None


def timings(**given: object) -> dict[str, object]:
    base: dict[str, object] = {
        "signalled_after_s": 0.01,
        "trainer_pids": [42],
        "skipped_pids": [],
        "complete_after_s": 0.5,
        "committed_after_s": 1.5,
        "committed_before_deadline": True,
        "checkpoint": "checkpoint-7",
        "bytes": 99,
    }
    return {**base, **given}


def statuses(stages: list[StageResult]) -> list[str]:
    return [f"{s.stage}:{s.status}" for s in stages]


def test_the_first_stage_that_did_not_hold_is_where_a_drill_failed() -> None:
    ok = notice_stages(timings(), "SIGUSR1")
    assert statuses(ok) == ["signalled:ok", "complete:ok", "committed:ok"]
    assert [s.seconds for s in ok] == [0.01, 0.49, 1.0]
    nobody = notice_stages(
        timings(
            signalled_after_s=None,
            trainer_pids=[],
            complete_after_s=None,
            committed_after_s=None,
            committed_before_deadline=None,
        ),
        "SIGUSR1",
    )
    assert statuses(nobody) == ["signalled:failed", "complete:not_reached", "committed:not_reached"]
    assert "no trainer found" in nobody[0].detail
    spared = notice_stages(
        timings(
            signalled_after_s=None,
            trainer_pids=[],
            skipped_pids=[7],
            complete_after_s=None,
            committed_after_s=None,
            committed_before_deadline=None,
        ),
        "SIGUSR1",
    )
    assert "handles SIGUSR1" in spared[0].detail and "[7]" in spared[0].detail
    late = notice_stages(timings(committed_after_s=None, committed_before_deadline=None), "SIGUSR1")
    assert statuses(late) == ["signalled:ok", "complete:ok", "committed:failed"]
    assert "not committed before the deadline" in late[2].detail
    # The trainer read its notice file though no process caught the signal: it saved,
    # and the drill holds (the signal is said to be skipped, not passed).
    by_file = notice_stages(timings(signalled_after_s=None, trainer_pids=[]), "SIGUSR1")
    assert statuses(by_file) == ["signalled:skipped", "complete:ok", "committed:ok"]


def test_each_periods_drill_is_due_inside_its_jitter_share_the_same_on_every_node() -> None:
    schedule = Schedule(every=7 * 86400, jitter=0.25, seed="run1")
    period = schedule.period_of(T0)
    assert period <= T0 < period + schedule.every
    dues = [schedule.due(period + k * schedule.every) - k * schedule.every for k in range(50)]
    assert all(period <= d < period + 0.25 * schedule.every for d in dues)
    assert len(set(dues)) == 50  # drawn per period
    assert Schedule(7 * 86400, 0.25, "run1").due(period) == schedule.due(period)
    assert Schedule(7 * 86400, 0.25, "run2").due(period) != schedule.due(period)
    # A due time that passed before the daemon began looking is not made up.
    due = schedule.due(period)
    look = decide(schedule, due + 1, since=due + 0.5, handled=None, blocked=None, retry=1)
    assert look.action == "wait" and look.period == period + schedule.every


def test_the_run_ledger_counts_a_drill_as_its_own_cause_not_lost_time_nor_a_preemption() -> None:
    """What ``ckptd exec`` journals around a drill: the trainer's save report, its exit,
    the restart delay and the next start-up, and the drill's interval from its notice to
    the restart. The drill takes the save and the restart; nothing is lost, nothing is
    an interruption, and the causes still sum to the wall time."""

    def interval(n: int, cause: str, start: float, end: float, basis: str) -> Interval:
        return Interval(f"w:{n}", "node-a", "w/1", cause, start, end, basis)

    records = [
        Interval("w:1", "node-a", "w/1", "productive", 0.0, 100.0, "step-report", 1, 500),
        interval(2, "save", 100.2, 101.0, "trainer"),
        interval(3, "down", 100.0, 103.0, "trainer-exit"),
        interval(4, "down", 103.0, 104.0, "exec-restart"),
        interval(5, "drill", 99.9, 104.0, "drill"),
        interval(6, "startup", 104.0, 106.0, "step-report"),
        Interval("w:7", "node-a", "w/2", "productive", 106.0, 200.0, "step-report", 500, 900),
        Mark("w:8", "node-a", "w/2", "commit", 101.5, "step-500", 500),
    ]
    run = goodput(records)
    assert run.seconds["drill"] == 104.0 - 99.9
    assert run.seconds["save"] == 0 and run.seconds["down"] == 0 and run.seconds["lost"] == 0
    assert run.seconds["startup"] == 2.0
    assert run.interruptions == []
    assert abs(sum(run.seconds.values()) - run.wall) < 1e-9


def test_saves_hold_a_due_drill_back_only_until_a_routine_save_commits_or_the_hold_ends() -> None:
    """Issue 45: a run whose advised interval (60 s) is under the margin (600 s) always
    has its next save within the margin; that used to block its drill for ever."""
    due = T0

    def why(now: float, **state: object) -> str | None:
        given = {
            "notice": None,
            "saving": False,
            "next_save_at": now + 55,  # saving every 5 s, advised every 60 s
            "last_routine_save": due - 5,
            "margin": 600.0,
            "hold": 3600.0,
            "drilling": False,
            **state,
        }
        return blocked_reason(now, due=due, **given)  # type: ignore[arg-type]

    assert why(due) == "the advised next save is due within 600 s"
    assert why(due + 4, saving=True) == "a save is in progress"
    # Right after the first routine save committed after the due time: go.
    assert why(due + 5, last_routine_save=due + 4) is None
    # However long the margin or the saves last, the hold ends them.
    assert why(due + 3600, saving=True) is None
    assert why(due + 3600) is None
    # A notice and a running drill are never waited out.
    assert why(due + 9999, notice="aws spot") == "a notice is active (aws spot)"
    assert why(due + 9999, drilling=True) == "a drill is running"


def test_the_hold_ends_inside_the_period_and_a_skip_is_said_once_per_due_time() -> None:
    schedule = Schedule(every=3600, jitter=0.9, seed="run1")
    period = schedule.period_of(T0)
    for k in range(20):
        due = schedule.due(period + k * 3600)
        assert due + hold_seconds(schedule, due, 1e9) < period + (k + 1) * 3600
    assert hold_seconds(schedule, schedule.due(period), 60) <= 60
    skips = SkipLog()
    said = [skips.first(p) for p in (period, period, period, period + 3600, period + 3600)]
    assert said == [True, False, False, True, False]


def test_a_resume_drill_reads_back_and_counts_on_its_own() -> None:
    resumed = DrillRecord(
        "run1", drill_id(T0 + 10, "n"), "restore-only", "command", "n", T0 + 10, T0 + 20,
        (
            StageResult("restored", "ok", 1.0),
            StageResult("verified", "ok", 1.0),
            StageResult("loaded", "skipped"),
            StageResult("resumed", "failed", 4.0, "2 of 5 steps: the trainer exited 3"),
        ),
        error="2 of 5 steps: the trainer exited 3",
    )  # fmt: skip
    back = parse_record(resumed.to_bytes())
    assert back is not None and back.failed_stage == "resumed"
    summary = summarize([record(T0), back], 10)
    assert (summary.drills, summary.passed, summary.rate) == (2, 1, 0.5)
    assert (summary.resumes, summary.resumes_passed, summary.last_resume_success) == (1, 0, None)
    assert summary.to_json()["resume_success_rate"] == 0.0
