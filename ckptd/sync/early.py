"""Shipping the files of a checkpoint that is not complete yet, each once it is closed and quiet.

Most of a checkpoint's bytes (weights, each rank's optimizer shard) are written and
closed long before its commit record appears; ``EarlyUploads`` sends them meanwhile, so
that when the completion rule holds only the last files are left to send.

Invariant: an early upload writes nothing but objects under the checkpoint's own slot
(``ckptd.commit.slots``: claimed before the first, ``ckptd.sync.claims``) and their journal
rows, each row with the identity (size, mtime, ctime, inode) its file
had when it was read. It never writes a manifest, a part or an announcement: what is
committed is decided by the ordinary ship (``ckptd.sync.ship``) once the completion rule
holds, which takes an early object only while its file still has that identity, sends
the others again, and deletes early objects of files no longer in the checkpoint. A
checkpoint deleted before completion has its early objects and uploads removed
(``cleanup.discard``). So early shipping changes when bytes move, never what commits.

No early upload ends with an exception nobody handles: whatever one meets (the store,
the journal's disk) is logged as ``early_upload_failed`` / ``early_batch_failed`` and
leaves its file to the ordinary ship.

A file whose size and CRC-32C equal a file of the run's last committed checkpoint (a
frozen base model beside LoRA adapters) is copied server-side from that checkpoint's
object instead of uploaded (as the ordinary ship would: ``ckptd.sync.plan``); its CRC
is read first, so only files whose size matches one there pay that read. A copy's
journal row has the identity its file had before that read, as an upload's has.

A file goes early when it is not held open for writing (the ``/proc`` check the
quiescent rule uses; where ``/proc`` cannot tell, nothing goes early) and unchanged for
``EARLY_SETTLE_SECONDS``. Early uploads share the node's transfers (its workers, the
small files' lanes of ``ckptd.sync.lanes``, its bandwidth cap) and obey the emergency
rules: during a preemption notice only the checkpoint being written since the notice
goes early, and it pauses other uploads. With peer replication (``emergency_early``
False) not even that one: its part goes to its peers first and to the store after
(``ckptd.sync.replicate``), and an early upload would take the link and the cores the
push needs.
The small files ready at one look go as one batch, said in one log line
(``early_batch_started``/``_done``) rather than two per file; a large file is said on
its own (``early_upload_started``/``_done``).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core import checksum
from ckptd.core.concurrency import SMALL_FILE_MAX
from ckptd.core.manifest import Manifest
from ckptd.layouts.base import CheckpointListing, FileEntry, shippable
from ckptd.repository import object_key
from ckptd.storage.base import StorageError
from ckptd.sync.claims import Claims
from ckptd.sync.journal import Journal
from ckptd.sync.lanes import SmallFile, SmallFiles
from ckptd.sync.plan import CopySources, plan_upload, resolve_copies
from ckptd.sync.queue import InFlight
from ckptd.sync.transfer import (
    CheckpointChangedError,
    FileResult,
    TransferContext,
    TransferPausedError,
    Transfers,
)

# A closed file unchanged for this long is taken to be finished. Short: closing is the
# real signal; the wait only keeps a file that is closed and reopened at once (an append
# in several opens) from going out between two writes, and puts any later write in a
# later mtime tick than the one read.
EARLY_SETTLE_SECONDS = 0.5

EarlyFile = tuple[FileEntry, "asyncio.Future[FileResult | None]"]


def ready_files(
    listing: CheckpointListing,
    done: Mapping[str, tuple[int, int]],
    busy: Set[str],
    now_ns: int,
    settle_seconds: float = EARLY_SETTLE_SECONDS,
) -> tuple[list[FileEntry], float | None]:
    """``(files to send now, seconds until the next closed file is quiet or None)``.

    A file goes when it is not open for writing, unchanged for ``settle_seconds``, not
    a scratch file, not in ``busy`` (being sent) and not in ``done`` with its present
    size and mtime. Nothing goes from a file checkpoint (its one file is the whole
    checkpoint) or where ``/proc`` could not tell which files are open. Pure.
    """
    if not listing.is_dir or listing.open_for_write is None:
        return [], None
    ready: list[FileEntry] = []
    wait = math.inf
    for f in shippable(listing):
        if f.path in listing.open_for_write or f.path in busy:
            continue
        if done.get(f.path) == (f.size, f.mtime_ns):
            continue
        age = (now_ns - f.mtime_ns) / 1e9
        if age < 0:
            continue  # an mtime in the future: left to the completion rule
        if age < settle_seconds:
            wait = min(wait, settle_seconds - age)
            continue
        ready.append(f)
    return ready, (None if wait == math.inf else wait)


@dataclass
class EarlyShip:
    """The early uploads of one checkpoint."""

    run: str
    name: str
    emergency: bool
    ctx: TransferContext
    slot: str  # where its objects go (``ckptd.commit.slots``), claimed before the first
    files: dict[str, EarlyFile] = field(default_factory=dict)
    closed: bool = False  # handed to the ordinary ship: no new file starts
    # path -> (size, mtime_ns) of what an earlier process sent (the journal at the first
    # look); None until read.
    journalled: dict[str, tuple[int, int]] | None = None

    def busy(self, listing: CheckpointListing) -> set[str]:
        """Paths being sent, or tried already as they are now in ``listing`` (one that
        failed is left to the ordinary ship rather than tried again and again)."""
        now = {f.path: f for f in listing.files}
        return {
            path
            for path, (entry, future) in self.files.items()
            if not future.done() or now.get(path) == entry
        }

    def running(self) -> list[asyncio.Future[FileResult | None]]:
        return [future for _, future in self.files.values() if not future.done()]

    def bytes_in_flight(self) -> int:
        return sum(e.size for e, future in self.files.values() if not future.done())


class EarlyUploads:
    """Every checkpoint's early uploads on this node (module doc)."""

    def __init__(
        self,
        transfers: Transfers,
        journal: Journal,
        claims: Claims,
        *,
        slots: int,
        small: SmallFiles,
        log: Any,
        emergency_early: bool = True,
    ) -> None:
        self.emergency_early = emergency_early  # module doc
        self.transfers = transfers
        self.journal = journal
        self.claims = claims
        self.small = small
        self.log = log
        self._slots = asyncio.Semaphore(slots)
        self.ships: dict[tuple[str, str], EarlyShip] = {}
        self._batches: set[asyncio.Task[None]] = set()
        # The last committed manifest, indexed once for the copy checks (not per file).
        self._sources: tuple[Manifest, CopySources] | None = None

    async def offer(
        self,
        run: str,
        run_dir: Path,
        listing: CheckpointListing,
        *,
        emergency: bool,
        now_ns: int,
        settle_seconds: float = EARLY_SETTLE_SECONDS,
        previous: Manifest | None = None,
        trajectory: str = "",
    ) -> tuple[int, float | None]:
        """Start the uploads of ``listing``'s files that are ready; returns ``(bytes
        started, seconds until another file may be ready or None)``. ``previous`` is
        the run's last committed manifest, the base of server-side copies;
        ``trajectory`` the one the checkpoint's content belongs to (its slot's)."""
        if emergency and not self.emergency_early:
            return 0, None  # its peers first, the store after (module doc)
        key = (run, listing.name)
        ship = self.ships.get(key)
        if ship is not None and ship.closed:
            return 0, None
        if ship is not None and ship.ctx.pause.is_set():
            if ship.running():
                return 0, None  # paused: the ones in flight stop at their next part
            ship = None  # made way for an emergency before: start afresh
        if ship is None:
            prepared = await self.claims.prepare(run, listing.name, trajectory)
            if prepared.slot is None or prepared.committed is not None:
                # The name is committed (or being committed) on this trajectory: the
                # ordinary ship compares, and sends nothing if it is the same content.
                return 0, None
            ship = self.ships[key] = EarlyShip(
                run, listing.name, emergency, TransferContext(run, listing.name), prepared.slot.slot
            )
        ship.emergency = ship.emergency or emergency
        if ship.journalled is None:
            # Sent by an earlier process (the journal's rows), read once per checkpoint:
            # what this one sends since is in ``ship.files``.
            records = await asyncio.to_thread(self.journal.objects_for, run, listing.name)
            ship.journalled = {p: (r.size, r.mtime_ns) for p, r in records.items()}
        if ship.closed:  # handed over while the journal was read
            return 0, None
        ready, wait = ready_files(
            listing, ship.journalled, ship.busy(listing), now_ns, settle_seconds
        )
        sources = self._copy_sources(previous)
        small = [f for f in ready if self.small.fits(f)]
        for f in ready:
            if self.small.fits(f):
                continue
            local = run_dir / listing.name / f.path
            future = asyncio.ensure_future(self._send(ship, local, f, sources))
            ship.files[f.path] = (f, future)
            self.log.info(
                "early_upload_started", run=run, checkpoint=listing.name, path=f.path, bytes=f.size
            )
        if small:
            self._start_batch(ship, run_dir / listing.name, small)
        return sum(f.size for f in ready), wait

    def _copy_sources(self, previous: Manifest | None) -> CopySources | None:
        if previous is None:
            return None
        if self._sources is None or self._sources[0] is not previous:
            self._sources = (previous, CopySources.of(previous))
        return self._sources[1]

    def _start_batch(self, ship: EarlyShip, ckpt_dir: Path, files: list[FileEntry]) -> None:
        """Small files through the lanes (``ckptd.sync.lanes``), one future each for the
        ordinary ship, and one log line for the batch rather than two per file."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[FileResult | None]] = []
        for f in files:
            future: asyncio.Future[FileResult | None] = loop.create_future()
            ship.files[f.path] = (f, future)
            futures.append(future)
        self.log.info(
            "early_batch_started",
            run=ship.run,
            checkpoint=ship.name,
            files=len(files),
            bytes=sum(f.size for f in files),
        )
        task = asyncio.ensure_future(self._send_batch(ship, ckpt_dir, files, futures))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _send_batch(
        self,
        ship: EarlyShip,
        ckpt_dir: Path,
        files: list[FileEntry],
        futures: list[asyncio.Future[FileResult | None]],
    ) -> None:
        """Each file's future gets its result, or None where the batch stopped first
        (the ordinary ship then sends it), whatever happens."""
        results: list[FileResult | None] = [None] * len(files)
        error: BaseException | None = None
        try:
            batch = [
                SmallFile(object_key(ship.run, ship.slot, f.path), ckpt_dir / f.path, f)
                for f in files
            ]
            results, error = await self.small.try_send(batch, ship.ctx)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - said below; the ordinary ship sends them
            error = exc
        finally:
            for future, result in zip(futures, results, strict=True):
                if not future.done():
                    future.set_result(result)
        sent = [r for r in results if r is not None]
        done = {"files": len(sent), "bytes": sum(r.size for r in sent)}
        log = self.log.bind(run=ship.run, checkpoint=ship.name)
        if error is None:
            log.info("early_batch_done", **done)
        elif isinstance(error, TransferPausedError | CheckpointChangedError):
            log.info("early_batch_stopped", reason=str(error), left=len(files) - len(sent), **done)
        else:
            log.warning("early_batch_failed", error=str(error), left=len(files) - len(sent), **done)

    async def _send(
        self, ship: EarlyShip, local: Path, entry: FileEntry, previous: CopySources | None
    ) -> FileResult | None:
        """One file's early upload, or copy; None when it did not finish (the ordinary
        ship then sends it: paused, changed, or the store failed)."""
        key = object_key(ship.run, ship.slot, entry.path)
        log = self.log.bind(run=ship.run, checkpoint=ship.name, path=entry.path)
        try:
            async with self._slots:
                copied = await self._copy_if_unchanged(ship, key, local, entry, previous)
                if copied is not None:
                    log.info("early_copied", bytes=entry.size)
                    return copied
                result = await self.transfers.upload(key, local, entry, ship.ctx)
        except TransferPausedError:
            log.info("early_upload_paused")
            return None
        except CheckpointChangedError as exc:
            log.info("early_upload_dropped", reason=str(exc))
            return None
        except (StorageError, OSError) as exc:
            log.warning("early_upload_failed", error=str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - the journal's sqlite (disk full), a bug
            # The future is awaited only if the ordinary ship takes it: an exception in
            # it would be retrieved by no one. The ordinary ship sends this file.
            log.warning("early_upload_failed", error=repr(exc))
            return None
        log.info("early_upload_done", bytes=entry.size)
        return result

    async def _copy_if_unchanged(
        self,
        ship: EarlyShip,
        key: str,
        local: Path,
        entry: FileEntry,
        previous: CopySources | None,
    ) -> FileResult | None:
        """The server-side copy of ``entry`` from ``previous`` when a file there has its
        size and CRC-32C; None (nothing done but the read) when none has."""
        if previous is None or not self.transfers.can_copy:
            return None
        plan = plan_upload([entry], previous, {}, min_copy_size=SMALL_FILE_MAX + 1)
        if not plan.copy_candidates:
            return None  # no file of that size: not worth reading
        # Taken before the read: a file replaced after it has another identity at
        # commit (ctime, inode), and is sent again (``ship.unchanged``).
        identity = await asyncio.to_thread(os.stat, local)
        if (identity.st_size, identity.st_mtime_ns) != (entry.size, entry.mtime_ns):
            raise CheckpointChangedError(f"{entry.path} changed")
        crc, sums = await self.transfers.crc_of(local, entry, ship.ctx)
        copies, _ = resolve_copies([entry], {entry.path: checksum.to_hex(crc)}, previous)
        if not copies:
            return None
        src = object_key(previous.run_id, previous.checkpoint, copies[0].source_path)
        return await self.transfers.copy(src, key, entry, crc, ship.ctx, sums, identity)

    def take(self, run: str, name: str) -> dict[str, EarlyFile]:
        """Hand ``run/name``'s early uploads to the ordinary ship: none starts after this."""
        ship = self.ships.get((run, name))
        if ship is None:
            return {}
        ship.closed = True
        return dict(ship.files)

    async def close(self) -> None:
        """Stop every early upload and wait until none is sending (the daemon is
        stopping: the transfer pool goes next, and a send still queued for it would
        fail). Parts already sent stay journalled for the next start."""
        for run, name in list(self.ships):
            await self.cancel(run, name)

    async def cancel(self, run: str, name: str) -> bool:
        """Stop ``run/name``'s early uploads and wait until none is sending; True if it
        had any."""
        ship = self.ships.pop((run, name), None)
        if ship is None:
            return False
        ship.closed = True
        ship.ctx.cancel.set()
        running = ship.running()
        if running:
            await asyncio.wait(running)
        return bool(ship.files)

    def pause(self, run: str, name: str) -> None:
        """Pause ``run/name``'s early uploads at their next part (their finished parts
        stay journalled; the ordinary ship sends the rest): an emergency push to peers
        goes first (``ckptd.sync.replicate``)."""
        ship = self.ships.get((run, name))
        if ship is not None:
            ship.ctx.pause.set()

    def in_flight(self) -> list[tuple[InFlight, TransferContext]]:
        """Early uploads sending now, as the emergency's pause decision sees them."""
        found = []
        for ship in self.ships.values():
            left = ship.bytes_in_flight()
            if left and not ship.closed:
                upload = InFlight(ship.run, ship.name, left, 0, emergency=ship.emergency)
                found.append((upload, ship.ctx))
        return found

    def emergency_active(self) -> bool:
        """Whether the checkpoint being written since a notice is being sent early."""
        return any(s.emergency and s.running() for s in self.ships.values())
