"""Shipping one complete checkpoint: plan, transfer, re-check, build the manifest, commit.

``Shipper.ship`` returns an ``Outcome`` and never raises for what can happen to a
checkpoint in the normal course of things (the caller decides what each means):

    committed   the manifest is in the store (now, or already before this call)
    paused      made way for an emergency checkpoint; the journal keeps every finished part
    changed     the local files changed or vanished while shipping: never committed
    conflict    another manifest with other content holds the name: never overwritten
                (many nodes: or two nodes' parts disagree on a file)
    waiting     many nodes: this node's part is in the store, another node's is not yet
    failed      the store or the local disk failed; worth another try later

The files are listed before and after the transfer: a checkpoint whose listing differs
is ``changed``, so a manifest only ever describes files that stood still while sent.
An object sent before (an earlier attempt, or early: ``ckptd.sync.early``) counts only
while its file still has the identity it had when read (``unchanged``); any other is
sent again, and an early object of a file no longer in the checkpoint is deleted before
the commit, so the committed prefix holds what the manifest names.

With many nodes (``ShipRequest.cluster``) the node holding the commit record announces
first, every node writes its part once its files are verified, and the commit is of the
union of every node's part (``ckptd.cluster.assemble``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from ckptd.cluster.assemble import (
    Assembly,
    AssemblyResult,
    ClusterShip,
    announce,
    try_commit,
    write_part,
)
from ckptd.cluster.protocol import Part, part_files
from ckptd.core import checksum, digest
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import Manifest, ManifestError, build_manifest, utc_timestamp
from ckptd.core.signing import KeyRing
from ckptd.layouts.base import CheckpointListing, Completion, FileEntry, step_of
from ckptd.runtime.clock import Clock
from ckptd.runtime.environment import describe
from ckptd.storage.base import StorageError
from ckptd.store.repository import Repository, checkpoint_prefix, object_key
from ckptd.sync.commit import CommitConflictError, CommitResult, commit, move_latest
from ckptd.sync.early import EarlyFile
from ckptd.sync.journal import Journal, ObjectRecord
from ckptd.sync.plan import plan_upload, resolve_copies
from ckptd.sync.scanner import snapshot
from ckptd.sync.transfer import (
    CheckpointChangedError,
    FileResult,
    TransferContext,
    TransferPausedError,
    Transfers,
    abort_journalled_upload,
    abort_lost_uploads,
)

T = TypeVar("T")


class Outcome(Enum):
    COMMITTED = "committed"
    PAUSED = "paused"
    CHANGED = "changed"
    CONFLICT = "conflict"
    WAITING = "waiting"
    FAILED = "failed"


class ClusterConflictError(CkptdError):
    """Two nodes' parts name one path with different bytes."""


@dataclass
class ShipResult:
    """What became of one checkpoint; ``manifest`` is set when committed."""

    outcome: Outcome
    manifest: Manifest | None = None
    already_committed: bool = False
    commit: CommitResult | None = None
    files: list[FileResult] = field(default_factory=list)
    error: Exception | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    assembly: AssemblyResult | None = None  # many nodes: what the committer found

    @property
    def reason(self) -> str:
        """The failure's code (a storage error's) or its type's name."""
        if self.error is None:
            return ""
        return getattr(self.error, "code", "") or type(self.error).__name__


@dataclass
class ShipRequest:
    """One checkpoint to ship, as its completion rule saw it."""

    run: str
    dir: Path
    listing: CheckpointListing
    verdict: Completion
    previous: Manifest | None
    context: TransferContext
    on_started: Callable[[int], None] = lambda total_bytes: None
    on_copied: Callable[[int], None] = lambda nbytes: None
    cluster: ClusterShip | None = None
    # Early uploads of this checkpoint (path -> the entry sent and its outcome), handed
    # over by ``EarlyUploads.take``: awaited, never started again.
    early: Mapping[str, EarlyFile] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.listing.name


def unchanged(local: Path, record: ObjectRecord) -> bool:
    """Whether ``local`` still has the identity it had when ``record``'s object was read
    (size, mtime, and where recorded ctime and inode). Blocking (one stat)."""
    try:
        st = os.stat(local)
    except OSError:
        return False
    if record.ctime_ns == 0:  # recorded without (a copy, an older journal)
        return (st.st_size, st.st_mtime_ns) == (record.size, record.mtime_ns)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) == record.identity


