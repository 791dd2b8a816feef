"""A dead node's part, put in the store by a peer holding its verified replica.

If a node dies after its part was safe on a peer but before the store had it, the
checkpoint can still commit: the holder finishes the origin's store upload in the
origin's name, through the commit protocol, and no human is involved. Each tick
(``tick``), for every replica held whose origin has not delivered:

1. **is the origin gone?** It is asked ``/v1/peer/hello``; an origin that answers as
   itself (its peer id) is alive and left to finish. One that has not answered, or that
   answers as another node (a replacement at its address), for ``handoff_after_seconds``
   is gone;
2. **is its part in the store already?** (its ``ckptd.part-<rank>.json`` of the replica's
   save, or the checkpoint committed): then the replica is marked delivered, nothing sent;
3. **may this node write it?** The save must still be the announced one (a withdrawn or
   superseded save is stale: refused), and the slot's claim must name the replica's
   writer. With many nodes that writer is the job's (``ckptd.sync.claims.cluster_writer``):
   every node of the save is the slot's writer (``ckptd.commit.slots``), this holder
   included. So the part ships
   into **the origin's claimed slot**, where the other nodes' parts are and where the
   global commit joins them; a private slot and a redirect would commit the holder's
   copy alone, not the many-node checkpoint, and would leave the other parts orphaned;
4. **is the replica whole?** Every file is read again and held to the replica's CRC-32C
   (and digest): a replica damaged at rest is refused, removed, and never sent, so it
   can never overwrite a good object the origin had uploaded;
5. every file is uploaded into the slot (verified by the store as any upload,
   ``ckptd.sync.transfer``; its own journal under ``<state dir>/peers/handoff``), its
   CRC-32C compared with the replica's again, then the origin's part is written (the
   part the origin would have written, ``Replica.to_part``) and the global commit tried
   (``ckptd.commit.assemble.try_commit``: create-only, one content, never mixed).

Two holders of one part (``copies`` > 1) may both hand it off: they write the same bytes
and the same files into the same slot, so the store ends the same. An origin that was
only cut off, not dead, and comes back writes the same content too.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from ckptd.commit import objects
from ckptd.commit.assemble import Assembly, Committer, try_commit
from ckptd.commit.slots import parse_claim
from ckptd.core import checksum, digest
from ckptd.core.manifest import ManifestError
from ckptd.core.signing import KeyRing
from ckptd.layouts.base import FileEntry
from ckptd.peers.client import PeerClient, PeerError
from ckptd.peers.replicas import DATA, HELD, HeldReplica, ReplicaStore
from ckptd.repository import Repository, claim_key, object_key
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import StorageError
from ckptd.sync.transfer import TransferContext, Transfers

#: The origins of undelivered replicas are asked this often whether they are alive.
TICK_SECONDS = 2.0
HELLO_SECONDS = 2.0
#: A hand-off the store failed is tried again after this long.
RETRY_SECONDS = 30.0


class RefusedError(Exception):
    """A replica this node must not hand off; the message says why."""


class HandOff:
    """Finishes dead origins' store uploads from their replicas (module doc)."""

    def __init__(
        self,
        store: ReplicaStore,
        client: PeerClient,
        repo: Repository,
        transfers: Transfers,
        committer: Committer,
        *,
        after_seconds: float,
        keys: KeyRing | None,
        metrics: Metrics,
        clock: Clock,
        log: Any,
    ) -> None:
        self.store = store
        self.client = client
        self.repo = repo
        self.transfers = transfers
        self.committer = committer
        self.after_seconds = after_seconds
        self.keys = keys
        self.metrics = metrics
        self.clock = clock
        self.log = log
        self._gone_since: dict[str, float] = {}  # origin peer id -> first unanswered ask
        self._running: dict[str, asyncio.Task[None]] = {}  # replica id -> its hand-off
        self._retry_at: dict[str, float] = {}  # replica id -> not before (monotonic)
        self.done: list[dict[str, Any]] = []  # what /v1/status shows

    async def tick(self) -> None:
        """One look at every replica whose origin has not delivered (module doc, 1-2)."""
        waiting = [
            h
            for h in self.store.held()
            if not (h.delivered or h.handed_off) and h.id not in self._running
        ]
        origins = {h.replica.peer: h.replica.address for h in waiting}
        alive = await asyncio.gather(*(self._alive(p, a) for p, a in origins.items()))
        now = self.clock.monotonic()
        for (peer, _), up in zip(origins.items(), alive, strict=True):
            if up:
                self._gone_since.pop(peer, None)
            else:
                self._gone_since.setdefault(peer, now)
        for held in waiting:
            since = self._gone_since.get(held.replica.peer)
            if since is None or now - since < self.after_seconds:
                continue
            if now < self._retry_at.get(held.id, 0.0):
                continue
            task = asyncio.get_running_loop().create_task(self._hand_off(held))
            self._running[held.id] = task
            task.add_done_callback(self._forget_done)

    def _forget_done(self, task: asyncio.Task[None]) -> None:
        for rid, running in list(self._running.items()):
            if running is task:
                del self._running[rid]

    async def _alive(self, peer: str, address: str) -> bool:
        try:
            hello = await self.client.hello(address, timeout=HELLO_SECONDS)
        except PeerError:
            return False
        return hello.get("peer") == peer

    async def _hand_off(self, held: HeldReplica) -> None:
        replica = held.replica
        run, name, slot = replica.run_id, replica.name, replica.checkpoint
        log = self.log.bind(
            run=run, checkpoint=name, slot=slot, node=replica.node_rank, replica=held.id
        )
        started = self.clock.monotonic()
        try:
            with self.store.pinned(held.id):
                if await asyncio.to_thread(self._delivered_already, held):
                    self.store.mark(held.id, delivered=True)
                    log.info("peer_replica_delivered", how="found in the store")
                    return
                await asyncio.to_thread(self._may_write, held)
                log.warning(
                    "peer_handoff_started",
                    origin=replica.host,
                    origin_address=replica.address,
                    bytes=replica.total_bytes,
                    why=f"the origin has not answered for {self.after_seconds:g} s and its "
                    "part is not in the store",
                )
                await asyncio.to_thread(self._whole, held)
                await self._upload(held)
                result = await asyncio.to_thread(self._part_and_commit, held)
        except RefusedError as exc:
            self.metrics.peer_handoffs.labels(run=run, outcome="refused").inc()
            log.error("peer_handoff_refused", error=str(exc))
            self.store.mark(held.id, delivered=True)  # never tried again
            self._record(held, "refused", str(exc), started)
            return
        except (StorageError, ManifestError, OSError) as exc:
            self.metrics.peer_handoffs.labels(run=run, outcome="failed").inc()
            self._retry_at[held.id] = self.clock.monotonic() + RETRY_SECONDS
            log.error("peer_handoff_failed", error=str(exc), retry_in=RETRY_SECONDS)
            self._record(held, "failed", str(exc), started)
            return
        self.store.mark(held.id, handed_off=True)
        self.metrics.peer_handoffs.labels(run=run, outcome="committed").inc()
        seconds = self.clock.monotonic() - started
        log.warning(
            "peer_handoff_done",
            bytes=replica.total_bytes,
            seconds=round(seconds, 3),
            checkpoint_committed=result,
        )
        self._record(held, "committed" if result else "part_written", None, started)

    def _record(self, held: HeldReplica, outcome: str, error: str | None, started: float) -> None:
        r = held.replica
        self.done.append(
            {
                "run": r.run_id,
                "checkpoint": r.name,
                "node": r.node_rank,
                "origin": r.host,
                "bytes": r.total_bytes,
                "outcome": outcome,
                "error": error,
                "seconds": round(self.clock.monotonic() - started, 3),
            }
        )
        del self.done[:-16]

    # -- the steps (blocking) ----------------------------------------------------------------

    def _delivered_already(self, held: HeldReplica) -> bool:
        """The origin's part of this save is in the store, or the checkpoint committed."""
        r = held.replica
        part = objects.read_part(self.repo, r.run_id, r.checkpoint, r.node_rank)
        if part is not None and part.save == r.save:
            return True
        manifest = self.repo.read_manifest(r.run_id, r.checkpoint)
        return manifest is not None and manifest.save == r.save

    def _may_write(self, held: HeldReplica) -> None:
        """RefusedError unless the replica's save is the announced one and the slot's claim
        names the replica's writer (module doc, 3)."""
        r = held.replica
        announcement = objects.read_announcement(self.repo, r.run_id, r.checkpoint)
        if announcement is None or announcement.save != r.save:
            raise RefusedError(
                f"save {r.save} of {r.run_id}/{r.name} is no longer announced "
                f"({'none is' if announcement is None else 'save ' + announcement.save + ' is'}): "
                "a stale replica is never handed off"
            )
        if announcement.slot_name != r.checkpoint:
            raise RefusedError(
                f"the save ships into slot {announcement.slot_name}, the replica names {r.checkpoint}"
            )
        body = self.repo.get_or_none(claim_key(r.run_id, r.checkpoint))
        try:
            claim = parse_claim(body) if body is not None else None
        except ManifestError:
            claim = None
        if (
            claim is None
            or claim.writer != r.writer
            or r.writer != (self.committer.writer or f"cluster-{self.committer.nodes}")
        ):
            raise RefusedError(
                f"the claim of {r.run_id}/{r.checkpoint} does not name writer {r.writer} as "
                "this node is: it cannot write there in the origin's name"
            )

    def _whole(self, held: HeldReplica) -> None:
        """Every file of the replica read again and held to its CRC-32C (and digest);
        a damaged replica is removed and RefusedError raised (module doc, 4)."""
        r = held.replica
        for entry in r.files:
            path = self._path(held, entry.path)
            crc, blocks, size = 0, [], 0
            with open(path, "rb", buffering=0) as fh:
                while chunk := fh.read(digest.BLOCK):
                    crc = checksum.crc32c(chunk, crc)
                    size += len(chunk)
                    if r.digest is not None:
                        blocks.append(digest.block_digest(chunk))
            found_digest = digest.file_digest(size, blocks) if r.digest is not None else None
            if (
                size != entry.size
                or checksum.to_hex(crc) != entry.crc32c
                or found_digest != entry.digest
            ):
                self.store.remove((HELD, held.id))
                raise RefusedError(
                    f"{entry.path} of the replica is damaged at rest ({size} bytes, crc32c "
                    f"{checksum.to_hex(crc)}; the replica says {entry.size}, {entry.crc32c}): "
                    "removed, never sent"
                )

    def _path(self, held: HeldReplica, rel: str) -> Path:
        return self.store.root.joinpath(HELD, held.id, DATA, *rel.split("/"))

    async def _upload(self, held: HeldReplica) -> None:
        """Each file into the origin's slot, verified by the store, and its CRC-32C
        compared with the replica's once more (module doc, 5)."""
        r = held.replica
        ctx = TransferContext(r.run_id, r.name)
        for entry in r.files:
            local = self._path(held, entry.path)
            st = await asyncio.to_thread(os.stat, local)
            sent = await self.transfers.upload(
                object_key(r.run_id, r.checkpoint, entry.path),
                local,
                FileEntry(entry.path, st.st_size, st.st_mtime_ns),
                ctx,
            )
            if checksum.to_hex(sent.crc32c) != entry.crc32c:
                raise RefusedError(
                    f"{entry.path} changed on this node's disk while handed off: the part is "
                    "not written"
                )

    def _part_and_commit(self, held: HeldReplica) -> bool:
        """The origin's part, then the global commit if every part is there; whether the
        checkpoint is committed now."""
        r = held.replica
        objects.write_part(self.repo, r.to_part(self.clock.time()), r.checkpoint)
        result = try_commit(
            self.repo,
            r.run_id,
            r.name,
            self.committer,
            save=r.save,
            now=self.clock.time(),
            keys=self.keys,
            slot=r.checkpoint,
        )
        return result.outcome is Assembly.COMMITTED

    async def close(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["TICK_SECONDS", "HandOff", "RefusedError"]
