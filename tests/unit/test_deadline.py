"""Deadline planning for an emergency flush: pure, bytes and rates and seconds in."""

from __future__ import annotations

import pytest

from ckptd.sync.deadline import SAFETY, may_finish_first, plan_flush

MiB = 1024 * 1024


def test_eta_is_bytes_over_rate_and_the_margin_is_what_is_left_after_it() -> None:
    plan = plan_flush(300 * MiB, 100.0 * MiB, 10.0)
    assert plan.eta_seconds == pytest.approx(3.0)
    assert plan.seconds_left == 10.0
    assert plan.margin_seconds == pytest.approx(7.0)
    assert plan.will_make_it is True


def test_a_flush_needing_more_than_the_safe_share_of_the_time_will_not_make_it() -> None:
    # Exactly the safe share makes it; a byte more does not.
    fits = int(SAFETY * 10.0 * 100 * MiB)
    assert plan_flush(fits, 100.0 * MiB, 10.0).will_make_it is True
    assert plan_flush(fits + MiB, 100.0 * MiB, 10.0).will_make_it is False
    # It would finish before the deadline itself, but not with the margin to spare.
    assert plan_flush(9 * 100 * MiB, 100.0 * MiB, 10.0).will_make_it is False


@pytest.mark.parametrize("rate", [None, 0.0])
def test_without_a_measured_rate_nothing_is_promised(rate: float | None) -> None:
    plan = plan_flush(MiB, rate, 10.0)
    assert plan.eta_seconds is None and plan.will_make_it is None and plan.margin_seconds is None


def test_without_a_deadline_there_is_an_eta_but_no_verdict() -> None:
    plan = plan_flush(50 * MiB, 100.0 * MiB, None)
    assert plan.eta_seconds == pytest.approx(0.5)
    assert plan.will_make_it is None and plan.margin_seconds is None


def test_nothing_left_to_send_makes_it_even_with_little_time() -> None:
    assert plan_flush(0, 1.0, 0.01).will_make_it is True


def test_an_older_upload_may_finish_first_only_when_both_fit() -> None:
    rate, left = 100.0 * MiB, 20.0
    assert may_finish_first(500 * MiB, 500 * MiB, rate, left)  # 10 s of 16 s usable
    assert not may_finish_first(1200 * MiB, 500 * MiB, rate, left)  # 17 s > 16 s
    # The emergency checkpoint alone fits; with the older one it would not.
    assert plan_flush(500 * MiB, rate, left).will_make_it
    assert not may_finish_first(1500 * MiB, 500 * MiB, rate, left)


@pytest.mark.parametrize(("rate", "left"), [(None, 60.0), (0.0, 60.0), (100.0 * MiB, None)])
def test_an_older_upload_never_finishes_first_when_unsure(
    rate: float | None, left: float | None
) -> None:
    assert not may_finish_first(1, 1, rate, left)
