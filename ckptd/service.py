"""The daemon's lifecycle, and nothing else: start-up, the task group, shutdown order.

    start-up   journal -> storage (+check) -> recover journal -> HTTP -> watcher -> scan
    running    worker (ships checkpoints) + ticker (gauges, rescans, destination check)
    shutdown   stop intake (watcher) -> let the checkpoint in flight finish or journal
               it (bounded by ``shutdown_timeout``) -> stop HTTP -> close

As in uvicorn, a signal handler only sets a flag; the main coroutine acts on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ckptd.config import Settings
from ckptd.logs import get_logger
from ckptd.metrics import Metrics
from ckptd.notices.detect import make_source
from ckptd.notices.model import Notice, NoticeSource
from ckptd.respond import Responder
from ckptd.sdnotify import SystemdNotifier, summarize
from ckptd.storage import StorageError, open_destination
from ckptd.storage.retrying import RetryingStorage
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline
from ckptd.sync.watcher import Watcher

TICK_SECONDS = 1.0
# `run --once` waits this long at most for checkpoints still in a quiet window.
ONCE_MAX_WAIT_SECONDS = 120.0
# After SIGTERM: exit once nothing is pending, uploading or being written for this long.
DRAIN_QUIET_SECONDS = 2.0


class Service:
    """One daemon: ``await Service(settings).serve()`` returns the exit code."""

    def __init__(
        self, settings: Settings, *, once: bool = False, shutdown_timeout: float = 60.0
    ) -> None:
        self.settings = settings
        self.once = once
        self.shutdown_timeout = shutdown_timeout
        self.metrics = Metrics()
        self.log = get_logger()
        self.stop_event = asyncio.Event()
        self._io_stop = threading.Event()
        self.destination_ok = False
        self.destination_error = ""
        self.watching: list[str] = []
        self.http: Any = None  # ckptd.http.HttpServer, imported only when serving
        self.storage: RetryingStorage | None = None
        self.pipeline: SyncPipeline | None = None
        self.responder: Responder | None = None
        self.sigterm = asyncio.Event()
        self._signals = 0
        self.sd = SystemdNotifier.from_env()  # systemd Type=notify; inert elsewhere

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
        """Stop after the upload in flight (SIGINT; a second signal of any kind)."""
        self.stop_event.set()

    def _on_sigterm(self) -> None:
        # Only flags, as in uvicorn: the main coroutine acts on them.
        self._signals += 1
        if self._signals == 1:
            self.sigterm.set()
        else:
            self.stop_event.set()

    async def serve(self) -> int:
        settings = self.settings
        journal = Journal(Path(settings.state.dir))
        self.storage = open_destination(
            settings.destination, limit_uploads=True, on_retry=self._on_retry, stop=self._io_stop
        )
        self.pipeline = pipeline = SyncPipeline(settings, self.storage, journal, self.metrics)
        loop = asyncio.get_running_loop()
        # SIGTERM is a notice (Kubernetes, systemd): flush first, exit last.
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        self.responder = responder = Responder(settings, self.metrics, pipeline)
        pipeline.on_commit = responder.on_commit
        pipeline.on_emergency_complete = responder.on_complete
        self.log.info(
            "ckptd_starting",
            destination=self.storage.url,
            runs=list(pipeline.runs),
            state_dir=str(settings.state.dir),
            once=self.once,
        )
        await self._check_destination()
        await pipeline.recover()
        if not self.once:
            from ckptd.http import HttpServer  # aiohttp costs ~0.3 s of start-up; --once needs none

            self.http = HttpServer(
                self.metrics,
                status=self.status,
                ready=self.ready,
                preemption=responder.preemption_json,
                drill=responder.drill,
                token=settings.http.token.get_secret_value(),
            )
            port = await self.http.start(settings.metrics.host, settings.metrics.port)
            self.log.info("http_listening", host=settings.metrics.host, port=port)
        watcher = Watcher({r: s.dir for r, s in pipeline.runs.items()}, pipeline.hint)
        try:
            if self.once:
                for run_id in pipeline.runs:
                    await pipeline.rescan(run_id)
                ok = await pipeline.drain_once()
                # Checkpoints complete but for a quiet window (settle/quiescence) are
                # waited for, within ONCE_MAX_WAIT, then shipped too.
                waited_until = time.monotonic() + ONCE_MAX_WAIT_SECONDS
                while not pipeline.idle() and time.monotonic() < waited_until:
                    await asyncio.sleep(0.1)
                    ok = await pipeline.drain_once() and ok
                return 0 if ok else 1
            watcher.start(loop)
            self.watching = watcher.refresh()
            for run_id in pipeline.runs:
                await pipeline.rescan(run_id)
            worker = asyncio.create_task(pipeline.work(self.stop_event), name="worker")
            ticker = asyncio.create_task(self._tick(watcher), name="ticker")
            notices = asyncio.create_task(self._watch_notices(), name="notices")
            self.log.info("ckptd_ready", watching=self.watching)
            self.sd.ready(summarize(self.status()))
            stop_wait = asyncio.ensure_future(self.stop_event.wait())
            term_wait = asyncio.ensure_future(self.sigterm.wait())
            await asyncio.wait([stop_wait, term_wait], return_when=asyncio.FIRST_COMPLETED)
            self.sd.stopping("stopping: shipping what is in flight")
            if self.sigterm.is_set() and not self.stop_event.is_set():
                await self._flush_on_sigterm()
            stop_wait.cancel()
            term_wait.cancel()
            self.stop_event.set()
            self.log.info("ckptd_stopping")
            watcher.stop()
            ticker.cancel()
            notices.cancel()
            try:
                await asyncio.wait_for(worker, timeout=self.shutdown_timeout)
            except TimeoutError:
                # The journal holds every finished part: the next start resumes there.
                self.log.warning("shutdown_timeout", seconds=self.shutdown_timeout)
            return 0
        finally:
            self._io_stop.set()
            watcher.stop()
            if self.http is not None:
                await self.http.stop()
            await pipeline.close()
            journal.close()
            self.log.info("ckptd_stopped")

    async def _watch_notices(self) -> None:
        """Feed the cloud's notices to the responder; a source never ends the daemon."""
        assert self.responder is not None
        p = self.settings.preemption
        try:
            source: NoticeSource | None = make_source(
                p.provider, p.endpoint, p.poll_interval_seconds, p.imdsv1_fallback
            )
        except (ValueError, OSError) as exc:
            self.log.error("notice_source_unavailable", provider=p.provider, error=str(exc))
            return
        if source is None:
            self.log.info("notice_source", provider=p.provider, source=None)
            return
        self.log.info("notice_source", provider=p.provider, source=source.name)
        while True:
            try:
                async for notice in source.watch():
                    await self.responder.handle(notice, source)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep listening whatever a source does
                self.log.error("notice_source_failed", source=source.name, error=repr(exc))
            await asyncio.sleep(p.poll_interval_seconds)

    async def _flush_on_sigterm(self) -> None:
        """SIGTERM: act on it as a notice, keep shipping (the trainer may be saving its
        emergency checkpoint right now), and return once all is committed and quiet, or
        when ``shutdown_timeout`` runs out (the journal then keeps finished parts)."""
        assert self.responder is not None and self.pipeline is not None
        now = datetime.now(UTC)
        notice = Notice(
            source="sigterm",
            kind="sigterm",
            id=f"sigterm:{now.isoformat()}",
            noticed_at=now,
            deadline=now + timedelta(seconds=self.shutdown_timeout),
        )
        await self.responder.handle(notice)
        deadline = time.monotonic() + self.shutdown_timeout
        quiet_since: float | None = None
        while time.monotonic() < deadline and not self.stop_event.is_set():
            if not self.destination_ok:
                # Nothing can be flushed to a destination that refuses us; the journal
                # keeps what was sent, and waiting out the grace period helps no one.
                self.log.error("sigterm_flush_impossible", error=self.destination_error)
                return
            if self.pipeline.idle():
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= DRAIN_QUIET_SECONDS:
                    self.log.info("flushed_on_sigterm")
                    return
            else:
                quiet_since = None
            await asyncio.sleep(0.1)
        if not self.stop_event.is_set():
            self.log.warning("sigterm_flush_timeout", seconds=self.shutdown_timeout)

    async def _check_destination(self) -> None:
        assert self.storage is not None
        try:
            await asyncio.to_thread(self.storage.check)
        except StorageError as exc:
            if self.destination_ok or not self.destination_error:
                self.log.error(
                    "destination_unusable",
                    destination=self.storage.url,
                    error=str(exc),
                    code=exc.code,
                )
            self.destination_ok = False
            self.destination_error = str(exc)
            self.metrics.destination_up.set(0)
            return
        if not self.destination_ok:
            self.log.info("destination_ok", destination=self.storage.url)
        self.destination_ok = True
        self.destination_error = ""
        self.metrics.destination_up.set(1)

    async def _tick(self, watcher: Watcher) -> None:
        assert self.pipeline is not None
        pipeline = self.pipeline
        last_scan = {run_id: time.monotonic() for run_id in pipeline.runs}
        last_check = time.monotonic()
        while True:
            await asyncio.sleep(TICK_SECONDS)
            pipeline._update_gauges()
            self.metrics.upload_rate.set(pipeline.rate.rate() or 0.0)
            self.sd.tick(summarize(self.status()))
            for table, rows in pipeline.journal.stats().items():
                self.metrics.journal_rows.labels(table=table).set(rows)
            now = time.monotonic()
            self.watching = watcher.refresh()
            for run_id, state in pipeline.runs.items():
                if now - last_scan[run_id] >= state.watch.rescan_seconds:
                    last_scan[run_id] = now
                    with contextlib.suppress(OSError):
                        await pipeline.rescan(run_id)
            if now - last_check >= (5.0 if not self.destination_ok else 60.0):
                last_check = now
                await self._check_destination()

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready: config loaded, destination reachable, watcher running."""
        runs = list(self.pipeline.runs) if self.pipeline else []
        ok = self.destination_ok and set(self.watching) == set(runs)
        return ok, {
            "destination": self.destination_ok,
            "destination_error": self.destination_error,
            "watching": self.watching,
            "runs": runs,
        }

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = self.pipeline.status() if self.pipeline else {"runs": {}}
        body["destination"] = {
            "url": self.storage.url if self.storage else "",
            "ok": self.destination_ok,
        }
        body["preemption"] = (
            self.responder.preemption_json() if self.responder else {"notice": False}
        )
        return body
