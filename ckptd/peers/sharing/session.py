"""One node's part in a shared restore: from its record in the store to its last byte served.

``start_sharing`` (when ``[peers] enabled`` and ``share_restores``):

1. resolves the checkpoint in the first tier (the store's manifest is the authority, as
   for every restore), and names the session by its slot and content
   (``rendezvous.session_of``);
2. starts this node's server (``ckptd.peers.sharing.server``) and writes its record;
   lists the others' (``rendezvous.participants``). Its place, ``cluster.node_rank`` out
   of ``cluster.nodes`` (where no rank is set: its place among the records listed, out
   of ``max(cluster.nodes, participants)``), is where in the checkpoint's bytes it
   starts fetching (``order``), so that nodes starting together fetch apart; once its
   own stretch is done it takes the others' files from the far end backward
   (``board.fetch_order``);
3. polls every participant's state every ``POLL_SECONDS`` (``POLL_TIMEOUT`` each), and
   lists the records again every ``LIST_SECONDS`` to meet the ones that came later.

The restore then runs through ``SharedStorage`` as the tier ``shared``, first, twice
(the second attempt without a participant whose bytes did not verify), ahead of the
tiers it would use anyway: a failure costs store egress, never a wrong byte.

``finish`` says this node is done and keeps serving while a live participant still
restores and has moved within ``LINGER_IDLE_SECONDS`` (``LINGER_MAX_SECONDS`` at most),
then stops the server and deletes the record. Nothing here fails a restore: a store
that refuses the record, or no address to advertise, is a warning, and the restore
runs as it would alone.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptd.config import Settings
from ckptd.config.base import parse_listen
from ckptd.config.peers import read_peer_token
from ckptd.core.manifest import Manifest, ManifestError, ManifestFile
from ckptd.peers.discovery import advertised_address
from ckptd.peers.sharing import rendezvous
from ckptd.peers.sharing.board import ShareBoard, fetch_order
from ckptd.peers.sharing.server import Served, ShareServer, open_beneath
from ckptd.peers.sharing.storage import SharedStorage
from ckptd.peers.source import PEERS_TIER, PeerReader, PeerReadError, PeersTier
from ckptd.repository import Repository, object_key
from ckptd.storage.base import StorageError
from ckptd.store.restore.procedure import part_manifest
from ckptd.store.restore.request import RestoreRequest
from ckptd.store.restore.staging import STAGING_PREFIX, manifest_identity, staged_parts
from ckptd.store.tiers import TierRestore, TierStore

SHARED_TIER = "shared"
POLL_SECONDS = 0.2  # after a poll failed, and the longest a waiting read sleeps
POLL_TIMEOUT = 3.0  # beyond HOLD_SECONDS: an answer later than that is a failed poll
HOLD_SECONDS = 1.0
LIST_SECONDS = 0.5
#: A claim that has not grown for this long is taken over (a node stopped, or stuck).
STALL_SECONDS = 10.0
LINGER_IDLE_SECONDS = 30.0
LINGER_MAX_SECONDS = 600.0


class ShareSession:
    """The board behind a lock, the polling, the server and the record (module doc)."""

    def __init__(
        self,
        name: str,
        repo: Repository,
        run: str,
        manifest: Manifest,
        me: rendezvous.Participant,
        reader: PeerReader,
        log: Any,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.repo = repo
        self.run = run
        self.manifest = manifest
        self.me = me
        self.reader = reader
        self.log = log
        self.clock = clock
        self.board = ShareBoard([f.size for f in manifest.files], stall_seconds=STALL_SECONDS)
        self.numbers = {f.path: i for i, f in enumerate(manifest.files)}
        self.place = (0, 1)  # (this node's place, out of) when it started: ``order``
        self.served_bytes = 0
        self.record_key: str | None = None
        self.server: ShareServer | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._lister: threading.Thread | None = None

    # -- for SharedStorage ---------------------------------------------------------

    def source(self, number: int) -> tuple[str, str]:
        """Where file ``number``'s next range comes from; waits while another node
        fetches it and moves (``ShareBoard.source``)."""
        with self._cond:
            while True:
                where, address = self.board.source(number, self.clock())
                if where != "wait":
                    return where, address
                self._cond.wait(POLL_SECONDS)

    def fetched(self, number: int, nbytes: int) -> None:
        with self._cond:
            self.board.fetched(number, nbytes)

    def release(self, number: int) -> None:
        with self._cond:
            self.board.release(number)
            self._cond.notify_all()

    def read_failed(self, address: str, error: str) -> None:
        """A read from ``address`` failed (refused, cut short, gone): nothing more is read
        from it; what it claimed is fetched by whoever gets there first."""
        with self._cond:
            self.board.served_badly(address)
            self._cond.notify_all()
        self.log.warning("restore_share_read_failed", peer=address, error=error)

    def served_badly(self, address: str, path: str) -> None:
        with self._cond:
            self.board.served_badly(address)
        self.log.warning(
            "restore_share_bad_bytes",
            peer=address,
            file=path,
            hint="what it served does not match the manifest; not read from it again",
        )

    # -- the restore's hooks -------------------------------------------------------

    def request(self, request: RestoreRequest, served: Served) -> RestoreRequest:
        """``request`` with this node's fetch order and a hook that serves each file as
        soon as it verified (and then calls the request's own hook)."""
        theirs = request.on_verified
        manifest = self.manifest

        def on_verified(path: str) -> None:
            number = self.numbers[path]
            parts = staged_parts(manifest, path)[1:]  # under data/ (or data itself)
            fd = open_beneath(served.staged, parts)
            if fd is not None:
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                served.add(number, parts, st.st_ino, st.st_size)
                with self._cond:
                    self.board.kept(number)
                    self._cond.notify_all()
            if theirs is not None:
                theirs(path)

        return replace(request, on_verified=on_verified, order=self.order)

    def order(self, files: Sequence[ManifestFile]) -> list[ManifestFile]:
        """``files`` in this node's fetch order (``board.fetch_order``, module doc 2)."""
        place, out_of = self.place
        return [files[n] for n in fetch_order([f.size for f in files], place, out_of)]

    def document(self, after: int = -1, asker: str = "") -> dict[str, Any]:
        """This node's state, once its version passes ``after`` or ``HOLD_SECONDS``
        passed (a poll is held open until there is news: no round trip per change), with
        the participants it knows; ``asker`` (the poller's address) is met."""
        if asker and rendezvous.is_address(asker):
            self.met([asker])
        deadline = self.clock() + HOLD_SECONDS
        with self._cond:
            while self.board.version <= after and not self._stop.is_set():
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._cond.wait(left)
            return {**self.board.document(), "peers": sorted(self.board.peers)}

    def counted_served(self, nbytes: int) -> None:
        with self._cond:
            self.served_bytes += nbytes

    # -- polling -----------------------------------------------------------------------

    def meet(self) -> None:
        """List the records; every participant not met yet is polled from now on, each
        from a thread of its own."""
        found = rendezvous.participants(self.repo, self.run, self.name, now=time.time())
        with self._cond:
            if self._lister is None:
                mine = [p.node for p in found]
                place = mine.index(self.me.node) if self.me.node in mine else len(mine)
                self.place = (place, max(len(found), 1))
        self.met([p.address for p in found if p.node != self.me.node])

    def met(self, addresses: Sequence[str]) -> None:
        """Participants heard of (listed in the store, polling this node, or named by
        another's state): each new one is polled from now on, from a thread of its own.
        (Told by the others, a node meets them as soon as they meet it: a listing of
        the store, slow on a saturated link, is not the only way in.)"""
        fresh = []
        with self._cond:
            now = self.clock()
            for address in addresses:
                if address != self.me.address and address not in self.board.peers:
                    self.board.join(address, now)
                    fresh.append(address)
        for address in fresh:
            threading.Thread(
                target=self._follow, args=(address,), name="ckptd-share-poll", daemon=True
            ).start()

    def _follow(self, address: str) -> None:
        """Poll ``address`` (held polls, back to back) until it is gone or this ends."""
        version = -1
        while not self._stop.is_set():
            try:
                target = f"/v1/share/{self.name}/state?after={version}&from={self.me.address}"
                response = self.reader.request(address, target, timeout=HOLD_SECONDS + POLL_TIMEOUT)
                body = response.read()
                if response.status != 200:
                    raise PeerReadError(f"{address} answered {response.status}")
                doc = json.loads(body)
                version = int(doc.get("version", -1)) if isinstance(doc, dict) else -1
            except (PeerReadError, OSError, ValueError) as exc:
                self.reader.drop(address)
                refused = isinstance(exc.__cause__ or exc, ConnectionRefusedError)
                with self._cond:
                    self.board.unanswered(address, self.clock(), refused=refused)
                    self._cond.notify_all()
                    gone = not self.board.live(address, self.clock())
                self.log.debug("restore_share_poll_failed", peer=address, error=str(exc))
                if gone or self._stop.wait(POLL_SECONDS):
                    return
                continue
            named = doc.get("peers", []) if isinstance(doc, dict) else []
            self.met([a for a in named if isinstance(a, str) and rendezvous.is_address(a)])
            with self._cond:
                try:
                    self.board.heard(address, doc, self.clock())
                except ValueError as exc:
                    self.board.served_badly(address)
                    self.log.warning("restore_share_bad_state", peer=address, error=str(exc))
                self._cond.notify_all()

    def _list(self) -> None:
        while not self._stop.wait(LIST_SECONDS):
            try:
                self.meet()
            except StorageError as exc:
                self.log.debug("restore_share_list_failed", error=str(exc))

    def start_polling(self) -> None:
        self._lister = threading.Thread(target=self._list, name="ckptd-share", daemon=True)
        self._lister.start()

    # -- the end -----------------------------------------------------------------------

    def finish(self, *, linger: bool = True) -> None:
        """Done here: serve while others still need it (module doc; not after a restore
        that failed), then leave."""
        began = self.clock()
        with self._cond:
            self.board.finished()
            self._cond.notify_all()
            while (
                linger
                and self.board.others_busy(self.clock(), LINGER_IDLE_SECONDS)
                and self.clock() - began < LINGER_MAX_SECONDS
            ):
                self._cond.wait(POLL_SECONDS)
        with self._cond:
            self._stop.set()
            self._cond.notify_all()  # held polls answer now
        if self._lister is not None:
            self._lister.join(timeout=POLL_TIMEOUT * 4)
        if self.server is not None:
            self.server.stop()
        if self.record_key is not None:
            try:
                rendezvous.withdraw(self.repo, self.record_key)
            except StorageError as exc:
                self.log.warning("restore_share_record_left", key=self.record_key, error=str(exc))
        self.log.info(
            "restore_share_done",
            session=self.name,
            lingered_seconds=round(self.clock() - began, 3),
            served_bytes=self.served_bytes,
        )


@dataclass
class Sharing:
    """A running shared restore: the tiers to restore from, and what to do after."""

    session: ShareSession
    storage: SharedStorage
    served: Served
    slot: str

    def tiers(self, tiers: Sequence[TierStore]) -> list[TierStore]:
        """``tiers`` with the ``shared`` tier first, twice (module doc)."""
        tier = TierStore(SHARED_TIER, self.storage, tiers[0].config)
        return [tier, tier, *tiers]

    def request(self, request: RestoreRequest) -> RestoreRequest:
        return self.session.request(replace(request, checkpoint=self.slot), self.served)

    def credit(self, done: TierRestore, via: PeersTier | None, store_tier: str) -> TierRestore:
        """``done`` with the bytes by source, named by where they came from: from the
        participants and the peers (``via``: the ``peers`` tier the ``shared`` one read
        through, which counted the store's bytes), and from the store (what the tiers
        before ``done.tier`` fetched, and what it downloaded itself)."""
        storage = self.storage
        first = done.tier in (SHARED_TIER, PEERS_TIER)
        later = 0 if first else done.result.downloaded_bytes
        fetched = storage.from_store if via is None else via.storage.from_store
        from_peers = storage.from_peers + (via.storage.from_peers if via is not None else 0)
        tier = done.tier
        if first:
            # Named for where the bytes came from; the tiers this restore used name each.
            shared = SHARED_TIER if storage.from_peers else None
            tier = shared or (PEERS_TIER if from_peers else store_tier)
        return replace(done, tier=tier, peer_bytes=from_peers, store_bytes=fetched + later)

    def finish(self, *, linger: bool = True) -> None:
        self.session.finish(linger=linger)


def start_sharing(
    settings: Settings,
    tiers: Sequence[TierStore],
    run: str,
    checkpoint: str | None,
    part: int | None,
    target_dir: Path,
    log: Any,
) -> Sharing | None:
    """Join (or open) the shared restore of ``run``'s ``checkpoint`` (None: the newest in
    the first tier) into ``target_dir`` (module doc); None when it cannot share."""
    if not (settings.peers.enabled and settings.peers.share_restores and tiers):
        return None
    host = advertised_address(settings).rpartition(":")[0]
    if not host:
        log.warning("restore_share_skipped", error="no address to advertise (peers.advertise)")
        return None
    repo = Repository(tiers[0].storage)
    try:
        manifest = repo.resolve(run, checkpoint)
        if part is not None:
            manifest = part_manifest(repo, manifest, part)
    except (StorageError, ManifestError) as exc:
        log.debug("restore_share_skipped", error=str(exc))
        return None  # the restore itself says why
    identity = manifest_identity(manifest, digests=settings.authentication.key_ring() is not None)
    name = rendezvous.session_of(manifest.checkpoint, identity)
    reader = PeerReader(read_peer_token(settings.peers))
    me = rendezvous.Participant(rendezvous.new_node(), "", time.time())
    session = ShareSession(name, repo, run, manifest, me, reader, log)
    local = manifest.local_name
    staged = target_dir / f"{STAGING_PREFIX}{local}" / "data"
    served = Served(staged=staged, final=target_dir / local)
    listen_host, _ = parse_listen(settings.peers.listen)
    try:
        server = ShareServer(
            listen_host,
            name,
            reader.token,
            session.document,
            served,
            session.counted_served,
            port=settings.peers.share_port,
        )
    except OSError as exc:
        where = f"{listen_host}:{settings.peers.share_port or 'any port'}"
        log.warning("restore_share_skipped", error=f"cannot listen on {where}: {exc}")
        return None
    server.start()
    session.server = server
    session.me = me = replace(me, address=f"{host}:{server.port}")
    try:
        session.record_key = rendezvous.announce(repo, run, name, me)
        session.meet()
    except StorageError as exc:
        log.warning("restore_share_skipped", error=str(exc))
        session.finish(linger=False)
        return None
    cluster = settings.cluster
    place, out_of = session.place
    session.place = (
        (cluster.node_rank, cluster.nodes)  # distinct on every node, with no race
        if cluster.node_rank is not None
        else (place, max(out_of, cluster.nodes))
    )
    session.board.expected = cluster.nodes
    session.start_polling()
    log.info(
        "restore_share_joined",
        session=name,
        address=me.address,
        participants=len(session.board.peers) + 1,
        place=f"{session.place[0]}/{session.place[1]}",
    )
    numbers = {
        object_key(run, manifest.checkpoint, f.path): i for i, f in enumerate(manifest.files)
    }
    storage = SharedStorage(tiers[0].storage, session, reader, numbers, manifest.files, log)
    return Sharing(session, storage, served, manifest.checkpoint)


__all__ = [
    "LINGER_IDLE_SECONDS",
    "POLL_SECONDS",
    "SHARED_TIER",
    "STALL_SECONDS",
    "ShareSession",
    "Sharing",
    "start_sharing",
]
