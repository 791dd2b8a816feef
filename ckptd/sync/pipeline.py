"""The sync pipeline: from "a checkpoint may have changed" to "it is committed".

Inputs are hints (file events, rescans, start-up): each makes the pipeline look at one
checkpoint again, after a short debounce (none for a commit record) (``Intake``, ``ckptd.sync.intake``: the
completion rule's verdict, early shipping, what a vanished checkpoint leaves). A
complete checkpoint goes into the ``ShipQueue`` (``ckptd.sync.queue``: the order, the
backoff, the emergency rules); one worker takes the next one and hands it to
``Outcomes`` (``ckptd.sync.outcomes``), which ships it (``ckptd.sync.ship``) and acts
on what became of it. When a checkpoint is looked at (the hints' timers, one look at a
time, the retries) is ``Looks``' (``ckptd.sync.looks``). So this module keeps only the
worker loop and the state ``/v1/status`` shows, and builds the parts; every decision is
made by a pure function elsewhere. All time is read from one injected ``Clock``.

The parts share the run states (``ckptd.sync.runs``) and the queue. Besides the two
above: the emergency mode a preemption notice switches on (``ckptd.sync.emergency``),
and, with many nodes, the coordination with the other nodes through the store
(``ckptd.sync.coordination``: who announces, who follows, the global commit). What
the pipeline tells the daemon and asks of it are constructor arguments
(``ckptd.sync.hooks``), never attributes assigned afterwards.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

from ckptd.commit.assemble import Committer
from ckptd.config import Settings
from ckptd.core.concurrency import lanes_for
from ckptd.layouts.base import Completion, step_of
from ckptd.repository import Repository
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.environment import describe
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import Storage, StorageError
from ckptd.sync import cleanup
from ckptd.sync.claims import Claims
from ckptd.sync.coordination import ClusterCoordination
from ckptd.sync.early import EarlyUploads
from ckptd.sync.emergency import Emergency
from ckptd.sync.hooks import PipelineHooks
from ckptd.sync.intake import Intake
from ckptd.sync.journal import Journal
from ckptd.sync.lanes import SmallFiles
from ckptd.sync.lineage import RunLineage
from ckptd.sync.looks import EVENT_DEBOUNCE_SECONDS, Looks
from ckptd.sync.outcomes import Outcomes
from ckptd.sync.priority import ThreadPriority
from ckptd.sync.queue import ShipQueue
from ckptd.sync.rate import RateMeter
from ckptd.sync.runs import RunState, previous_manifest
from ckptd.sync.ship import Shipper
from ckptd.sync.transfer import Transfers


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
        hooks: PipelineHooks | None = None,
    ) -> None:
        self.settings = settings
        self.repo = Repository(storage)
        # Several tiers: one pipeline each (``ckptd.daemon.tier_set``). ``metrics`` is the first
        # tier's (the unlabelled contract); every tier also counts under its ``tier``
        # label in ``tier_metrics`` (the exported one).
        self.tier = tier
        self.tier_metrics = tier_metrics if tier_metrics is not None else metrics
        self.hooks = hooks if hooks is not None else PipelineHooks()
        self.journal = journal
        self.metrics = metrics
        self.clock = clock
        # Several tiers: every line says which one (one tier: as before).
        self.log = get_logger(tier=tier) if settings.tiers else get_logger()
        self.rate = RateMeter(clock=clock.monotonic)
        # Authenticated checkpoints: digests in the upload's read pass, manifests signed.
        self.keys = settings.authentication.key_ring()
        self.queue = ShipQueue()
        self.runs: dict[str, RunState] = {
            w.effective_run_id: RunState.of(w) for w in settings.watch
        }
        for state in self.runs.values():
            state.lineage = RunLineage(state.run_id, state.dir, self.repo, journal, self.log)
        for run in self.runs:
            self.metrics.init_run(run)
            self.tier_metrics.init_tier(run, tier)
        self._wake = asyncio.Event()
        self.priority = ThreadPriority(settings, self.log)
        self.transfers, self.small, self.claims, self.shipper, self.early = _shipping(self, storage)
        self.emergency = Emergency(
            self.runs,
            self.queue,
            self.early,
            self.rate,
            metrics,
            clock,
            self.log,
            look_again=self.hint,
            wake=self._wake.set,
        )
        self.cluster = self._cluster()
        self.intake = _intake(self)
        self.outcomes = _outcomes(self)
        self.looks = Looks(
            self.runs, self.intake.look, tier_metrics=self.tier_metrics, log=self.log
        )

    def _cluster(self) -> ClusterCoordination:
        """The coordination with the other nodes (inert with one node)."""
        cluster = self.settings.cluster
        return ClusterCoordination(
            Committer(
                cluster.nodes, cluster.rank, self.shipper.host, describe(), self.shipper.writer.id
            )
            if cluster.multi_node
            else None,
            self.runs,
            self.repo,
            self.queue,
            self.metrics,
            self.clock,
            self.log,
            keys=self.keys,
            look_again=self.hint,
            changed=self.update_gauges,
            claims=self.shipper.claims,
        )

    def _urgent(self) -> bool:
        """``Emergency.urgent`` (the emergency mode is built after the transfers it
        steers: it pauses their uploads)."""
        return self.emergency.urgent()

    @property
    def flushing(self) -> bool:
        """The daemon is going away (SIGTERM): what it ships until then is urgent."""
        return self.emergency.flushing

    @flushing.setter
    def flushing(self, value: bool) -> None:
        self.emergency.flushing = value

    @property
    def unusable(self) -> StorageError | None:
        """The last failure by which the store refused this node itself (credentials,
        access, bucket): `ckptd run --once` ends on it. Cleared by a commit."""
        return self.outcomes.unusable

    def _count_bytes(self, run: str, n: int) -> None:
        self.metrics.upload_bytes.labels(run=run).inc(n)
        self.rate.add(n)
        state = self.runs.get(run)
        if state is not None and state.current is not None:
            state.current.sent_bytes += n

    def watch_dirs(self) -> list[Path]:
        """Every watched run's directory (where the responder writes notice files)."""
        return self.emergency.watch_dirs()

    # -- start-up --------------------------------------------------------------------

    async def recover(self) -> None:
        """Settle what a previous process left in the journal (``cleanup.recover``) and
        learn what is committed already: the journal's names, and the store's last
        committed manifest of each run."""
        dirs = {run: state.dir for run, state in self.runs.items()}
        await asyncio.to_thread(cleanup.recover, self.repo, self.journal, dirs, self.log)
        await asyncio.to_thread(
            functools.partial(
                cleanup.discard_vanished,
                self.repo,
                self.journal,
                dirs,
                self.cluster.part_written,
                self.log,
                whole_prefix=self.cluster.whole_prefix,
            )
        )
        for state in self.runs.values():
            state.recall(self.journal)
            # What the store holds as the run's last commit is shown (/v1/status, the
            # gauges) before anything new ships, and is the base early copies start from.
            manifest = await previous_manifest(self.repo, state, self.log)
            if manifest is not None:
                self.outcomes.found_committed(state, manifest)

    # -- hints -------------------------------------------------------------------------

    def hint(self, run_id: str, name: str | None, delay: float = EVENT_DEBOUNCE_SECONDS) -> None:
        """Something under ``run_id``'s dir changed (``name`` None: look at all of it):
        look again after ``delay`` (``Looks.hint``). Must be called on the event loop
        thread."""
        self.looks.hint(run_id, name, delay)

    def record_seen(self, run_id: str, name: str | None) -> None:
        """A commit record appeared (``ckptd.sync.watcher``): look at ``name`` (None:
        every checkpoint of the run) now, with no debounce (``Looks.record_seen``). Must be
        called on the event loop thread."""
        self.looks.record_seen(run_id, name)

    async def rescan(self, run_id: str, *, committed: bool = False) -> None:
        """Look at every checkpoint of a run (start-up, periodic, lost events). A name
        committed already is skipped (the daemon hears of a re-save under it by its file
        events), unless ``committed``: ``run --once`` hears no events, so it looks at
        those too, and one whose files are not the ones committed is new content, a
        conflict or another trajectory's, exactly as the daemon decides (``Intake.look``)."""
        await self.looks.rescan(run_id, committed=committed)

    async def evaluate(self, run_id: str, name: str) -> Completion | None:
        """Apply the completion rule to one checkpoint now; queue it if complete. While
        a look at it runs, another is not started beside it: the caller gets that
        look's verdict, and one more look follows it (a look lists every file: looks
        side by side would hold as many listings, and take as many times the CPU)."""
        return await self.looks.evaluate(run_id, name)

    def _discard(self, run: str, name: str) -> None:
        """``cleanup.discard``; with one node the checkpoint's whole slot is ours."""
        self.claims.forget(run, name)
        cleanup.discard(
            self.repo, self.journal, run, name, self.log, whole_prefix=self.cluster.whole_prefix
        )

    # -- the worker ------------------------------------------------------------------

    async def work(self, stop: asyncio.Event) -> None:
        """Ship pending checkpoints until ``stop`` is set (the current one finishes first)."""
        while not stop.is_set():
            pending = self.queue.next(self.clock.monotonic())
            # The checkpoint written since a notice goes first, even before it is
            # complete: while its files are sent early, no older checkpoint starts.
            held = pending is not None and (
                (not pending.emergency and self.early.emergency_active()) or self.hooks.held()
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
                await self.outcomes.ship(pending)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one checkpoint never stops the worker
                # A bug or an input nobody foresaw: this checkpoint backs off and is
                # said to have failed; every other checkpoint still ships.
                await self.outcomes.crashed(pending, exc)

    def retry_now(self) -> None:
        """The store is back: end every backoff and ship the backlog now."""
        self.queue.retry_now()
        self._wake.set()

    async def drain_once(self) -> bool:
        """Ship everything pending now (``ckptd run --once``), in step order
        (``ShipQueue.next_in_step_order``); True if all committed."""
        ok = True
        while (pending := self.queue.next_in_step_order(self.clock.monotonic())) is not None:
            try:
                ok = await self.outcomes.ship(pending) and ok
            except Exception as exc:  # noqa: BLE001 - as in work(): said, then backed off
                await self.outcomes.crashed(pending, exc)
                ok = False
        # Failures left in backoff count as not done.
        return ok and not len(self.queue)

    async def retain(self) -> None:
        """One retention pass of every run (``Outcomes.retain``): what a SIGTERM's flush
        left undone, since no pass runs while a notice's seconds are spent on commits."""
        for state in self.runs.values():
            await self.outcomes.retain(state, self.log.bind(run=state.run_id))

    def unshippable(self) -> dict[str, str]:
        """``run/name`` of each checkpoint that, as it is, never ships (``RunState
        .never_shipped``), with why: ``run --once`` fails on them."""
        return {
            f"{run}/{name}": why
            for run, state in sorted(self.runs.items())
            for name, why in sorted(state.why_never_shipped().items())
        }

    # -- many nodes (``ckptd.sync.coordination``) -------------------------------------

    async def poll_cluster(self) -> None:
        """Many nodes, one look at the store (``ClusterCoordination.poll``); a global
        commit it makes or finds is acted on as this node's own."""
        async for state, pending, shipped in self.cluster.poll():
            log = self.log.bind(run=state.run_id, checkpoint=pending.name)
            await self.outcomes.committed(state, pending, shipped, log)

    def awaiting_emergency(self) -> bool:
        """Many nodes, during a notice: this node's share of the emergency save waits for
        its announcement (``ClusterCoordination.awaiting_emergency``)."""
        return self.cluster.awaiting_emergency(self.emergency.since)

    def holds_newer(self, run_id: str, name: str) -> bool:
        """A checkpoint of ``run_id`` with a higher step than ``name`` is in hand and not
        committed (``RunState.holds_newer``), or queued or being looked at here."""
        state, step = self.runs.get(run_id), step_of(name)
        around = self.looks.pending(run_id) | {p.name for p in self.queue.of_run(run_id)}
        return state is not None and step is not None and state.holds_newer(step, around)

    def cluster_busy(self) -> bool:
        """Many nodes: a checkpoint still waits for an announcement or for other nodes."""
        return self.cluster.busy()

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
            if self.cluster.committer is not None:
                self.metrics.waiting_for_nodes.labels(run=state.run_id).set(len(state.waiting))
        self.metrics.upload_rate.set(self.rate.rate() or 0.0)

    def idle(self) -> bool:
        """Nothing pending, nothing uploading, nothing waiting to be looked at again."""
        return (
            not self.looks.busy()
            and not len(self.queue)
            and all(s.current is None for s in self.runs.values())
        )

    def status(self) -> dict[str, Any]:
        """Per-run state for ``/v1/status``."""
        self.update_gauges()
        now = self.clock.time()
        multi = self.cluster.committer is not None
        return {
            "runs": {
                run: state.status(
                    self.queue, now, failures=self.metrics.failures_of(run), cluster=multi
                )
                for run, state in self.runs.items()
            }
        }

    async def close(self) -> None:
        self.looks.close()
        await self.early.close()
        await asyncio.to_thread(self.transfers.close)
        await asyncio.to_thread(self.small.close)


def _shipping(
    self: SyncPipeline, storage: Storage
) -> tuple[Transfers, SmallFiles, Claims, Shipper, EarlyUploads]:
    """A pipeline's transfers (worker pools for large files, lanes for small ones), its
    claims, the shipper over them, and the early uploads."""
    dest = self.settings.destination
    transfers = Transfers(
        storage,
        self.journal,
        part_size=dest.part_size_mib * 1024 * 1024,
        concurrency=dest.concurrency,
        on_bytes=self._count_bytes,
        drop_page_cache=self.settings.resources.drop_page_cache,
        thread_setup=self.priority.lower_worker,
        urgent_setup=self.priority.lower_urgent_worker,
        is_urgent=self._urgent,
        digests=self.keys is not None,
    )
    claims = Claims.of(self.repo, self.journal, self.settings.cluster, self.clock, self.log)
    small = SmallFiles(
        transfers,
        lanes=lanes_for(dest.concurrency),
        thread_setup=self.priority.lower_worker,
        urgent_setup=self.priority.lower_urgent_worker,
        is_urgent=self._urgent,
    )
    shipper = Shipper(
        self.repo,
        transfers,
        self.journal,
        self.clock,
        file_slots=max(4, dest.concurrency * 2),
        log=self.log,
        claims=claims,
        small=small,
        keys=self.keys,
    )
    # With peers, an emergency part goes to them first (ckptd.sync.replicate).
    early = EarlyUploads(
        transfers,
        self.journal,
        claims,
        slots=max(2, dest.concurrency),
        small=small,
        log=self.log,
        emergency_early=not self.settings.peers.enabled,
    )
    return transfers, small, claims, shipper, early


def _intake(self: SyncPipeline) -> Intake:
    """The pipeline's intake (``ckptd.sync.intake``), wired to its parts."""
    return Intake(
        self.runs,
        self.queue,
        self.early,
        self.cluster,
        self.emergency,
        journal=self.journal,
        metrics=self.metrics,
        clock=self.clock,
        log=self.log,
        hooks=self.hooks,
        look_again=self.hint,
        changed=self.update_gauges,
        wake=self._wake.set,
        discard=self._discard,
    )


def _outcomes(self: SyncPipeline) -> Outcomes:
    """The pipeline's outcomes (``ckptd.sync.outcomes``), wired to its parts."""
    return Outcomes(
        self.runs,
        self.queue,
        self.shipper,
        self.early,
        self.cluster,
        self.emergency,
        repo=self.repo,
        journal=self.journal,
        settings=self.settings,
        metrics=self.metrics,
        tier_metrics=self.tier_metrics,
        tier=self.tier,
        clock=self.clock,
        log=self.log,
        hooks=self.hooks,
        look_again=self.hint,
        changed=self.update_gauges,
        discard=self._discard,
    )
