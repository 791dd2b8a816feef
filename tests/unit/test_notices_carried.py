"""ckptd.notices.carried: a notice is carried across the daemon's restart only while it is
in force and a process it signalled still lives (the same process, not its reused pid)."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ckptd.notices import carried
from ckptd.notices.model import Notice

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


def spot(deadline_in: float | None = 120.0, kind: str = "spot") -> Notice:
    deadline = None if deadline_in is None else NOW + timedelta(seconds=deadline_in)
    return Notice(source="aws", kind=kind, id=f"{kind}:1", noticed_at=NOW, deadline=deadline)


def exited_pid() -> int:
    """A pid no process holds now (the highest free one: a unit test starts no process)."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_a_notice_whose_trainer_still_lives_is_carried_while_in_force(tmp_path: Path) -> None:
    carried.record(tmp_path, spot(), [os.getpid()])
    found = carried.load(tmp_path, NOW + timedelta(seconds=60))
    assert found is not None
    assert found[0].id == "spot:1"
    assert found[1] == [os.getpid()]
    assert carried.load(tmp_path, NOW + timedelta(seconds=121)) is None  # past its deadline


def test_a_notice_whose_every_signalled_trainer_is_gone_is_not_carried(tmp_path: Path) -> None:
    """A Slurm job requeued within the notice's deadline: the trainer that saved for it is
    gone, and the next attempt's trainer must not be taken as already signalled."""
    carried.record(tmp_path, spot(), [exited_pid()])
    assert carried.load(tmp_path, NOW + timedelta(seconds=1)) is None
    carried.record(tmp_path, spot(), [exited_pid(), os.getpid()])
    assert carried.load(tmp_path, NOW + timedelta(seconds=1)) is not None


def test_a_reused_pid_is_not_the_process_that_was_signalled(tmp_path: Path) -> None:
    carried.record(tmp_path, spot(), [os.getpid()])
    doc = json.loads((tmp_path / carried.FILE_NAME).read_text())
    doc["signalled"][0]["start"] -= 1  # the same number, an earlier process
    (tmp_path / carried.FILE_NAME).write_text(json.dumps(doc))
    assert carried.load(tmp_path, NOW + timedelta(seconds=1)) is None


def test_a_notice_that_signalled_no_one_is_carried_by_its_deadline_alone(tmp_path: Path) -> None:
    carried.record(tmp_path, spot(), [])
    assert carried.load(tmp_path, NOW + timedelta(seconds=1)) is not None
    carried.record(tmp_path, spot(deadline_in=None), [])
    assert carried.load(tmp_path, NOW + timedelta(seconds=carried.UNDATED_SECONDS - 1))
    assert carried.load(tmp_path, NOW + timedelta(seconds=carried.UNDATED_SECONDS + 1)) is None


def test_drills_and_unreadable_files_are_never_carried(tmp_path: Path) -> None:
    carried.record(tmp_path, spot(kind="drill"), [os.getpid()])
    assert not (tmp_path / carried.FILE_NAME).exists()
    (tmp_path / carried.FILE_NAME).write_text("{not json")
    assert carried.load(tmp_path, NOW) is None
    carried.forget(tmp_path)
    assert not (tmp_path / carried.FILE_NAME).exists()
