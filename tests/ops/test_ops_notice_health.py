"""A daemon that cannot hear its cloud says so (issue #31): a metadata endpoint that
never answers the IMDSv2 token PUT (the hop limit from a container), one that answers
403 (IMDS turned off) and one that refuses connections each show the source down in
``/v1/status``, the metrics and ``/readyz``, with the cause in the log; a real Prometheus
scraping it has the CkptdNoticeSourceDown alert active (its firing after the ``for``
is the promtool rule test's, deploy/prometheus/ckptd-alerts.test.yml). When the endpoint
recovers the source is up again, and a spot notice is still caught."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from tests.ops.test_ops_prometheus import needs_prometheus, prometheus_factory  # noqa: F401
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.fakes.aws_imds import FakeAwsImds
from tests.support.ops import hf_daemon

POLL = 0.2  # the AWS token PUT itself times out after 2 s


def source(daemon: Daemon) -> dict[str, Any]:
    return dict(daemon.get_json("/v1/status")["notice_sources"]["aws"])


def readyz(daemon: Daemon) -> tuple[int, dict[str, Any]]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/readyz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_down(daemon: Daemon, why: str, what: str) -> dict[str, Any]:
    """The source down in status and metrics, its error containing ``why``."""
    state = wait_until(
        lambda: (s := source(daemon)) and not s["up"] and why in s["error"] and s,
        30,
        f"aws source down: {what}",
        interval=0.1,
        details=lambda: str(source(daemon)),
    )
    assert daemon.metric("ckptd_notice_source_up", source="aws") == 0.0
    return dict(state)


@needs_prometheus
def test_a_deaf_notice_source_is_loud_and_recovers(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_dest: str,
    prometheus_factory: Any,  # noqa: F811
) -> None:
    imds = FakeAwsImds()
    imds.start_in_thread()
    port = imds.port
    env = {
        "CKPTD_PREEMPTION__PROVIDER": "aws",
        "CKPTD_PREEMPTION__ENDPOINT": imds.url,
        "CKPTD_PREEMPTION__POLL_INTERVAL_SECONDS": str(POLL),
    }
    daemon, _ = hf_daemon(tmp_path, local_s3, s3_dest, env=env)
    try:
        with daemon:
            wait_until(lambda: source(daemon)["up"], 30, "aws source up")
            # A run with nothing committed yet: how long, and what its watch dir holds.
            run = wait_until(
                lambda: (
                    (r := daemon.get_json("/v1/status")["runs"]["run1"])["watch_dir_seen"] and r
                ),
                30,
                "the watch dir looked at",
            )
            assert run["watch_dir_seen"] == {"exists": True, "entries": 0, "newest": []}
            assert run["seconds_without_commit"] >= 0
            assert ("ckptd_seconds_without_commit", (("run", "run1"),)) in daemon.metrics()
            heard = daemon.metric(
                "ckptd_notice_source_last_success_timestamp_seconds", source="aws"
            )
            assert heard > 0 and daemon.metric("ckptd_notice_source_up", source="aws") == 1
            prom = prometheus_factory(f"127.0.0.1:{daemon.port}")
            wait_until(lambda: prom.value("ckptd_notice_source_up") == 1.0, 60, "scraped")

            # 1. The token PUT never answers (what a container behind a bridge sees with
            # the default hop limit): the hop limit is named with its fix, once.
            imds.set_token_mode("hang")
            imds.expire_tokens()  # the next read asks for a new token
            down = wait_down(daemon, "timeout", "token PUT hangs")
            assert down["error"] == "token: timeout"
            _, ready = wait_until(
                lambda: (r := readyz(daemon))[0] == 503 and r, 30, "/readyz says deaf"
            )
            assert "aws" in ready["notice_sources_down"], ready
            wait_until(lambda: source(daemon)["consecutive_failures"] >= 4, 30, "more timeouts")
            (hint,) = daemon.events_named("imds_token_timeout")  # not once per poll
            assert "hop limit" in hint["why"] and "http-put-response-hop-limit 2" in hint["fix"]

            def alert_active() -> bool:
                return any(
                    a["labels"]["alertname"] == "CkptdNoticeSourceDown"
                    and a["labels"].get("source") == "aws"
                    for a in prom.api("alerts")["alerts"]
                )

            wait_until(alert_active, 60, "CkptdNoticeSourceDown active in Prometheus", 0.5)
            shown = run_cli("status", config=daemon.config)
            assert shown.returncode == 0, shown.stderr
            assert "notices from aws: NOT HEARD" in shown.stdout, shown.stdout
            assert "token: timeout" in shown.stdout

            # 2. IMDS turned off: 403, said as such.
            imds.set_token_mode("forbidden")
            down = wait_down(daemon, "403", "token PUT forbidden")
            assert "turned off" in down["error"]

            # 3. Nothing listens: connections refused.
            imds.stop_thread()
            down = wait_down(daemon, "Cannot connect", "connection refused")
            assert down["last_success"] == heard or down["last_success"] >= heard
            assert "Cannot connect" in daemon.log_text()

            # 4. Back: up again, ready again, and a notice is still caught.
            imds.set_token_mode("ok")
            imds.start_in_thread(port=port)
            wait_until(lambda: source(daemon)["up"], 30, "aws source up again")
            assert daemon.metric("ckptd_notice_source_up", source="aws") == 1.0
            wait_until(lambda: readyz(daemon)[0] == 200, 30, "/readyz ready again")
            imds.trigger_spot()
            wait_until(
                lambda: daemon.get_json("/v1/preemption")["notice"], 30, "spot notice caught"
            )
            assert daemon.stop() == 0
    finally:
        imds.stop_thread()
