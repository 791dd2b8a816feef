"""The daemon's drill runner (``ckptd.drill.runner``) on a real directory store, with the
responder's half stood in for by its timings: a commit after the deadline fails the drill
at "committed" (nothing restored, the record written, counted as a failure, the failure
gauge set); the history read from the store sets the gauges every node shows; a second
drill asked for while one runs is refused, not queued."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from ckptd.config import Settings
from ckptd.drill.model import STAGES, DrillRecord, StageResult, drill_id
from ckptd.drill.runner import DrillBusyError, DrillRunner
from ckptd.repository import Repository
from ckptd.runtime.clock import ManualClock
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_storage


def runner(
    tmp_path: Path, notice_drill: Any, clock: ManualClock
) -> tuple[DrillRunner, Metrics, Repository]:
    storage = open_storage(f"file://{tmp_path / 'store'}")
    metrics = Metrics()
    settings = Settings(state={"dir": str(tmp_path / "state")})
    drills = DrillRunner(
        settings,
        notice_drill,
        storage,
        metrics,
        runs=["run1"],
        host="node-a",
        clock=clock,
        log=get_logger(),
    )
    return drills, metrics, Repository(storage)


def gauge(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_a_commit_after_the_deadline_fails_the_drill_at_committed_loudly(
    tmp_path: Path,
) -> None:
    clock = ManualClock()

    async def late(deadline: float) -> dict[str, Any]:
        clock.advance(deadline)  # the deadline passed with the checkpoint still uploading
        return {
            "signalled_after_s": 0.01,
            "trainer_pids": [42],
            "skipped_pids": [],
            "complete_after_s": 0.4,
            "committed_after_s": None,
            "committed_before_deadline": None,
            "checkpoint": "step-9",
            "run": "run1",
            "bytes": 0,
        }

    drills, metrics, repo = runner(tmp_path, late, clock)
    answer = await drills.drill(5.0)
    assert (answer["result"], answer["failed_stage"]) == ("failure", "committed")
    assert "not committed before the deadline" in answer["error"]
    (body,) = repo.read_drill_records("run1", 10)
    stored = json.loads(body)
    assert [s["status"] for s in stored["stages"]] == [
        "ok", "ok", "failed", "not_reached", "not_reached", "not_reached"
    ]  # fmt: skip
    assert stored["result"] == "failure" and answer["record"].endswith(f"{stored['id']}.json")
    assert not (tmp_path / "state" / "drill").exists()  # nothing was restored
    assert gauge(metrics, "ckptd_drills_total", run="run1", result="failure") == 1
    assert gauge(metrics, "ckptd_drills_total", run="run1", result="success") == 0
    assert gauge(metrics, "ckptd_drill_last_failure_timestamp_seconds", run="run1") == round(
        clock.time(), 3
    )
    assert gauge(metrics, "ckptd_drill_last_success_timestamp_seconds", run="run1") == 0
    assert drills.status()["run1"]["last"]["failed_stage"] == "committed"


async def test_the_gauges_come_from_the_runs_records_in_the_store(tmp_path: Path) -> None:
    clock = ManualClock()
    drills, metrics, repo = runner(tmp_path, None, clock)
    await drills.refresh()  # no drill yet: no series (and no alert on them)
    assert gauge(metrics, "ckptd_drill_last_success_timestamp_seconds", run="run1") is None
    for n, failed in enumerate((None, "loaded", None)):
        started = clock.time() + 100 * n
        stages = [StageResult(s, "failed" if s == failed else "ok", 1.0 + n) for s in STAGES]
        record = DrillRecord(
            "run1", drill_id(started, f"node-{n}"), "full", "schedule", f"node-{n}",
            started, started + 10, tuple(stages),
        )  # fmt: skip
        repo.write_drill_record("run1", record.drill_id, record.to_bytes())
    await drills.refresh()
    assert gauge(metrics, "ckptd_drill_last_success_timestamp_seconds", run="run1") == (
        clock.time() + 210
    )
    assert gauge(metrics, "ckptd_drill_last_failure_timestamp_seconds", run="run1") == (
        clock.time() + 110
    )
    assert gauge(metrics, "ckptd_drill_stage_seconds", run="run1", stage="loaded") == 3.0
    summary = drills.status()["run1"]
    assert (summary["drills"], summary["passed"]) == (3, 2)


async def test_a_drill_asked_for_while_one_runs_is_refused(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def slow(deadline: float) -> dict[str, Any]:
        await release.wait()
        return {"run": "run1", "signalled_after_s": None, "complete_after_s": None}

    drills, _, _ = runner(tmp_path, slow, ManualClock())
    first = asyncio.create_task(drills.drill(30.0))
    await asyncio.sleep(0)
    assert drills.busy
    with pytest.raises(DrillBusyError):
        await drills.drill(30.0)
    release.set()
    assert (await first)["failed_stage"] == "signalled"
