"""The sync pipeline: from "a checkpoint may have changed" to "it is committed".

Inputs are hints (file events, rescans, start-up): each makes the pipeline look at one
checkpoint again, after a short debounce. A checkpoint whose completion rule holds goes
into the ``ShipQueue`` (``ckptd.sync.queue``: the order, the backoff, the emergency
rules); one worker takes the next one and hands it to the ``Shipper``
(``ckptd.sync.ship``), whose outcome this module acts on (metrics, logs, what to try
again). So this module keeps only hints, timers, the worker loop and the state
``/v1/status`` shows; every decision it takes is made by a pure function elsewhere.
All time is read from one injected ``Clock``.

With many nodes (``cluster.nodes > 1``) the verdict has two sources (``_judge``): a node
whose own rule holds on a commit record announces the save and ships; any other node
waits until ``poll_cluster`` finds the checkpoint announced, then ships once its own
files are quiet and closed (``ckptd.cluster.protocol`` says why that is enough, per framework).
A part written but not yet joined by every node's is "waiting": ``poll_cluster`` tries
the global commit again every ``cluster.poll_interval_seconds``.

A checkpoint not complete yet has its closed, quiet files sent early (``[[watch]]
ship_early``, ``ckptd.sync.early``); the ship that follows completion takes them over.
One deleted before completion has what was sent early removed (``cleanup.discard``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any

from ckptd import layouts
from ckptd.cluster.assemble import (
    Assembly,
    AssemblyResult,
    ClusterShip,
    Committer,
    judge_role,
    try_commit,
    withdraw,
)
from ckptd.cluster.protocol import ABANDON_GRACE_SECONDS, save_id, superseded
from ckptd.config import Settings
from ckptd.core.manifest import Manifest, ManifestError
from ckptd.layouts.base import CheckpointListing, Completion, step_of
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.environment import describe
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.runtime.yielding import idle_this_thread, lower_this_thread, priority_of
from ckptd.storage.base import NO_SPACE_CODES, Storage, StorageError, storage_error_kind
from ckptd.store.repository import Repository
from ckptd.sync import cleanup
from ckptd.sync.deadline import plan_flush
from ckptd.sync.early import EarlyUploads
from ckptd.sync.housekeeping import after_commit
from ckptd.sync.journal import Journal
from ckptd.sync.queue import (
    EMERGENCY_MTIME_SLACK,
    InFlight,
    Pending,
    ShipQueue,
    completed_in_emergency,
    uploads_to_pause,
)
from ckptd.sync.rate import RateMeter
from ckptd.sync.runs import Progress, RunState, WaitingEntry
from ckptd.sync.scanner import list_candidates, snapshot
from ckptd.sync.ship import (
    ClusterConflictError,
    Outcome,
    Shipper,
    ShipRequest,
    ShipResult,
    fingerprint,
)
from ckptd.sync.transfer import TransferContext, Transfers

# Coalesces the burst of events one save produces into one look at the checkpoint.
EVENT_DEBOUNCE_SECONDS = 0.2
# ...but a burst that goes on (a save writing GiBs) is looked at at least this often, or
# the files it closed meanwhile would wait for its end to go early.
EVENT_MAX_DELAY_SECONDS = 1.0

CommitHook = Callable[[str, str, int, bool], Awaitable[None]]
# (run, checkpoint, complete at (wall clock), first file -> last file written (s),
# complete -> committed (s), emergency): what a committed checkpoint cost.
CostHook = Callable[[str, str, float, float, float, bool], None]


class SyncPipeline:
    """Detects complete checkpoints and commits them to ``storage``."""

    def __init__(
        self,
        settings: Settings,
        storage: Storage,
        journal: Journal,
        metrics: Metrics,
        *,
        clock: Clock = SYSTEM_CLOCK,
        tier: str = "primary",
        tier_metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.repo = Repository(storage)
        # Several tiers: one pipeline each (``ckptd.daemon.service``). ``metrics`` is the first
        # tier's (the unlabelled contract); every tier also counts under its ``tier``
        # label in ``tier_metrics`` (the exported one).
        self.tier = tier
        self.tier_metrics = tier_metrics if tier_metrics is not None else metrics
        # Further tiers start nothing new while the first is in emergency mode.
        self.held: Callable[[], bool] = lambda: False
        # Local checkpoints local retention may delete: committed here (overridden with
        # several tiers: committed in every tier).
        self.locally_deletable: Callable[[str], set[str]] = lambda run: set(
            self.runs[run].committed
        )
        self.journal = journal
        self.metrics = metrics
        self.clock = clock
        # Several tiers: every line says which one (one tier: as before).
        self.log = get_logger(tier=tier) if settings.tiers else get_logger()
        dest = settings.destination
        self.rate = RateMeter(clock=clock.monotonic)
        # Authenticated checkpoints: digests in the upload's read pass, manifests signed.
        self.keys = settings.authentication.key_ring()
        self.transfers = Transfers(
            storage,
            journal,
            part_size=dest.part_size_mib * 1024 * 1024,
            concurrency=dest.concurrency,
            on_bytes=self._count_bytes,
            drop_page_cache=settings.resources.drop_page_cache,
            thread_setup=self._lower_worker,
            urgent_setup=self._lower_urgent_worker,
            is_urgent=self.urgent,
            digests=self.keys is not None,
        )
        self.shipper = Shipper(
            self.repo,
            self.transfers,
            journal,
            clock,
            file_slots=max(4, dest.concurrency * 2),
            log=self.log,
            keys=self.keys,
        )
        self.queue = ShipQueue()
        self.early = EarlyUploads(
            self.transfers, journal, slots=max(2, dest.concurrency), log=self.log
        )
        self.runs: dict[str, RunState] = {
            w.effective_run_id: RunState.of(w) for w in settings.watch
        }
        for run in self.runs:
            self.metrics.init_run(run)
            self.tier_metrics.init_tier(run, tier)
        self._wake = asyncio.Event()
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        # When the pending look at a checkpoint was first asked for (loop time).
        self._first_hint: dict[tuple[str, str], float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._evaluating = 0
        # Emergency mode (a preemption notice): checkpoints completed after the notice go
        # first, and the deadline decides whether an older upload may finish.
        self.emergency_since: float | None = None
        self.emergency_deadline: datetime | None = None
        self.on_emergency_complete: Callable[[str, str], None] = lambda run, name: None
        self.on_commit: CommitHook | None = None
        # The last failure by which the store refused this node itself (credentials,
        # access, bucket): `ckptd run --once` ends on it. Cleared by a commit.
        self.unusable: StorageError | None = None
        self.on_cost: CostHook | None = None
        cluster = settings.cluster
        self.committer: Committer | None = (
            Committer(cluster.nodes, cluster.rank, self.shipper.host, describe())
            if cluster.multi_node
            else None
        )
        # A checkpoint below the newest committed step, waiting longer than this, is given
        # up (``cluster.superseded``), here and by retention's sweep.
        self.abandon_grace_seconds = ABANDON_GRACE_SECONDS
        self._priority_problems: set[str] = set()
        # The daemon is going away (SIGTERM): what it ships until then is urgent.
        self.flushing = False

    def _lower_worker(self) -> None:
        """Each transfer thread moves itself down to [resources] as it starts (under
        ``ckptd run`` it inherited the niceness from the main thread already), and to
        SCHED_IDLE with ``cpu_policy = "idle"`` (``ckptd.runtime.yielding``)."""
        problems = lower_this_thread(priority_of(self.settings.resources))
        if self.settings.resources.cpu_policy == "idle":
            problems += idle_this_thread()
        self._report_priority(problems)

    def _lower_urgent_worker(self) -> None:
        """A thread of the urgent pool (``Transfers``): the niceness, never SCHED_IDLE."""
        self._report_priority(lower_this_thread(priority_of(self.settings.resources)))

    def _report_priority(self, problems: list[str]) -> None:
        for problem in problems:
            if problem not in self._priority_problems:
                self._priority_problems.add(problem)
                self.log.warning("priority_not_lowered", problem=problem)

    def urgent(self) -> bool:
        """Whether what ships now must not wait for an idle CPU: a preemption notice is
        being handled, or the daemon is flushing before it goes (``flushing``)."""
        return self.emergency_since is not None or self.flushing

    def _count_bytes(self, run: str, n: int) -> None:
        self.metrics.upload_bytes.labels(run=run).inc(n)
        self.rate.add(n)
        state = self.runs.get(run)
        if state is not None and state.current is not None:
            state.current.sent_bytes += n

    def watch_dirs(self) -> list[Path]:
        """Every watched run's directory (where the responder writes notice files)."""
        return [state.dir for state in self.runs.values()]

    # -- start-up --------------------------------------------------------------------

    async def recover(self) -> None:
        """Settle what a previous process left in the journal (``cleanup.recover``) and
        learn what is committed already."""
        dirs = {run: state.dir for run, state in self.runs.items()}
        await asyncio.to_thread(cleanup.recover, self.repo, self.journal, dirs, self.log)
        await asyncio.to_thread(
            functools.partial(
                cleanup.discard_vanished,
                self.repo,
                self.journal,
                dirs,
                self._part_written,
                self.log,
                whole_prefix=self.committer is None,
            )
        )
        for state in self.runs.values():
            state.committed.update(name for name, _ in self.journal.committed(state.run_id))

    def _part_written(self, run: str, name: str) -> bool:
        """Many nodes: whether this node's part of ``run/name`` is in the store (its
        objects then belong to a save the other nodes may still complete). Blocking."""
        committer = self.committer
        return committer is not None and self.repo.read_part(run, name, committer.rank) is not None

    # -- hints -------------------------------------------------------------------------

    def hint(self, run_id: str, name: str | None, delay: float = EVENT_DEBOUNCE_SECONDS) -> None:
        """Something under ``run_id``'s dir changed (``name`` None: look at all of it).
        Must be called on the event loop thread."""
        state = self.runs.get(run_id)
        if state is None:
            return
        if name is None:
            for candidate in state.seen - state.committed:
                self.hint(run_id, candidate, delay)
            self._spawn(self.rescan(run_id))
            return
        key = (run_id, name)
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        if name in state.committed:
            self._first_hint.pop(key, None)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if old is None:
            self._first_hint[key] = now
        else:  # a burst: no later than EVENT_MAX_DELAY_SECONDS after its first hint
            first = self._first_hint.setdefault(key, now)
            delay = min(delay, max(0.0, first + EVENT_MAX_DELAY_SECONDS - now))

        def fire() -> None:
            self._first_hint.pop(key, None)
            self._spawn(self.evaluate(run_id, name))

        self._timers[key] = loop.call_later(delay, fire)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def rescan(self, run_id: str) -> None:
        """Look at every checkpoint of a run (start-up, periodic, lost events)."""
        state = self.runs[run_id]
        if not state.dir.is_dir():
            return
        names = await asyncio.to_thread(list_candidates, state.dir)
        for name in names:
            if name not in state.committed:
                await self.evaluate(run_id, name)

    def _verdict(self, state: RunState, listing: CheckpointListing) -> Completion:
        """The run's completion rule applied to ``listing`` now."""
        return layouts.evaluate(
            state.watch.layout, listing, int(self.clock.time() * 1e9), state.rules
        )

    def _judge(
        self, state: RunState, listing: CheckpointListing
    ) -> tuple[Completion, ClusterShip | None]:
        """The verdict on ``listing`` and, with many nodes, how this node ships it: as the
        announcer (its rule holds on the commit record) or as a follower of the save the
        store announced (module doc). One node: the rule's verdict, unchanged."""
        verdict = self._verdict(state, listing)
        if self.committer is None:
            return verdict, None
        return judge_role(state, listing, verdict, self.committer, self.clock.time())

    async def _superseded(
        self, state: RunState, name: str, since: float, *, refresh: bool = False
    ) -> bool:
        """Many nodes: whether a checkpoint (waiting or written since ``since``) can never
        commit any more (``cluster.superseded``); if so it is given up and left alone.
        ``refresh`` reads LATEST again: another node may have committed a later step."""
        previous = await self._previous_manifest(state)
        steps = [state.last_step, previous.step if previous else None]
        if refresh:
            latest = await asyncio.to_thread(self.repo.read_latest, state.run_id)
            steps.append(latest.step if latest else None)
        newest = max((s for s in steps if s is not None), default=None)
        entry = state.waiting.get(name)
        since = min(since, entry.since) if entry else since
        if not superseded(
            step_of(name), newest, since, self.clock.time(), self.abandon_grace_seconds
        ):
            return False
        state.forget_cluster(name)
        self.queue.remove(state.run_id, name)
        state.failed_for_good[name] = (
            f"superseded: step {newest} committed and not every node's part arrived"
        )
        self.log.warning(
            "checkpoint_superseded", run=state.run_id, checkpoint=name, newest_step=newest
        )
        self.update_gauges()
        return True

    async def _withdraw_if_resaved(self, state: RunState, listing: CheckpointListing) -> None:
        """Many nodes: this node announced a save whose files have since changed (a
        re-save under the same name): withdraw it (``assemble.withdraw``)."""
        committer = self.committer
        if committer is None:
            return
        run, name = state.run_id, listing.name
        entry = state.waiting.get(name)
        known = state.announcements.get(name)  # after a restart: found by poll_cluster
        if entry is not None and entry.announced:
            save = entry.save
        elif known is not None and known.node_rank == committer.rank:
            save = known.save
        else:
            return
        if save_id((f.path, f.size, f.mtime_ns) for f in listing.files) == save:
            return
        state.waiting.pop(name, None)
        state.announcements.pop(name, None)
        try:
            await asyncio.to_thread(withdraw, self.repo, run, name, committer.rank, save)
        except StorageError as exc:
            self.log.warning(
                "announcement_withdraw_failed", run=run, checkpoint=name, error=str(exc)
            )
            return
        self.log.info("announcement_withdrawn", run=run, checkpoint=name, save=save)
        self.update_gauges()

    async def evaluate(self, run_id: str, name: str) -> Completion | None:
        """Apply the completion rule to one checkpoint now; queue it if complete."""
        # Counted from before the timer is dropped to after a verdict is queued, so idle()
        # never sees the gap between "timer fired" and "checkpoint pending".
        self._evaluating += 1
        try:
            return await self._evaluate(run_id, name)
        finally:
            self._evaluating -= 1

    async def _evaluate(self, run_id: str, name: str) -> Completion | None:
        state = self.runs[run_id]
        self._timers.pop((run_id, name), None)
        if name in state.committed or name in state.failed_for_good:
            return None
        listing = await asyncio.to_thread(snapshot, state.dir, name)
        current, ctx = state.current, state.current_ctx
        if (ctx is not None and current is not None and current.name == name) and (
            listing is None or fingerprint(listing.files) != state.current_files
        ):
            # Deleted (save_total_limit rotation) or rewritten mid-upload: stop
            # sending now rather than at the final check.
            ctx.cancel.set()
        if listing is None:
            # Gone locally: nothing left to announce or follow (a part already written
            # stays waiting: the store holds all it needs).
            state.awaiting.pop(name, None)
            state.announcements.pop(name, None)
            if self.queue.remove(run_id, name) is not None:
                self.log.info("checkpoint_vanished", run=run_id, checkpoint=name)
            state.seen.discard(name)
            if current is None or current.name != name:
                await self._discard_unfinished(state, name)
            return None
        if name not in state.seen:
            state.seen.add(name)
            self.log.info(
                "checkpoint_detected", run=run_id, checkpoint=name, files=len(listing.files)
            )
        if self.committer is not None and await self._superseded(
            state, name, listing.newest_mtime_ns / 1e9
        ):
            return None
        if listing.unshippable and state.reported_unshippable.get(name) != listing.unshippable:
            state.reported_unshippable[name] = listing.unshippable
            self.metrics.unshippable.labels(run=run_id).inc(len(listing.unshippable))
            self.log.error(
                "checkpoint_has_unshippable_entries",
                run=run_id,
                checkpoint=name,
                entries=list(listing.unshippable[:10]),
                count=len(listing.unshippable),
            )
        verdict, role = self._judge(state, listing)
        await self._withdraw_if_resaved(state, listing)
        if not verdict.complete:
            recheck = verdict.recheck_after
            early_wait = await self._ship_early(state, listing)
            if early_wait is not None:
                recheck = early_wait if recheck is None else min(recheck, early_wait)
            if recheck is not None:
                self.hint(run_id, name, delay=recheck + 0.05)
            return verdict
        waiting = state.waiting.get(name)
        if role is not None and waiting is not None and waiting.save == role.save:
            return verdict  # its part is in the store: poll_cluster takes it from here
        if name in state.committed:
            # Committed by the worker while this look awaited the listing (a rescan
            # racing a commit): queuing it again would ship and count it twice.
            return verdict
        total = sum(f.size for f in verdict.files)
        pending = Pending(
            run_id,
            name,
            step_of(name),
            self.clock.time(),
            emergency=completed_in_emergency(listing.newest_mtime_ns / 1e9, self.emergency_since),
            total_bytes=total,
        )
        if not self.queue.add(pending):
            return verdict
        if pending.emergency:
            self.log.warning("emergency_checkpoint_complete", run=run_id, checkpoint=name)
            self.on_emergency_complete(run_id, name)
            self._make_way(total)
        self.log.info(
            "checkpoint_complete",
            run=run_id,
            checkpoint=name,
            layout=verdict.layout,
            bytes=total,
            files=len(verdict.files),
        )
        self.update_gauges()
        self._wake.set()
        return verdict

    # -- early shipping ----------------------------------------------------------------

    async def _ship_early(self, state: RunState, listing: CheckpointListing) -> float | None:
        """Send the closed, quiet files of a checkpoint not complete yet (module doc);
        returns when to look again for the next file to settle."""
        run, name = state.run_id, listing.name
        current = state.current
        if (
            not state.watch.ship_early
            or (run, name) in self.queue
            or (current is not None and current.name == name)
            or name in state.waiting
        ):
            return None
        emergency = completed_in_emergency(listing.newest_mtime_ns / 1e9, self.emergency_since)
        if self.emergency_since is not None and not emergency:
            return None  # during a notice only the checkpoint being written goes early
        started, wait = await self.early.offer(
            run,
            state.dir,
            listing,
            emergency=emergency,
            now_ns=int(self.clock.time() * 1e9),
        )
        if started and emergency:
            self._make_way(started)
        return wait

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
        if await asyncio.to_thread(self._part_written, run, name):
            return
        self.log.info("checkpoint_discarded_before_complete", run=run, checkpoint=name)
        await asyncio.to_thread(self._discard, run, name)

    def _discard(self, run: str, name: str) -> None:
        """``cleanup.discard``; with one node the checkpoint's whole prefix is ours."""
        cleanup.discard(
            self.repo, self.journal, run, name, self.log, whole_prefix=self.committer is None
        )

    # -- emergency mode ------------------------------------------------------------------

    def enter_emergency(self, deadline: datetime | None) -> None:
        """A notice arrived now: what completes from now on goes first."""
        self.emergency_since = self.clock.time()
        self.emergency_deadline = deadline
        for state in self.runs.values():
            for name in state.seen - state.committed:
                self.hint(state.run_id, name, delay=0.0)
        self._wake.set()

    def leave_emergency(self) -> None:
        self.emergency_since = None
        self.emergency_deadline = None
        self.metrics.emergency_eta.set(0)

    def _seconds_left(self) -> float | None:
        if self.emergency_deadline is None:
            return None
        return self.emergency_deadline.timestamp() - self.clock.time()

    def _in_flight(self) -> list[tuple[InFlight, TransferContext]]:
        found = self.early.in_flight()
        for state in self.runs.values():
            current, ctx = state.current, state.current_ctx
            if current is None or ctx is None:
                continue
            pending = self.queue.get(state.run_id, current.name)
            upload = InFlight(
                state.run_id,
                current.name,
                current.total_bytes,
                current.sent_bytes,
                emergency=pending is not None and pending.emergency,
            )
            found.append((upload, ctx))
        return found

    def _make_way(self, emergency_bytes: int) -> None:
        """Pause an older upload in flight unless both can finish before the deadline;
        its finished parts stay in the journal and it resumes afterwards."""
        in_flight = self._in_flight()
        pause, keep = uploads_to_pause(
            [u for u, _ in in_flight], emergency_bytes, self.rate.rate(), self._seconds_left()
        )
        for u in keep:
            self.log.info(
                "older_upload_continues", run=u.run, checkpoint=u.name, bytes_left=u.bytes_left
            )
        for u, ctx in in_flight:
            if u in pause:
                self.log.warning(
                    "older_upload_paused", run=u.run, checkpoint=u.name, bytes_left=u.bytes_left
                )
                ctx.pause.set()
        self._update_eta()

    def _update_eta(self) -> None:
        """Log and export when the emergency work will be committed at the measured rate."""
        if self.emergency_since is None:
            return
        left = self.queue.emergency_bytes() - sum(
            u.sent_bytes for u, _ in self._in_flight() if u.emergency
        )
        plan = plan_flush(max(0, left), self.rate.rate(), self._seconds_left())
        if plan.eta_seconds is not None:
            self.metrics.emergency_eta.set(plan.eta_seconds)
        if plan.will_make_it is False:
            self.log.warning(
                "emergency_flush_at_risk",
                eta_seconds=round(plan.eta_seconds or 0, 1),
                seconds_left=plan.seconds_left,
            )

    # -- the worker ------------------------------------------------------------------

    async def work(self, stop: asyncio.Event) -> None:
        """Ship pending checkpoints until ``stop`` is set (the current one finishes first)."""
        while not stop.is_set():
            pending = self.queue.next(self.clock.monotonic())
            # The checkpoint written since a notice goes first, even before it is
            # complete: while its files are sent early, no older checkpoint starts.
            held = pending is not None and (
                (not pending.emergency and self.early.emergency_active()) or self.held()
            )
            if pending is None or held:
                self._wake.clear()
                waiters = [
                    asyncio.ensure_future(self._wake.wait()),
                    asyncio.ensure_future(stop.wait()),
                ]
                await asyncio.wait(
                    waiters,
                    timeout=0.2 if held else self.queue.next_wakeup(self.clock.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for w in waiters:
                    w.cancel()
                continue
            try:
                await self.ship(pending)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one checkpoint never stops the worker
                # A bug or an input nobody foresaw: this checkpoint backs off and is
                # said to have failed; every other checkpoint still ships.
                await self._crashed(pending, exc)

    async def _crashed(self, pending: Pending, exc: Exception) -> None:
        """A bug or an input nobody foresaw: failed and backed off like any other
        failure (reason "local"), with its traceback in the log."""
        log = self.log.bind(run=pending.run, checkpoint=pending.name)
        result = ShipResult(Outcome.FAILED, error=exc)
        await self._failed(self.runs[pending.run], pending, result, log, traceback=True)

    def retry_now(self) -> None:
        """The store is back: end every backoff and ship the backlog now."""
        self.queue.retry_now()
        self._wake.set()

    async def drain_once(self) -> bool:
        """Ship everything pending now (``ckptd run --once``); True if all committed."""
        ok = True
        while (pending := self.queue.next(self.clock.monotonic())) is not None:
            try:
                ok = await self.ship(pending) and ok
            except Exception as exc:  # noqa: BLE001 - as in work(): said, then backed off
                await self._crashed(pending, exc)
                ok = False
        # Failures left in backoff count as not done.
        return ok and not len(self.queue)

    # -- shipping one checkpoint --------------------------------------------------------

    async def ship(self, pending: Pending) -> bool:
        """Ship one queued checkpoint and act on the outcome; True when committed."""
        state = self.runs[pending.run]
        run, name = pending.run, pending.name
        listing = await asyncio.to_thread(snapshot, state.dir, name)
        verdict, role = self._judge(state, listing) if listing else (None, None)
        if listing is None or verdict is None or not verdict.complete:
            self.queue.remove(run, name)
            self.update_gauges()
            if listing is not None:
                self.hint(run, name)
            return False
        ctx = TransferContext(run, name)

        def started(total_bytes: int) -> None:
            state.current = Progress(name, self.clock.time(), total_bytes)

        request = ShipRequest(
            run,
            state.dir,
            listing,
            verdict,
            await self._previous_manifest(state),
            ctx,
            on_started=started,
            on_copied=lambda n: self.metrics.copied_bytes.labels(run=run).inc(n),
            cluster=role,
            early=self.early.take(run, name),
        )
        state.current_files, state.current_ctx = fingerprint(listing.files), ctx
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
            await self._committed(state, pending, result, log)
            if self.on_cost is not None and result.commit is not None:
                upload = max(0.0, self.clock.time() - pending.completed_at)
                self.on_cost(run, name, pending.completed_at, write_span, upload, pending.emergency)
            return True
        if result.outcome is Outcome.PAUSED:
            log.warning("checkpoint_paused")
        elif result.outcome is Outcome.CHANGED:
            await self._abandon(state, pending, str(result.error), log)
        elif result.outcome is Outcome.CONFLICT:
            self.queue.remove(run, name)
            self._conflict(state, name, result.error, log)
        elif result.outcome is Outcome.WAITING:
            self.queue.remove(run, name)
            self._waiting(state, name, role, result.assembly, log, emergency=pending.emergency)
        else:
            await self._failed(state, pending, result, log)
        return False

    async def _committed(
        self, state: RunState, pending: Pending, result: ShipResult, log: Any
    ) -> None:
        manifest = result.manifest
        assert manifest is not None  # an Outcome.COMMITTED always carries it
        self.unusable = None
        self._mark_committed(state, manifest, log, already=result.already_committed)
        if self.on_commit is not None:
            await self.on_commit(
                state.run_id, pending.name, manifest.total_bytes, pending.emergency
            )
        if result.commit is None:
            return  # committed before this attempt: nothing was shipped now
        if self.emergency_since is None:  # never spend a preemption's seconds on deletes
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
                committed_here=self.locally_deletable(state.run_id),
                log=log,
                cluster_grace_seconds=None
                if self.committer is None
                else self.abandon_grace_seconds,
            )
            state.seen.difference_update(removed)
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

    def _conflict(self, state: RunState, name: str, error: Exception | None, log: Any) -> None:
        """Never committed: a manifest of other content holds the name, or (many nodes)
        two nodes' parts differ on a file."""
        state.forget_cluster(name)
        state.failed_for_good[name] = str(error)
        self.metrics.failed.labels(run=state.run_id, reason="conflict").inc()
        if isinstance(error, ClusterConflictError):
            self.metrics.cluster_conflicts.labels(run=state.run_id).inc()
        log.error("checkpoint_conflict", error=str(error))
        self.update_gauges()

    def _waiting(
        self,
        state: RunState,
        name: str,
        role: ClusterShip | None,
        assembly: AssemblyResult | None,
        log: Any,
        *,
        emergency: bool = False,
    ) -> None:
        """Many nodes: this node's part is written (or another node leads the save);
        ``poll_cluster`` takes it from here."""
        if assembly is not None and assembly.outcome is Assembly.RESAVED:
            # Another save is announced than the one just shipped: follow it.
            if assembly.announcement is not None:
                state.announcements[name] = assembly.announcement
            state.waiting.pop(name, None)
            log.info("checkpoint_follows_announcement", reason=assembly.reason)
            self.hint(state.run_id, name, delay=0.0)
            return
        if role is None:
            return
        entry = state.waiting.get(name)
        if entry is None or entry.save != role.save:
            entry = state.waiting[name] = WaitingEntry(role.save, self.clock.time())
        entry.announced = role.announcement is not None
        entry.emergency = entry.emergency or emergency
        if assembly is not None:
            entry.missing, entry.reason = assembly.missing, assembly.reason
        log.info("checkpoint_waiting_for_nodes", missing=list(entry.missing), reason=entry.reason)
        self.update_gauges()

    async def poll_cluster(self) -> None:
        """Many nodes, one look at the store: announcements this node waits for, and the
        global commit of checkpoints whose part is written (``assemble.try_commit``)."""
        committer = self.committer
        if committer is None:
            return
        for state in self.runs.values():
            run = state.run_id
            for name in list(state.awaiting):
                if name in state.committed or name in state.failed_for_good:
                    state.awaiting.pop(name, None)
                    continue
                found = await asyncio.to_thread(self.repo.read_announcement, run, name)
                known = state.announcements.get(name)
                if found is not None and (known is None or known.save != found.save):
                    state.announcements[name] = found
                    self.log.info(
                        "checkpoint_announced_by", run=run, checkpoint=name, node=found.node_rank
                    )
                    self.hint(run, name, delay=0.0)
            for name, entry in list(state.waiting.items()):
                if await self._superseded(state, name, entry.since):
                    continue
                result = await asyncio.to_thread(
                    try_commit,
                    self.repo,
                    run,
                    name,
                    committer,
                    save=entry.save,
                    now=self.clock.time(),
                    keys=self.keys,
                )
                await self._after_assembly(state, name, entry, result)

    async def _after_assembly(
        self, state: RunState, name: str, entry: WaitingEntry, result: AssemblyResult
    ) -> None:
        log = self.log.bind(run=state.run_id, checkpoint=name)
        committer = self.committer
        assert committer is not None
        if result.outcome is Assembly.COMMITTED:
            assert result.manifest is not None
            pending = Pending(
                state.run_id, name, result.manifest.step, entry.since, emergency=entry.emergency
            )
            shipped = ShipResult(
                Outcome.COMMITTED,
                result.manifest,
                already_committed=result.already_committed,
                commit=result.commit,
            )
            await self._committed(state, pending, shipped, log)
        elif result.outcome is Assembly.CONFLICT:
            self._conflict(state, name, ClusterConflictError(result.reason), log)
        elif committer.rank in result.missing and await self._superseded(
            state, name, 0.0, refresh=True
        ):
            # This node's part is gone (retention's sweep) and a later step is committed:
            # given up, never announced again.
            pass
        elif result.outcome is Assembly.RESAVED or committer.rank in result.missing:
            # A later save is announced, or this node's own part is gone: ship again
            # (the journal skips every object already sent; the part is rewritten).
            state.waiting.pop(name, None)
            if result.announcement is not None:
                state.announcements[name] = result.announcement
            else:  # withdrawn: wait for the next announcement
                state.announcements.pop(name, None)
            log.info("checkpoint_reshipping", reason=result.reason or "own part missing")
            self.update_gauges()
            self.hint(state.run_id, name, delay=0.0)
        elif (entry.missing, entry.reason) != (result.missing, result.reason):
            entry.missing, entry.reason = result.missing, result.reason
            log.info(
                "checkpoint_waiting_for_nodes", missing=list(entry.missing), reason=entry.reason
            )

    def awaiting_emergency(self) -> bool:
        """Many nodes, during a notice: a checkpoint that appeared since the notice waits
        for its announcement. That is this node's share of the emergency save, which the
        node with the commit record is about to announce: a SIGTERM flush waits for it."""
        if self.emergency_since is None:
            return False
        since = self.emergency_since - EMERGENCY_MTIME_SLACK
        return any(t >= since for s in self.runs.values() for t in s.awaiting.values())

    def cluster_busy(self) -> bool:
        """Many nodes: a checkpoint still waits for an announcement or for other nodes."""
        return any(s.awaiting or s.waiting for s in self.runs.values())

    async def _previous_manifest(self, state: RunState) -> Manifest | None:
        if not state.previous_loaded:
            try:
                latest = await asyncio.to_thread(self.repo.read_latest, state.run_id)
                if latest is not None:
                    state.previous = await asyncio.to_thread(
                        self.repo.read_manifest, state.run_id, latest.checkpoint
                    )
            except (StorageError, ManifestError) as exc:
                self.log.warning("previous_manifest_unreadable", run=state.run_id, error=str(exc))
                state.previous = None
            state.previous_loaded = True
        return state.previous

    def _mark_committed(
        self, state: RunState, manifest: Manifest, log: Any, *, already: bool
    ) -> None:
        self.journal.mark_committed(state.run_id, manifest.checkpoint, manifest.step)
        self.queue.remove(state.run_id, manifest.checkpoint)
        state.forget_cluster(manifest.checkpoint)
        run = state.run_id
        if state.record_commit(manifest) and state.last_step is not None:
            self.metrics.last_step.labels(run=run).set(state.last_step)
        self.metrics.committed.labels(run=run).inc()
        self.metrics.last_commit_ts.labels(run=run).set(self.clock.time())
        self.tier_metrics.tier_committed.labels(run=run, tier=self.tier).inc()
        self.tier_metrics.tier_last_commit_ts.labels(run=run, tier=self.tier).set(self.clock.time())
        if state.last_step is not None:
            self.tier_metrics.tier_last_step.labels(run=run, tier=self.tier).set(state.last_step)
        if already:
            log.info("checkpoint_already_committed", step=manifest.step)
        self.update_gauges()

    async def _abandon(self, state: RunState, pending: Pending, reason: str, log: Any) -> None:
        """Drop a checkpoint that changed under us (``cleanup.discard``), and look at it
        again later: if it was rewritten rather than deleted, it may become complete."""
        run, name = state.run_id, pending.name
        self.queue.remove(run, name)
        self.metrics.abandoned.labels(run=run).inc()
        log.warning("checkpoint_abandoned", reason=reason)
        await asyncio.to_thread(self._discard, run, name)
        self.update_gauges()
        self.hint(run, name, delay=max(1.0, state.rules.settle_seconds))

    async def _failed(
        self,
        state: RunState,
        pending: Pending,
        result: ShipResult,
        log: Any,
        *,
        traceback: bool = False,
    ) -> None:
        exc, code = result.error, result.reason
        delay = self.queue.failed(pending, self.clock.monotonic())
        kind = storage_error_kind(exc) if isinstance(exc, StorageError) else None
        reason = "local" if kind is None else kind if kind in ("unusable", "verify") else "storage"
        self.metrics.failed.labels(run=state.run_id, reason=reason).inc()
        self.tier_metrics.tier_failed.labels(run=state.run_id, tier=self.tier).inc()
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
        self.update_gauges()

    # -- state for metrics and /v1/status -------------------------------------------------

    def update_gauges(self) -> None:
        now = self.clock.time()
        for state in self.runs.values():
            self.metrics.pending.labels(run=state.run_id).set(len(self.queue.of_run(state.run_id)))
            self.tier_metrics.tier_pending.labels(run=state.run_id, tier=self.tier).set(
                len(self.queue.of_run(state.run_id))
            )
            self.metrics.sync_lag.labels(run=state.run_id).set(
                self.queue.sync_lag(state.run_id, now)
            )
            if self.committer is not None:
                self.metrics.waiting_for_nodes.labels(run=state.run_id).set(len(state.waiting))
        self.metrics.upload_rate.set(self.rate.rate() or 0.0)

    def idle(self) -> bool:
        """Nothing pending, nothing uploading, nothing waiting to be looked at again."""
        busy_timers = [k for k, t in self._timers.items() if not t.cancelled()]
        return (
            not busy_timers
            and not self._evaluating
            and not len(self.queue)
            and all(s.current is None for s in self.runs.values())
        )

    def status(self) -> dict[str, Any]:
        """Per-run state for ``/v1/status``."""
        self.update_gauges()
        now = self.clock.time()
        multi = self.committer is not None
        return {
            "runs": {
                run: state.status(self.queue, now, cluster=multi)
                for run, state in self.runs.items()
            }
        }

    async def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await self.early.close()
        await asyncio.to_thread(self.transfers.close)
