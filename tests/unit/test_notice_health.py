"""A notice source's health (``ckptd.notices.health``): up only while its reads work."""

from __future__ import annotations


def test_notice_source_health_is_up_only_while_no_read_fails() -> None:
    from ckptd.notices.health import DEAF_AFTER_FAILURES, SourceHealth

    health = SourceHealth("aws", wall=lambda: 1000.0)
    assert not health.up and not health.deaf  # no read yet: down, but not deaf
    health.succeeded("spot")
    assert health.up and health.last_success == 1000.0
    for _ in range(DEAF_AFTER_FAILURES):
        health.failed("token", "timeout")
    assert not health.up and health.deaf and health.error == "token: timeout"
    health.failed("compute-name", "HTTP 404")  # Azure's name lookup: not deafening
    assert health.consecutive_failures == DEAF_AFTER_FAILURES
    health.succeeded("token")
    assert health.up and health.consecutive_failures == 0 and health.error == ""
