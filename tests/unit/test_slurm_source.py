"""What the Slurm notice source yields from what Slurm said (``SlurmJobSource.due``):
the job is set as if read, the clock is an argument; nothing runs."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptd.notices.slurm import SlurmError, SlurmJobSource
from ckptd.notices.slurm_job import parse_job
from tests.unit.test_slurm_job import PREEMPTED, RUNNING

END = datetime(2026, 12, 4, 21, 22, 33, tzinfo=UTC)


def source(text: str, lead: float = 32.0) -> SlurmJobSource:
    s = SlurmJobSource("1", lead=lambda: lead)
    s.job = parse_job(text, tz=UTC)
    return s


def test_the_time_limit_is_a_notice_lead_seconds_before_the_end_and_not_sooner() -> None:
    s = source(RUNNING, lead=32.0)
    assert s.due(END - timedelta(seconds=32.5)) == []
    [notice] = s.due(END - timedelta(seconds=31.5))
    assert (notice.source, notice.kind, notice.deadline) == ("slurm", "time-limit", END)
    assert notice.detail["partition"] == "low"


def test_a_longer_time_limit_moves_the_notice_and_gives_it_a_new_id() -> None:
    s = source(RUNNING)
    [first] = s.due(END)
    s.job = parse_job(
        RUNNING.replace("EndTime=2026-12-04T21:22:33", "EndTime=2026-12-04T21:52:33"), tz=UTC
    )
    assert s.due(END) == []
    [later] = s.due(END + timedelta(minutes=30))
    assert later.id != first.id


def test_a_preemption_is_a_notice_at_once_with_the_moved_end_as_deadline() -> None:
    s = source(PREEMPTED, lead=0.0)
    now = datetime(2026, 12, 4, 21, 21, 51, tzinfo=UTC)  # 1 s into the grace period
    [notice] = s.due(now)
    assert notice.kind == "preemption"
    assert notice.deadline == datetime(2026, 12, 4, 21, 22, 20, tzinfo=UTC)


def test_the_user_signal_is_a_notice_whose_deadline_is_the_end() -> None:
    s = source(RUNNING)
    early = END - timedelta(minutes=10)
    assert s.due(early) == []
    s._on_signal()
    [notice] = s.due(early)
    assert (notice.kind, notice.deadline, notice.detail["signal"]) == (
        "user-signal",
        END,
        "SIGUSR1",
    )


def test_a_notice_yielded_once_is_not_due_again() -> None:
    s = source(RUNNING)
    [notice] = s.due(END)
    s._yielded.add(notice.id)
    assert s.due(END) == []


def test_nothing_is_due_before_the_job_was_read_or_without_a_time_limit() -> None:
    s = SlurmJobSource("1", lead=lambda: 30.0)
    assert s.due(END) == []
    unlimited = source(RUNNING.replace("TimeLimit=00:01:00", "TimeLimit=UNLIMITED"))
    assert unlimited.due(END + timedelta(days=1)) == []


def test_an_unreadable_job_makes_the_source_deaf_and_a_read_brings_it_back() -> None:
    answers: list[str | None] = [None, None, None, RUNNING]

    def read(job_id: str) -> Any:
        text = answers.pop(0)
        if text is None:
            raise SlurmError("scontrol show job 1: slurm_load_jobs error: timed out")
        return parse_job(text, tz=UTC)

    s = SlurmJobSource("1", lead=lambda: 32.0, read=read)
    assert not s.health.up and not s.health.deaf  # not read yet: not up, not deaf either
    for failures in (1, 2, 3):
        asyncio.run(s._refresh())
        assert not s.health.up and s.health.consecutive_failures == failures
    assert s.health.deaf and "timed out" in s.health.error
    asyncio.run(s._refresh())
    assert s.health.up and not s.health.deaf and s.job is not None
