"""The ship queue, pure and in-process: which checkpoint ships next, the backoff after a
failure, an emergency checkpoint first, and whether an older upload is paused for it."""

from __future__ import annotations

import pytest

from ckptd.sync.queue import (
    EMERGENCY_MTIME_SLACK,
    FAILURE_BACKOFF,
    InFlight,
    Pending,
    ShipQueue,
    backoff_delay,
    completed_in_emergency,
    uploads_to_pause,
)

MiB = 1024 * 1024


def pending(
    name: str,
    step: int | None,
    *,
    run: str = "run",
    completed_at: float = 100.0,
    emergency: bool = False,
    total_bytes: int = MiB,
) -> Pending:
    return Pending(run, name, step, completed_at, emergency=emergency, total_bytes=total_bytes)


# -- ranking -----------------------------------------------------------------------------


def test_highest_step_ships_first_whatever_the_order_of_arrival() -> None:
    queue = ShipQueue()
    for step in (3, 10, 7):
        queue.add(pending(f"ck-{step}", step))
    order = []
    while (p := queue.next(now=0.0)) is not None:
        order.append(p.name)
        queue.remove(p.run, p.name)
    assert order == ["ck-10", "ck-7", "ck-3"]


def test_a_step_less_checkpoint_ships_after_every_stepped_one() -> None:
    queue = ShipQueue()
    queue.add(pending("final", None))
    queue.add(pending("ck-1", 1))
    assert queue.next(now=0.0).name == "ck-1"  # type: ignore[union-attr]


def test_same_step_the_most_recently_completed_goes_first() -> None:
    queue = ShipQueue()
    queue.add(pending("a", 5, run="r1", completed_at=10.0))
    queue.add(pending("b", 5, run="r2", completed_at=20.0))
    assert queue.next(now=0.0).name == "b"  # type: ignore[union-attr]


def test_an_emergency_checkpoint_jumps_ahead_of_higher_steps_and_other_runs() -> None:
    queue = ShipQueue()
    queue.add(pending("ck-900", 900, run="big"))
    queue.add(pending("ck-12", 12, run="small", emergency=True))
    queue.add(pending("ck-901", 901, run="big"))
    assert queue.next(now=0.0).name == "ck-12"  # type: ignore[union-attr]


def test_adding_twice_keeps_the_first_and_its_failure_count() -> None:
    queue = ShipQueue()
    first = pending("ck-1", 1)
    assert queue.add(first)
    queue.failed(first, now=0.0)
    assert not queue.add(pending("ck-1", 1, emergency=True))
    assert queue.get("run", "ck-1") is first and first.failures == 1 and not first.emergency
    assert len(queue) == 1


def test_a_queued_checkpoint_is_made_the_emergency_one_once_and_keeps_its_failures() -> None:
    queue = ShipQueue()
    first = pending("ck-1", 1)
    queue.add(first)
    queue.failed(first, now=0.0)
    assert queue.make_emergency("run", "ck-1") is first and first.emergency
    assert first.failures == 1
    assert queue.make_emergency("run", "ck-1") is None  # counted so already
    assert queue.make_emergency("run", "ck-9") is None  # not queued


# -- backoff -----------------------------------------------------------------------------


def test_backoff_doubles_from_the_base_and_stops_at_the_cap() -> None:
    base, cap = FAILURE_BACKOFF
    delays = [backoff_delay(n) for n in range(1, 12)]
    assert delays[:4] == [base, 2 * base, 4 * base, 8 * base]
    assert max(delays) == cap and delays[-1] == cap
    assert delays == sorted(delays)


def test_a_failed_checkpoint_waits_out_its_backoff_while_others_ship() -> None:
    queue = ShipQueue(backoff=(2.0, 300.0))
    newest, older = pending("ck-9", 9), pending("ck-1", 1)
    queue.add(newest)
    queue.add(older)
    assert queue.failed(newest, now=50.0) == 2.0
    assert queue.next(now=50.0) is older  # the failed one is held back...
    queue.remove("run", "ck-1")
    assert queue.next(now=51.9) is None
    assert queue.next_wakeup(now=51.0) == pytest.approx(1.0)
    assert queue.next(now=52.0) is newest  # ...and offered again when it has waited
    assert queue.failed(newest, now=52.0) == 4.0  # the second failure waits longer
    assert queue.next(now=55.9) is None and queue.next(now=56.0) is newest


def test_nothing_pending_means_no_wakeup() -> None:
    queue = ShipQueue()
    assert queue.next(now=0.0) is None and queue.next_wakeup(now=0.0) is None


