"""Which trajectory a local checkpoint's content belongs to, as this node's trainer says.

Each report in ``<watch dir>/.ckptd/resumed.json`` (``ckptd.trainer.resumed``: what the
trainer resumed from, and when it started; ``ckptd exec`` writes it for its child) is a
trainer start. It is decided once, against LATEST as the store holds it then
(``ckptd.commit.lineage.decide``), and the decision is kept in the journal, so a daemon
restarted under a running trainer decides the same. A checkpoint belongs to the newest
start no later than its oldest file; with no start known (no report: a trainer without
the helpers), to the live trajectory, LATEST's, as before trajectories existed.

The reported name is matched to a committed content by what this node knows of its local
copy (the journal's commit, ``ckptd restore``'s record of what it wrote), else by the
name's own slot in the store. Blocking; run it in a thread.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ckptd.commit.lineage import Resumed, decide
from ckptd.core import handoff
from ckptd.core.manifest import (
    SCRATCH,
    Manifest,
    ManifestError,
    Parent,
    Trajectory,
)
from ckptd.layouts.base import CheckpointListing
from ckptd.repository import Repository
from ckptd.storage.base import StorageError
from ckptd.sync.journal import Journal

# A checkpoint whose oldest file is this much older than a start is still that start's
# (mtime granularity, and a report written just after the first save began).
START_SLACK_SECONDS = 2.0
# A report is a small JSON object; anything larger is not one.
_REPORT_MAX_BYTES = 64 * 1024

ParentRef = Parent | Literal["scratch"] | None


@dataclass(frozen=True)
class Attempt:
    """One trainer start and the trajectory decided for its saves."""

    started: float
    report: str  # "<pid>:<time>", what tells this start from another
    trajectory: Trajectory
    parent: ParentRef

    def to_json(self) -> str:
        parent: Any = (
            self.parent.model_dump(mode="json") if isinstance(self.parent, Parent) else self.parent
        )
        return json.dumps({"trajectory": self.trajectory.to_document(), "parent": parent})


def _attempt_of(started: float, report: str, body: str) -> Attempt | None:
    try:
        doc = json.loads(body)
        trajectory = Trajectory.model_validate(doc["trajectory"])
        raw = doc.get("parent")
        parent: ParentRef = Parent.model_validate(raw) if isinstance(raw, dict) else raw
    except (ValueError, KeyError, TypeError):
        return None
    if parent not in (None, SCRATCH) and not isinstance(parent, Parent):
        return None
    return Attempt(started, report, trajectory, parent)


def read_report(watch_dir: Path) -> tuple[str | None, str, float] | None:
    """``(checkpoint name or None, report id, started)`` of the trainer's resume report, or
    None when there is none or it is not one."""
    try:
        with open(watch_dir / handoff.RESUMED, "rb") as fh:
            doc = json.loads(fh.read(_REPORT_MAX_BYTES))
        name = doc.get("checkpoint")
        started = float(doc["at"])
        pid = int(doc.get("pid", 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if name is not None and (not isinstance(name, str) or not name or "/" in name):
        return None
    return name, f"{pid}:{started:.6f}", started


def read_restored(watch_dir: Path) -> dict[str, dict[str, Any]]:
    """What ``ckptd restore`` wrote into ``watch_dir`` (``handoff.RESTORED``): local name ->
    its record (``slot``, ``files``: path -> [size, mtime_ns], ...); {} when none."""
    try:
        with open(watch_dir / handoff.RESTORED, "rb") as fh:
            doc = json.loads(fh.read(8 * 1024 * 1024))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, dict)}


def restored_as(watch_dir: Path, listing: CheckpointListing) -> str | None:
    """The slot a local checkpoint was restored from, when ``ckptd restore`` wrote it and
    its files are still exactly as written (path, size, mtime); else None."""
    record = read_restored(watch_dir).get(listing.name)
    if record is None:
        return None
    files = record.get("files")
    slot = record.get("slot")
    if not isinstance(files, dict) or not isinstance(slot, str) or not slot:
        return None
    now = {f.path: [f.size, f.mtime_ns] for f in listing.files}
    return slot if now == files else None


class RunLineage:
    """This node's trainer starts of one run, and the trajectories decided for them."""

    def __init__(
        self, run: str, watch_dir: Path, repo: Repository, journal: Journal, log: Any
    ) -> None:
        self.run = run
        self.watch_dir = watch_dir
        self.repo = repo
        self.journal = journal
        self.log = log
        self.attempts: list[Attempt] = []
        for started, report, body in journal.attempts(run):
            attempt = _attempt_of(started, report, body)
            if attempt is not None:
                self.attempts.append(attempt)
        self._report_stat: tuple[int, int] | None = None

    def refresh(self) -> Attempt | None:
        """Look at the trainer's report; a start not seen before is decided now and
        returned (None when nothing new)."""
        try:
            st = os.stat(self.watch_dir / handoff.RESUMED)
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp == self._report_stat:
            return None
        report = read_report(self.watch_dir)
        if report is None:
            return None
        self._report_stat = stamp
        name, report_id, started = report
        if any(a.report == report_id for a in self.attempts):
            return None
        attempt = self._decide(name, report_id, started)
        if attempt is None:
            self._report_stat = None  # the store could not be read: try again next time
            return None
        self.journal.record_attempt(self.run, started, report_id, attempt.to_json())
        self.attempts.append(attempt)
        self.attempts.sort(key=lambda a: a.started)
        return attempt

    def _decide(self, name: str | None, report_id: str, started: float) -> Attempt | None:
        try:
            latest = self.repo.read_latest(self.run)
            live = self.repo.read_manifest(self.run, latest.checkpoint) if latest else None
            resumed: Resumed | Literal["scratch"] | None
            if name is None:
                resumed = SCRATCH
            else:
                manifest = self.committed_as(name)
                resumed = Resumed(manifest) if manifest is not None else None
        except (StorageError, ManifestError) as exc:
            self.log.warning("trajectory_undecided", run=self.run, error=str(exc))
            return None
        trajectory = decide(resumed, latest, live)
        parent: ParentRef = (
            SCRATCH
            if resumed == SCRATCH
            else resumed.parent
            if isinstance(resumed, Resumed)
            else None
        )
        attempt = Attempt(started, report_id, trajectory, parent)
        live_id = live.lineage.id if live is not None else ""
        fields = {
            "run": self.run,
            "resumed_from": name,
            "trajectory": trajectory.id or "original",
            "generation": trajectory.generation,
        }
        if resumed == SCRATCH and latest is not None:
            self.log.warning(
                "trainer_started_from_scratch",
                **fields,
                latest=latest.checkpoint,
                hint="the run has checkpoints: its saves start a new trajectory, which "
                "LATEST follows from its first commit; resume from CKPTD_RESUME_FROM unless "
                "starting over is meant",
            )
        elif trajectory.id != live_id or trajectory.generation != (
            live.lineage.generation if live else 0
        ):
            self.log.warning(
                "trainer_rolled_back", **fields, latest=latest.checkpoint if latest else None
            )
        else:
            self.log.info("trainer_resumed", **fields)
        return attempt

    def committed_as(self, name: str) -> Manifest | None:
        """The committed content the local checkpoint ``name`` is: by this node's commit
        of it, by the restore that wrote it, else by the name's own slot."""
        slot = self.journal.committed_files(self.run).get(name, (None, ""))[0]
        if slot is None:
            record = read_restored(self.watch_dir).get(name)
            found = record.get("slot") if record else None
            slot = found if isinstance(found, str) and found else None
        if slot is not None:
            manifest = self.repo.read_manifest(self.run, slot)
            if manifest is not None:
                return manifest
        return self.repo.read_manifest(self.run, name, follow=True)

    def for_checkpoint(
        self, oldest_mtime: float, live: Manifest | None
    ) -> tuple[Trajectory, ParentRef]:
        """The trajectory (and parent) of a checkpoint whose oldest file was written at
        ``oldest_mtime``: its start's, else the live one (``live``: LATEST's manifest)."""
        for attempt in reversed(self.attempts):
            if attempt.started <= oldest_mtime + START_SLACK_SECONDS:
                return attempt.trajectory, attempt.parent
        return (live.lineage if live is not None else Trajectory(id="", generation=0)), None
