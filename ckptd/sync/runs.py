"""What the daemon knows of each watched run, and how that reads in ``/v1/status``.

A ``RunState`` is only ever changed on the event loop. ``committed`` holds every
checkpoint this daemon saw committed (by itself or found in the store); ``previous`` is
the newest committed manifest by step, the base that unchanged files are copied from.

With many nodes, ``announcements`` caches what the store announced for checkpoints this
node does not hold the commit record of, ``awaiting`` holds those it still waits to see
announced (since when), and ``waiting`` those whose part is written but not yet joined by
every other node's (``/v1/status``'s ``waiting``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ckptd.commit.parts import Announcement
from ckptd.config import WatchConfig
from ckptd.core.manifest import (
    ROOT_TRAJECTORY,
    Manifest,
    ManifestError,
    Parent,
    Trajectory,
    utc_timestamp,
)
from ckptd.layouts.base import CheckpointListing, RuleSettings, step_of
from ckptd.repository import Repository
from ckptd.storage.base import StorageError
from ckptd.store.catalog import RunCatalog
from ckptd.sync.journal import Journal
from ckptd.sync.lineage import RunLineage
from ckptd.sync.queue import ShipQueue
from ckptd.sync.transfer import TransferContext


@dataclass
class Progress:
    """The checkpoint being shipped now."""

    name: str
    started_at: float
    total_bytes: int
    sent_bytes: int = 0


@dataclass
class WaitingEntry:
    """A checkpoint whose part this node wrote, waiting for other nodes' parts."""

    save: str
    since: float  # wall clock: when this node's part was first written
    missing: tuple[int, ...] = ()
    reason: str = ""
    announced: bool = False  # this node wrote the announcement (it holds the record)
    # Shipped as the emergency checkpoint: its global commit, by whichever node, ends
    # this node's emergency (the responder's report and a drill wait for it).
    emergency: bool = False


