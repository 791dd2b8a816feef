"""The daemon's lifecycle, and nothing else: build, start-up, main loop, shutdown.

    build      every part made and wired (``ckptd.daemon.build``, called by
               ``Service.__init__``): the instance locks, the journals, the stores, the
               pipelines, responder, watcher, notice sources. Everything that can fail
               before the daemon runs fails there; no task, thread or socket is started
    start-up   SIGTERM handled as a notice from here on -> destination check ->
               recover the journal -> HTTP
    main loop  watcher + rescan, then worker (ships checkpoints), ticker (gauges,
               rescans, systemd's watchdog; it never waits on the store: the stores'
               rechecks run beside it, and so do the cadence history's reads and
               writes, one at a time), notices (every source, SIGTERM included,
               through one loop into the responder: ``ckptd.daemon.notice_loop``) and,
               with many nodes, the cluster poll (announcements, other nodes' parts)
               until a stop; with many nodes the other nodes' NOTICE is one more notice
               source, and our own are published. Every tier has its own worker and its
               own store checks (``ckptd.daemon.tier_set``). Beside them the drills
               (``ckptd.drill``): each run's drill history read from the store, and with
               ``[drill] every`` the schedule that starts them
    shutdown   stop intake (watcher) -> let the checkpoint in flight finish or journal
               it (bounded by ``shutdown_timeout``) -> stop HTTP -> a NOTICE write in
               flight gets a few seconds -> close

As in uvicorn, a signal handler only sets a flag; the main loop acts on it. The first
SIGTERM is a notice when the machine or pod is going away (``ckptd.notices.shutdown``:
flush first, exit last: ``ckptd.daemon.drain``), else a plain stop; SIGINT, or a second SIGTERM, stops after
the upload in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptd.config import Settings
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import ManifestError
from ckptd.daemon.build import build_daemon
from ckptd.daemon.drain import DRAIN_QUIET_SECONDS as DRAIN_QUIET_SECONDS  # ckptd exec's
from ckptd.daemon.drain import Drain
from ckptd.daemon.goodput import ledger_for
from ckptd.daemon.health_loop import build_health
from ckptd.daemon.loss_watch import build_loss_watch
from ckptd.daemon.notice_loop import NoticeLoop, remove_stale_notice_files
from ckptd.daemon.quiet import QuietRuns, sight
from ckptd.daemon.sdnotify import SystemdNotifier, summarize
from ckptd.drill.schedule import build_drills
from ckptd.notices import carried
from ckptd.notices.model import Notice, NoticeSource
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.instance import WATCH_LOCK
from ckptd.runtime.logs import get_logger
from ckptd.runtime.tasks import noted, start_supervised
from ckptd.storage import StorageError

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


# At shutdown, a cluster NOTICE write still in flight gets this long before the store closes.
PUBLISH_DRAIN_SECONDS = 5.0


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
        """The build: every part made and wired by ``build_daemon``, where a second
        daemon, a state dir or a destination that cannot be opened stops us; nothing
        runs until ``serve``."""
        self.settings = settings
        self.once = once
        self.shutdown_timeout = shutdown_timeout
        self.clock = clock
        self.log = get_logger()
        self.stop_event = asyncio.Event()
        self.sigterm = asyncio.Event()
        self.sd = SystemdNotifier.from_env()  # systemd Type=notify; inert elsewhere
        parts = build_daemon(
            settings,
            shutdown_timeout=shutdown_timeout,
            clock=clock,
            log=self.log,
            on_repeated_sigterm=self.request_stop,
        )
        self.metrics = parts.metrics
        self.locks = parts.locks
        self.unlocked_watch_dirs = parts.unlocked_watch_dirs
        self.io_stop = parts.io_stop
        self.tiers = parts.tiers
        first = parts.tiers.first
        self.journal, self.destination, self.pipeline = first.journal, first.health, first.pipeline
        self.storage = first.health.storage
        self.responder = parts.responder
        self.advisor = parts.advisor
        self.watcher = parts.watcher
        self.sigterm_source = parts.sigterm_source
        self.started_at = parts.started_at
        self.peering = parts.peering  # peer replication ([peers] enabled), else None
        self.publisher = parts.cluster.publisher if parts.cluster else None
        self.cluster_source = parts.cluster.source if parts.cluster else None
        self.notices = NoticeLoop(
            settings,
            self.responder,
            self.advisor,
            cluster_source=self.cluster_source,
            react=self._on_notice,
            clock=clock,
            log=self.log,
        )
        self.notices.export_health(self.metrics)  # every source's series, from the start
        self.drills, self.drill_schedule = build_drills(
            settings,
            self.responder,
            self.pipeline,
            self.advisor,
            self.storage,
            self.metrics,
            clock=clock,
            log=self.log,
            scheduled=not once,
        )
        self.ledger = ledger_for(self, once=once)
        # [health]: the monitor, its save-and-stop events' notice source, the loss watch.
        self.health, self.health_source = build_health(self)
        self.loss = build_loss_watch(self)
        self.drain = Drain(
            self.tiers, self.stop_event, timeout=shutdown_timeout, clock=clock, log=self.log
        )
        self.quiet = QuietRuns(clock.time())
        # What start-up and the main loop learn.
        self.http: Any = None  # ckptd.daemon.http.HttpServer, imported only when serving
        self.http_port: int | None = None
        self.control_http: Any = None  # the control listener's HttpServer
        self.watching: list[str] = []
        self.missing_watch_dirs: list[Path] = []
        # The cadence history's store I/O (start-up read, periodic writes) in flight; a
        # dead store holds it for the retries' ~25 s, so it never runs in the ticker.
        self._advice_io: asyncio.Task[None] | None = None

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
        for t in self.tiers.further:
            self.log.info("tier", tier=t.name, destination=t.health.storage.url)
            await t.health.check()  # a tier that is down holds no other back
        now = datetime.fromtimestamp(self.clock.time(), UTC)
        carried_over = await asyncio.to_thread(carried.load, Path(self.settings.state.dir), now)
        await asyncio.to_thread(
            remove_stale_notice_files,
            self.pipeline.watch_dirs(),
            self.log,
            carried_over[0].id if carried_over is not None else None,
        )
        for t in self.tiers:
            await t.pipeline.recover()
        if carried_over is not None:
            self.responder.carry_on(*carried_over)
        if self.peering is not None:
            from ckptd.daemon.peering import start_peering  # [peers] on: imported with it

            await start_peering(self.peering, once=self.once)
        if not self.once:
            # Off the start-up path: with the store down, reading the history would hold
            # READY, HTTP and the notice watch for its retries. The prior advises till then.
            load = noted("advice", self.advisor.load(), metrics=self.metrics, log=self.log)
            self._advice_io = asyncio.create_task(load, name="advice-load")
            await self._start_http()

    async def _start_http(self) -> None:
        """The scrape listener, then the control listener (``ckptd.daemon.surfaces``)."""
        from ckptd.daemon.surfaces import start_surfaces  # aiohttp: --once needs none

        self.http, self.control_http = await start_surfaces(self, self.settings, self.log)
        self.http_port = self.http.port

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

    async def run_once(self) -> int:
        """Ship what is complete now, then return 0, or 1 if any checkpoint failed."""
        pipeline = self.pipeline
        # A store that refuses this node (no credentials, access denied, no such bucket)
        # ends --once at once with its one line, whether or not there is work: waiting
        # out the backoff would only hide it.
        if (refusal := self.destination.refusal) is not None:
            raise refusal
        for run_id in pipeline.runs:
            # Committed names too: with no file events, a re-save under one (a rollback)
            # is seen only by comparing its files with the ones committed.
            await self.tiers.rescan(run_id, committed=True)
        ok = await self.tiers.drain_once()
        # Checkpoints complete but for a quiet window (settle/quiescence) are waited
        # for, within ONCE_MAX_WAIT, then shipped too.
        waited_until = self.clock.monotonic() + ONCE_MAX_WAIT_SECONDS

        # With many nodes, also until every checkpoint is announced and joined by the
        # other nodes' parts (or the wait runs out: then 1).
        while (self.tiers.busy() or pipeline.cluster_busy()) and (
            self.clock.monotonic() < waited_until
        ):
            if pipeline.unusable is not None:
                raise pipeline.unusable
            await asyncio.sleep(0.1)
            await self._cluster_round()
            ok = await self.tiers.drain_once() and ok
        if self.missing_watch_dirs:
            # Nothing could be shipped from there: "all shipped" would not be true.
            raise WatchDirMissingError(self.missing_watch_dirs)
        refused = self.tiers.refused()
        if refused:
            self.log.error("tiers_not_committed", tiers=refused)
        # Logged as checkpoint_has_unshippable_entries already; never committed, so
        # --once did not ship what is there.
        if unshipped := pipeline.unshippable():
            self.log.error("checkpoints_not_shipped", checkpoints=[*unshipped], why=unshipped)
        ok = ok and not refused and not unshipped
        return 0 if ok and not pipeline.cluster_busy() else 1

    async def main_loop(self) -> int:
        """Run until a stop (or SIGTERM's flush), then stop intake and let the work in
        flight finish or journal it, within ``shutdown_timeout``; 0."""
        pipeline = self.pipeline
        self.watcher.start(asyncio.get_running_loop())
        self.watching = self.watcher.refresh()
        for run_id in pipeline.runs:
            # Committed names too: what was re-saved while no daemon ran sent no event.
            await self.tiers.rescan(run_id, committed=True)
        stop = self.stop_event  # each task below is restarted whenever it fails
        sup = functools.partial(start_supervised, metrics=self.metrics, log=self.log)
        worker = sup("worker", lambda: pipeline.work(stop))
        # Each further tier has its own worker: one that is down holds no other back.
        tier_workers = [
            sup(f"worker-{t.name}", functools.partial(t.pipeline.work, stop))
            for t in self.tiers.further
        ]
        background = [
            sup("ticker", self._tick),
            sup("rechecks", lambda: self.tiers.recheck_stores(TICK_SECONDS)),
            sup("notices", lambda: self.notices.run(self._notice_sources())),
            sup("cluster", self._poll_cluster),
            sup("drill-history", self.drills.keep_history),
        ]
        if self.drill_schedule is not None:
            background.append(sup("drill-schedule", self.drill_schedule.run))
        if self.health is not None:
            background.append(sup("health", self.health.run))
        background.append(sup("loss", self.loss.run))
        self.ledger.begin()
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
        for task in background:
            task.cancel()
        try:
            await asyncio.wait_for(
                asyncio.gather(worker, *tier_workers), timeout=self.shutdown_timeout
            )
        except TimeoutError:
            # The journal holds every finished part: the next start resumes there.
            self.log.warning("shutdown_timeout", seconds=self.shutdown_timeout)
        return 0

    async def shutdown(self) -> None:
        """Stop intake and HTTP, let a NOTICE write and the cadence history's I/O end,
        close every tier, let the locks go; a step that fails (the store down, the state
        dir read-only) is noted (``task_failed``) and the stop goes on, to exit 0."""
        self.io_stop.set()
        self.watcher.stop()
        step = functools.partial(noted, metrics=self.metrics, log=self.log)
        for server in (self.http, self.control_http):
            if server is not None:
                await step("stop-http", server.stop())
        if self.publisher is not None:
            await step("stop-publisher", self.publisher.drain(PUBLISH_DRAIN_SECONDS))
        if self.peering is not None:
            from ckptd.daemon.peering import stop_peering

            await step("stop-peering", stop_peering(self.peering))
        if not self.once:
            if self._advice_io is not None:
                # The store's retries end on io_stop: this returns within a request.
                with contextlib.suppress(Exception):
                    await self._advice_io
            await step("stop-advice", self.advisor.flush(force=True))
        await step("stop-goodput", self.ledger.finish())  # the stop marked, shipped
        await step("stop-tiers", self.tiers.close())
        self.locks.release()
        self.sigterm_source.close()
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        self.log.info("ckptd_stopped")

    # -- notices -----------------------------------------------------------------------

    def _notice_sources(self) -> list[NoticeSource]:
        """SIGTERM's, and with many nodes the other nodes' NOTICE (the cloud's is found
        by the notice loop)."""
        cluster = [self.cluster_source] if self.cluster_source is not None else []
        health = [self.health_source] if self.health_source is not None else []
        return [self.sigterm_source, *cluster, *health]

    async def _on_notice(self, notice: Notice, source: NoticeSource) -> None:
        """What a notice means for the daemon: a SIGTERM that is a plain stop stops it;
        any other goes to the responder, and SIGTERM's is flushed, then the daemon stops."""
        if notice.source == "sigterm" and not await self.notices.sigterm_is_a_notice():
            self.request_stop()
            return
        if notice.kind not in carried.ENDS_BY_ITSELF:
            # Another node's drill or health save interrupts no attempt here (this
            # node's own never come this way): the trainer saves and trains on.
            self.ledger.noticed(self.clock.time(), notice.source)
        response = await self.notices.respond(notice, source)
        if notice.source == "sigterm":
            self.sigterm.set()  # the main loop flushes, then stops
        self.notices.end_followed_drill(notice, source, response)

    async def _drain_after_sigterm(self, why: str = "sigterm") -> None:
        """SIGTERM (``ckptd exec``: also its trainer's end): ship what is complete, then
        retention, within ``shutdown_timeout`` (``Drain.run``)."""
        await self.drain.run(why)

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
                # Observed time and new records, every ``FLUSH_SECONDS`` at most.
                flush = noted("advice", self.advisor.flush(), metrics=self.metrics, log=self.log)
                self._advice_io = asyncio.create_task(flush, name="advice-flush")
            now = self.clock.monotonic()
            if now - last_stats >= JOURNAL_STATS_SECONDS:
                last_stats = now
                stats = await asyncio.to_thread(self.journal.stats)
                for run_id, state in pipeline.runs.items():
                    self.quiet.sights[run_id] = await asyncio.to_thread(sight, state.dir)
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
                        await self.tiers.rescan(run_id)

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
        """Ready: config loaded, destination reachable, watcher running, and the cloud's
        notice source not deaf (``DEAF_AFTER_FAILURES`` failed reads in a row): a node
        that cannot hear a preemption is as unprotected as one that cannot ship."""
        runs = list(self.pipeline.runs)
        deaf = {name: h.error for name, h in self.notices.health().items() if h.deaf}
        ok = self.destination.ok and set(self.watching) == set(runs) and not deaf
        return ok, {
            "destination": self.destination.ok,
            "destination_error": self.destination.error,
            "watching": self.watching,
            "runs": runs,
            "notice_sources_down": deaf,
            "node_healthy": None if self.health is None else self.health.healthy,
        }

    def status(self) -> dict[str, Any]:
        body = self.pipeline.status()
        body["destination"] = self.destination.to_json()
        body["tiers"] = self.tiers.status(body["runs"])
        body["preemption"] = self.responder.preemption_json()
        body["advice"] = self.advisor.advice_json()["runs"]
        body["notice_sources"] = self.notices.export_health(self.metrics)
        body["drills"] = self.drills.status()
        if self.drill_schedule is not None:
            body["drill_schedule"] = self.drill_schedule.status()
        body.update({"peers": self.peering.status()} if self.peering is not None else {})
        body.update({"health": self.health.status()} if self.health is not None else {})
        body.update({"loss": losses} if (losses := self.loss.status()) else {})
        self.quiet.annotate(body["runs"], self.clock.time(), self.metrics)
        self.ledger.annotate(body)
        return body
