"""Shipping one queued checkpoint, and acting on what became of it.

``ship`` looks at the checkpoint once more (it may have changed since it was queued),
hands it to the ``Shipper`` (``ckptd.sync.ship``) and acts on the ``Outcome``:

    committed   remembered (journal, run state, metrics), the daemon told (``on_commit``,
                ``on_cost``), local retention run (never during a notice)
    paused      left queued: it resumes after the emergency checkpoint
    changed     dropped and what it sent discarded; looked at again later (``abandon``)
    conflict    never committed (``ClusterCoordination.conflict``)
    waiting     many nodes: ``ClusterCoordination`` takes it from here
    failed      backed off in the queue, counted by why (``failed``); a full store has
                what this attempt sent discarded

A global commit another node made, or this node's poll found (``ClusterCoordination
.poll``), is acted on as this node's own commit (``committed``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from ckptd.commit.assemble import Assembly
from ckptd.commit.single import CommitConflictError, SlotWithdrawnError
from ckptd.config import Settings
from ckptd.core.manifest import (
    Manifest,
    epoch_of_timestamp,
)
from ckptd.layouts.base import CheckpointListing
from ckptd.repository import Repository
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import NO_SPACE_CODES, StorageError, storage_error_kind
from ckptd.sync.coordination import ClusterCoordination
from ckptd.sync.early import EarlyUploads
from ckptd.sync.emergency import Emergency
from ckptd.sync.hooks import PipelineHooks
from ckptd.sync.housekeeping import after_commit
from ckptd.sync.journal import Journal
from ckptd.sync.queue import Pending, ShipQueue
from ckptd.sync.request import ShipRequest, fingerprint, fingerprint_id
from ckptd.sync.runs import Progress, RunState, lineage_of, previous_manifest
from ckptd.sync.scanner import snapshot
from ckptd.sync.ship import Outcome, Shipper, ShipResult
from ckptd.sync.transfer import TransferContext


class LookAgain(Protocol):
    """The pipeline's ``hint``: look at one checkpoint again (after its debounce)."""

    def __call__(self, run_id: str, name: str | None, delay: float = ...) -> None: ...