@dataclass
class RunState:
    """One watched run."""

    watch: WatchConfig
    run_id: str
    rules: RuleSettings
    seen: set[str] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)
    failed_for_good: dict[str, str] = field(default_factory=dict)
    # The last failed attempt (``/v1/status``'s ``failures.last``): which checkpoint, why
    # (the metric's reason), the error, when (wall clock); None since that one committed.
    last_failure: dict[str, Any] | None = None
    # Checkpoints whose unshippable entries were logged and counted (once each).
    reported_unshippable: dict[str, tuple[str, ...]] = field(default_factory=dict)
    previous: Manifest | None = None
    previous_loaded: bool = False
    last_committed: dict[str, Any] | None = None
    last_step: int | None = None  # highest committed step (commit order may not be step order)
    current: Progress | None = None
    # The checkpoint being shipped: its files as listed when it started, and how to
    # tell its transfers to stop if a file event shows it changed or vanished.
    current_files: list[tuple[str, int, int]] | None = None
    current_ctx: TransferContext | None = None
    # Many nodes (module doc).
    announcements: dict[str, Announcement] = field(default_factory=dict)
    awaiting: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, WaitingEntry] = field(default_factory=dict)
    # What retention has read of the run's store, kept from one pass to the next.
    catalog: RunCatalog = field(default_factory=RunCatalog)
    # The trainer's starts and their trajectories (set by the pipeline, which has the
    # store and journal it needs).
    lineage: RunLineage | None = None
    # Local checkpoints refused because another content holds the name on their
    # trajectory: name -> (the local files' fingerprint then, who holds it).
    conflicts: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    # The fingerprint of each committed local checkpoint's files when committed ('' when
    # not known): a re-save under a committed name shows as another.
    committed_files: dict[str, str] = field(default_factory=dict)

    def holds_newer(self, step: int, around: set[str]) -> bool:
        """Whether a checkpoint of the run above ``step`` is in hand and not committed:
        shipping, awaiting its announcement or other nodes (many nodes), or among
        ``around`` (the pipeline's queue and looks). ``ckptd exec`` waits for one after a
        notice: the trainer's save for it may come after a routine save that counted as
        it (written within the slack, ``ckptd.sync.queue``)."""
        current = {self.current.name} if self.current is not None else set()
        in_hand = (around | current | set(self.awaiting) | set(self.waiting)) - self.committed
        return any((step_of(name) or -1) > step for name in in_hand)

    @classmethod
    def of(cls, watch: WatchConfig) -> RunState:
        rules = RuleSettings(
            quiescence_seconds=watch.quiescence_seconds,
            marker=watch.marker,
            settle_seconds=watch.settle_seconds,
        )
        return cls(watch, watch.effective_run_id, rules)

    @property
    def dir(self) -> Path:
        return Path(self.watch.dir)

    def recall(self, journal: Journal) -> None:
        """What the journal holds of this run from earlier lives: the local checkpoints
        committed (with their files' fingerprints) and those refused as conflicts."""
        committed = journal.committed_files(self.run_id)
        self.committed.update(committed)
        self.committed_files.update({name: fp for name, (_, fp) in committed.items()})
        for name, (local, detail) in journal.conflicts(self.run_id).items():
            said = json.loads(detail)
            self.conflicts[name] = (local, said)
            self.failed_for_good[name] = str(said.get("error", "conflict"))

    def record_commit(
        self, manifest: Manifest, local: str | None = None, *, live: bool | None = None
    ) -> bool:
        """Remember ``manifest`` as committed, and the local checkpoint whose files are its
        content (``local``: a fingerprint; None when no local copy is known to be it, as
        for the run's last commit read from the store); ``live``: whether LATEST names it
        now (None: not known; then the higher step is taken to). True when its step is the
        run's highest."""
        if local is not None:
            self.committed.add(manifest.local_name)
            self.committed_files[manifest.local_name] = local
            self.conflicts.pop(manifest.local_name, None)
        newer = self.previous is None or (manifest.step or -1) >= (self.previous.step or -1)
        if live or (live is None and newer):
            self.previous = manifest
            self.previous_loaded = True
        self.last_committed = {
            "checkpoint": manifest.checkpoint,
            "step": manifest.step,
            "bytes": manifest.total_bytes,
            "committed_at": manifest.committed_at,
        }
        if manifest.step is not None and (self.last_step is None or manifest.step > self.last_step):
            self.last_step = manifest.step
            return True
        return False

    def never_shipped(self) -> set[str]:
        """Local checkpoints that, as they are, will never commit: seen with entries that
        cannot be shipped, or refused as a conflict."""
        return set(self.why_never_shipped())

    def why_never_shipped(self) -> dict[str, str]:
        """``never_shipped``'s checkpoints, each with why: a conflict's recorded error (a
        later ``run --once`` says it again, not only the run that met it), or the entries
        it holds that cannot be shipped."""
        why = {
            name: f"entries it cannot ship: {', '.join(entries)}"
            for name, entries in self.reported_unshippable.items()
            if entries and name not in self.committed
        }
        for name, (_, said) in self.conflicts.items():
            why[name] = f"conflict: {said.get('error', 'another writer committed this name')}"
        return why

    def forget_cluster(self, name: str) -> None:
        """Drop what many-node bookkeeping holds for ``name`` (committed, or given up)."""
        self.announcements.pop(name, None)
        self.awaiting.pop(name, None)
        self.waiting.pop(name, None)

    def waiting_status(self) -> list[dict[str, Any]]:
        return [
            {
                "checkpoint": name,
                "missing_nodes": list(entry.missing),
                "since": utc_timestamp(entry.since),
                "save": entry.save,
                "reason": entry.reason,
            }
            for name, entry in sorted(self.waiting.items())
        ]

    def failed_attempt(self, name: str, reason: str, error: str, now: float) -> None:
        """An attempt to ship ``name`` failed (counted in the metric by the caller)."""
        self.last_failure = {
            "checkpoint": name,
            "reason": reason,
            "error": error,
            "at": utc_timestamp(now),
        }

    def status(
        self,
        queue: ShipQueue,
        now: float,
        *,
        failures: dict[str, int] | None = None,
        cluster: bool = False,
    ) -> dict[str, Any]:
        """This run's entry in ``/v1/status`` (``now``: wall clock, for the sync lag);
        ``failures`` the run's ``ckptd_checkpoints_failed_total`` by reason (so status and
        the metric count the same thing); ``cluster`` adds the checkpoints waiting for
        other nodes."""
        current = self.current
        doc: dict[str, Any] = {
            "dir": str(self.dir),
            "layout": self.watch.layout,
            "pending": queue.names(self.run_id),
            "uploading": None
            if current is None
            else {
                "checkpoint": current.name,
                "bytes_total": current.total_bytes,
                "bytes_sent": current.sent_bytes,
            },
            "last_committed": self.last_committed,
            # What LATEST names (a restore --latest takes it): the last commit in time may
            # be another (a backlog shipped out of step order, an older trajectory's).
            "latest": None
            if self.previous is None
            else {
                "checkpoint": self.previous.checkpoint,
                "step": self.previous.step,
                "committed_at": self.previous.committed_at,
            },
            "failed": self.failed_for_good,
            "failures": {
                "count": sum((failures or {}).values()),
                "by_reason": dict(failures or {}),
                "last": self.last_failure,
            },
            "sync_lag_seconds": queue.sync_lag(self.run_id, now),
            "conflicts": {name: detail for name, (_, detail) in sorted(self.conflicts.items())},
        }
        if cluster:
            doc["waiting"] = self.waiting_status()
        return doc


async def previous_manifest(repo: Repository, state: RunState, log: Any) -> Manifest | None:
    """``state.previous``, read from the store (LATEST's manifest) the first time it is
    asked for; an unreadable one is logged and taken as none this time."""
    if not state.previous_loaded:
        try:
            latest = await asyncio.to_thread(repo.read_latest, state.run_id)
            if latest is not None:
                state.previous = await asyncio.to_thread(
                    repo.read_manifest, state.run_id, latest.checkpoint
                )
        except (StorageError, ManifestError) as exc:
            # Asked again next time: a store down at start-up must not cost every
            # later checkpoint its server-side copies.
            log.warning("previous_manifest_unreadable", run=state.run_id, error=str(exc))
            return None
        state.previous_loaded = True
    return state.previous


async def lineage_of(
    state: RunState, listing: CheckpointListing
) -> tuple[Trajectory, Parent | Literal["scratch"] | None]:
    """The trajectory a local checkpoint's content belongs to and what its trainer
    resumed from (``ckptd.sync.lineage``): the trainer's report is looked at first."""
    lineage = state.lineage
    if lineage is None:
        live = state.previous
        return (live.lineage if live is not None else ROOT_TRAJECTORY), None
    await asyncio.to_thread(lineage.refresh)
    oldest = min((f.mtime_ns for f in listing.files), default=0) / 1e9
    return lineage.for_checkpoint(oldest, state.previous)
