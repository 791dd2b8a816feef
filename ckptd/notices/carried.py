"""A notice carried across the daemon's restart: ``<state dir>/notice.json``.

One notice, one signal. A daemon killed while it handles a notice (an OOM kill in the
save burst, say) and restarted at once by systemd or the pod would otherwise hear the
same notice again from its source, signal the trainer a second time (a trainer that saves
on each signal then writes a second emergency checkpoint inside the same window), and
remove the notice file the trainer is reading as stale. So the responder records each
notice it acts on here (``record``), after the signal; a daemon that starts while that
notice is still in force (``load``: its deadline not passed, or noticed within
``UNDATED_SECONDS`` when it has none) keeps the notice file, takes the notice as handled
(its source's repeats are the same id: never signalled again) and carries on in emergency
mode from the notice's own time, so the checkpoint written since then still goes first
and its upload resumes from the journal. Drills and health saves are never carried.

A notice is carried only while a process it signalled still lives (its pid with the start
it had then, so never a later process given the same number): when every one is gone,
the trainer that saved for it went with it (a Slurm job requeued, a node's whole pod
restarted), and the next trainer is a new start, not the same save's. A notice that
signalled no one is carried while in force.

Written atomically (``ckptd.core.handoff.replace_json``); a file that does not parse is
no notice. Blocking; small.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ckptd.core.handoff import replace_json
from ckptd.notices.model import Notice
from ckptd.runtime.processes import start_ticks

FILE_NAME = "notice.json"
# Notices the daemon ends itself once their checkpoint committed (a drill, a health save,
# ``ckptd.daemon.health_loop``): a restart ends them too, so they are never carried.
ENDS_BY_ITSELF = frozenset({"drill", "health-save"})
# A notice without a deadline is carried this long after it was noticed.
UNDATED_SECONDS = 600.0


def record(state_dir: Path, notice: Notice, pids: list[int]) -> None:
    """Remember ``notice`` as acted on (``pids``: the processes signalled for it)."""
    if notice.kind in ENDS_BY_ITSELF or notice.source.endswith("drill"):
        return  # a drill's or a health save's, or one followed from another node's drill
    signalled = [{"pid": pid, "start": start_ticks(pid)} for pid in pids]
    replace_json(state_dir / FILE_NAME, {"notice": notice.to_json(), "signalled": signalled})


def load(state_dir: Path, now: datetime) -> tuple[Notice, list[int]] | None:
    """The notice an earlier daemon acted on, when it is still in force at ``now``."""
    try:
        doc: Any = json.loads((state_dir / FILE_NAME).read_text())
        notice = Notice.from_json(doc["notice"])
        signalled = [(int(p["pid"]), p.get("start")) for p in doc.get("signalled", [])]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if notice.cancelled:
        return None
    if signalled and not any(
        start is not None and start_ticks(pid) == start for pid, start in signalled
    ):
        return None  # the trainer it signalled is gone: a new start is no repeat
    pids = [pid for pid, _ in signalled]
    if notice.deadline is not None:
        in_force = notice.deadline > now
    else:
        in_force = now - notice.noticed_at < timedelta(seconds=UNDATED_SECONDS)
    return (notice, pids) if in_force else None


def forget(state_dir: Path) -> None:
    with contextlib.suppress(OSError):
        (state_dir / FILE_NAME).unlink()
