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
name's own slot in the store. A report ``ckptd exec`` wrote for its child (``"by":
"ckptd"``) names the checkpoint ckptd chose, from the live line (``live_line``): it is
matched by the content the watch dir holds under that name now (``content_of``), and a
save not committed yet continues the trajectory of the start that wrote it, so ckptd's
own choice is never taken for a rollback to another line. Blocking; run it in a thread.

**The live line** (``live_line``): the trajectory a restarted trainer continues, and the
steps of it and of its ancestors that are on it. Its head is LATEST's trajectory, unless
this node's newest start was decided on a newer generation (a rollback whose first save
is not committed yet: that commit moves LATEST to it, ``ckptd.commit.lineage``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ckptd.commit.lineage import Resumed, decide, live_lineage
from ckptd.core import handoff
from ckptd.core.manifest import (
    SCRATCH,
    Manifest,
    ManifestError,
    Parent,
    Trajectory,
)
from ckptd.layouts.base import CheckpointListing, step_of
from ckptd.repository import Repository
from ckptd.storage.base import StorageError
from ckptd.sync.journal import Journal
from ckptd.sync.request import fingerprint_id
from ckptd.sync.scanner import snapshot

# A checkpoint whose oldest file is this much older than a start is still that start's
# (mtime granularity, and a report written just after the first save began).
START_SLACK_SECONDS = 2.0
# A report is a small JSON object; anything larger is not one.
_REPORT_MAX_BYTES = 64 * 1024
# A resume report's ``by`` when ``ckptd exec`` wrote it for its child (its own choice).
BY_CKPTD = handoff.RESUMED_BY_CKPTD
# How many forks the live line is followed back through, at most (a loop in garbage).
_MAX_FORKS = 64

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


@dataclass(frozen=True)
class Report:
    """One resume report: the checkpoint's name (None: from scratch), what tells this
    start from another (``"<pid>:<time>"``), when it started, and whether ``ckptd exec``
    wrote it (its own choice of resume point, not the trainer's)."""

    name: str | None
    id: str
    started: float
    by_ckptd: bool = False


def read_report(watch_dir: Path) -> Report | None:
    """The resume report in ``watch_dir``, or None when there is none or it is not one."""
    try:
        with open(watch_dir / handoff.RESUMED, "rb") as fh:
            doc = json.loads(fh.read(_REPORT_MAX_BYTES))
        name = doc.get("checkpoint")
        started = float(doc["at"])
        pid = int(doc.get("pid", 0))
        by = doc.get("by")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if name is not None and (not isinstance(name, str) or not name or "/" in name):
        return None
    return Report(name, f"{pid}:{started:.6f}", started, by == BY_CKPTD)


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


