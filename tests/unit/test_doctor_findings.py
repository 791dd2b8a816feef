"""``ckptd doctor``'s verdicts (``ckptd.doctor.findings``, ``config.control.exposed_bits``):
pure, data in, verdict out."""

from __future__ import annotations

from ckptd.config.control import exposed_bits
from ckptd.doctor.findings import (
    CLOCK_SKEW_WARN_SECONDS,
    WATCH_MIN_FREE_BYTES,
    Finding,
    clock_finding,
    clock_skew,
    document,
    exit_code,
    free_space_finding,
)


def test_any_failure_is_exit_1_and_warnings_and_skips_are_not() -> None:
    ok, warn = Finding("a", "ok", "fine"), Finding("b", "warn", "hm", "do x")
    skip, fail = Finding("c", "skip", "not checked"), Finding("d", "fail", "bad", "do y")
    assert exit_code([ok, warn, skip]) == 0
    assert exit_code([ok, warn, skip, fail]) == 1
    assert document([ok, fail])["ok"] is False and document([ok])["ok"] is True
    assert [f["check"] for f in document([ok, fail])["findings"]] == ["a", "d"]


def test_a_line_is_status_check_message_and_the_fix_unless_ok() -> None:
    assert Finding("disk", "ok", "fine", "unused").line() == "ok    disk         fine"
    assert (
        Finding("token", "fail", "readable", "chmod 600 /t", "s3").line()
        == "fail  token        [s3] readable; fix: chmod 600 /t"
    )


def test_the_stores_clock_is_judged_to_its_resolution() -> None:
    # Written between 100.0 and 100.4 by this clock; stores keep whole seconds.
    assert clock_skew(99.0, 100.0, 100.4) == 0.0  # truncated to the second: no skew
    assert clock_skew(100.4, 100.0, 100.4) == 0.0
    assert clock_skew(110.0, 100.0, 100.4) == 110.0 - 100.4
    assert clock_skew(90.0, 100.0, 100.4) == 90.0 - 99.0
    assert clock_finding(CLOCK_SKEW_WARN_SECONDS, "s3://b").status == "ok"
    ahead = clock_finding(12.0, "s3://b")
    assert ahead.status == "warn" and "12 s ahead of" in ahead.message and "chrony" in ahead.fix
    assert "behind" in clock_finding(-600.0, "s3://b").message


def test_free_space_under_the_bound_warns() -> None:
    assert (
        free_space_finding("watch dir", "/d", WATCH_MIN_FREE_BYTES, WATCH_MIN_FREE_BYTES).status
        == "ok"
    )
    low = free_space_finding("watch dir", "/d", 1 << 29, WATCH_MIN_FREE_BYTES)
    assert low.status == "warn" and "0.50 GiB free, under 10 GiB" in low.message


def test_a_token_file_is_exposed_as_ssh_judges_a_private_key() -> None:
    # Owned by the reader: group and others get nothing.
    assert exposed_bits(0o100600, True) == 0
    assert exposed_bits(0o100400, True) == 0
    assert exposed_bits(0o100644, True) == 0o044
    assert exposed_bits(0o100640, True) == 0o040
    # Read through its group (root's, group-readable: a Secret under fsGroup): others
    # get nothing.
    assert exposed_bits(0o100440, False) == 0
    assert exposed_bits(0o100444, False) == 0o004
