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
from pathlib import Path
from typing import Any

from ckptd.config import Settings
from ckptd.http import HttpServer
from ckptd.logs import get_logger
from ckptd.metrics import Metrics
from ckptd.storage import StorageError, open_storage
from ckptd.storage.retrying import RetryingStorage
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline
from ckptd.sync.watcher import Watcher

TICK_SECONDS = 1.0


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
        self.http: HttpServer | None = None
        self.storage: RetryingStorage | None = None
        self.pipeline: SyncPipeline | None = None

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
        """Ask the daemon to stop (signal handlers call this, and only this)."""
        self.stop_event.set()

    async def serve(self) -> int:
        settings = self.settings
        dest = settings.destination
        journal = Journal(Path(settings.state.dir))
        self.storage = open_storage(
            dest.url,
            endpoint_url=dest.endpoint_url,
            region=dest.region,
            concurrency=dest.concurrency,
            max_upload_bytes_per_s=dest.max_upload_mib_per_s * 1024 * 1024,
            max_attempts=dest.max_attempts,
            on_retry=self._on_retry,
            stop=self._io_stop,
        )
        self.pipeline = pipeline = SyncPipeline(settings, self.storage, journal, self.metrics)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
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
            self.http = HttpServer(
                self.metrics,
                status=self.status,
                ready=self.ready,
                preemption=lambda: {"notice": False},
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
                return 0 if ok else 1
            watcher.start(loop)
            self.watching = watcher.refresh()
            for run_id in pipeline.runs:
                await pipeline.rescan(run_id)
            worker = asyncio.create_task(pipeline.work(self.stop_event), name="worker")
            ticker = asyncio.create_task(self._tick(watcher), name="ticker")
            self.log.info("ckptd_ready", watching=self.watching)
            await self.stop_event.wait()
            self.log.info("ckptd_stopping")
            watcher.stop()
            ticker.cancel()
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
        body["preemption"] = {"notice": False}
        return body
