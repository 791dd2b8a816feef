"""Many small files in few hand-offs: lanes that each send one file after another.

A file of at most ``SMALL_FILE_MAX`` bytes is one PUT of the whole file from memory
(``Transfers.send_small``). Sent as a coroutine and a pool task each, such files cost
about as much CPU in hand-offs between the event loop and the pool as in their requests
(measured on 3,000 shards of 64 KiB: ``bench/bench_manyfiles.py``). A batch of them goes
instead to ``SmallFiles.send``: ``lanes`` pool tasks that each take the next file of the
batch until none is left, and write their journal rows in one transaction per
``_ROWS_PER_COMMIT`` files. The event loop hears from a batch once per lane.

Concurrency: ``lanes`` requests in flight (``ckptd.core.concurrency``: 32 at the default
concurrency of 8), while large files' parts stay at ``concurrency``. The lanes' threads
are set up as the transfer pool's are (``SCHED_IDLE``, nice 19: ``yielding``), and
while ``is_urgent()`` holds (a preemption notice) a batch runs on a second pool set up
as the urgent transfer pool is, so an emergency checkpoint of many files never waits
for an idle CPU either.

Invariant: as ``Transfers.upload``: a result is returned only for a file now in the
store as a verified object, and its journal row is written only after that; the first
failure stops the lanes at their next file (the files already sent stay journalled)
and is raised, as is a pause or a cancel of the context.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckptd.core.concurrency import SMALL_FILE_MAX
from ckptd.layouts.base import FileEntry
from ckptd.sync.journal import ObjectRecord
from ckptd.sync.transfer import (
    CheckpointChangedError,
    FileResult,
    TransferContext,
    TransferPausedError,
    Transfers,
)

# Journal rows written per transaction by one lane: few enough that a crash re-sends
# little, many enough that the journal costs nothing per file.
_ROWS_PER_COMMIT = 64


@dataclass(frozen=True)
class SmallFile:
    """One file to send: where its bytes are, where they go, what it was when listed."""

    key: str
    local: Path
    entry: FileEntry


class _Batch:
    """The files of one ``send`` call, taken one at a time by the lanes."""

    def __init__(self, files: Sequence[SmallFile], ctx: TransferContext) -> None:
        self.files = files
        self.ctx = ctx
        self.results: list[FileResult | None] = [None] * len(files)
        self._next = 0
        self._lock = threading.Lock()
        self.failed = threading.Event()

    def take(self) -> int | None:
        with self._lock:
            if self._next >= len(self.files) or self.failed.is_set():
                return None
            index = self._next
            self._next += 1
            return index


class SmallFiles:
    """Sends batches of small files through ``lanes`` threads (module doc)."""

    def __init__(
        self,
        transfers: Transfers,
        *,
        lanes: int,
        thread_setup: Callable[[], None] | None = None,
        urgent_setup: Callable[[], None] | None = None,
        is_urgent: Callable[[], bool] = lambda: False,
    ) -> None:
        self.transfers = transfers
        self.lanes = lanes
        self._setup = thread_setup
        self._urgent_setup = urgent_setup
        self._is_urgent = is_urgent
        self._pool: ThreadPoolExecutor | None = None
        self._urgent_pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def fits(self, entry: FileEntry) -> bool:
        """Whether ``entry`` goes through the lanes: small enough, and one PUT."""
        return entry.size <= min(SMALL_FILE_MAX, self.transfers.single_put_max)

    def _pool_now(self) -> ThreadPoolExecutor:
        """The pool a batch starting now runs on; each started on first use."""
        urgent = self._is_urgent()
        with self._lock:
            if urgent:
                if self._urgent_pool is None:
                    self._urgent_pool = ThreadPoolExecutor(
                        self.lanes, "ckptd-small-urgent", initializer=self._urgent_setup
                    )
                return self._urgent_pool
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.lanes, "ckptd-small", initializer=self._setup)
            return self._pool

    async def send(self, files: Sequence[SmallFile], ctx: TransferContext) -> list[FileResult]:
        """Send every file of ``files``, each verified and journalled; the results in
        the order of ``files``. Raises the first failure."""
        results, error = await self.try_send(files, ctx)
        if error is not None:
            raise error
        return [r for r in results if r is not None]

    async def try_send(
        self, files: Sequence[SmallFile], ctx: TransferContext
    ) -> tuple[list[FileResult | None], BaseException | None]:
        """As ``send``, but each file's result or None (not sent: the batch stopped at a
        failure first), and that failure instead of raising it."""
        if not files:
            return [], None
        batch = _Batch(files, ctx)
        try:
            ctx.check()
        except (CheckpointChangedError, TransferPausedError) as exc:
            return list(batch.results), exc
        pool = self._pool_now()
        lanes = [
            asyncio.wrap_future(pool.submit(self._lane, batch))
            for _ in range(min(self.lanes, len(files)))
        ]
        outcomes = await asyncio.gather(*lanes, return_exceptions=True)
        error = next((o for o in outcomes if isinstance(o, BaseException)), None)
        return list(batch.results), error

    def _lane(self, batch: _Batch) -> None:
        transfers, ctx = self.transfers, batch.ctx
        rows: list[ObjectRecord] = []
        try:
            while (index := batch.take()) is not None:
                ctx.check()
                f = batch.files[index]
                try:
                    result, record = transfers.send_small(f.key, f.local, f.entry, ctx)
                except FileNotFoundError as exc:
                    raise CheckpointChangedError(f"{f.entry.path} vanished") from exc
                batch.results[index] = result
                rows.append(record)
                if len(rows) >= _ROWS_PER_COMMIT:
                    transfers.journal.record_objects(ctx.run, ctx.checkpoint, rows)
                    rows = []
        except BaseException:
            batch.failed.set()  # the other lanes stop at their next file
            raise
        finally:
            if rows:
                transfers.journal.record_objects(ctx.run, ctx.checkpoint, rows)

    def close(self) -> None:
        for pool in (self._pool, self._urgent_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
