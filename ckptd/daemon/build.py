"""The build: every part of the daemon made and wired, before anything runs.

Everything that can fail before the daemon runs fails here, in this order, and leaves
nothing held behind it: a second daemon on this state dir or these watch dirs (the
instance locks, first), a state dir sqlite cannot open (the journals), a destination that
cannot be opened, a signing key that cannot be read (the pipelines). Nothing here starts
a task or a thread, opens a socket or asks the store anything: that is start-up's
(``ckptd.daemon.service``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.cadence.advisor import CadenceAdvisor
from ckptd.config import Settings
from ckptd.daemon.health import DestinationHealth, WatchedStorage
from ckptd.daemon.tier_set import Tier, TierSet, committed_in_every_tier, tier_settings
from ckptd.notices.cluster import ClusterNoticeSource, NoticePublisher
from ckptd.notices.responder import Responder
from ckptd.notices.sigterm import SigtermSource
from ckptd.repository import Repository
from ckptd.runtime.clock import Clock
from ckptd.runtime.instance import STATE_LOCK, WATCH_LOCK, InstanceLocks
from ckptd.runtime.metrics import Metrics
from ckptd.storage import RetryingStorage, StorageError, open_destination
from ckptd.storage.base import Storage
from ckptd.sync.hooks import PipelineHooks
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline
from ckptd.sync.watcher import COMMIT_RECORDS, Watcher

if TYPE_CHECKING:
    # The peering modules (aiohttp among them) are imported only with [peers] on.
    from ckptd.daemon.peering import Peering


@dataclass
class OpenedTier:
    """A destination opened for the daemon: its store, its journal, and the metrics its
    pipeline counts in (a further tier's unlabelled ones stay private: they are the
    first tier's; it counts under its ``tier`` label in ``tier_metrics``)."""

    name: str
    settings: Settings
    storage: RetryingStorage
    journal: Journal
    metrics: Metrics
    tier_metrics: Metrics | None


@dataclass
class WiredPipelines:
    """The pipelines, one per tier in order, and the parts their hooks call."""

    pipelines: list[SyncPipeline]
    responder: Responder
    advisor: CadenceAdvisor


@dataclass
class ClusterNotices:
    """Many nodes: our own notices go to ``<run>/NOTICE`` (``publisher``), and the other
    nodes' come from it (``source``)."""

    publisher: NoticePublisher
    source: ClusterNoticeSource


@dataclass
class DaemonParts:
    """Every part of one daemon, built and wired; nothing runs yet."""

    metrics: Metrics
    locks: InstanceLocks
    # Watch dirs that exist but could not be locked (read-only): start-up warns.
    unlocked_watch_dirs: list[Path]
    # Set at shutdown: the stores' retries end at once.
    io_stop: threading.Event
    tiers: TierSet
    responder: Responder
    advisor: CadenceAdvisor
    watcher: Watcher
    sigterm_source: SigtermSource
    # A cluster NOTICE from before this moment is an earlier cluster's, never followed.
    started_at: datetime
    cluster: ClusterNotices | None
    # Peer replication (``[peers] enabled``), else None.
    peering: Peering | None = None


def build_daemon(
    settings: Settings,
    *,
    shutdown_timeout: float,
    clock: Clock,
    log: Any,
    on_repeated_sigterm: Callable[[], None],
) -> DaemonParts:
    """Every part of the daemon, or the error that stops it before anything runs (the
    locks taken by then are let go)."""
    metrics = Metrics()
    locks = InstanceLocks()
    stop = threading.Event()  # set at shutdown: the stores' retries end at once
    opened: list[OpenedTier] = []
    peering: Peering | None = None
    try:
        # First: a second daemon on this journal or these watch dirs stops here.
        unlocked = take_instance_locks(settings, locks)
        opened = open_tiers(settings, metrics, log, stop)
        if settings.peers.enabled:
            from ckptd.daemon.peering import Peering

            peering = Peering(
                settings, opened[0].storage, opened[0].journal.writer, metrics, clock, log
            )
        healths = [health_of(o, log) for o in opened]
        wired = build_pipelines(settings, opened, metrics, clock, peering, healths)
        tiers = TierSet(
            [
                Tier(o.name, o.journal, h, p)
                for o, h, p in zip(opened, healths, wired.pipelines, strict=True)
            ],
            clock,
        )
        first = tiers.first.pipeline
        started_at = datetime.fromtimestamp(clock.time(), UTC)
        cluster = None
        if settings.cluster.multi_node:
            cluster = build_cluster_notices(
                settings, opened[0].storage, first, metrics, clock, started_at
            )
            wired.responder.publish_notice = cluster.publisher.publish
            if peering is not None:
                from ckptd.daemon.peering import own_notice_to_peers

                wired.responder.publish_notice = own_notice_to_peers(
                    cluster.publisher.publish, peering
                )
        return DaemonParts(
            metrics=metrics,
            locks=locks,
            unlocked_watch_dirs=unlocked,
            io_stop=stop,
            tiers=tiers,
            responder=wired.responder,
            advisor=wired.advisor,
            watcher=Watcher(
                {r: s.dir for r, s in first.runs.items()},
                tiers.hint,
                tiers.record_seen,
                {r: COMMIT_RECORDS | {s.rules.marker} for r, s in first.runs.items()},
            ),
            # SIGTERM's deadline is our own grace period: what we may spend flushing.
            sigterm_source=SigtermSource(grace=shutdown_timeout, on_repeat=on_repeated_sigterm),
            started_at=started_at,
            cluster=cluster,
            peering=peering,
        )
    except BaseException:
        for tier in opened:
            tier.journal.close()
        if peering is not None:
            peering.journal.close()
        locks.release()
        raise


def take_instance_locks(settings: Settings, locks: InstanceLocks) -> list[Path]:
    """The state dir's lock and each existing watch dir's; the watch dirs that could not
    be locked (read-only) are returned. AlreadyRunningError when another daemon holds one."""
    state_dir = Path(settings.state.dir)
    locks.acquire(
        state_dir / STATE_LOCK,
        f"the state dir {state_dir}",
        "or give this one its own state.dir",
    )
    return [
        w.dir
        for w in settings.watch
        if w.dir.is_dir()
        and not locks.acquire(w.dir / WATCH_LOCK, f"the watch dir {w.dir}", "or watch another dir")
    ]


def open_tiers(
    settings: Settings, metrics: Metrics, log: Any, stop: threading.Event
) -> list[OpenedTier]:
    """The first destination, then each ``[[tiers]]`` one: its store and its journal
    (``state.dir``, a further tier's ``state.dir/tiers/NAME``)."""
    on_retry = partial(log_retry, metrics, log)
    state_dir = Path(settings.state.dir)
    journal = Journal(state_dir)
    opened: list[OpenedTier] = []
    try:
        storage = open_destination(
            settings.destination, limit_uploads=True, on_retry=on_retry, stop=stop
        )
        opened.append(
            OpenedTier(settings.destination.name, settings, storage, journal, metrics, None)
        )
        for tier in settings.tiers:
            own = tier_settings(settings, tier)
            storage = open_destination(
                own.destination, limit_uploads=True, on_retry=on_retry, stop=stop
            )
            journal = Journal(state_dir / "tiers" / tier.name)
            opened.append(OpenedTier(tier.name, own, storage, journal, Metrics(), metrics))
    except BaseException:
        if not opened:
            journal.close()
        for done in opened:
            done.journal.close()
        raise
    return opened


def build_pipelines(
    settings: Settings,
    opened: list[OpenedTier],
    metrics: Metrics,
    clock: Clock,
    peering: Peering | None = None,
    healths: list[DestinationHealth] | None = None,
) -> WiredPipelines:
    """Each tier's pipeline and every pipeline hook, in one place: commits and emergency
    saves go to the responder, what a save cost to the cadence advisor; a further tier
    starts nothing while the first is in emergency mode, and with several tiers local
    retention deletes only what every tier has committed. With ``healths`` (one per
    tier), each pipeline works through its tier's ``WatchedStorage``: a request of it
    that fails has the tier checked at once (``ckptd.daemon.health``)."""
    first = opened[0]
    stores = tier_stores(opened, healths)
    advisor = CadenceAdvisor(
        settings,
        Repository(first.storage),
        metrics,
        {w.effective_run_id: Path(w.dir) for w in settings.watch},
        clock=clock,
    )
    pipelines: list[SyncPipeline] = []  # filled below, before anything runs
    deletable = partial(committed_in_every_tier, pipelines) if len(opened) > 1 else None
    # The responder switches the first pipeline's emergency mode and hears of its
    # commits: these hooks reach it once it is built, just below.
    reach = ResponderHooks(peering)
    pipeline = SyncPipeline(
        settings,
        stores[0],
        first.journal,
        metrics,
        clock=clock,
        tier=first.name,
        hooks=PipelineHooks(
            on_commit=reach.on_commit,
            on_emergency_complete=reach.on_emergency_complete,
            on_cost=advisor.record_save,
            locally_deletable=deletable,
            on_claimed=peering.replicator.claimed if peering is not None else None,
            on_stored=reach.on_stored,
        ),
    )
    responder = Responder(settings, metrics, pipeline.emergency, clock=clock)
    reach.responder = responder
    if peering is not None:
        peering.replicator.on_safe = responder.on_safe
    pipelines.append(pipeline)
    for tier, store in zip(opened[1:], stores[1:], strict=True):
        pipelines.append(further_pipeline(tier, store, clock, deletable, pipeline))
    return WiredPipelines(pipelines, responder, advisor)


def tier_stores(opened: list[OpenedTier], healths: list[DestinationHealth] | None) -> list[Storage]:
    """Each tier's store as its pipeline uses it: watched by its tier's health (one per
    tier in ``healths``), or as opened when there are none."""
    if healths is None:
        return [o.storage for o in opened]
    return [watched(o.storage, h) for o, h in zip(opened, healths, strict=True)]


class ResponderHooks:
    """The first pipeline's hooks that reach the responder. The responder is built from
    that pipeline (its emergency mode), so ``responder`` is set once both exist, before
    anything runs; a hook called before then is a wiring bug."""

    def __init__(self, peering: Peering | None) -> None:
        self.responder: Responder | None = None
        self.peering = peering

    async def on_commit(self, run: str, name: str, size: int, emergency: bool) -> None:
        """A commit of the first tier: the responder hears of it."""
        assert self.responder is not None
        await self.responder.on_commit(run, name, size, emergency)

    def on_emergency_complete(self, run: str, name: str) -> None:
        """An emergency save shipped whole: the responder hears of it."""
        assert self.responder is not None
        self.responder.on_complete(run, name)

    def on_stored(self, run: str, name: str, emergency: bool) -> None:
        """This node's files are in the store: safe off the node that way, and the peers
        holding a replica of them need not hand it off."""
        assert self.responder is not None
        self.responder.on_safe(run, name, "store", emergency, {})
        if self.peering is not None:
            self.peering.replicator.stored(run, name)


def further_pipeline(
    tier: OpenedTier,
    store: Storage,
    clock: Clock,
    deletable: Callable[[str], set[str]] | None,
    first: SyncPipeline,
) -> SyncPipeline:
    """A further tier's pipeline: it starts nothing while the ``first`` tier's is in
    emergency mode, and deletes locally only what ``deletable`` allows."""
    return SyncPipeline(
        tier.settings,
        store,
        tier.journal,
        tier.metrics,
        clock=clock,
        tier=tier.name,
        tier_metrics=tier.tier_metrics,
        hooks=PipelineHooks(
            locally_deletable=deletable,
            held=lambda: first.emergency.since is not None,
        ),
    )


def health_of(tier: OpenedTier, log: Any) -> DestinationHealth:
    """A tier's destination health, counted as its pipeline counts."""
    return DestinationHealth(
        tier.storage, tier.metrics, log, tier=tier.name, tier_metrics=tier.tier_metrics
    )


def watched(storage: RetryingStorage, health: DestinationHealth) -> Storage:
    """``storage`` as a pipeline uses it: every failed request, final or retried, makes
    ``health`` suspect the destination (``DestinationHealth.suspect``)."""
    log_retries = storage.on_retry

    def on_retry(operation: str, exc: StorageError, attempt: int, delay: float) -> None:
        if log_retries is not None:
            log_retries(operation, exc, attempt, delay)
        health.retry_seen(operation, exc, attempt, delay)

    storage.on_retry = on_retry
    return WatchedStorage(storage, health.suspect)


def build_cluster_notices(
    settings: Settings,
    storage: RetryingStorage,
    pipeline: SyncPipeline,
    metrics: Metrics,
    clock: Clock,
    started_at: datetime,
) -> ClusterNotices:
    """Many nodes: the publisher of our notices and the source of the other nodes'."""
    cluster = settings.cluster
    repo = Repository(storage)
    runs = list(pipeline.runs)

    def now() -> datetime:
        return datetime.fromtimestamp(clock.time(), UTC)

    publisher = NoticePublisher(
        repo,
        runs,
        node_rank=cluster.rank,
        host=socket.gethostname(),
        retry_seconds=cluster.poll_interval_seconds,
        metrics=metrics,
        clock=now,
    )
    source = ClusterNoticeSource(
        repo,
        runs,
        own_rank=cluster.rank,
        started_at=started_at,
        interval=cluster.poll_interval_seconds,
        metrics=metrics,
        clock=now,
    )
    return ClusterNotices(publisher, source)


def log_retry(
    metrics: Metrics, log: Any, operation: str, exc: StorageError, attempt: int, delay: float
) -> None:
    """Every storage retry: counted, and one warning line."""
    metrics.retries.labels(operation=operation).inc()
    log.warning(
        "storage_retry",
        operation=operation,
        attempt=attempt,
        delay=round(delay, 2),
        error=str(exc),
    )
