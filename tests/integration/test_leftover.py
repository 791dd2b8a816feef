"""``ckptd.supervision.leftover``: a trainer its exec left behind is ended; nothing else is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ckptd.supervision import leftover


class Events:
    """What ``end_leftover`` logged, by event name."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.seen.append((event, fields))

    def names(self) -> list[str]:
        return [name for name, _ in self.seen]


def _group_with_a_child() -> subprocess.Popen[bytes]:
    """A process leading its own session with a child in its group, as a trainer under
    a launcher is."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _wait_for_child(pgid: int) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        members = leftover._group_members(pgid)
        if len(members) >= 2:
            return members
        time.sleep(0.02)
    raise AssertionError(f"the child of {pgid} never started")


def test_a_recorded_group_still_running_is_killed_whole(tmp_path: Path) -> None:
    pidfile = tmp_path / leftover.PIDFILE
    proc = _group_with_a_child()
    try:
        members = _wait_for_child(proc.pid)
        leftover.record(pidfile, proc.pid)
        events = Events()
        killed = leftover.end_leftover(pidfile, events)
        assert sorted(killed) == sorted(members)
        assert proc.wait(timeout=30) == -9
        assert leftover._group_members(proc.pid) == []  # the child too
        assert events.names() == ["trainer_leftover_killed"]
        assert not pidfile.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    pidfile = tmp_path / leftover.PIDFILE
    proc = _group_with_a_child()
    try:
        _wait_for_child(proc.pid)
        leftover.record(pidfile, proc.pid)
        doc = json.loads(pidfile.read_text())
        # The same PID, started at another time: another process.
        pidfile.write_text(json.dumps({**doc, "start_ticks": doc["start_ticks"] - 1}))
        assert leftover.end_leftover(pidfile, Events()) == []
        # Or the same numbers from before a reboot.
        leftover.record(pidfile, proc.pid)
        doc = json.loads(pidfile.read_text())
        pidfile.write_text(json.dumps({**doc, "boot_id": "another boot"}))
        assert leftover.end_leftover(pidfile, Events()) == []
        assert proc.poll() is None and len(leftover._group_members(proc.pid)) == 2
        assert not pidfile.exists()
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_an_ended_trainer_or_an_unreadable_file_is_forgotten(tmp_path: Path) -> None:
    pidfile = tmp_path / leftover.PIDFILE
    assert leftover.end_leftover(pidfile, Events()) == []  # none recorded
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    pidfile.write_text(json.dumps({"pgid": proc.pid, "start_ticks": 1, "boot_id": "x"}))
    assert leftover.end_leftover(pidfile, Events()) == []
    assert not pidfile.exists()
    pidfile.write_text("{not json")
    events = Events()
    assert leftover.end_leftover(pidfile, events) == []
    assert events.names() == ["trainer_pidfile_unreadable"]
    assert not pidfile.exists()