def fingerprint(files: tuple[FileEntry, ...]) -> list[tuple[str, int, int]]:
    """What must not change while a checkpoint ships: each file's path, size, mtime."""
    return sorted((f.path, f.size, f.mtime_ns) for f in files)


def _local_path(request: ShipRequest, f: FileEntry | str) -> Path:
    """Where a file of the request's checkpoint lies (a checkpoint may be one file)."""
    path = f if isinstance(f, str) else f.path
    name = request.name
    return request.dir / name / path if request.listing.is_dir else request.dir / name


def _sent_early_as(request: ShipRequest, f: FileEntry) -> bool:
    """Whether ``f`` was handed over from early shipping as it is now."""
    early = request.early.get(f.path)
    return early is not None and early[0] == f


def _taken_early(f: FileEntry, early: FileResult) -> FileResult:
    """An early transfer's result as the ship reports it: a copy stays a copy (it is
    counted in ``ckptd_copied_bytes_total``), an upload is "early"."""
    how = "copied" if early.how == "copied" else "early"
    return FileResult(f.path, f.size, early.crc32c, how, early.bytes_sent, digest=early.digest)


class Shipper:
    """Ships checkpoints to one repository through one set of transfers."""

    def __init__(
        self,
        repo: Repository,
        transfers: Transfers,
        journal: Journal,
        clock: Clock,
        *,
        file_slots: int,
        log: Any,
        keys: KeyRing | None = None,
    ) -> None:
        self.repo = repo
        # Authenticated checkpoints: every manifest this node commits is signed.
        self.keys = keys
        self.transfers = transfers
        self.journal = journal
        self.clock = clock
        self.log = log
        self.host = socket.gethostname()
        self.environment = describe()
        self._file_slots = asyncio.Semaphore(file_slots)

    async def ship(self, request: ShipRequest) -> ShipResult:
        """Upload, verify and commit ``request``'s checkpoint (module doc)."""
        run, name = request.run, request.name
        log = self.log.bind(run=run, checkpoint=name)
        started, cpu_started = self.clock.monotonic(), time.process_time()
        try:
            existing = await asyncio.to_thread(self.repo.read_manifest, run, name)
            if existing is not None:
                # Committed before a crash, perhaps with LATEST not yet moved (commit.py).
                await asyncio.to_thread(move_latest, self.repo, existing)
                return ShipResult(Outcome.COMMITTED, existing, already_committed=True)
            cluster = request.cluster
            if cluster is not None and cluster.announcement is not None:
                in_force = await asyncio.to_thread(announce, self.repo, cluster.announcement)
                if in_force.save != cluster.save:
                    # A lower rank holds the record too and leads: follow its save.
                    return ShipResult(
                        Outcome.WAITING,
                        assembly=AssemblyResult(
                            Assembly.RESAVED,
                            reason=f"node {in_force.node_rank} announced save {in_force.save}",
                            announcement=in_force,
                        ),
                    )
                log.info("checkpoint_announced", save=cluster.save)
            files = await self._transfer_all(request, log)
            after = await asyncio.to_thread(snapshot, request.dir, name)
            if after is None or fingerprint(after.files) != fingerprint(request.listing.files):
                return ShipResult(
                    Outcome.CHANGED, error=CheckpointChangedError("files changed while uploading")
                )
            await self._abort_lost_uploads(run, name, files, log)
            if cluster is not None:
                return await self._part_and_commit(request, cluster, files, started, log)
            manifest = build_manifest(
                run_id=run,
                checkpoint=name,
                step=step_of(name),
                layout=request.verdict.layout,
                host=self.host,
                created_at=request.listing.newest_mtime_ns / 1e9,
                committed_at=self.clock.time(),
                files=[(r.path, r.size, checksum.to_hex(r.crc32c)) for r in files],
                environment=self.environment,
                **self._digests(files),
            )
            if self.keys is not None:
                manifest = self.keys.sign(manifest)
            log.info("checkpoint_verified", files=len(files), bytes=manifest.total_bytes)
            result = await asyncio.to_thread(commit, self.repo, manifest)
        except TransferPausedError as exc:
            return ShipResult(Outcome.PAUSED, error=exc)
        except CheckpointChangedError as exc:
            return ShipResult(Outcome.CHANGED, error=exc)
        except CommitConflictError as exc:
            return ShipResult(Outcome.CONFLICT, error=exc)
        except (StorageError, ManifestError, OSError) as exc:
            return ShipResult(Outcome.FAILED, error=exc)
        return ShipResult(
            Outcome.COMMITTED,
            manifest,
            already_committed=result.already_committed,
            commit=result,
            files=files,
            seconds=self.clock.monotonic() - started,
            # The whole process's CPU over the upload: the price of shipping this
            # checkpoint on a node whose cores the trainer wants.
            cpu_seconds=time.process_time() - cpu_started,
        )

    def _digests(self, files: list[FileResult]) -> dict[str, Any]:
        """build_manifest's digest arguments: the files' digests when signing."""
        if self.keys is None:
            return {}
        return {
            "digests": {r.path: r.digest for r in files if r.digest},
            "digest_algorithm": digest.ALGORITHM,
        }

    async def _abort_lost_uploads(
        self, run: str, name: str, files: list[FileResult], log: Any
    ) -> None:
        """Every file is in the store now: an upload still open for one of them was lost
        to a dropped answer (``abort_lost_uploads``). Found by the proxy-fault campaign; a
        failure here is logged and leaves it for the store's lifecycle rule."""
        keys = [object_key(run, name, r.path) for r in files]
        try:
            aborted = await asyncio.to_thread(
                abort_lost_uploads, self.repo.storage, checkpoint_prefix(run, name), keys
            )
        except StorageError as exc:
            log.warning("lost_upload_check_failed", error=str(exc))
            return
        if aborted:
            log.warning("lost_uploads_aborted", uploads=aborted)

    async def _part_and_commit(
        self,
        request: ShipRequest,
        cluster: ClusterShip,
        files: list[FileResult],
        started: float,
        log: Any,
    ) -> ShipResult:
        """Write this node's part of ``cluster.save``, then commit the union if every
        node's part is there (``ckptd.cluster.assemble``)."""
        run, name = request.run, request.name
        now = self.clock.time()
        part = Part(
            run_id=run,
            checkpoint=name,
            node_rank=cluster.committer.rank,
            nodes=cluster.committer.nodes,
            save=cluster.save,
            layout=request.verdict.layout,
            step=step_of(name),
            host=self.host,
            created_at=utc_timestamp(request.listing.newest_mtime_ns / 1e9),
            verified_at=utc_timestamp(now),
            total_bytes=sum(r.size for r in files),
            files=part_files(
                [(r.path, r.size, checksum.to_hex(r.crc32c)) for r in files],
                {r.path: r.digest for r in files if r.digest},
            ),
            environment=self.environment,
        )
        await asyncio.to_thread(write_part, self.repo, part)
        log.info("part_written", save=cluster.save, files=len(files), bytes=part.total_bytes)
        assembly = await asyncio.to_thread(
            try_commit,
            self.repo,
            run,
            name,
            cluster.committer,
            save=cluster.save,
            now=now,
            keys=self.keys,
        )
        result = ShipResult(
            Outcome.WAITING,
            files=files,
            seconds=self.clock.monotonic() - started,
            assembly=assembly,
        )
        if assembly.outcome is Assembly.COMMITTED:
            assert assembly.manifest is not None
            result.outcome, result.manifest = Outcome.COMMITTED, assembly.manifest
            result.already_committed, result.commit = assembly.already_committed, assembly.commit
        elif assembly.outcome is Assembly.CONFLICT:
            result.outcome = Outcome.CONFLICT
            result.error = ClusterConflictError(f"{run}/{name}: {assembly.reason}")
        return result

    async def _transfer_all(self, request: ShipRequest, log: Any) -> list[FileResult]:
        run, name, ctx = request.run, request.name, request.context
        files_to_ship = request.verdict.files

        def still_done() -> dict[str, ObjectRecord]:
            records = self.journal.objects_for(run, name)
            return {p: r for p, r in records.items() if unchanged(_local_path(request, p), r)}

        done_records = await asyncio.to_thread(still_done)
        done = {p: (r.size, r.mtime_ns) for p, r in done_records.items()}
        # No copy candidates where the store cannot copy: every changed file is uploaded.
        previous = request.previous if self.transfers.can_copy else None
        plan = plan_upload(files_to_ship, previous, done)
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
        results: list[FileResult] = list(
            await asyncio.gather(*(self._done(request, f, done_records) for f in plan.done))
        )
        uploads = list(plan.upload)
        # A candidate sent early as it is now is the early transfer's to finish (it copies
        # what it can, ``ckptd.sync.early``): never a second copy or upload of one key.
        candidates = [f for f in plan.copy_candidates if not _sent_early_as(request, f)]
        uploads.extend(f for f in plan.copy_candidates if _sent_early_as(request, f))
        jobs: list[Awaitable[FileResult]] = []
        if candidates and previous is not None:
            copies, more = await self._copies(request, candidates, previous)
            jobs.extend(copies)
            uploads.extend(more)
        for f in uploads:
            if f.path in request.early:
                sent, future = request.early[f.path]
                jobs.append(self._after_early(request, f, sent, future))
            else:
                jobs.append(self._upload(request, f))
        tasks = [asyncio.ensure_future(j) for j in jobs]
        try:
            results.extend(await asyncio.gather(*tasks))
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

    async def _bounded(self, work: Awaitable[T]) -> T:
        # Coroutines are created up front but start only here, so at most
        # file_slots files are open (and hold buffers) at once.
        async with self._file_slots:
            return await work

    async def _upload(self, request: ShipRequest, f: FileEntry) -> FileResult:
        key = object_key(request.run, request.name, f.path)
        local = _local_path(request, f)
        return await self._bounded(self.transfers.upload(key, local, f, request.context))

    async def _after_early(
        self,
        request: ShipRequest,
        f: FileEntry,
        sent: FileEntry,
        future: Awaitable[FileResult | None],
    ) -> FileResult:
        """Sent early and maybe still sending: wait for it, then take it only if the
        file is still what was read; else send it now."""
        early = await future
        if early is not None and sent == f:
            records = await asyncio.to_thread(self.journal.objects_for, request.run, request.name)
            record = records.get(f.path)
            local = _local_path(request, f)
            if record is not None and await asyncio.to_thread(unchanged, local, record):
                return _taken_early(f, early)
        return await self._upload(request, f)

    async def _done(
        self, request: ShipRequest, f: FileEntry, done_records: Mapping[str, ObjectRecord]
    ) -> FileResult:
        """A file the journal holds as sent and unchanged: sent (or copied) early by this
        process, so said as such, or sent by an earlier one (``_skipped``)."""
        early = request.early.get(f.path)
        if early is not None and early[0] == f and early[1].done() and not early[1].cancelled():
            result = early[1].result()
            if result is not None:
                return _taken_early(f, result)
        return await self._skipped(request, f, done_records)

    async def _skipped(
        self, request: ShipRequest, f: FileEntry, done_records: Mapping[str, ObjectRecord]
    ) -> FileResult:
        crc = done_records[f.path].crc32c
        if not self.transfers.digests:
            return FileResult(f.path, f.size, crc, "skipped")
        # Sent by an earlier run of the daemon: read it once more for its digest,
        # and to prove it is still the bytes that were sent.
        local = _local_path(request, f)
        again, sums = await self._bounded(self.transfers.crc_of(local, f, request.context))
        if again != crc:
            raise CheckpointChangedError(f"{f.path} changed since it was sent")
        return FileResult(f.path, f.size, crc, "skipped", digest=sums)

    async def _copies(
        self, request: ShipRequest, candidates: Sequence[FileEntry], previous: Manifest
    ) -> tuple[list[Awaitable[FileResult]], list[FileEntry]]:
        """The server-side copies of the candidates whose CRC-32C still matches the
        previous checkpoint's, and the candidates to upload after all."""
        run, name, ctx = request.run, request.name, request.context
        crcs = await asyncio.gather(
            *(
                self._bounded(self.transfers.crc_of(_local_path(request, f), f, ctx))
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
            dst = object_key(run, name, c.file.path)
            jobs.append(
                self._bounded(
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
