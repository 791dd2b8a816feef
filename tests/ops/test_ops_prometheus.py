"""Prometheus: the alert rules load and behave (promtool), and a real Prometheus scrapes
a real daemon that commits a checkpoint.

Needs ``promtool`` and ``prometheus`` (Debian package ``prometheus``); skips without them.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.drill.model import STAGES, DrillRecord, StageResult, drill_id
from tests.support.daemon import wait_until
from tests.support.ops import DEPLOY, hf_daemon, tool
from tests.support.writers import write_hf

RULES = DEPLOY / "prometheus" / "ckptd-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "ckptd-alerts.test.yml"
SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = {
    "CkptdSyncLagHigh",
    "CkptdUploadsFailing",
    "CkptdNoticeWithoutCommit",
    "CkptdDestinationDown",
    "CkptdNoticeSourceDown",
    "CkptdNoCheckpoint",
    "CkptdNoRecentDrill",
    "CkptdDrillSuccessRateLow",
    "CkptdDrillScheduleMissed",
    "CkptdDrillResumeFailing",
    "CkptdNodeUnhealthy",
    "CkptdHealthSourceDown",
    "CkptdDiskTooFullForNextSave",
    "CkptdLossSpike",
    "CkptdDown",
}

needs_promtool = pytest.mark.skipif(
    tool("promtool") is None, reason="promtool not installed (apt: prometheus)"
)
needs_prometheus = pytest.mark.skipif(
    tool("prometheus") is None, reason="prometheus not installed (apt: prometheus)"
)


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_alert_rules_cover_every_failure_mode() -> None:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@needs_promtool
def test_promtool_checks_the_rules_and_the_scrape_config() -> None:
    rules = _run(tool("promtool") or "", "check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"{len(ALERTS)} rules found" in rules.stdout
    config = _run(tool("promtool") or "", "check", "config", str(SCRAPE))
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_promtool_rule_unit_tests_pass() -> None:
    """Each alert fires on its failure and stays quiet otherwise (ckptd-alerts.test.yml)."""
    result = _run(tool("promtool") or "", "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


class Prometheus:
    """A real Prometheus on loopback, scraping one target every second."""

    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        self.tmp = tmp
        config = yaml.safe_load(SCRAPE.read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(RULES)]
        (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ckptd"]
        job["static_configs"] = [{"targets": [target]}]
        self.config = tmp / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        log = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                tool("prometheus") or "",
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        wait_until(self._ready, 60, "prometheus ready", interval=0.2)
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}{query}"
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def value(self, query: str, **labels: str) -> float | None:
        """The instant value of ``query`` for the series carrying ``labels``."""
        for sample in self.api("query", query=query)["result"]:
            if all(sample["metric"].get(k) == v for k, v in labels.items()):
                return float(sample["value"][1])
        return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Prometheus] = []

    def make(target: str) -> Prometheus:
        (tmp_path / "prom").mkdir(exist_ok=True)
        prom = Prometheus(tmp_path / "prom", target).start()
        started.append(prom)
        return prom

    yield make
    for prom in started:
        prom.stop()


@needs_prometheus
def test_prometheus_scrapes_the_daemon_and_sees_the_commit_counter_rise(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, prometheus_factory: Any
) -> None:
    daemon, root = hf_daemon(tmp_path, local_s3, s3_dest)
    with daemon:
        prom = prometheus_factory(f"127.0.0.1:{daemon.port}")
        # The first scrapes: the target is up, the destination is up, nothing committed.
        wait_until(lambda: prom.value('up{job="ckptd"}') == 1.0, 60, "first scrape")
        wait_until(lambda: prom.value("ckptd_destination_up") == 1.0, 30, "destination_up")
        before = prom.value("ckptd_checkpoints_committed_total", run="run1") or 0.0
        assert before == 0.0
        write_hf(root, 10)
        wait_until(
            lambda: (prom.value("ckptd_checkpoints_committed_total", run="run1") or 0) >= 1,
            60,
            "the commit counter to rise in Prometheus",
            interval=0.5,
        )
        assert prom.value("ckptd_last_committed_step", run="run1") == 10.0

        # The rule file is loaded and every alert evaluates without error against the
        # real series; none fires for a healthy daemon.
        def evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            ok = rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules)
            return rules if ok else None

        rules = wait_until(evaluated, 30, "rules evaluated", interval=0.5)
        assert {r["name"] for r in rules} == ALERTS
        assert all(r["health"] == "ok" for r in rules), rules
        assert prom.api("alerts")["alerts"] == []
        # Every Grafana panel's query is valid PromQL against the real series, and the
        # commit and step panels show the commit.
        from tests.ops.test_ops_grafana import dashboard, exprs

        for expr in exprs(dashboard()):
            concrete = (
                expr.replace("$__rate_interval", "1m")
                .replace("$instance", ".*")
                .replace("$run", ".*")
            )
            prom.api("query", query=concrete)  # raises unless status == success
        assert prom.value('max by (run) (ckptd_last_committed_step{run=~".*"})', run="run1") == 10
        assert daemon.stop() == 0


@needs_prometheus
def test_no_recent_drill_fires_in_prometheus_when_the_last_success_is_older_than_8_days(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
    prometheus_factory: Any,
) -> None:
    """The run's last passing drill, recorded in the store 9 days ago: the daemon reads it
    at start-up, exports its time, and the rule as shipped fires for the run."""
    finished = time.time() - 9 * 86400
    stages = tuple(StageResult(name, "ok", 0.5) for name in STAGES)
    old = DrillRecord(
        run_id="run1",
        drill_id=drill_id(finished - 3, "node-a"),
        kind="full",
        trigger="schedule",
        node="node-a",
        started=finished - 3,
        finished=finished,
        stages=stages,
        checkpoint="checkpoint-5",
    )
    key = f"{s3_prefix}/run1/DRILL.{old.drill_id}.json"
    s3_client.put_object(Bucket="ckpt", Key=key, Body=old.to_bytes())
    daemon, _ = hf_daemon(tmp_path, local_s3, s3_dest)
    with daemon:
        gauge = wait_until(
            lambda: daemon.metric("ckptd_drill_last_success_timestamp_seconds", run="run1"),
            30,
            "the last drill read from the store",
        )
        assert gauge == round(finished, 3)
        assert daemon.metric("ckptd_drill_stage_seconds", run="run1", stage="loaded") == 0.5
        prom = prometheus_factory(f"127.0.0.1:{daemon.port}")

        def firing() -> list[dict[str, Any]]:
            return [
                a
                for a in prom.api("alerts")["alerts"]
                if a["labels"]["alertname"] == "CkptdNoRecentDrill" and a["state"] == "firing"
            ]

        (alert,) = wait_until(firing, 60, "CkptdNoRecentDrill firing", interval=0.5)
        assert alert["labels"]["run"] == "run1" and alert["labels"]["severity"] == "warning"
        assert "ckptd drill --restore-only --run run1" in alert["annotations"]["description"]
        assert daemon.stop() == 0
