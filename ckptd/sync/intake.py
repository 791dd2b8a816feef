"""From one look at a checkpoint to what follows from it.

A look (``look``, on a hint's timer or a rescan) lists the checkpoint and applies its
completion rule (with many nodes: ``ClusterCoordination.judge``). A complete one goes
into the queue, first if it completed during a notice (then older uploads may have to
make way: ``Emergency.make_way``); one not complete yet has its closed, quiet files sent
early (``[[watch]] ship_early``, ``ckptd.sync.early``) and is looked at again when the
rule or the next file to settle says; one that vanished has what it sent early removed
(``cleanup.discard``) unless it is committed or its part is written. A checkpoint being
shipped whose files changed has its transfers told to stop at once. Early shipping that
raises (a claim the store refuses, the journal's disk full) is said
(``early_ship_failed``), counted (``ckptd_task_failures_total{task="early"}``) and tried
again at a later look; it never fails the look, whose verdict stands without it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from ckptd.commit.assemble import ClusterShip
from ckptd.layouts.base import CheckpointListing, Completion, step_of
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics
from ckptd.runtime.tasks import doubling
from ckptd.sync.coordination import ClusterCoordination
from ckptd.sync.early import EarlyUploads
from ckptd.sync.emergency import Emergency
from ckptd.sync.hooks import PipelineHooks
from ckptd.sync.journal import Journal
from ckptd.sync.lineage import restored_as
from ckptd.sync.queue import Pending, ShipQueue, completed_in_emergency
from ckptd.sync.request import fingerprint, fingerprint_id
from ckptd.sync.runs import RunState, lineage_of
from ckptd.sync.scanner import snapshot

# Early shipping that raised is tried again after this, doubling to the max meanwhile.
EARLY_RETRY_SECONDS = 2.0
EARLY_RETRY_MAX_SECONDS = 60.0


class Intake:
    """Looks at checkpoints and queues the complete ones (module doc)."""

    def __init__(
        self,
        runs: Mapping[str, RunState],
        queue: ShipQueue,
        early: EarlyUploads,
        cluster: ClusterCoordination,
        emergency: Emergency,
        *,
        journal: Journal,
        metrics: Metrics,
        clock: Clock,
        log: Any,
        hooks: PipelineHooks,
        look_again: Callable[[str, str, float], None],
        changed: Callable[[], None],
        wake: Callable[[], None],
        discard: Callable[[str, str], None],
    ) -> None:
        self.runs = runs
        self.queue = queue
        self.early = early
        self.cluster = cluster
        self.emergency = emergency
        self.journal = journal
        self.metrics = metrics
        self.clock = clock
        self.log = log
        self.hooks = hooks
        # The pipeline's ``hint`` (look again after a delay), its gauges' refresh, a
        # nudge to its worker, and ``cleanup.discard`` of one checkpoint (blocking).
        self._look_again = look_again
        self._changed = changed
        self._wake = wake
        self._discard = discard
        # Early shipping's failures in a row, per checkpoint (``_early_failed``).
        self._early_failures: dict[tuple[str, str], int] = {}

    async def look(self, run_id: str, name: str) -> Completion | None:
        """Apply the completion rule to one checkpoint now; queue it if complete."""
        state = self.runs[run_id]
        if name in state.failed_for_good and name not in state.conflicts:
            return None
        listing = await asyncio.to_thread(snapshot, state.dir, name)
        if listing is not None and not await self._content_is_new(state, listing):
            return None
        current, ctx = state.current, state.current_ctx
        if (ctx is not None and current is not None and current.name == name) and (
            listing is None or fingerprint(listing.files) != state.current_files
        ):
            # Deleted (save_total_limit rotation) or rewritten mid-upload: stop
            # sending now rather than at the final check.
            ctx.cancel.set()
        if listing is None:
            await self._vanished(state, name)
            return None
        if name not in state.seen:
            state.seen.add(name)
            self.log.info(
                "checkpoint_detected", run=run_id, checkpoint=name, files=len(listing.files)
            )
        if self.cluster.committer is not None and await self.cluster.superseded(
            state, name, listing.newest_mtime_ns / 1e9
        ):
            return None
        self._report_unshippable(state, listing)
        verdict, role = self.cluster.judge(state, listing)
        await self.cluster.withdraw_if_resaved(state, listing)
        if not verdict.complete:
            recheck = verdict.recheck_after
            early_wait = await self._ship_early(state, listing)
            if early_wait is not None:
                recheck = early_wait if recheck is None else min(recheck, early_wait)
            if recheck is not None:
                self._look_again(run_id, name, recheck + 0.05)
            return verdict
        self._queue_complete(state, listing, verdict, role)
        return verdict

    async def _content_is_new(self, state: RunState, listing: CheckpointListing) -> bool:
        """Whether ``listing`` holds content not yet committed nor refused: a committed
        (or refused) name whose files changed since is new content, said as such (a
        re-save under a name); one ``ckptd restore`` wrote, unchanged, is committed."""
        name, run = listing.name, state.run_id
        if name not in state.committed and name not in state.conflicts:
            # Neither committed nor refused (every look at a checkpoint being saved): its
            # fingerprint, a sort of every file, is not needed.
            return await self._not_restored(state, listing)
        local = fingerprint_id(listing.files)
        if name in state.committed:
            known = state.committed_files.get(name, "")
            if not known or known == local:
                return False
            self.log.warning(
                "checkpoint_resaved_after_commit",
                run=run,
                checkpoint=name,
                reason="its files changed after it was committed: the new content ships "
                "only if its trajectory is not the committed one's, else it is a conflict",
            )
            state.committed.discard(name)
            state.committed_files.pop(name, None)
            await asyncio.to_thread(self.journal.forget_committed, run, name)
        refused = state.conflicts.get(name)
        if refused is not None:
            if refused[0] == local:
                return False
            state.conflicts.pop(name, None)
            state.failed_for_good.pop(name, None)
            await asyncio.to_thread(self.journal.forget_conflict, run, name)
        return await self._not_restored(state, listing)

    async def _not_restored(self, state: RunState, listing: CheckpointListing) -> bool:
        """False for a checkpoint ``ckptd restore`` wrote and no one changed since: it
        is taken as committed (from the slot it was restored from) and said so."""
        name, run = listing.name, state.run_id
        restored = await asyncio.to_thread(restored_as, state.dir, listing)
        if restored is not None:
            local = fingerprint_id(listing.files)
            await asyncio.to_thread(
                self.journal.mark_committed,
                run,
                name,
                step_of(name),
                slot=restored,
                fingerprint=local,
            )
            state.committed.add(name)
            state.committed_files[name] = local
            self.log.info("checkpoint_restored_here", run=run, checkpoint=name, slot=restored)
            return False
        return True

    async def _vanished(self, state: RunState, name: str) -> None:
        """Gone locally: nothing left to announce or follow (a part already written
        stays waiting: the store holds all it needs)."""
        run_id, current = state.run_id, state.current
        state.awaiting.pop(name, None)
        state.announcements.pop(name, None)
        if self.queue.remove(run_id, name) is not None:
            self.log.info("checkpoint_vanished", run=run_id, checkpoint=name)
        state.seen.discard(name)
        if current is None or current.name != name:
            await self._discard_unfinished(state, name)

    def _report_unshippable(self, state: RunState, listing: CheckpointListing) -> None:
        """Log and count a checkpoint's unshippable entries, once for each set of them."""
        name = listing.name
        if listing.unshippable and state.reported_unshippable.get(name) != listing.unshippable:
            state.reported_unshippable[name] = listing.unshippable
            self.metrics.unshippable.labels(run=state.run_id).inc(len(listing.unshippable))
            self.log.error(
                "checkpoint_has_unshippable_entries",
                run=state.run_id,
                checkpoint=name,
                entries=list(listing.unshippable[:10]),
                count=len(listing.unshippable),
            )

    def _queue_complete(
        self,
        state: RunState,
        listing: CheckpointListing,
        verdict: Completion,
        role: ClusterShip | None,
    ) -> None:
        """A complete checkpoint into the queue, unless it is there already, waits for
        other nodes, or is committed."""
        run_id, name = state.run_id, listing.name
        waiting = state.waiting.get(name)
        if role is not None and waiting is not None and waiting.save == role.save:
            return  # its part is in the store: the cluster's poll takes it from here
        if name in state.committed:
            # Committed by the worker while this look awaited the listing (a rescan
            # racing a commit): queuing it again would ship and count it twice.
            return
        total = sum(f.size for f in verdict.files)
        pending = Pending(
            run_id,
            name,
            step_of(name),
            self.clock.time(),
            emergency=completed_in_emergency(listing.newest_mtime_ns / 1e9, self.emergency.since),
            total_bytes=total,
        )
        added = self.queue.add(pending)
        # Or queued before the notice it turns out to be the save for (the trainer saved on
        # another node's notice that reached this daemon a moment later): it now goes
        # first, and no older upload holds it back.
        promoted = (
            not added
            and self._saved_for_the_notice(state, listing)
            and self.queue.make_emergency(run_id, name) is not None
        )
        if pending.emergency and (added or promoted):
            self.log.warning("emergency_checkpoint_complete", run=run_id, checkpoint=name)
            self.hooks.on_emergency_complete(run_id, name)
            self.emergency.make_way(total)
        if not added:
            return
        self.log.info(
            "checkpoint_complete",
            run=run_id,
            checkpoint=name,
            layout=verdict.layout,
            bytes=total,
            files=len(verdict.files),
        )
        self._changed()
        self._wake()

    def _saved_for_the_notice(self, state: RunState, listing: CheckpointListing) -> bool:
        """Whether a checkpoint queued before this daemon heard of the notice is the save
        made for it: written after the notice began (its origin's time, for one followed
        from another node), with no slack, and no newer checkpoint of the run seen. A
        routine save made a moment before a local notice stays routine: the trainer's
        save for the notice comes after it."""
        since, step = self.emergency.since, step_of(listing.name)
        if since is None or step is None or listing.newest_mtime_ns / 1e9 < since:
            return False
        return all((step_of(other) or 0) <= step for other in state.seen)

    async def _ship_early(self, state: RunState, listing: CheckpointListing) -> float | None:
        """Send the closed, quiet files of a checkpoint not complete yet (``ckptd.sync.early``);
        returns when to look again for the next file to settle."""
        run, name = state.run_id, listing.name
        current = state.current
        if (
            not state.watch.ship_early
            # Never committed as it is (a dangling link, say): nothing to send ahead.
            or listing.unshippable
            or (run, name) in self.queue
            or (current is not None and current.name == name)
            or name in state.waiting
        ):
            return None
        emergency = completed_in_emergency(listing.newest_mtime_ns / 1e9, self.emergency.since)
        if self.emergency.since is not None and not emergency:
            return None  # during a notice only the checkpoint being written goes early
        try:
            trajectory, _ = await lineage_of(state, listing)
            started, wait = await self.early.offer(
                run,
                state.dir,
                listing,
                emergency=emergency,
                now_ns=int(self.clock.time() * 1e9),
                # Read at start-up (``SyncPipeline.recover``) and kept by each commit.
                previous=state.previous,
                trajectory=trajectory.id,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - early shipping is never worth the look
            return self._early_failed(run, name, exc)
        self._early_failures.pop((run, name), None)
        if started and emergency:
            self.emergency.make_way(started)
        return wait

    def _early_failed(self, run: str, name: str, exc: Exception) -> float:
        """Early shipping of ``run/name`` raised (its claim's write refused, the journal's
        disk full): said, counted, and tried again at a later look, after a backoff that
        doubles up to ``EARLY_RETRY_MAX_SECONDS``. The completion rule does not wait on
        it: the ordinary ship sends whatever did not go early."""
        key = (run, name)
        failures = self._early_failures[key] = self._early_failures.get(key, 0) + 1
        delay = doubling(failures, EARLY_RETRY_SECONDS, EARLY_RETRY_MAX_SECONDS)
        self.metrics.task_failures.labels(task="early").inc()
        self.log.warning(
            "early_ship_failed",
            run=run,
            checkpoint=name,
            error=str(exc),
            error_type=type(exc).__name__,
            retry_in_seconds=delay,
        )
        return delay

    async def _discard_unfinished(self, state: RunState, name: str) -> None:
        """A checkpoint deleted locally before it was complete (or while queued): stop
        its early uploads, then delete what it sent and abort its multipart uploads,
        unless it is committed or (many nodes) its part is written."""
        run = state.run_id
        await self.early.cancel(run, name)
        if name in state.waiting or name in state.committed:
            return
        if (run, name) not in await asyncio.to_thread(self.journal.uncommitted):
            return
        if await asyncio.to_thread(self.cluster.part_written, run, name):
            return
        self.log.info("checkpoint_discarded_before_complete", run=run, checkpoint=name)
        await asyncio.to_thread(self._discard, run, name)
