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
union of every node's part (``ckptd.commit.assemble``).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from ckptd.commit.assemble import (
    Assembly,
    AssemblyResult,
    ClusterShip,
    announce,
    announced_slot,
    try_commit,
)
from ckptd.commit.objects import NOT_OURS, identities, object_identity, write_part
from ckptd.commit.parts import Part, part_files
from ckptd.commit.single import (
    CommitConflictError,
    CommitResult,
    commit,
    committed_at,
    conflict,
    move_latest,
    take_back_name,
)
from ckptd.commit.slots import Redirect, Withdrawal
from ckptd.core import checksum, digest
from ckptd.core.concurrency import NEVER_MULTIPART
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import (
    Manifest,
    ManifestError,
    build_manifest,
    utc_timestamp,
)
from ckptd.core.signing import KeyRing
from ckptd.layouts.base import step_of
from ckptd.repository import Repository, checkpoint_prefix
from ckptd.runtime.clock import Clock
from ckptd.runtime.environment import describe
from ckptd.storage.base import ObjectInfo, StorageError
from ckptd.sync.claims import Claims
from ckptd.sync.files import CheckpointFiles
from ckptd.sync.journal import Journal
from ckptd.sync.lanes import SmallFiles
from ckptd.sync.request import ShipRequest, fingerprint, local_path, unchanged
from ckptd.sync.scanner import snapshot
from ckptd.sync.transfer import (
    CheckpointChangedError,
    FileResult,
    TransferPausedError,
    Transfers,
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


def _identity_of(result: FileResult, info: ObjectInfo | None) -> str:
    """The identity of the object this node verified for ``result`` (``object_identity``),
    or a mark no object ever has when what the store reports now is not that object (of
    another size, or of another whole-object CRC-32C): the committer then never commits
    over it, and waits for this node to ship again."""
    if info is None or info.size != result.size:
        return NOT_OURS
    whole = info.checksum and "-" not in info.checksum
    if whole and info.checksum != checksum.to_base64(result.crc32c):
        return NOT_OURS
    return object_identity(info) or ""


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
        claims: Claims,
        small: SmallFiles,
        keys: KeyRing | None = None,
    ) -> None:
        self.repo = repo
        # Step 0 of the commit protocol: the slot each checkpoint ships into.
        self.claims = claims
        self.writer = claims.writer
        # Authenticated checkpoints: every manifest this node commits is signed.
        self.keys = keys
        self.transfers = transfers
        self.journal = journal
        self.clock = clock
        self.log = log
        self.host = socket.gethostname()
        self.environment = describe()
        self.files = CheckpointFiles(repo, transfers, journal, file_slots=file_slots, small=small)
        # (run, step) -> why a checkpoint is suspect, or None (the daemon's loss watch).
        self.suspect_of: Callable[[str, int | None], Awaitable[str | None]] | None = None

    async def ship(self, request: ShipRequest) -> ShipResult:
        """Upload, verify and commit ``request``'s checkpoint (module doc)."""
        run, name = request.run, request.name
        log = self.log.bind(run=run, checkpoint=name)
        started, cpu_started = self.clock.monotonic(), time.process_time()
        try:
            cluster = request.cluster
            if cluster is None:
                found = await self._claim(request, log)
                if found is not None:
                    return found
            else:
                found = await self._cluster_slot(request, cluster, log)
                if found is not None:
                    return found
            if request.on_claimed is not None:  # the slot is known, no object sent yet
                hold = request.on_claimed(request)
                if hold is not None:
                    await hold  # an emergency push to peers goes first
            files = await self.files.transfer_all(request, log)
            after = await asyncio.to_thread(snapshot, request.dir, name)
            if after is None or fingerprint(after.files) != fingerprint(request.listing.files):
                return ShipResult(
                    Outcome.CHANGED, error=CheckpointChangedError("files changed while uploading")
                )
            await self._abort_lost_uploads(request, files, log)
            if cluster is not None:
                return await self._part_and_commit(request, cluster, files, started, log)
            assert request.slot is not None
            step = step_of(name)
            suspect = None if self.suspect_of is None else await self.suspect_of(run, step)
            manifest = build_manifest(
                run_id=run,
                checkpoint=request.slot.slot,
                step=step,
                layout=request.verdict.layout,
                host=self.host,
                created_at=request.listing.newest_mtime_ns / 1e9,
                committed_at=self.clock.time(),
                files=[(r.path, r.size, checksum.to_hex(r.crc32c)) for r in files],
                environment=self.environment,
                name=name,
                trajectory=request.trajectory,
                parent=request.parent,
                suspect=suspect,
                **self._digests(files),
            )
            if self.keys is not None:
                manifest = self.keys.sign(manifest)
            log.info("checkpoint_verified", files=len(files), bytes=manifest.total_bytes)
            result = await asyncio.to_thread(
                functools.partial(
                    commit, self.repo, manifest, request.slot, self.writer, now=self.clock.time()
                )
            )
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
            result.manifest,
            already_committed=result.already_committed,
            commit=result,
            files=files,
            seconds=self.clock.monotonic() - started,
            # The whole process's CPU over the upload: the price of shipping this
            # checkpoint on a node whose cores the trainer wants.
            cpu_seconds=time.process_time() - cpu_started,
        )

    async def _claim(self, request: ShipRequest, log: Any) -> ShipResult | None:
        """Step 0 (``ckptd.sync.claims``): the slot to ship into, set on ``request``; or,
        when the name is committed on this trajectory already, the outcome without a
        byte sent: committed (the same content) or a conflict."""
        run, name = request.run, request.name
        prepared = await self.claims.prepare(run, name, request.trajectory.id)
        request.slot = prepared.slot
        theirs = prepared.committed
        slot = prepared.slot
        if (
            isinstance(theirs, Redirect)
            and slot is not None
            and not slot.private
            and theirs.to != slot.slot
        ):
            # Another writer's redirect in the slot this writer owns: its manifest follows
            # within seconds, or the name is taken back (``ckptd.commit.withdrawal``).
            taken = await asyncio.to_thread(
                take_back_name, self.repo, run, slot, theirs, self.writer, self.clock.time()
            )
            if taken:
                log.warning(
                    "checkpoint_name_taken_back",
                    slot=slot.slot,
                    their_slot=theirs.to,
                    their_host=theirs.host,
                    reason="a redirect was not followed by its manifest: its slot is "
                    "withdrawn and this content commits under the name",
                )
                return None
            theirs = await asyncio.to_thread(committed_at, self.repo, run, slot)
        if isinstance(theirs, Manifest):
            return await self._against(request, theirs, log)
        if isinstance(theirs, Withdrawal) or (
            isinstance(theirs, Redirect) and (slot is None or theirs.to != slot.slot)
        ):
            # A withdrawn slot never commits; another writer's redirect: every object of
            # its content is verified, and its manifest follows. Nothing of this content
            # can commit under the name.
            return ShipResult(Outcome.CONFLICT, error=conflict(run, name, theirs))
        return None

    async def _against(self, request: ShipRequest, theirs: Manifest, log: Any) -> ShipResult:
        """``theirs`` commits the name already: the local checkpoint is committed if it is
        the same content (same paths, sizes and CRC-32C, each read where this node's
        journal does not hold it), else a conflict. Nothing is sent either way."""
        run, name = request.run, request.name
        local = sorted((f.path, f.size) for f in request.verdict.files)
        if local != sorted((f.path, f.size) for f in theirs.files):
            return ShipResult(
                Outcome.CONFLICT,
                error=conflict(run, name, theirs, "the files or their sizes differ"),
            )
        records = await asyncio.to_thread(self.journal.objects_for, run, name)
        expected = {f.path: f.crc32c for f in theirs.files}
        for f in request.verdict.files:
            record = records.get(f.path)
            if record is not None and await asyncio.to_thread(
                unchanged, local_path(request, f), record
            ):
                crc = record.crc32c
            else:
                crc, _ = await self.files.bounded(
                    self.transfers.crc_of(local_path(request, f), f, request.context)
                )
            if checksum.to_hex(crc) != expected[f.path]:
                return ShipResult(
                    Outcome.CONFLICT,
                    error=conflict(run, name, theirs, f"{f.path} differs"),
                )
        await asyncio.to_thread(move_latest, self.repo, theirs)
        log.info("checkpoint_committed_already", slot=theirs.checkpoint, host=theirs.host)
        return ShipResult(Outcome.COMMITTED, theirs, already_committed=True)

    async def _cluster_slot(
        self, request: ShipRequest, cluster: ClusterShip, log: Any
    ) -> ShipResult | None:
        """Many nodes: the announcer claims the save's slot, then announces it; a follower
        ships into the slot the announcement it follows names. A manifest there already:
        committed (a crash after the commit)."""
        run, name = request.run, request.name
        if cluster.announcement is not None:
            found = await self._claim(request, log)
            if found is not None:
                return found
            assert request.slot is not None
            slot = request.slot
            announcement = cluster.announcement.model_copy(
                update={
                    "slot": slot.slot if slot.slot != name else None,
                    "canonical": slot.canonical if slot.canonical != slot.slot else None,
                    "writer": self.writer.id,
                    "trajectory": request.trajectory if request.trajectory.id else None,
                    "parent": request.parent,
                }
            )
            in_force = await asyncio.to_thread(announce, self.repo, announcement)
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
            log.info("checkpoint_announced", save=cluster.save, slot=slot.slot)
        else:
            assert cluster.followed is not None, "a follower follows an announcement"
            request.slot = announced_slot(cluster.followed)
        existing = await asyncio.to_thread(self.repo.read_manifest, run, request.slot.slot)
        if existing is not None:
            await asyncio.to_thread(move_latest, self.repo, existing)
            return ShipResult(Outcome.COMMITTED, existing, already_committed=True)
        return None

    def _digests(self, files: list[FileResult]) -> dict[str, Any]:
        """build_manifest's digest arguments: the files' digests when signing."""
        if self.keys is None:
            return {}
        return {
            "digests": {r.path: r.digest for r in files if r.digest},
            "digest_algorithm": digest.ALGORITHM,
        }

    async def _abort_lost_uploads(
        self, request: ShipRequest, files: list[FileResult], log: Any
    ) -> None:
        """Every file is in the store now: an upload still open for one of them was lost
        to a dropped answer (``abort_lost_uploads``). Found by the proxy-fault campaign; a
        failure here is logged and leaves it for the store's lifecycle rule. A checkpoint
        whose every file is at most ``NEVER_MULTIPART`` bytes cannot have one: no listing
        (one request saved per checkpoint of small files)."""
        if all(r.size <= NEVER_MULTIPART for r in files):
            return
        assert request.slot is not None
        keys = [request.key(r.path) for r in files]
        try:
            aborted = await asyncio.to_thread(
                abort_lost_uploads,
                self.repo.storage,
                checkpoint_prefix(request.run, request.slot.slot),
                keys,
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
        node's part is there (``ckptd.commit.assemble``)."""
        run, name = request.run, request.name
        now = self.clock.time()
        assert request.slot is not None
        # Which write of each object this node verified: the committer commits over these
        # very objects only (``ckptd.commit.objects.not_as_written``).
        found = await asyncio.to_thread(
            identities, self.repo, run, request.slot.slot, [r.path for r in files]
        )
        suspect = None if self.suspect_of is None else await self.suspect_of(run, step_of(name))
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
            objects={
                r.path: identity for r in files if (identity := _identity_of(r, found[r.path]))
            },
            suspect=suspect,
        )
        await asyncio.to_thread(write_part, self.repo, part, request.slot.slot)
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
            slot=request.slot.slot,
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