class Outcomes:
    """Ships queued checkpoints and acts on each outcome (module doc)."""

    def __init__(
        self,
        runs: Mapping[str, RunState],
        queue: ShipQueue,
        shipper: Shipper,
        early: EarlyUploads,
        cluster: ClusterCoordination,
        emergency: Emergency,
        *,
        repo: Repository,
        journal: Journal,
        settings: Settings,
        metrics: Metrics,
        tier_metrics: Metrics,
        tier: str,
        clock: Clock,
        log: Any,
        hooks: PipelineHooks,
        look_again: LookAgain,
        changed: Callable[[], None],
        discard: Callable[[str, str], None],
    ) -> None:
        self.runs = runs
        self.queue = queue
        self.shipper = shipper
        self.early = early
        self.cluster = cluster
        self.emergency = emergency
        self.repo = repo
        self.journal = journal
        self.settings = settings
        self.metrics = metrics
        self.tier_metrics = tier_metrics
        self.tier = tier
        self.clock = clock
        self.log = log
        self.hooks = hooks
        self._look_again = look_again
        self._changed = changed  # the pipeline's gauges' refresh
        self._discard = discard  # ``cleanup.discard`` of one checkpoint; blocking
        # The last failure by which the store refused this node itself (credentials,
        # access, bucket): `ckptd run --once` ends on it. Cleared by a commit.
        self.unusable: StorageError | None = None

    def _locally_deletable(self, run: str) -> set[str]:
        if self.hooks.locally_deletable is not None:
            return self.hooks.locally_deletable(run)
        return set(self.runs[run].committed)

    async def ship(self, pending: Pending) -> bool:
        """Ship one queued checkpoint and act on the outcome; True when committed."""
        state = self.runs[pending.run]
        run, name = pending.run, pending.name
        listing = await asyncio.to_thread(snapshot, state.dir, name)
        verdict, role = self.cluster.judge(state, listing) if listing else (None, None)
        if listing is None or verdict is None or not verdict.complete:
            self.queue.remove(run, name)
            self._changed()
            if listing is not None:
                self._look_again(run, name)
            return False
        ctx = TransferContext(run, name)

        def started(total_bytes: int) -> None:
            state.current = Progress(name, self.clock.time(), total_bytes)

        previous = await previous_manifest(self.repo, state, self.log)
        trajectory, parent = await lineage_of(state, listing)
        request = ShipRequest(
            run,
            state.dir,
            listing,
            verdict,
            previous,
            ctx,
            on_started=started,
            on_copied=lambda n: self.metrics.copied_bytes.labels(run=run).inc(n),
            cluster=role,
            early=self.early.take(run, name),
            trajectory=trajectory,
            parent=parent,
            on_claimed=claimed_hook(self.hooks, self.early, self.emergency, pending),
        )
        state.current_files, state.current_ctx = fingerprint(listing.files), ctx
        local = fingerprint_id(listing.files)
        # The save as the files tell it: first file written -> last (a trainer that
        # reports its own save time is believed first, ``ckptd.cadence.advisor``).
        mtimes = [f.mtime_ns for f in listing.files]
        write_span = (max(mtimes) - min(mtimes)) / 1e9 if mtimes else 0.0
        try:
            result = await self.shipper.ship(request)
        finally:
            state.current = state.current_ctx = state.current_files = None
            # Whatever the outcome, nothing sent early is still sending (a discard
            # after "changed" must not race an early upload).
            await self.early.cancel(run, name)
        log = self.log.bind(run=run, checkpoint=name)
        if result.outcome is Outcome.COMMITTED:
            await self.committed(state, pending, result, log, local=local)
            if self.hooks.on_cost is not None and result.commit is not None:
                upload = max(0.0, self.clock.time() - pending.completed_at)
                self.hooks.on_cost(
                    run, name, pending.completed_at, write_span, upload, pending.emergency
                )
            return True
        if result.outcome is Outcome.PAUSED:
            log.warning("checkpoint_paused")
        elif result.outcome is Outcome.CHANGED:
            await self.abandon(state, pending, str(result.error), log)
        elif result.outcome is Outcome.CONFLICT:
            self.queue.remove(run, name)
            await self.conflicted(state, name, local, listing, request, result, log)
        elif result.outcome is Outcome.WAITING:
            if result.assembly is None or result.assembly.outcome is not Assembly.RESAVED:
                self.hooks.on_stored(run, name, pending.emergency)  # this node's part is there
            self.queue.remove(run, name)
            self.cluster.waiting(
                state, name, role, result.assembly, log, emergency=pending.emergency
            )
        else:
            await self.failed(state, pending, result, log)
        return False

    async def conflicted(
        self,
        state: RunState,
        name: str,
        local: str,
        listing: CheckpointListing,
        request: ShipRequest,
        result: ShipResult,
        log: Any,
    ) -> None:
        """Another content holds ``name`` on its trajectory: never committed, said loudly
        (both writers named), counted, kept in the journal and ``/v1/status``, never
        deleted locally, and looked at again only once its files change. What this
        attempt sent (its own slot's objects) is removed."""
        error = result.error
        theirs = error.theirs if isinstance(error, CommitConflictError) else {}
        ours = {
            "host": self.shipper.host,
            "writer": self.shipper.writer.id,
            "node": self.settings.cluster.rank,
            "slot": request.slot.slot if request.slot is not None else None,
            "files": len(listing.files),
            "bytes": sum(f.size for f in listing.files),
        }
        detail = {"error": str(error), "ours": ours, "theirs": theirs}
        state.conflicts[name] = (local, detail)
        await asyncio.to_thread(
            self.journal.record_conflict, state.run_id, name, local, json.dumps(detail)
        )
        if isinstance(error, SlotWithdrawnError):
            # Taken from under this writer (``ckptd rm --force``, retention): never
            # committed over what was deleted; the local copy stays.
            log.error("checkpoint_slot_withdrawn", ours=ours, theirs=theirs)
        log.warning("checkpoint_conflict_writers", ours=ours, theirs=theirs)
        self.cluster.conflict(state, name, error, log)
        if request.slot is not None and self.cluster.committer is None:
            await asyncio.to_thread(self._discard, state.run_id, name)

    async def retain(self, state: RunState, log: Any) -> None:
        """One retention pass of the run, remote then local (``after_commit``): after each
        commit, and once more when a SIGTERM's flush is done (``SyncPipeline.retain``)."""
        protected = (
            set(self.queue.names(state.run_id))
            | set(state.waiting)
            | {n for r, n in self.early.ships if r == state.run_id}
        )
        removed = await after_commit(
            self.repo,
            self.settings.retention,
            state.run_id,
            state.dir,
            protected=protected,
            committed_here=self._locally_deletable(state.run_id),
            log=log,
            cluster_grace_seconds=None
            if self.cluster.committer is None
            else self.cluster.abandon_grace_seconds,
            catalog=state.catalog,
        )
        state.seen.difference_update(removed)

    async def committed(
        self,
        state: RunState,
        pending: Pending,
        result: ShipResult,
        log: Any,
        *,
        local: str = "",
    ) -> None:
        """``pending`` is committed (by this ship, or globally by any node); ``local`` is
        the fingerprint of the local files it was shipped from ('' when not known)."""
        manifest = result.manifest
        assert manifest is not None  # an Outcome.COMMITTED always carries it
        self.unusable = None
        self._mark_committed(
            state,
            pending.name,
            manifest,
            log,
            already=result.already_committed,
            local=local,
            result_latest_moved=result.commit.latest_moved if result.commit is not None else None,
        )
        self.hooks.on_stored(state.run_id, pending.name, pending.emergency)
        if self.hooks.on_commit is not None:
            await self.hooks.on_commit(
                state.run_id, pending.name, manifest.total_bytes, pending.emergency
            )
        if result.commit is None:
            return  # committed before this attempt: nothing was shipped now
        state.catalog.forget(manifest.checkpoint)  # read afresh by the next pass
        if not result.commit.latest_moved and not result.already_committed:
            self._said_latest_stays(state, manifest, log)
        if self.emergency.since is None:  # never spend a preemption's seconds on deletes
            await self.retain(state, log)
        run = state.run_id
        self.metrics.upload_duration.labels(run=run).observe(
            max(0.0, self.clock.time() - pending.completed_at)
        )
        self.metrics.checkpoint_bytes.labels(run=run).observe(manifest.total_bytes)
        files = result.files
        log.info(
            "checkpoint_committed",
            step=manifest.step,
            bytes=manifest.total_bytes,
            bytes_sent=sum(r.bytes_sent for r in files),
            copied=sum(1 for r in files if r.how == "copied"),
            resumed=sum(1 for r in files if r.how == "resumed"),
            skipped=sum(1 for r in files if r.how == "skipped"),
            early=sum(1 for r in files if r.how == "early"),
            seconds=round(result.seconds, 3),
            cpu_seconds=round(result.cpu_seconds, 3),
            latest_moved=result.commit.latest_moved,
            manifest_crc32c=result.commit.manifest_crc32c,
        )

    def _mark_committed(
        self,
        state: RunState,
        name: str,
        manifest: Manifest,
        log: Any,
        *,
        already: bool,
        local: str,
        result_latest_moved: bool | None,
    ) -> None:
        self.journal.mark_committed(
            state.run_id, name, manifest.step, slot=manifest.checkpoint, fingerprint=local
        )
        self.queue.remove(state.run_id, name)
        state.forget_cluster(name)
        state.failed_for_good.pop(name, None)
        if (state.last_failure or {}).get("checkpoint") == name:
            state.last_failure = None  # what failed went through after all
        run = state.run_id
        before = state.previous
        if state.record_commit(manifest, local, live=result_latest_moved) and (
            state.last_step is not None
        ):
            self.metrics.last_step.labels(run=run).set(state.last_step)
        self.metrics.committed.labels(run=run).inc()
        self.metrics.last_commit_ts.labels(run=run).set(self.clock.time())
        self.tier_metrics.tier_committed.labels(run=run, tier=self.tier).inc()
        self.tier_metrics.tier_last_commit_ts.labels(run=run, tier=self.tier).set(self.clock.time())
        if state.last_step is not None:
            self.tier_metrics.tier_last_step.labels(run=run, tier=self.tier).set(state.last_step)
        if already:
            log.info("checkpoint_already_committed", step=manifest.step)
        if (
            not already
            and (before is None or before.lineage != manifest.lineage)
            and (manifest.trajectory is not None)
        ):
            self._said_new_trajectory(manifest, before, log)
        self._changed()

    def _said_new_trajectory(self, manifest: Manifest, before: Manifest | None, log: Any) -> None:
        """The first commit of a trajectory other than the run's first: loud, since it
        moves LATEST off the line ``restore --latest`` returned so far."""
        lineage = manifest.lineage
        log.warning(
            "checkpoint_starts_trajectory",
            trajectory=lineage.id,
            generation=lineage.generation,
            from_scratch=bool(lineage.from_scratch),
            forked_from=lineage.forked_from.checkpoint if lineage.forked_from else None,
            previous_latest=before.checkpoint if before is not None else None,
            hint="the trainer resumed from an older checkpoint than the newest, or from "
            "scratch: the abandoned checkpoints stay restorable by their slot ('ckptd list' "
            "marks them) and retention removes them first",
        )

    def _said_latest_stays(self, state: RunState, manifest: Manifest, log: Any) -> None:
        """A new commit that does not move LATEST: said, with why, since ``restore
        --latest`` will not return it."""
        latest = state.previous
        if latest is None:
            return
        if manifest.parent is None and (manifest.step or 0) < (latest.step or 0):
            why = (
                "its step is below LATEST's on the live trajectory and its trainer did not say "
                "what it resumed from: if it rolled back, call ckptd.trainer.report_resumed "
                "(load_training_state and the callbacks do) so its trajectory becomes live"
            )
        else:
            why = "LATEST names a checkpoint of a newer trajectory or a higher step"
        log.warning(
            "latest_not_moved",
            step=manifest.step,
            latest=latest.checkpoint,
            latest_step=latest.step,
            reason=why,
        )

    def found_committed(self, state: RunState, manifest: Manifest) -> None:
        """``manifest`` is the run's last commit as the store held it at start-up: shown
        by ``/v1/status`` and the last-commit gauges; no commit is counted (none
        happened now)."""
        state.record_commit(manifest, live=True)
        run = state.run_id
        at = epoch_of_timestamp(manifest.committed_at)
        if at is not None:
            self.metrics.last_commit_ts.labels(run=run).set(at)
            self.tier_metrics.tier_last_commit_ts.labels(run=run, tier=self.tier).set(at)
        if state.last_step is not None:
            self.metrics.last_step.labels(run=run).set(state.last_step)
            self.tier_metrics.tier_last_step.labels(run=run, tier=self.tier).set(state.last_step)
        self._changed()

    async def abandon(self, state: RunState, pending: Pending, reason: str, log: Any) -> None:
        """Drop a checkpoint that changed under us (``cleanup.discard``), and look at it
        again later: if it was rewritten rather than deleted, it may become complete."""
        run, name = state.run_id, pending.name
        self.queue.remove(run, name)
        self.metrics.abandoned.labels(run=run).inc()
        log.warning("checkpoint_abandoned", reason=reason)
        await asyncio.to_thread(self._discard, run, name)
        self._changed()
        self._look_again(run, name, delay=max(1.0, state.rules.settle_seconds))

    async def failed(
        self,
        state: RunState,
        pending: Pending,
        result: ShipResult,
        log: Any,
        *,
        traceback: bool = False,
    ) -> None:
        """Backed off in the queue and counted by why; a full store has what this
        attempt sent discarded."""
        exc, code = result.error, result.reason
        delay = self.queue.failed(pending, self.clock.monotonic())
        kind = storage_error_kind(exc) if isinstance(exc, StorageError) else None
        reason = "local" if kind is None else kind if kind in ("unusable", "verify") else "storage"
        self.metrics.failed.labels(run=state.run_id, reason=reason).inc()
        self.tier_metrics.tier_failed.labels(run=state.run_id, tier=self.tier).inc()
        state.failed_attempt(pending.name, reason, str(exc), self.clock.time())
        # Counted as a storage error only when the store said no; a local I/O error or
        # a manifest that would not build is a failed checkpoint, not a storage error.
        if isinstance(exc, StorageError) and kind is not None:
            self.metrics.storage_errors.labels(operation="checkpoint", kind=kind).inc()
            if exc.destination_unusable:  # decided by the backend that saw it
                self.metrics.destination_up.set(0)
                self.unusable = exc
        log.error(
            "checkpoint_failed",
            error=str(exc),
            code=code,
            reason=reason,
            attempt=pending.failures,
            retry_in=round(delay, 1),
            exc_info=exc if traceback else None,
        )
        if isinstance(exc, StorageError) and exc.code in NO_SPACE_CODES:
            # A full destination: what this attempt sent holds the space a smaller
            # checkpoint needs, and it cannot commit until space is freed anyway.
            log.warning("checkpoint_discarded_for_space", code=code)
            await asyncio.to_thread(self._discard, state.run_id, pending.name)
        self._changed()

    async def crashed(self, pending: Pending, exc: Exception) -> None:
        """A bug or an input nobody foresaw: failed and backed off like any other
        failure (reason "local"), with its traceback in the log."""
        log = self.log.bind(run=pending.run, checkpoint=pending.name)
        result = ShipResult(Outcome.FAILED, error=exc)
        await self.failed(self.runs[pending.run], pending, result, log, traceback=True)


def claimed_hook(
    hooks: PipelineHooks, early: EarlyUploads, emergency: Emergency, pending: Pending
) -> Callable[[ShipRequest], Awaitable[None] | None] | None:
    """``ShipRequest.on_claimed``: the pipeline's ``on_claimed`` told whether the checkpoint
    is an emergency one and how long the notice leaves. When the push to peers goes first,
    the checkpoint's early uploads pause (their parts kept) and the ship sends the rest
    once it may."""
    hook = hooks.on_claimed
    if hook is None:
        return None

    def claimed(request: ShipRequest) -> Awaitable[None] | None:
        first = hook(request, pending.emergency, emergency.seconds_left())
        if first is not None:
            early.pause(request.run, request.name)
        return first

    return claimed