def test_sync_lag_is_the_age_of_the_oldest_pending_checkpoint_of_that_run() -> None:
    queue = ShipQueue()
    queue.add(pending("a", 1, completed_at=100.0))
    queue.add(pending("b", 2, completed_at=130.0))
    queue.add(pending("c", 3, run="other", completed_at=10.0))
    assert queue.sync_lag("run", wall=160.0) == 60.0
    assert queue.sync_lag("nothing", wall=160.0) == 0.0
    assert queue.names("run") == ["a", "b"]


# -- emergency marking -------------------------------------------------------------------


def test_a_checkpoint_written_after_the_notice_is_the_emergency_one() -> None:
    notice = 1000.0
    assert completed_in_emergency(1000.5, notice)
    assert completed_in_emergency(notice - EMERGENCY_MTIME_SLACK, notice)
    assert not completed_in_emergency(notice - EMERGENCY_MTIME_SLACK - 0.01, notice)
    assert not completed_in_emergency(2000.0, None)  # no notice, no emergency


def test_emergency_bytes_count_only_emergency_checkpoints() -> None:
    queue = ShipQueue()
    queue.add(pending("a", 1, total_bytes=5 * MiB))
    queue.add(pending("b", 2, total_bytes=7 * MiB, emergency=True))
    assert queue.emergency_bytes() == 7 * MiB


# -- the pause decision ------------------------------------------------------------------


def upload(left: int, *, emergency: bool = False) -> InFlight:
    return InFlight("run", "older", total_bytes=left + 10, sent_bytes=10, emergency=emergency)


def test_an_older_upload_that_fits_with_the_emergency_one_finishes_first() -> None:
    # 100 MiB/s, 60 s left: 1 GiB + 1 GiB takes ~20 s, well inside the safety margin.
    pause, keep = uploads_to_pause([upload(1024 * MiB)], 1024 * MiB, 100.0 * MiB, 60.0)
    assert pause == [] and [u.name for u in keep] == ["older"]


def test_an_older_upload_that_would_crowd_out_the_emergency_one_is_paused() -> None:
    # 100 MiB/s, 30 s left: 2 GiB + 1 GiB needs ~31 s.
    pause, keep = uploads_to_pause([upload(2048 * MiB)], 1024 * MiB, 100.0 * MiB, 30.0)
    assert [u.name for u in pause] == ["older"] and keep == []


@pytest.mark.parametrize(("rate", "seconds_left"), [(None, 60.0), (100.0 * MiB, None)])
def test_without_a_measured_rate_or_a_deadline_the_older_upload_is_paused(
    rate: float | None, seconds_left: float | None
) -> None:
    pause, _ = uploads_to_pause([upload(MiB)], MiB, rate, seconds_left)
    assert len(pause) == 1


def test_an_emergency_upload_in_flight_is_never_paused() -> None:
    pause, keep = uploads_to_pause([upload(10**12, emergency=True)], MiB, 1.0, 1.0)
    assert pause == [] and keep == []


def test_bytes_left_never_goes_negative() -> None:
    assert InFlight("r", "n", total_bytes=10, sent_bytes=25, emergency=False).bytes_left == 0


# -- run --once's order ------------------------------------------------------------------


def _drain_in_step_order(queue: ShipQueue) -> list[str]:
    order = []
    while (p := queue.next_in_step_order(now=0.0)) is not None:
        order.append(p.name)
        queue.remove(p.run, p.name)
    return order


def test_run_once_ships_the_lowest_step_first_as_the_trainer_saved_them() -> None:
    """A backlog shipped newest first commits the older steps after LATEST moved past
    them, which reads as a rollback (issue 45): ``run --once`` keeps the trainer's order."""
    queue = ShipQueue()
    for step in (20, 10, 30):
        queue.add(pending(f"checkpoint-{step}", step))
    queue.add(pending("final", None))
    assert _drain_in_step_order(queue) == [
        "checkpoint-10",
        "checkpoint-20",
        "checkpoint-30",
        "final",
    ]


def test_run_once_still_ships_an_emergency_checkpoint_first_and_skips_backoff() -> None:
    queue = ShipQueue()
    queue.add(pending("ck-5", 5))
    queue.add(pending("ck-9", 9, emergency=True))
    failed = pending("ck-1", 1)
    queue.add(failed)
    queue.failed(failed, now=0.0)
    assert _drain_in_step_order(queue) == ["ck-9", "ck-5"]
    assert queue.next_in_step_order(now=10 * FAILURE_BACKOFF[0]) is failed
