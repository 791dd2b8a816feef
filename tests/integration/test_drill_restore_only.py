"""The restore-only drill (``ckptd.drill.standalone``) on a real directory store with a
checkpoint committed by ckptd's own commit, and a real trainer process resumed from it:

- a run with nothing committed (a typo) is refused, and nothing is written under it;
- with ``resume_steps`` the trainer is started from the restored checkpoint and the drill
  passes once it reports its steps (whether it then exits or has to be stopped), and
  fails at ``resumed`` when it crashes first, naming how many steps it made;
- the daemon's drill history counts those drills from the store: its success ratio, the
  resume drills' ratio and their last success, restore-only drills included."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ckptd.commit.single import commit
from ckptd.config import Settings
from ckptd.core import checksum
from ckptd.core.manifest import build_manifest
from ckptd.drill import proof
from ckptd.drill.runner import DrillRunner
from ckptd.drill.standalone import NothingToDrillError, RestoreOnlyDrill, run_restore_only
from ckptd.repository import object_key
from ckptd.runtime.clock import ManualClock
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_storage
from ckptd.storage.base import Storage

TRAINER = [sys.executable, "-m", "tests.support.trainers.resume_steps"]


def committed_store(tmp_path: Path) -> Storage:
    """A directory store holding run1/step-7 (a model file and its marker), committed."""
    storage = open_storage(f"file://{tmp_path / 'store'}")
    files = {"model.bin": b"\x01" * 4096, "COMPLETE": b"7"}
    for path, data in files.items():
        key = object_key("run1", "step-7", path)
        storage.put_bytes(key, data, crc32c=checksum.crc32c(data))
    manifest = build_manifest(
        run_id="run1",
        checkpoint="step-7",
        step=7,
        layout="marker",
        host="test",
        created_at=time.time(),
        committed_at=time.time(),
        files=[(p, len(d), checksum.to_hex(checksum.crc32c(d))) for p, d in files.items()],
        environment={},
    )
    commit(storage, manifest)
    return storage


def drill(tmp_path: Path, run: str = "run1", **resume: object) -> RestoreOnlyDrill:
    return RestoreOnlyDrill(run, None, tmp_path / "scratch", [], 60.0, **resume)  # type: ignore[arg-type]


def test_a_run_with_nothing_committed_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    storage = committed_store(tmp_path)
    with pytest.raises(NothingToDrillError, match="'nosuchrun' has no committed checkpoint"):
        run_restore_only(storage, drill(tmp_path, "nosuchrun"))
    assert list(storage.list_objects("nosuchrun/")) == []
    with pytest.raises(NothingToDrillError, match="step-8 is not committed"):
        run_restore_only(
            storage, RestoreOnlyDrill("run1", "step-8", tmp_path / "scratch", [], 60.0)
        )
    assert [o.key for o in storage.list_objects("run1/DRILL.")] == []


async def test_the_trainer_resumed_for_its_steps_and_the_daemon_counts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proof, "STOP_GRACE_SECONDS", 1.0)  # not 10 s for the one that lingers
    storage = committed_store(tmp_path)
    report = tmp_path / "report.txt"
    resume = {"resume": [*TRAINER, "--report", str(report)], "resume_steps": 5}

    # It resumes from step 7, makes its 5 steps, and exits by itself.
    record, key = run_restore_only(storage, drill(tmp_path, **resume))
    assert (record.result, key is not None) == ("success", True), record
    resumed = record.stages[-1]
    assert (resumed.stage, resumed.status) == ("resumed", "ok")
    assert "reported 5 steps (5 asked); it exited 0" in resumed.detail
    assert report.read_text() == "7 12"

    # It keeps training past them: the drill passes and stops it.
    resume["resume"] = [*TRAINER, "--ignore-steps"]
    record, _ = run_restore_only(storage, drill(tmp_path, **resume))
    assert record.result == "success", record
    assert "it was stopped (SIGTERM)" in record.stages[-1].detail

    # It crashes after 2 steps: the drill fails at resumed, saying how far it got.
    resume["resume"] = [*TRAINER, "--fail-after", "2"]
    record, _ = run_restore_only(storage, drill(tmp_path, **resume))
    assert (record.result, record.failed_stage) == ("failure", "resumed")
    assert record.error == "2 of 5 steps: the trainer exited 3: loss is nan at step 9"
    assert list((tmp_path / "scratch").iterdir()) == []

    # A restore-only drill without a resume, which passes.
    plain, _ = run_restore_only(storage, drill(tmp_path))
    assert [s.stage for s in plain.stages] == ["restored", "verified", "loaded"]

    # A daemon of the run (which ran none of them) counts them all from the store.
    metrics = Metrics()
    runner = DrillRunner(
        Settings(state={"dir": str(tmp_path / "state")}),
        None,  # type: ignore[arg-type]
        storage,
        metrics,
        runs=["run1"],
        host="node-a",
        clock=ManualClock(),
        log=get_logger(),
    )
    await runner.refresh()

    def gauge(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"run": "run1"})

    assert gauge("ckptd_drill_success_ratio") == 3 / 4
    assert gauge("ckptd_drill_resume_success_ratio") == 2 / 3
    assert gauge("ckptd_drill_last_resume_success_timestamp_seconds") == pytest.approx(
        runner.status()["run1"]["last_resume_success"]
    )
    summary = runner.status()["run1"]
    assert (summary["drills"], summary["passed"]) == (4, 3)
    assert (summary["resumes"], summary["resumes_passed"]) == (3, 2)
