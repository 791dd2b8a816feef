"""A trainer left running by a ``ckptd exec`` that died (``kill -9``, OOM killer): ended
before the next exec starts its own.

The trainer runs in its own session (``ckptd.supervision.supervisor``), so the death of
its exec does not reach it: without this, the next exec would start a second trainer
writing into the same watch dir beside the first. Each start writes ``trainer.json`` in
the state dir: the process group (the trainer's PID), its start time in clock ticks since
boot (``/proc/PID/stat`` field 22) and the boot's ID; a normal end removes it.

Invariant: only a process group whose leader is that very process (same PID, same start
time, same boot) is signalled, so a PID reused by anything else is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from ckptd.runtime.processes import all_stat_fields, stat_fields

PIDFILE = "trainer.json"

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22); None when it is gone."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def record(path: Path, pid: int) -> None:
    """Note the trainer just started as ``pid`` (its own process group) in ``path``."""
    ticks = start_ticks(pid)
    if ticks is None:
        return  # already gone: nothing can be left behind
    doc = {"pgid": pid, "start_ticks": ticks, "boot_id": _boot_id()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def clear(path: Path) -> None:
    """The trainer recorded in ``path`` has ended (and its group been killed)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _group_members(pgid: int) -> list[int]:
    # A zombie (state Z) has ended already and only waits to be reaped.
    return [
        pid
        for pid, fields in all_stat_fields()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z"
    ]


def end_leftover(path: Path, log: Any, *, wait_seconds: float = 30.0) -> list[int]:
    """SIGKILL the process group recorded in ``path`` if its leader still lives (a
    previous exec died without ending it), wait until none of it runs, and forget it;
    returns the PIDs that were killed. A file that cannot be read is forgotten."""
    try:
        doc = json.loads(path.read_text())
        pgid, ticks, boot = int(doc["pgid"]), int(doc["start_ticks"]), str(doc["boot_id"])
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("trainer_pidfile_unreadable", path=str(path), error=str(exc))
        clear(path)
        return []
    if boot != _boot_id() or start_ticks(pgid) != ticks:
        clear(path)  # ended with its exec, or the machine rebooted: nothing left
        return []
    members = _group_members(pgid)
    log.warning("trainer_leftover_killed", pgid=pgid, pids=members)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + wait_seconds
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    clear(path)
    return members
