"""The daemon's lifecycle, and nothing else: build, start-up, main loop, shutdown.

    build      every part, wired (``Service.__init__``): journal, storage, pipeline,
               responder, watcher, notice sources; nothing runs yet
    start-up   SIGTERM handled as a notice from here on -> destination check ->
               recover the journal -> HTTP
    main loop  watcher + rescan, then worker (ships checkpoints), ticker (gauges,
               rescans, systemd's watchdog; it never waits on the store: the stores'
               rechecks run beside it, and so do the cadence history's reads and
               writes, one at a time), notices (every source, SIGTERM included,
               through one loop into the responder) and, with many nodes, the cluster
               poll (announcements, other nodes' parts) until a stop; with many nodes the
               other nodes' NOTICE is one more notice source, and our own are published
    shutdown   stop intake (watcher) -> let the checkpoint in flight finish or journal
               it (bounded by ``shutdown_timeout``) -> stop HTTP -> a NOTICE write in
               flight gets a few seconds -> close

As in uvicorn, a signal handler only sets a flag; the main loop acts on it. The first
SIGTERM is a notice when the machine or pod is going away (``ckptd.notices.shutdown``:
flush first, exit last), else a plain stop; SIGINT, or a second SIGTERM, stops after
the upload in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptd.cadence.advisor import CadenceAdvisor
from ckptd.config import ConfigError, DestinationConfig, RetentionConfig, Settings, TierConfig
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import ManifestError
from ckptd.daemon.health import RECHECK_FAILING_SECONDS, DestinationHealth
from ckptd.daemon.sdnotify import SystemdNotifier, summarize
from ckptd.notices.cluster import ClusterNoticeSource, NoticePublisher
from ckptd.notices.detect import make_source
from ckptd.notices.model import Notice, NoticeSource
from ckptd.notices.responder import NOTICE_FILE, Responder, Response
from ckptd.notices.shutdown import sigterm_meaning
from ckptd.notices.sigterm import SigtermSource
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.instance import STATE_LOCK, WATCH_LOCK, InstanceLocks
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.storage import StorageError, open_destination
from ckptd.store.repository import Repository
from ckptd.sync.hooks import PipelineHooks
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline
from ckptd.sync.resume import find_resume_point
from ckptd.sync.watcher import Watcher

TICK_SECONDS = 1.0
# The journal's row counts (a sqlite query, run off the event loop) are exported this often.
JOURNAL_STATS_SECONDS = 10.0
# `run --once` waits this long at most for checkpoints still in a quiet window.
ONCE_MAX_WAIT_SECONDS = 120.0


class WatchDirMissingError(CkptdError):
    """``run --once``: a watch dir does not exist, so nothing could be shipped from it."""

    def __init__(self, missing: list[Path]) -> None:
        names = ", ".join(str(p) for p in missing)
        super().__init__(
            f"watch dir {names} does not exist: nothing was shipped from it; create it or "
            "fix [[watch]] dir"
        )


# After SIGTERM: exit once nothing is pending, uploading or being written for this long.
DRAIN_QUIET_SECONDS = 2.0
# At shutdown, a cluster NOTICE write still in flight gets this long before the store closes.
PUBLISH_DRAIN_SECONDS = 5.0

# `ckptd exec`: a newer checkpoint complete but for its quiet window (the trainer that
# wrote it is gone) is waited for this long at most before the trainer starts again.
RESUME_SETTLE_MAX_SECONDS = 15.0


@dataclass
class Tier:
    """One destination with its own pipeline, journal and health (README, "Tiers")."""

    name: str
    journal: Journal
    health: DestinationHealth
    pipeline: SyncPipeline
    last_check: float = 0.0


def tier_settings(settings: Settings, tier: TierConfig) -> Settings:
    """The settings a further tier's pipeline runs with: its destination and retention,
    the node's local retention, no early shipping (first tier only), one node."""
    destination = DestinationConfig(**tier.model_dump(exclude={"retention"}))
    retention = RetentionConfig(
        **tier.retention.model_dump(), local_keep_last=settings.retention.local_keep_last
    )
    watch = [w.model_copy(update={"ship_early": False}) for w in settings.watch]
    return settings.model_copy(
        update={"destination": destination, "retention": retention, "watch": watch}
    )


