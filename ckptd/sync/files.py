"""The files of one checkpoint into its slot: planned, then sent, copied server-side, or
taken from early shipping, each verified.

``CheckpointFiles.transfer_all`` is step 1 of the commit protocol for the ``Shipper``
(``ckptd.sync.ship``): every file of the verdict ends in the store as a verified object of
the request's slot, or the call raises. An object sent before (an earlier attempt, or
early: ``ckptd.sync.early``) counts only while its file still has the identity it had
when read (``unchanged``); any other is sent again, and an early object of a file no
longer in the checkpoint is deleted, so the slot holds what the manifest will name.

Small files go in one batch through the lanes (``ckptd.sync.lanes``), larger ones each on
its own; nothing here reads the whole journal or the whole checkpoint per file, so the
cost per file is the same for ten files or 100,000.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

from ckptd.core import checksum
from ckptd.core.concurrency import SMALL_FILE_MAX
from ckptd.core.manifest import Manifest
from ckptd.layouts.base import FileEntry
from ckptd.repository import Repository, object_key
from ckptd.sync.journal import Journal, ObjectRecord
from ckptd.sync.lanes import SmallFile, SmallFiles
from ckptd.sync.plan import plan_upload, resolve_copies
from ckptd.sync.request import ShipRequest, local_path, sent_early_as, taken_early, unchanged
from ckptd.sync.transfer import (
    CheckpointChangedError,
    FileResult,
    Transfers,
    abort_journalled_upload,
)

T = TypeVar("T")


class CheckpointFiles:
    """Sends one checkpoint's files at a time into its slot, through one set of transfers."""

    def __init__(
        self,
        repo: Repository,
        transfers: Transfers,
        journal: Journal,
        *,
        file_slots: int,
        small: SmallFiles,
    ) -> None:
        self.repo = repo
        self.transfers = transfers
        self.journal = journal
        self.small = small
        self._file_slots = asyncio.Semaphore(file_slots)

    async def transfer_all(self, request: ShipRequest, log: Any) -> list[FileResult]:
        """Step 1 for every file of ``request``'s verdict (module doc)."""
        run, name, ctx = request.run, request.name, request.context
        files_to_ship = request.verdict.files

        def still_done() -> dict[str, ObjectRecord]:
            records = self.journal.objects_for(run, name)
            return {
                p: r
                for p, r in records.items()
                if r.key == request.key(p) and unchanged(local_path(request, p), r)
            }

        done_records = await asyncio.to_thread(still_done)
        done = {p: (r.size, r.mtime_ns) for p, r in done_records.items()}
        # No copy candidates where the store cannot copy: every changed file is uploaded.
        previous = request.previous if self.transfers.can_copy else None
        plan = plan_upload(files_to_ship, previous, done, min_copy_size=SMALL_FILE_MAX + 1)
        total = sum(f.size for f in files_to_ship)
        request.on_started(total)
        log.info(
            "checkpoint_uploading",
            files=len(files_to_ship),
            bytes=total,
            to_upload=len(plan.upload),
            # Same size and mtime as in the previous checkpoint: copied server-side if
            # their CRC-32C still matches (checkpoint_committed counts those copied).
            unchanged_candidates=len(plan.copy_candidates),
            already_done=len(plan.done),
            early_in_flight=sum(1 for _, f in request.early.values() if not f.done()),
        )
        found_done = [self._done(request, f, done_records) for f in plan.done]
        if self.transfers.digests:
            found_done.extend(
                await asyncio.gather(*(self._skipped(request, f, done_records) for f in plan.done))
            )
        results: list[FileResult] = [r for r in found_done if r is not None]
        uploads = list(plan.upload)
        # A candidate sent early as it is now is the early transfer's to finish (it copies
        # what it can, ``ckptd.sync.early``): never a second copy or upload of one key.
        candidates = [f for f in plan.copy_candidates if not sent_early_as(request, f)]
        uploads.extend(f for f in plan.copy_candidates if sent_early_as(request, f))
        jobs: list[Awaitable[list[FileResult]]] = []
        if candidates and previous is not None:
            copies, more = await self._copies(request, candidates, previous)
            jobs.extend(self._one(c) for c in copies)
            uploads.extend(more)
        early = [f for f in uploads if f.path in request.early]
        if early:
            jobs.append(self._after_early(request, early))
        jobs.extend(self._uploads(request, [f for f in uploads if f.path not in request.early]))
        tasks = [asyncio.ensure_future(j) for j in jobs]
        try:
            for found in await asyncio.gather(*tasks):
                results.extend(found)
        except BaseException:
            ctx.cancel.set()  # the other files stop at their next part...
            if tasks:
                await asyncio.wait(tasks)  # ...and none is still sending when we clean up
            raise
        await self._drop_strays(request, {f.path for f in files_to_ship}, log)
        for r in results:
            if r.how == "copied":
                request.on_copied(r.size)
        return results

    async def bounded(self, work: Awaitable[T]) -> T:
        # Coroutines are created up front but start only here, so at most
        # file_slots files are open (and hold buffers) at once.
        async with self._file_slots:
            return await work

    @staticmethod
    async def _one(work: Awaitable[FileResult]) -> list[FileResult]:
        return [await work]

    def _uploads(
        self, request: ShipRequest, files: Sequence[FileEntry]
    ) -> list[Awaitable[list[FileResult]]]:
        """Small files in one batch through the lanes (``ckptd.sync.lanes``), larger
        ones each on its own, at most file_slots at a time."""
        small = [f for f in files if self.small.fits(f)]
        jobs: list[Awaitable[list[FileResult]]] = [
            self._one(self._upload(request, f)) for f in files if not self.small.fits(f)
        ]
        if small:
            batch = [SmallFile(request.key(f.path), local_path(request, f), f) for f in small]
            jobs.append(self.small.send(batch, request.context))
        return jobs

    async def _upload(self, request: ShipRequest, f: FileEntry) -> FileResult:
        key = request.key(f.path)
        local = local_path(request, f)
        return await self.bounded(self.transfers.upload(key, local, f, request.context))

    async def _after_early(
        self, request: ShipRequest, files: Sequence[FileEntry]
    ) -> list[FileResult]:
        """Files sent early and maybe still sending: wait for them, then take each one
        whose file is still what was read; send the others now."""
        sent = [(f, request.early[f.path]) for f in files]
        outcomes = await asyncio.gather(*(future for _, (_, future) in sent))

        def check() -> tuple[list[FileResult], list[FileEntry]]:
            taken: list[FileResult] = []
            again: list[FileEntry] = []
            for (f, (entry, _)), early in zip(sent, outcomes, strict=True):
                record = self.journal.object_at(request.key(f.path)) if early else None
                if (
                    early is not None
                    and entry == f
                    and record is not None
                    and unchanged(local_path(request, f), record)
                ):
                    taken.append(taken_early(f, early))
                else:
                    again.append(f)
            return taken, again

        taken, again = await asyncio.to_thread(check)
        for found in await asyncio.gather(*self._uploads(request, again)):
            taken.extend(found)
        return taken

    def _done(
        self, request: ShipRequest, f: FileEntry, done_records: Mapping[str, ObjectRecord]
    ) -> FileResult | None:
        """A file the journal holds as sent and unchanged: sent (or copied) early by this
        process, so said as such, or sent by an earlier one (``_skipped``; None here
        when that needs its bytes read again for a digest)."""
        early = request.early.get(f.path)
        sent_early = early is not None and early[0] == f
        if early is not None and sent_early and early[1].done() and not early[1].cancelled():
            result = early[1].result()
            if result is not None:
                return taken_early(f, result)
        if self.transfers.digests:
            return None
        # Its early batch, still sending others, journalled it already: early, not skipped.
        how = "early" if sent_early else "skipped"
        return FileResult(f.path, f.size, done_records[f.path].crc32c, how)

    async def _skipped(
        self, request: ShipRequest, f: FileEntry, done_records: Mapping[str, ObjectRecord]
    ) -> FileResult | None:
        """With digests, a file sent by an earlier run of the daemon is read once more
        for its digest, and to prove it is still the bytes that were sent; None for one
        ``_done`` already took."""
        if self._done(request, f, done_records) is not None or not self.transfers.digests:
            return None
        crc = done_records[f.path].crc32c
        local = local_path(request, f)
        again, sums = await self.bounded(self.transfers.crc_of(local, f, request.context))
        if again != crc:
            raise CheckpointChangedError(f"{f.path} changed since it was sent")
        return FileResult(f.path, f.size, crc, "skipped", digest=sums)

    async def _copies(
        self, request: ShipRequest, candidates: Sequence[FileEntry], previous: Manifest
    ) -> tuple[list[Awaitable[FileResult]], list[FileEntry]]:
        """The server-side copies of the candidates whose CRC-32C still matches the
        previous checkpoint's, and the candidates to upload after all."""
        ctx = request.context
        crcs = await asyncio.gather(
            *(
                self.bounded(self.transfers.crc_of(local_path(request, f), f, ctx))
                for f in candidates
            )
        )
        crc_map = {f.path: c for f, (c, _) in zip(candidates, crcs, strict=True)}
        digest_map = {f.path: d for f, (_, d) in zip(candidates, crcs, strict=True)}
        copies, more = resolve_copies(
            candidates, {p: checksum.to_hex(c) for p, c in crc_map.items()}, previous
        )
        jobs: list[Awaitable[FileResult]] = []
        for c in copies:
            src = object_key(previous.run_id, previous.checkpoint, c.source_path)
            dst = request.key(c.file.path)
            jobs.append(
                self.bounded(
                    self.transfers.copy(
                        src, dst, c.file, crc_map[c.file.path], ctx, digest_map[c.file.path]
                    )
                )
            )
        return jobs, list(more)

    async def _drop_strays(self, request: ShipRequest, paths: set[str], log: Any) -> None:
        """Delete the objects and abort the uploads of this checkpoint whose file is not
        (any more) among ``paths``: sent early, then renamed or removed by the trainer."""
        run, name = request.run, request.name
        leftover = [f for p, (_, f) in request.early.items() if p not in paths and not f.done()]
        if leftover:
            await asyncio.wait(leftover)

        def drop() -> list[str]:
            stray = [r for p, r in self.journal.objects_for(run, name).items() if p not in paths]
            for rec in self.journal.all_uploads():
                if rec.run == run and rec.checkpoint == name and rec.path not in paths:
                    abort_journalled_upload(self.repo.storage, rec.key, rec.upload_id)
                    self.journal.forget_upload(rec.key)
            if stray:
                self.repo.delete([r.key for r in stray])
                for r in stray:
                    self.journal.forget_object(r.key)
            return [r.path for r in stray]

        dropped = await asyncio.to_thread(drop)
        if dropped:
            log.info("early_objects_dropped", paths=dropped)
