"""The sync pipeline: from "a checkpoint may have changed" to "it is committed".

Inputs are hints (file events, rescans, start-up): each makes the pipeline look at one
checkpoint again. A checkpoint whose completion rule holds becomes *pending*; one
worker takes pending checkpoints one at a time — newest step first, an emergency one
before all (a preemption's checkpoint is the one that matters) — and ships it with
every file in parallel. Pure decisions live in ``ckptd.layouts``, ``ckptd.plan`` and
``ckptd.manifest``; I/O in ``ckptd.storage``, ``transfer``, ``journal``; this module
only sequences them and keeps the state ``/v1/status`` shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from ckptd import checksum, layouts
from ckptd.config import Settings, WatchConfig
from ckptd.deadline import may_finish_first, plan_flush
from ckptd.environment import describe
from ckptd.layouts.base import CheckpointListing, Completion, FileEntry, RuleSettings, step_of
from ckptd.logs import get_logger
from ckptd.manifest import Manifest, ManifestError, build_manifest, manifest_key, object_key
from ckptd.metrics import Metrics
from ckptd.plan import plan_upload, resolve_copies
from ckptd.retention import apply_local_cleanup, apply_retention
from ckptd.storage.base import Storage, StorageError
from ckptd.sync.commit import CommitConflictError, commit, read_latest, read_manifest
from ckptd.sync.journal import Journal
from ckptd.sync.scanner import list_candidates, snapshot
from ckptd.sync.transfer import (
    CheckpointChangedError,
    FileResult,
    TransferContext,
    TransferPausedError,
    Transfers,
    abort_journalled_upload,
)

T = TypeVar("T")

# Coalesces the burst of events one save produces into one look at the checkpoint.
EVENT_DEBOUNCE_SECONDS = 0.2
# A failed checkpoint is tried again after this backoff (doubling, capped).
FAILURE_BACKOFF = (2.0, 300.0)


class RateMeter:
    """Bytes per second over a sliding window, from the transfers' byte counts.
    Fed from the I/O worker threads and read on the event loop, hence the lock; adding
    is O(1) amortised."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        cutoff = now - self.window
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()

    def add(self, nbytes: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._samples.append((now, nbytes))
            self._expire(now)

    def rate(self, now: float | None = None) -> float | None:
        """Bytes per second, or None before anything was measured."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            if len(self._samples) < 2:
                return None
            span = max(now - self._samples[0][0], 0.5)
            return sum(n for _, n in self._samples) / span


@dataclass
class Pending:
    """A complete checkpoint waiting to be (or being) shipped."""

    name: str
    step: int | None
    completed_at: float  # wall clock, for sync lag
    emergency: bool = False
    total_bytes: int = 0
    failures: int = 0
    not_before: float = 0.0  # monotonic; backoff after a failure


@dataclass
class Progress:
    """The checkpoint being shipped now."""

    name: str
    started_at: float
    total_bytes: int
    sent_bytes: int = 0


@dataclass
class RunState:
    """What the pipeline knows of one watched run."""

    watch: WatchConfig
    run_id: str
    rules: RuleSettings
    seen: set[str] = field(default_factory=set)
    pending: dict[str, Pending] = field(default_factory=dict)
    committed: set[str] = field(default_factory=set)
    failed_for_good: dict[str, str] = field(default_factory=dict)
    previous: Manifest | None = None
    previous_loaded: bool = False
    last_committed: dict[str, Any] | None = None
    last_step: int | None = None  # highest committed step (commit order may not be step order)
    current: Progress | None = None
    # The checkpoint being shipped: its files as listed when it started, and how to
    # tell its transfers to stop if a file event shows it changed or vanished.
    current_files: list[tuple[str, int, int]] | None = None
    current_ctx: TransferContext | None = None

    @property
    def dir(self) -> Path:
        return Path(self.watch.dir)


def _fingerprint(files: tuple[FileEntry, ...]) -> list[tuple[str, int, int]]:
    return sorted((f.path, f.size, f.mtime_ns) for f in files)


class SyncPipeline:
    """Detects complete checkpoints and commits them to ``storage``."""

    def __init__(
        self,
        settings: Settings,
        storage: Storage,
        journal: Journal,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.storage = storage
        self.journal = journal
        self.metrics = metrics
        self.clock = clock
        dest = settings.destination
        self.transfers = Transfers(
            storage,
            journal,
            part_size=dest.part_size_mib * 1024 * 1024,
            concurrency=dest.concurrency,
            on_bytes=self._count_bytes,
        )
        self.runs: dict[str, RunState] = {}
        for w in settings.watch:
            rules = RuleSettings(
                quiescence_seconds=w.quiescence_seconds,
                marker=w.marker,
                settle_seconds=w.settle_seconds,
            )
            self.runs[w.effective_run_id] = RunState(w, w.effective_run_id, rules)
        self.host = socket.gethostname()
        self.environment = describe()
        self._wake = asyncio.Event()
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._evaluating = 0
        self._file_slots = asyncio.Semaphore(max(4, dest.concurrency * 2))
        self.log = get_logger()
        self.rate = RateMeter()
        # Emergency mode (a preemption notice): checkpoints completed after the notice go
        # first, and the deadline decides whether an older upload may finish.
        self.emergency_since: float | None = None
        self.emergency_deadline: Any = None  # aware datetime or None
        self.on_emergency_complete: Callable[[str, str], None] = lambda run, name: None
        self.on_commit: Callable[[str, str, int, bool], Awaitable[None]] | None = None

    def _count_bytes(self, run: str, n: int) -> None:
        self.metrics.upload_bytes.labels(run=run).inc(n)
        self.rate.add(n)
        state = self.runs.get(run)
        if state is not None and state.current is not None:
            state.current.sent_bytes += n

    # -- start-up --------------------------------------------------------------------

    async def recover(self) -> None:
        """Settle what a previous process left in the journal: keep uploads that can
        resume, abort the rest (including ones created but never recorded)."""
        for rec in await asyncio.to_thread(self.journal.all_uploads):
            state = self.runs.get(rec.run)
            local = None
            if state is not None:
                checkpoint = state.dir / rec.checkpoint
                # A file checkpoint (Lightning *.ckpt) is its own only file.
                local = checkpoint / rec.path if checkpoint.is_dir() else checkpoint
            keep = False
            if rec.upload_id is not None and local is not None:
                with contextlib.suppress(OSError):
                    st = local.stat()
                    keep = (st.st_size, st.st_mtime_ns) == (rec.size, rec.mtime_ns)
            if keep and not await asyncio.to_thread(
                self.journal.is_committed, rec.run, rec.checkpoint
            ):
                continue
            try:
                await asyncio.to_thread(
                    abort_journalled_upload, self.storage, rec.key, rec.upload_id
                )
                await asyncio.to_thread(self.journal.forget_upload, rec.key)
                self.log.info(
                    "orphan_upload_aborted", run=rec.run, checkpoint=rec.checkpoint, key=rec.key
                )
            except StorageError as exc:
                self.log.warning("orphan_abort_failed", key=rec.key, error=str(exc))
        for state in self.runs.values():
            state.committed.update(name for name, _ in self.journal.committed(state.run_id))

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
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(delay, lambda: self._spawn(self.evaluate(run_id, name)))
        if name in state.committed:
            self._timers.pop(key).cancel()

    def _spawn(self, coro: Any) -> None:
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
        if (
            state.current_ctx is not None
            and state.current is not None
            and state.current.name == name
        ) and (listing is None or _fingerprint(listing.files) != state.current_files):
            # Deleted (save_total_limit rotation) or rewritten mid-upload: stop
            # sending now rather than at the final check.
            state.current_ctx.cancel.set()
        if listing is None:
            if state.pending.pop(name, None) is not None:
                self.log.info("checkpoint_vanished", run=run_id, checkpoint=name)
            state.seen.discard(name)
            return None
        if name not in state.seen:
            state.seen.add(name)
            self.log.info(
                "checkpoint_detected", run=run_id, checkpoint=name, files=len(listing.files)
            )
        verdict = layouts.evaluate(state.watch.layout, listing, time.time_ns(), state.rules)
        if verdict.complete:
            if name not in state.pending:
                now = self.clock()
                emergency = (
                    self.emergency_since is not None
                    and listing.newest_mtime_ns / 1e9 >= self.emergency_since - 1.0
                )
                state.pending[name] = Pending(
                    name,
                    step_of(name),
                    now,
                    emergency=emergency,
                    total_bytes=sum(f.size for f in verdict.files),
                )
                if emergency:
                    self.log.warning("emergency_checkpoint_complete", run=run_id, checkpoint=name)
                    self.on_emergency_complete(run_id, name)
                    self._make_way(sum(f.size for f in verdict.files))
                self.log.info(
                    "checkpoint_complete",
                    run=run_id,
                    checkpoint=name,
                    layout=verdict.layout,
                    bytes=sum(f.size for f in verdict.files),
                    files=len(verdict.files),
                )
                self._update_gauges()
                self._wake.set()
        else:
            if verdict.recheck_after is not None:
                self.hint(run_id, name, delay=verdict.recheck_after + 0.05)
        return verdict

    def enter_emergency(self, deadline: Any, since: float) -> None:
        """A notice arrived at wall time ``since``: what completes from now on goes first."""
        self.emergency_since = since
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
        return float((self.emergency_deadline - datetime.now(UTC)).total_seconds())

    def _is_emergency(self, state: RunState, name: str) -> bool:
        pending = state.pending.get(name)
        return pending is not None and pending.emergency

    def _make_way(self, emergency_bytes: int) -> None:
        """Pause an older upload in flight unless both can finish before the deadline;
        its finished parts stay in the journal and it resumes afterwards."""
        for state in self.runs.values():
            current, ctx = state.current, state.current_ctx
            if current is None or ctx is None or self._is_emergency(state, current.name):
                continue
            left = current.total_bytes - current.sent_bytes
            if may_finish_first(left, emergency_bytes, self.rate.rate(), self._seconds_left()):
                self.log.info(
                    "older_upload_continues",
                    run=state.run_id,
                    checkpoint=current.name,
                    bytes_left=left,
                )
                continue
            self.log.warning(
                "older_upload_paused", run=state.run_id, checkpoint=current.name, bytes_left=left
            )
            ctx.pause.set()
        self._update_eta()

    def _update_eta(self) -> None:
        """Log and export when the emergency work will be committed at the measured rate."""
        if self.emergency_since is None:
            return
        left = 0
        for state in self.runs.values():
            left += sum(p.total_bytes for p in state.pending.values() if p.emergency)
            if state.current is not None and self._is_emergency(state, state.current.name):
                left -= state.current.sent_bytes
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

    def _next(self) -> tuple[RunState, Pending] | None:
        now = time.monotonic()
        best: tuple[tuple[int, int, float], RunState, Pending] | None = None
        for state in self.runs.values():
            for p in state.pending.values():
                if p.not_before > now:
                    continue
                rank = (
                    1 if p.emergency else 0,
                    p.step if p.step is not None else -1,
                    p.completed_at,
                )
                if best is None or rank > best[0]:
                    best = (rank, state, p)
        return None if best is None else (best[1], best[2])

    def _next_wakeup(self) -> float | None:
        times = [p.not_before for s in self.runs.values() for p in s.pending.values()]
        if not times:
            return None
        return max(0.0, min(times) - time.monotonic())

    async def work(self, stop: asyncio.Event) -> None:
        """Ship pending checkpoints until ``stop`` is set (the current one finishes first)."""
        while not stop.is_set():
            picked = self._next()
            if picked is None:
                self._wake.clear()
                waiters = [
                    asyncio.ensure_future(self._wake.wait()),
                    asyncio.ensure_future(stop.wait()),
                ]
                await asyncio.wait(
                    waiters, timeout=self._next_wakeup(), return_when=asyncio.FIRST_COMPLETED
                )
                for w in waiters:
                    w.cancel()
                continue
            state, pending = picked
            await self.ship(state, pending)

    async def drain_once(self) -> bool:
        """Ship everything pending now (``ckptd run --once``); True if all committed."""
        ok = True
        while (picked := self._next()) is not None:
            state, pending = picked
            ok = await self.ship(state, pending) and ok
        # Failures left in backoff count as not done.
        return ok and not any(s.pending for s in self.runs.values())

    # -- shipping one checkpoint --------------------------------------------------------

    async def ship(self, state: RunState, pending: Pending) -> bool:
        """Upload, verify and commit one checkpoint; True when committed."""
        run, name = state.run_id, pending.name
        log = self.log.bind(run=run, checkpoint=name)
        listing = await asyncio.to_thread(snapshot, state.dir, name)
        verdict = (
            layouts.evaluate(state.watch.layout, listing, time.time_ns(), state.rules)
            if listing
            else None
        )
        if listing is None or verdict is None or not verdict.complete:
            state.pending.pop(name, None)
            self._update_gauges()
            if listing is not None:
                self.hint(run, name)
            return False
        started, cpu_started = time.monotonic(), time.process_time()
        try:
            existing = await asyncio.to_thread(read_manifest, self.storage, run, name)
            if existing is not None:
                self._mark_committed(state, pending, existing, log, already=True)
                if self.on_commit is not None:
                    await self.on_commit(run, name, existing.total_bytes, pending.emergency)
                return True
            previous = await self._previous_manifest(state)
            results = await self._transfer_all(state, listing, verdict, previous, log)
            after = await asyncio.to_thread(snapshot, state.dir, name)
            if after is None or _fingerprint(after.files) != _fingerprint(listing.files):
                raise CheckpointChangedError("files changed while uploading")
            step = step_of(name)
            manifest = build_manifest(
                run_id=run,
                checkpoint=name,
                step=step,
                layout=verdict.layout,
                host=self.host,
                created_at=listing.newest_mtime_ns / 1e9,
                committed_at=self.clock(),
                files=[(r.path, r.size, checksum.to_hex(r.crc32c)) for r in results],
                environment=self.environment,
            )
            log.info("checkpoint_verified", files=len(results), bytes=manifest.total_bytes)
            result = await asyncio.to_thread(commit, self.storage, manifest)
        except TransferPausedError:
            # Made way for an emergency checkpoint; the journal keeps every finished part.
            log.warning("checkpoint_paused")
            return False
        except CheckpointChangedError as exc:
            await self._abandon(state, pending, str(exc), log)
            return False
        except CommitConflictError as exc:
            state.pending.pop(name, None)
            state.failed_for_good[name] = str(exc)
            self.metrics.failed.labels(run=run, reason="conflict").inc()
            log.error("checkpoint_conflict", error=str(exc))
            self._update_gauges()
            return False
        except (StorageError, ManifestError, OSError) as exc:
            self._failed(state, pending, exc, log)
            return False
        finally:
            state.current = None
            state.current_ctx = None
            state.current_files = None
        self._mark_committed(state, pending, manifest, log, already=result.already_committed)
        if self.on_commit is not None:
            await self.on_commit(run, name, manifest.total_bytes, pending.emergency)
        seconds = time.monotonic() - started
        # The whole process's CPU over the upload: the price of shipping this checkpoint
        # on a node whose cores the trainer wants (other work in the daemon is idle then).
        cpu_seconds = time.process_time() - cpu_started
        if self.emergency_since is None:  # never spend a preemption's seconds on deletes
            await self._retention(state, log)
        self.metrics.upload_duration.labels(run=run).observe(
            max(0.0, self.clock() - pending.completed_at)
        )
        self.metrics.checkpoint_bytes.labels(run=run).observe(manifest.total_bytes)
        sent = sum(r.bytes_sent for r in results)
        log.info(
            "checkpoint_committed",
            step=manifest.step,
            bytes=manifest.total_bytes,
            bytes_sent=sent,
            copied=sum(1 for r in results if r.how == "copied"),
            resumed=sum(1 for r in results if r.how == "resumed"),
            skipped=sum(1 for r in results if r.how == "skipped"),
            seconds=round(seconds, 3),
            cpu_seconds=round(cpu_seconds, 3),
            latest_moved=result.latest_moved,
            manifest_crc32c=result.manifest_crc32c,
        )
        return True

    async def _transfer_all(
        self,
        state: RunState,
        listing: CheckpointListing,
        verdict: Completion,
        previous: Manifest | None,
        log: Any,
    ) -> list[FileResult]:
        run, name = state.run_id, listing.name
        done_records = await asyncio.to_thread(self.journal.objects_for, run, name)
        done = {p: (r.size, r.mtime_ns) for p, r in done_records.items()}
        # No copy candidates where the store cannot copy: every changed file is uploaded.
        plan = plan_upload(verdict.files, previous if self.transfers.can_copy else None, done)
        total = sum(f.size for f in verdict.files)
        state.current = Progress(name, self.clock(), total)
        log.info(
            "checkpoint_uploading",
            files=len(verdict.files),
            bytes=total,
            to_upload=len(plan.upload),
            copy_candidates=len(plan.copy_candidates),
            already_done=len(plan.done),
        )
        ctx = TransferContext(run, name)
        state.current_files = _fingerprint(listing.files)
        state.current_ctx = ctx

        def local_path(f: FileEntry) -> Path:
            return state.dir / name / f.path if listing.is_dir else state.dir / name

        async def bounded(work: Awaitable[T]) -> T:
            # Coroutines are created up front but start only here, so at most
            # _file_slots files are open (and hold buffers) at once.
            async with self._file_slots:
                return await work

        results: list[FileResult] = [
            FileResult(f.path, f.size, done_records[f.path].crc32c, "skipped") for f in plan.done
        ]
        uploads = list(plan.upload)
        jobs: list[Any] = []
        if plan.copy_candidates and previous is not None:
            crcs = await asyncio.gather(
                *(
                    bounded(self.transfers.crc_of(local_path(f), f, ctx))
                    for f in plan.copy_candidates
                )
            )
            crc_map = {f.path: c for f, c in zip(plan.copy_candidates, crcs, strict=True)}
            copies, more = resolve_copies(
                plan.copy_candidates, {p: checksum.to_hex(c) for p, c in crc_map.items()}, previous
            )
            uploads.extend(more)
            for c in copies:
                src = object_key(previous.run_id, previous.checkpoint, c.source_path)
                dst = object_key(run, name, c.file.path)
                jobs.append(
                    bounded(self.transfers.copy(src, dst, c.file, crc_map[c.file.path], ctx))
                )
        for f in uploads:
            key = object_key(run, name, f.path)
            jobs.append(bounded(self.transfers.upload(key, local_path(f), f, ctx)))
        tasks = [asyncio.ensure_future(j) for j in jobs]
        try:
            results.extend(await asyncio.gather(*tasks))
        except BaseException:
            ctx.cancel.set()  # the other files stop at their next part...
            if tasks:
                await asyncio.wait(tasks)  # ...and none is still sending when we clean up
            raise
        for r in results:
            if r.how == "copied":
                self.metrics.copied_bytes.labels(run=run).inc(r.size)
        return results

    async def _retention(self, state: RunState, log: Any) -> None:
        """After a commit: remote retention, then (opt-in) local cleanup. A failure here
        is logged; it never fails the commit that came before it."""
        policy = self.settings.retention
        protected = set(state.pending)
        if state.current is not None:
            protected.add(state.current.name)
        try:
            deleted = await asyncio.to_thread(
                apply_retention,
                self.storage,
                state.run_id,
                keep_last=policy.keep_last,
                keep_every_steps=policy.keep_every_steps,
                protected=protected,
            )
            if deleted:
                log.info("retention_deleted", deleted=deleted)
        except (StorageError, ManifestError) as exc:
            log.warning("retention_failed", error=str(exc))
        if policy.local_keep_last > 0:
            try:
                names = await asyncio.to_thread(list_candidates, state.dir)
                local = sorted(
                    ((n, step_of(n)) for n in names),
                    key=lambda e: (e[1] if e[1] is not None else -1, e[0]),
                )
                removed = await asyncio.to_thread(
                    apply_local_cleanup,
                    state.dir,
                    local,
                    set(state.committed),
                    local_keep_last=policy.local_keep_last,
                )
                if removed:
                    state.seen.difference_update(removed)
                    log.info("local_cleanup_deleted", deleted=removed)
            except OSError as exc:
                log.warning("local_cleanup_failed", error=str(exc))

    async def _previous_manifest(self, state: RunState) -> Manifest | None:
        if not state.previous_loaded:
            try:
                latest = await asyncio.to_thread(read_latest, self.storage, state.run_id)
                if latest is not None:
                    state.previous = await asyncio.to_thread(
                        read_manifest, self.storage, state.run_id, latest.checkpoint
                    )
            except (StorageError, ManifestError) as exc:
                self.log.warning("previous_manifest_unreadable", run=state.run_id, error=str(exc))
                state.previous = None
            state.previous_loaded = True
        return state.previous

    def _mark_committed(
        self, state: RunState, pending: Pending, manifest: Manifest, log: Any, *, already: bool
    ) -> None:
        self.journal.mark_committed(state.run_id, manifest.checkpoint, manifest.step)
        state.committed.add(manifest.checkpoint)
        state.pending.pop(manifest.checkpoint, None)
        if state.previous is None or (manifest.step or -1) >= (state.previous.step or -1):
            state.previous = manifest
            state.previous_loaded = True
        run = state.run_id
        now = self.clock()
        self.metrics.committed.labels(run=run).inc()
        if manifest.step is not None and (
            state.last_step is None or manifest.step > state.last_step
        ):
            state.last_step = manifest.step
            self.metrics.last_step.labels(run=run).set(manifest.step)
        self.metrics.last_commit_ts.labels(run=run).set(now)
        state.last_committed = {
            "checkpoint": manifest.checkpoint,
            "step": manifest.step,
            "bytes": manifest.total_bytes,
            "committed_at": manifest.committed_at,
        }
        if already:
            log.info("checkpoint_already_committed", step=manifest.step)
        self._update_gauges()

    async def _abandon(self, state: RunState, pending: Pending, reason: str, log: Any) -> None:
        """Drop a checkpoint that changed under us: abort its multipart uploads and
        delete what it had sent, unless (by a race) it is committed already."""
        run, name = state.run_id, pending.name
        state.pending.pop(name, None)
        self.metrics.abandoned.labels(run=run).inc()
        log.warning("checkpoint_abandoned", reason=reason)
        try:
            for rec in await asyncio.to_thread(self.journal.all_uploads):
                if rec.run == run and rec.checkpoint == name:
                    await asyncio.to_thread(
                        abort_journalled_upload, self.storage, rec.key, rec.upload_id or None
                    )
            if await asyncio.to_thread(self.storage.head, manifest_key(run, name)) is None:
                sent = await asyncio.to_thread(self.journal.objects_for, run, name)
                if sent:
                    await asyncio.to_thread(self.storage.delete, [r.key for r in sent.values()])
            await asyncio.to_thread(self.journal.forget_checkpoint, run, name)
        except StorageError as exc:
            log.warning("abandon_cleanup_failed", error=str(exc))
        self._update_gauges()
        # If it was rewritten rather than deleted, it may become complete again.
        self.hint(run, name, delay=max(1.0, state.rules.settle_seconds))

    def _failed(self, state: RunState, pending: Pending, exc: Exception, log: Any) -> None:
        code = getattr(exc, "code", "") or type(exc).__name__
        pending.failures += 1
        base, cap = FAILURE_BACKOFF
        delay = min(cap, base * 2 ** (pending.failures - 1))
        pending.not_before = time.monotonic() + delay
        self.metrics.failed.labels(run=state.run_id, reason=code).inc()
        self.metrics.storage_errors.labels(operation="checkpoint", code=code).inc()
        if getattr(exc, "destination_unusable", False):  # decided by the backend that saw it
            self.metrics.destination_up.set(0)
        log.error(
            "checkpoint_failed",
            error=str(exc),
            code=code,
            attempt=pending.failures,
            retry_in=round(delay, 1),
        )
        self._update_gauges()

    # -- state for metrics and /v1/status -------------------------------------------------

    def _sync_lag(self, state: RunState, now: float) -> float:
        oldest = min((p.completed_at for p in state.pending.values()), default=None)
        return 0.0 if oldest is None else max(0.0, now - oldest)

    def _update_gauges(self) -> None:
        now = self.clock()
        for state in self.runs.values():
            self.metrics.pending.labels(run=state.run_id).set(len(state.pending))
            self.metrics.sync_lag.labels(run=state.run_id).set(self._sync_lag(state, now))

    def idle(self) -> bool:
        """Nothing pending, nothing uploading, nothing waiting to be looked at again."""
        busy_timers = [k for k, t in self._timers.items() if not t.cancelled()]
        return (
            not busy_timers
            and not self._evaluating
            and all(not s.pending and s.current is None for s in self.runs.values())
        )

    def status(self) -> dict[str, Any]:
        """Per-run state for ``/v1/status``."""
        self._update_gauges()
        now = self.clock()
        runs = {}
        for state in self.runs.values():
            current = state.current
            runs[state.run_id] = {
                "dir": str(state.dir),
                "layout": state.watch.layout,
                "pending": sorted(state.pending),
                "uploading": None
                if current is None
                else {
                    "checkpoint": current.name,
                    "bytes_total": current.total_bytes,
                    "bytes_sent": current.sent_bytes,
                },
                "last_committed": state.last_committed,
                "failed": state.failed_for_good,
                "sync_lag_seconds": self._sync_lag(state, now),
            }
        return {"runs": runs}

    async def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.to_thread(self.transfers.close)