class Service:
    """One daemon: ``await Service(settings).serve()`` returns the exit code."""

    def __init__(
        self,
        settings: Settings,
        *,
        once: bool = False,
        shutdown_timeout: float = 60.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.once = once
        self.shutdown_timeout = shutdown_timeout
        self.clock = clock
        self.metrics = Metrics()
        self.log = get_logger()
        self.stop_event = asyncio.Event()
        self.sigterm = asyncio.Event()
        self._io_stop = threading.Event()
        # The cadence history's store I/O (start-up read, periodic writes) in flight; a
        # dead store holds it for the retries' ~25 s, so it never runs in the ticker.
        self._advice_io: asyncio.Task[None] | None = None
        self.sd = SystemdNotifier.from_env()  # systemd Type=notify; inert elsewhere
        # First: a second daemon on this journal or these watch dirs stops here.
        self.locks = InstanceLocks()
        state_dir = Path(settings.state.dir)
        self.locks.acquire(
            state_dir / STATE_LOCK,
            f"the state dir {state_dir}",
            "or give this one its own state.dir",
        )
        self.unlocked_watch_dirs = [
            w.dir
            for w in settings.watch
            if w.dir.is_dir()
            and not self.locks.acquire(
                w.dir / WATCH_LOCK, f"the watch dir {w.dir}", "or watch another dir"
            )
        ]
        self.journal = Journal(state_dir)
        self.storage = open_destination(
            settings.destination, limit_uploads=True, on_retry=self._on_retry, stop=self._io_stop
        )
        first = settings.destination.name
        self.destination = DestinationHealth(self.storage, self.metrics, self.log, tier=first)
        self.advisor = CadenceAdvisor(
            settings,
            Repository(self.storage),
            self.metrics,
            {w.effective_run_id: Path(w.dir) for w in settings.watch},
            clock=clock,
        )
        # The responder switches the pipeline's emergency mode, and hears of its commits:
        # these two hooks reach it once it is built, just below.
        self.pipeline = SyncPipeline(
            settings,
            self.storage,
            self.journal,
            self.metrics,
            clock=clock,
            tier=first,
            hooks=PipelineHooks(
                on_commit=lambda run, name, size, emergency: self.responder.on_commit(
                    run, name, size, emergency
                ),
                on_emergency_complete=lambda run, name: self.responder.on_complete(run, name),
                on_cost=self.advisor.record_save,
                locally_deletable=self._committed_in_every_tier if settings.tiers else None,
            ),
        )
        self.responder = Responder(settings, self.metrics, self.pipeline.emergency, clock=clock)
        self.tiers: list[Tier] = [Tier(first, self.journal, self.destination, self.pipeline)]
        for tier in settings.tiers:
            self.tiers.append(self._build_tier(tier))
        self.watcher = Watcher({r: s.dir for r, s in self.pipeline.runs.items()}, self._hint)
        self.watching: list[str] = []
        self.missing_watch_dirs: list[Path] = []
        # SIGTERM's deadline is our own grace period: what we may spend flushing.
        self.sigterm_source = SigtermSource(grace=shutdown_timeout, on_repeat=self.request_stop)
        self.http: Any = None  # ckptd.daemon.http.HttpServer, imported only when serving
        # Many nodes: our own notices go to <run>/NOTICE, and the other nodes' come from it.
        # A NOTICE from before this moment is an earlier cluster's, never followed.
        self.started_at = datetime.fromtimestamp(clock.time(), UTC)
        self.cluster_source: ClusterNoticeSource | None = None
        self.publisher: NoticePublisher | None = None
        self._followed_drills: set[asyncio.Task[None]] = set()
        self.http_port: int | None = None
        if settings.cluster.multi_node:
            self._build_cluster_notices()

    def _build_tier(self, tier: TierConfig) -> Tier:
        """A further tier: its own storage, journal (``state.dir/tiers/NAME``) and
        pipeline, whose unlabelled metrics stay private (they are the first tier's);
        it counts under its ``tier`` label, and starts nothing during a notice."""
        own = tier_settings(self.settings, tier)
        private = Metrics()
        storage = open_destination(
            own.destination, limit_uploads=True, on_retry=self._on_retry, stop=self._io_stop
        )
        journal = Journal(Path(self.settings.state.dir) / "tiers" / tier.name)
        health = DestinationHealth(
            storage, private, self.log, tier=tier.name, tier_metrics=self.metrics
        )
        first = self.pipeline
        pipeline = SyncPipeline(
            own,
            storage,
            journal,
            private,
            clock=self.clock,
            tier=tier.name,
            tier_metrics=self.metrics,
            hooks=PipelineHooks(
                locally_deletable=self._committed_in_every_tier,
                held=lambda: first.emergency.since is not None,
            ),
        )
        return Tier(tier.name, journal, health, pipeline)

    def _committed_in_every_tier(self, run: str) -> set[str]:
        """Local retention deletes only what every tier has committed."""
        sets = [t.pipeline.runs[run].committed for t in self.tiers]
        return set.intersection(*(set(c) for c in sets))

    def _hint(self, run_id: str, name: str | None, delay: float | None = None) -> None:
        """A file event, to every tier's pipeline."""
        for t in self.tiers:
            if delay is None:
                t.pipeline.hint(run_id, name)
            else:
                t.pipeline.hint(run_id, name, delay)

    async def rescan(self, run_id: str) -> None:
        """Look at every checkpoint of ``run_id`` again, for every tier."""
        for t in self.tiers:
            await t.pipeline.rescan(run_id)

    def _build_cluster_notices(self) -> None:
        cluster = self.settings.cluster
        repo = Repository(self.storage)
        runs = list(self.pipeline.runs)

        def now() -> datetime:
            return datetime.fromtimestamp(self.clock.time(), UTC)

        self.publisher = NoticePublisher(
            repo,
            runs,
            node_rank=cluster.rank,
            host=socket.gethostname(),
            retry_seconds=cluster.poll_interval_seconds,
            metrics=self.metrics,
            clock=now,
        )
        self.responder.publish_notice = self.publisher.publish
        self.cluster_source = ClusterNoticeSource(
            repo,
            runs,
            own_rank=cluster.rank,
            started_at=self.started_at,
            interval=cluster.poll_interval_seconds,
            metrics=self.metrics,
            clock=now,
        )

    def _on_retry(self, operation: str, exc: StorageError, attempt: int, delay: float) -> None:
        self.metrics.retries.labels(operation=operation).inc()
        self.log.warning(
            "storage_retry",
            operation=operation,
            attempt=attempt,
            delay=round(delay, 2),
            error=str(exc),
        )

    def request_stop(self) -> None:
        """Stop after the upload in flight (SIGINT; a second SIGTERM)."""
        self.stop_event.set()

    # -- lifecycle ---------------------------------------------------------------------

    async def serve(self) -> int:
        """Start up, run until stopped (or, with ``once``, until shipped), shut down."""
        try:
            await self.startup()
            return await (self.run_once() if self.once else self.main_loop())
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self.sigterm_source.install()  # from here on SIGTERM is a notice, never lost
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        self.log.info(
            "ckptd_starting",
            destination=self.storage.url,
            runs=list(self.pipeline.runs),
            state_dir=str(self.settings.state.dir),
            once=self.once,
        )
        await self.destination.check()
        self.missing_watch_dirs = self._report_missing_watch_dirs()
        for path in self.unlocked_watch_dirs:
            self.log.warning(
                "watch_dir_not_locked",
                path=str(path),
                why=f"cannot create {WATCH_LOCK} there: a second daemon on this dir "
                "would not be stopped",
            )
        for t in self.tiers[1:]:
            self.log.info("tier", tier=t.name, destination=t.health.storage.url)
            await t.health.check()  # a tier that is down holds no other back
        await asyncio.to_thread(self._remove_stale_notice_files)
        for t in self.tiers:
            await t.pipeline.recover()
        if not self.once:
            # Off the start-up path: with the store down, reading the history would hold
            # READY, HTTP and the notice watch for its retries. The prior advises till then.
            self._advice_io = asyncio.create_task(self.advisor.load(), name="advice-load")
            from ckptd.daemon.http import (
                HttpServer,  # aiohttp costs ~0.3 s of start-up; --once needs none
            )

            self.http = HttpServer(
                self.metrics,
                status=self.status,
                ready=self.ready,
                preemption=self.responder.preemption_json,
                advice=self.advisor.advice_json,
                drill=self.responder.drill,
                token=self.settings.http.token.get_secret_value(),
            )
            try:
                port = await self.http.start(self.settings.metrics.host, self.settings.metrics.port)
            except OSError as exc:
                raise ConfigError(
                    "metrics.listen",
                    f"cannot listen on {self.settings.metrics.listen} "
                    f"({exc.strerror or exc}); another ckptd or program may hold it: choose a "
                    "free port (metrics.listen, CKPTD_METRICS__LISTEN; port 0 = any)",
                ) from None
            self.http_port = port
            self.log.info("http_listening", host=self.settings.metrics.host, port=port)

    def _report_missing_watch_dirs(self) -> list[Path]:
        """A watch dir that does not exist yet is watched from when it appears (a fresh
        node's trainer creates it); a mistyped one would wait forever in silence."""
        missing = [d for d in self.pipeline.watch_dirs() if not d.is_dir()]
        for path in missing:
            self.log.warning(
                "watch_dir_missing",
                path=str(path),
                action="nothing to ship from it now"
                if self.once
                else "watched from when it appears; check [[watch]] dir if that is a typo",
            )
        return missing

    def _remove_stale_notice_files(self) -> None:
        """A notice file left by an earlier daemon (a restart, a crash) describes a notice
        nobody acts on any more: it must not outlive it. A notice still in force is
        delivered again by its source and the file written anew."""
        for watch_dir in self.pipeline.watch_dirs():
            path = watch_dir / NOTICE_FILE
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                self.log.error("stale_notice_file_not_removed", path=str(path), error=str(exc))
                continue
            self.log.info("stale_notice_file_removed", path=str(path))

    async def run_once(self) -> int:
        """Ship what is complete now, then return 0, or 1 if any checkpoint failed."""
        pipeline = self.pipeline
        # A store that refuses this node (no credentials, access denied, no such bucket)
        # ends --once at once with its one line, whether or not there is work: waiting
        # out the backoff would only hide it.
        if (refusal := self.destination.refusal) is not None:
            raise refusal
        for run_id in pipeline.runs:
            await self.rescan(run_id)
        ok = await self._drain_tiers()
        # Checkpoints complete but for a quiet window (settle/quiescence) are waited
        # for, within ONCE_MAX_WAIT, then shipped too.
        waited_until = self.clock.monotonic() + ONCE_MAX_WAIT_SECONDS

        # With many nodes, also until every checkpoint is announced and joined by the
        # other nodes' parts (or the wait runs out: then 1).
        # A further tier that refuses this node (credentials, bucket) is not waited for:
        # it holds the others back no more here than in the daemon (the exit is 1).
        def busy(tier: Tier) -> bool:
            return not tier.pipeline.idle() and (
                tier.pipeline is pipeline or tier.pipeline.unusable is None
            )

        while (any(busy(t) for t in self.tiers) or pipeline.cluster_busy()) and (
            self.clock.monotonic() < waited_until
        ):
            if pipeline.unusable is not None:
                raise pipeline.unusable
            await asyncio.sleep(0.1)
            await self._cluster_round()
            ok = await self._drain_tiers() and ok
        if self.missing_watch_dirs:
            # Nothing could be shipped from there: "all shipped" would not be true.
            raise WatchDirMissingError(self.missing_watch_dirs)
        refused = [t.name for t in self.tiers if t.pipeline.unusable is not None]
        if refused:
            self.log.error("tiers_not_committed", tiers=refused)
        return 0 if ok and not refused and not pipeline.cluster_busy() else 1

    async def _drain_tiers(self) -> bool:
        ok = True
        for t in self.tiers:
            ok = await t.pipeline.drain_once() and ok
        return ok

    async def main_loop(self) -> int:
        pipeline = self.pipeline
        self.watcher.start(asyncio.get_running_loop())
        self.watching = self.watcher.refresh()
        for run_id in pipeline.runs:
            await self.rescan(run_id)
        worker = asyncio.create_task(pipeline.work(self.stop_event), name="worker")
        # Each further tier has its own worker: one that is down holds no other back.
        tier_workers = [
            asyncio.create_task(t.pipeline.work(self.stop_event), name=f"worker-{t.name}")
            for t in self.tiers[1:]
        ]
        ticker = asyncio.create_task(self._tick(), name="ticker")
        rechecks = asyncio.create_task(self._recheck_stores(), name="rechecks")
        notices = asyncio.create_task(self._watch_notices(), name="notices")
        cluster = asyncio.create_task(self._poll_cluster(), name="cluster")
        self.log.info("ckptd_ready", watching=self.watching)
        self.sd.ready(summarize(self.status()))
        stop_wait = asyncio.ensure_future(self.stop_event.wait())
        term_wait = asyncio.ensure_future(self.sigterm.wait())
        await asyncio.wait([stop_wait, term_wait], return_when=asyncio.FIRST_COMPLETED)
        self.sd.stopping("stopping: shipping what is in flight")
        if self.sigterm.is_set() and not self.stop_event.is_set():
            self.pipeline.flushing = True  # no transfer waits for an idle CPU now
            await self._drain_after_sigterm()
        stop_wait.cancel()
        term_wait.cancel()
        self.stop_event.set()
        self.log.info("ckptd_stopping")
        self.watcher.stop()
        ticker.cancel()
        rechecks.cancel()
        notices.cancel()
        cluster.cancel()
        try:
            await asyncio.wait_for(
                asyncio.gather(worker, *tier_workers), timeout=self.shutdown_timeout
            )
        except TimeoutError:
            # The journal holds every finished part: the next start resumes there.
            self.log.warning("shutdown_timeout", seconds=self.shutdown_timeout)
        return 0

    async def shutdown(self) -> None:
        self._io_stop.set()
        self.watcher.stop()
        if self.http is not None:
            await self.http.stop()
        if self.publisher is not None:
            await self.publisher.drain(PUBLISH_DRAIN_SECONDS)
        if not self.once:
            if self._advice_io is not None:
                # The store's retries end on _io_stop: this returns within a request.
                with contextlib.suppress(Exception):
                    await self._advice_io
            await self.advisor.flush(force=True)
        for t in self.tiers:
            await t.pipeline.close()
            t.journal.close()
        self.locks.release()
        self.sigterm_source.close()
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        self.log.info("ckptd_stopped")

    async def newest_complete(self, run_id: str) -> tuple[Path | None, int | None]:
        """Path and step of ``run_id``'s newest complete local checkpoint (None, None when
        there is none): where ``ckptd exec`` resumes its trainer. A newer one complete but
        for a quiet window is waited for, at most ``RESUME_SETTLE_MAX_SECONDS``."""
        state = self.pipeline.runs[run_id]
        until = self.clock.monotonic() + RESUME_SETTLE_MAX_SECONDS
        while True:
            now_ns = int(self.clock.time() * 1e9)
            point = await asyncio.to_thread(
                find_resume_point, state.dir, state.watch.layout, state.rules, now_ns
            )
            wait = point.recheck_after
            if wait is None or self.clock.monotonic() + wait > until:
                break
            await asyncio.sleep(wait + 0.05)
        found = point.checkpoint
        return (None, None) if found is None else (found.path, found.step)

    # -- notices -----------------------------------------------------------------------

    def _sources(self) -> list[NoticeSource]:
        sources: list[NoticeSource] = [self.sigterm_source]
        if self.cluster_source is not None:
            sources.append(self.cluster_source)
        p = self.settings.preemption
        try:
            cloud = make_source(p.provider, p.endpoint, p.poll_interval_seconds, p.imdsv1_fallback)
        except (ValueError, OSError) as exc:
            self.log.error("notice_source_unavailable", provider=p.provider, error=str(exc))
            return sources
        self.log.info("notice_source", provider=p.provider, source=cloud and cloud.name)
        if cloud is not None:
            sources.append(cloud)
        return sources

    async def _watch_notices(self) -> None:
        """Every notice source, SIGTERM's included, into the responder."""
        async with asyncio.TaskGroup() as group:
            for source in self._sources():
                group.create_task(self._follow(source), name=f"notices-{source.name}")

    async def _follow(self, source: NoticeSource) -> None:
        """Feed one source's notices to the responder; a source never ends the daemon."""
        while True:
            try:
                async for notice in source.watch():
                    await self._on_notice(notice, source)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep listening whatever a source does
                self.log.error("notice_source_failed", source=source.name, error=repr(exc))
            await asyncio.sleep(self.settings.preemption.poll_interval_seconds)

    async def _on_notice(self, notice: Notice, source: NoticeSource) -> None:
        if notice.source == "sigterm":
            mode = self.settings.preemption.sigterm
            meaning = await asyncio.to_thread(sigterm_meaning, mode, os.environ)
            if not meaning.notice:
                # A stop or restart of ckptd alone: the trainer trains on, and nothing
                # is written to its notice file.
                self.log.info("sigterm_is_a_stop", why=meaning.why)
                self.request_stop()
                return
            self.log.warning("sigterm_is_a_notice", why=meaning.why)
        response = await self._respond(notice, source)
        if notice.source == "sigterm":
            self.sigterm.set()  # the main loop flushes, then stops
        if source is self.cluster_source and notice.kind == "drill" and response is not None:
            task = asyncio.create_task(self._end_followed_drill(response))
            self._followed_drills.add(task)
            task.add_done_callback(self._followed_drills.discard)

    async def _respond(self, notice: Notice, source: NoticeSource) -> Response | None:
        """Hand ``notice`` to the responder, by the many-node rules: another node's notice
        is skipped while this node already responds, and never published again."""
        followed = source is self.cluster_source
        current = self.responder.current
        if followed and current is not None:
            # Already signalled and in emergency mode (typically our own notice: a cloud
            # reclaims the whole cluster at once). Acting again would move the emergency
            # start past a checkpoint already saved for it, and take the response (and
            # its acknowledgement to our cloud) from our own notice.
            self.log.info(
                "cluster_notice_already_responding",
                source=notice.source,
                responding_to=current.notice.source,
            )
            return None
        # A notice followed from another node is never published again (no echo).
        response = await self.responder.handle(notice, source, publish=not followed)
        self.record_notice(notice, response is not None)
        return response

    def record_notice(self, notice: Notice, new: bool) -> None:
        """A new notice is an interruption of every run here; a drill is none."""
        if new and notice.kind != "drill":
            self.advisor.record_interruption("notice", notice.source)

    async def _end_followed_drill(self, response: Response) -> None:
        """Another node's drill: as ``ckptd drill`` does on its own node, leave emergency
        mode once our emergency checkpoint is committed or the drill's deadline passed."""
        left = response.notice.seconds_left(datetime.fromtimestamp(self.clock.time(), UTC))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(response.done.wait(), timeout=max(0.0, left or 0.0))
        if self.responder.current is response:
            self.responder.clear()

    async def _drain_after_sigterm(self) -> None:
        """SIGTERM: keep shipping (the trainer may be saving its emergency checkpoint
        right now), and return once all is committed and quiet, or when
        ``shutdown_timeout`` runs out (the journal then keeps finished parts)."""
        deadline = self.clock.monotonic() + self.shutdown_timeout
        quiet_since: float | None = None
        while self.clock.monotonic() < deadline and not self.stop_event.is_set():
            if self.destination.refusal is not None:
                # Nothing can be flushed to a destination that refuses us (credentials,
                # no bucket); the journal keeps what was sent, and waiting out the grace
                # period helps no one. A store that is merely unreachable may come back
                # within it: that one is waited for.
                self.log.error("sigterm_flush_impossible", error=self.destination.error)
                return
            # With many nodes, this node's share of an emergency save is idle until the
            # node with the commit record announces it: wait for that too.
            if self.pipeline.idle() and not self.pipeline.awaiting_emergency():
                quiet_since = quiet_since or self.clock.monotonic()
                if self.clock.monotonic() - quiet_since >= DRAIN_QUIET_SECONDS:
                    self.log.info("flushed_on_sigterm")
                    return
            else:
                quiet_since = None
            await asyncio.sleep(0.1)
        if not self.stop_event.is_set():
            self.log.warning("sigterm_flush_timeout", seconds=self.shutdown_timeout)

    # -- periodic work -----------------------------------------------------------------

    async def _tick(self) -> None:
        pipeline = self.pipeline
        now = self.clock.monotonic()
        last_scan = {run_id: now for run_id in pipeline.runs}
        last_stats = now - JOURNAL_STATS_SECONDS  # the first tick exports them
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.sd.tick(summarize(self.status()))  # status() refreshes the gauges too
            if self._advice_io is None or self._advice_io.done():
                self._advice_io = asyncio.create_task(self._flush_advice(), name="advice-flush")
            now = self.clock.monotonic()
            if now - last_stats >= JOURNAL_STATS_SECONDS:
                last_stats = now
                stats = await asyncio.to_thread(self.journal.stats)
                for table, rows in stats.items():
                    self.metrics.journal_rows.labels(table=table).set(rows)
            before, self.watching = set(self.watching), self.watcher.refresh()
            for run_id, state in pipeline.runs.items():
                # A watch dir that appeared since the last tick may already hold
                # checkpoints its new watch will never hear of: look now.
                appeared = run_id in self.watching and run_id not in before
                if appeared or now - last_scan[run_id] >= state.watch.rescan_seconds:
                    last_scan[run_id] = now
                    with contextlib.suppress(OSError):
                        await self.rescan(run_id)

    async def _flush_advice(self) -> None:
        """Observed time and new records to the store, every ``FLUSH_SECONDS`` at most."""
        try:
            await self.advisor.flush()
        except Exception as exc:  # noqa: BLE001 - advice is never worth the daemon
            self.log.error("cadence_flush_failed", error=repr(exc))

    async def _recheck_stores(self) -> None:
        """Each tier's store asked again when due, beside the ticker: a probe of a store
        that is down waits for its connection timeout, which must never hold the ticker
        (systemd's watchdog) nor the rescans."""
        for t in self.tiers:
            t.last_check = self.clock.monotonic()  # start-up has just asked
        while True:
            await asyncio.sleep(TICK_SECONDS)
            for t in self.tiers:
                await self._check_tier(t, self.clock.monotonic())

    async def _check_tier(self, tier: Tier, now: float) -> None:
        """Ask a tier's store again when due; when it comes back, its backlog is shipped
        at once rather than after the rest of its backoff."""
        # A checkpoint that failed in this tier makes it due soon, so the metrics say the
        # tier is down within seconds, and its return is noticed as soon.
        failing = any(p.failures for p in tier.pipeline.queue)
        interval = RECHECK_FAILING_SECONDS if failing else tier.health.recheck_seconds
        if now - tier.last_check < interval:
            return
        tier.last_check = now
        was_ok = tier.health.ok
        if await tier.health.check() and not was_ok:
            tier.pipeline.retry_now()

    async def _poll_cluster(self) -> None:
        """Many nodes: look in the store every ``cluster.poll_interval_seconds``."""
        if not self.settings.cluster.multi_node:
            return
        while True:
            await asyncio.sleep(self.settings.cluster.poll_interval_seconds)
            await self._cluster_round()

    async def _cluster_round(self) -> None:
        try:
            await self.pipeline.poll_cluster()
        except (StorageError, ManifestError, OSError) as exc:  # the next round tries again
            self.log.warning("cluster_poll_failed", error=str(exc))

    # -- what HTTP shows -----------------------------------------------------------------

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready: config loaded, destination reachable, watcher running."""
        runs = list(self.pipeline.runs)
        ok = self.destination.ok and set(self.watching) == set(runs)
        return ok, {
            "destination": self.destination.ok,
            "destination_error": self.destination.error,
            "watching": self.watching,
            "runs": runs,
        }

    def status(self) -> dict[str, Any]:
        body = self.pipeline.status()
        body["destination"] = self.destination.to_json()
        body["tiers"] = {
            t.name: {
                "destination": t.health.to_json(),
                "runs": {
                    run: {
                        "pending": entry["pending"],
                        "uploading": entry["uploading"],
                        "last_committed": entry["last_committed"],
                        "failed": entry["failed"],
                        "sync_lag_seconds": entry["sync_lag_seconds"],
                    }
                    for run, entry in (
                        body["runs"] if t.pipeline is self.pipeline else t.pipeline.status()["runs"]
                    ).items()
                },
            }
            for t in self.tiers
        }
        body["preemption"] = self.responder.preemption_json()
        body["advice"] = self.advisor.advice_json()["runs"]
        return body