@dataclass(frozen=True)
class LocalContent:
    """What a local checkpoint's files are, as this node knows: a committed content
    (``manifest``: this node committed or restored exactly these files), or a save not
    committed yet, of the trajectory (and parent) of the start that wrote it."""

    trajectory: Trajectory
    step: int | None
    manifest: Manifest | None
    parent: ParentRef


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
        # The pipeline (shipping) and ``ckptd exec`` (choosing a resume point) both look
        # at the report, each from a thread: one start is decided once.
        self._refreshing = threading.Lock()

    def refresh(self) -> Attempt | None:
        """Look at the trainer's report; a start not seen before is decided now and
        returned (None when nothing new)."""
        with self._refreshing:
            return self._refresh()

    def _refresh(self) -> Attempt | None:
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
        if any(a.report == report.id for a in self.attempts):
            return None
        attempt = self._decide(report)
        if attempt is None:
            self._report_stat = None  # the store could not be read: try again next time
            return None
        self.journal.record_attempt(self.run, report.started, report.id, attempt.to_json())
        # A new list, not one changed in place: readers in other threads iterate it.
        self.attempts = sorted([*self.attempts, attempt], key=lambda a: a.started)
        return attempt

    def _decide(self, report: Report) -> Attempt | None:
        name, report_id, started = report.name, report.id, report.started
        try:
            latest = self.repo.read_latest(self.run)
            live = self.repo.read_manifest(self.run, latest.checkpoint) if latest else None
            resumed, chosen = self._resumed_from(report, live)
        except (StorageError, ManifestError) as exc:
            self.log.warning("trajectory_undecided", run=self.run, error=str(exc))
            return None
        if chosen is not None and chosen.manifest is None:
            # ckptd chose a save not committed yet: the trainer goes on with the line of
            # the start that wrote it (a rollback's first save included).
            trajectory, parent = chosen.trajectory, chosen.parent
        else:
            trajectory = decide(resumed, latest, live)
            parent = (
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
        known = {(a.trajectory.id, a.trajectory.generation) for a in self.attempts}
        if report.by_ckptd and (
            trajectory.id == live_id
            or (trajectory.id, trajectory.generation) in known
            or resumed is None
        ):
            # ckptd's own choice, on the live line: the trainer continues it.
            self.log.info("trainer_resumed", **fields, by=BY_CKPTD)
        elif report.by_ckptd:
            # ckptd's choice is behind the live line's newest (its local copy is gone or
            # changed; none at all: from scratch): the saves from it cannot be that
            # line's, so they fork one.
            self.log.warning(
                "resume_point_behind_latest",
                **fields,
                latest=latest.checkpoint if latest else None,
                hint="the live line's newest checkpoint is not complete in the watch dir: "
                "the trainer resumes from an older one (or from nothing) and its saves start "
                "a new trajectory",
            )
        elif resumed == SCRATCH and latest is not None:
            self.log.warning(
                "trainer_started_from_scratch",
                **fields,
                latest=latest.checkpoint,
                hint="the run has checkpoints: its saves start a new trajectory, which "
                "LATEST follows from its first commit; resume from CKPTD_RESUME_FROM unless "
                "starting over is meant",
            )
        elif (
            trajectory.id != live_id
            or trajectory.generation != (live.lineage.generation if live else 0)
        ) and (trajectory.id, trajectory.generation) not in known:
            # A rollback said once: a later start on the same new line (the trainer
            # reporting what ckptd handed it) continues it.
            self.log.warning(
                "trainer_rolled_back", **fields, latest=latest.checkpoint if latest else None
            )
        else:
            self.log.info("trainer_resumed", **fields)
        return attempt

    def _resumed_from(
        self, report: Report, live: Manifest | None
    ) -> tuple[Resumed | Literal["scratch"] | None, LocalContent | None]:
        """What the trainer resumed from: nothing (scratch), a committed content, or a
        local save not committed yet, whose start's line it goes on with (the second
        value: ckptd's own choice, or the trainer's own report of what ckptd handed it,
        before that save's commit). StorageError, ManifestError when the store cannot
        say."""
        name = report.name
        if name is None:
            return SCRATCH, None
        if report.by_ckptd and (chosen := self._chosen(name, live)) is not None:
            return (Resumed(chosen.manifest) if chosen.manifest is not None else None), chosen
        manifest = self.committed_as(name)
        if manifest is not None:
            return Resumed(manifest), None
        return None, self._chosen(name, live)

    def _chosen(self, name: str, live: Manifest | None) -> LocalContent | None:
        """What the local checkpoint ``name`` that ckptd chose holds now (None: gone)."""
        listing = snapshot(self.watch_dir, name)
        return None if listing is None else self.content_of(listing, live)

    def content_of(self, listing: CheckpointListing, live: Manifest | None) -> LocalContent:
        """What a local checkpoint is (``LocalContent``): the content this node committed
        or restored, when its files are still exactly those (path, size, mtime); else a
        save of the start its oldest file belongs to (``for_checkpoint``; ``live``:
        LATEST's manifest). StorageError, ManifestError when the store cannot say."""
        name = listing.name
        slot = restored_as(self.watch_dir, listing)
        if slot is None:
            known = self.journal.committed_files(self.run).get(name)
            # '' was recorded before fingerprints were: taken as these files, as the
            # pipeline takes it (a re-save since is said, and forgotten, when seen).
            if known is not None and known[1] in ("", fingerprint_id(listing.files)):
                slot = known[0]
        manifest = self.repo.read_manifest(self.run, slot) if slot is not None else None
        if manifest is not None and manifest.local_name == name:
            return LocalContent(manifest.lineage, manifest.step, manifest, Resumed(manifest).parent)
        oldest = min((f.mtime_ns for f in listing.files), default=0) / 1e9
        trajectory, parent = self.for_checkpoint(oldest, live)
        return LocalContent(trajectory, step_of(name), None, parent)

    def live_head(self, live: Manifest | None) -> Trajectory | None:
        """The live line's head (module doc; ``live``: LATEST's manifest, None when there
        is none or it cannot be read); None when nothing says which line is live."""
        newest = self.attempts[-1] if self.attempts else None
        if live is None:
            return newest.trajectory if newest is not None else None
        if newest is not None and newest.trajectory.generation > live.lineage.generation:
            return newest.trajectory
        return live.lineage

    def live_line(self, live: Manifest | None) -> dict[str, int | None] | None:
        """The live line: trajectory id -> the highest step of it on the line (None: all
        of it), from ``live_head`` back through each fork (``live_lineage``); a fork's
        parent trajectory is known from this node's starts, else from the store (the
        manifest it forked from). None when no line is known: every local checkpoint is
        on it, as before trajectories existed."""
        head = self.live_head(live)
        if head is None:
            return None
        known = {a.trajectory.id: a.trajectory for a in self.attempts}
        if live is not None:
            known[live.lineage.id] = live.lineage
        current = head
        for _ in range(_MAX_FORKS):
            fork = current.forked_from
            if fork is None or fork.trajectory == current.id:
                break
            parent = known.get(fork.trajectory)
            if parent is None:
                try:
                    found = self.repo.read_manifest(self.run, fork.checkpoint)
                except (StorageError, ManifestError) as exc:
                    self.log.warning("live_line_unread", run=self.run, error=str(exc))
                    break
                if found is None or found.lineage.id != fork.trajectory:
                    break  # deleted since: the line above it is not known
                parent = known[fork.trajectory] = found.lineage
            current = parent
        return live_lineage(head, known)

    def on_line(
        self, line: dict[str, int | None], live: Manifest | None
    ) -> Callable[[CheckpointListing], bool]:
        """Whether a local checkpoint is on ``line`` (``live_line``): its content's
        trajectory is, and at most at the step the line leaves that trajectory. A
        committed content whose manifest cannot be read is judged as a save of its
        start (``for_checkpoint``), never skipped for it."""

        def holds(listing: CheckpointListing) -> bool:
            try:
                content = self.content_of(listing, live)
            except (StorageError, ManifestError) as exc:
                self.log.warning("resume_point_unsure", checkpoint=listing.name, error=str(exc))
                oldest = min((f.mtime_ns for f in listing.files), default=0) / 1e9
                trajectory, _ = self.for_checkpoint(oldest, live)
                content = LocalContent(trajectory, step_of(listing.name), None, None)
            if content.trajectory.id not in line:
                return False
            bound = line[content.trajectory.id]
            return bound is None or content.step is None or content.step <= bound

        return holds

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
