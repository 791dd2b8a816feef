"""A restore that reads from peers first, verified, and from the store for the rest.

The store stays the authority on what is committed: the manifest (signed, when
authenticated) is the store's, read first, and peers only supply bytes, each file held to
that manifest's size and CRC-32C (and digest) as it is written, exactly as bytes from the
store are (``ckptd.store.restore``). So:

1. the announcements in the store name the run's peers (``ckptd.peers.discovery``); every
   one is asked at once what it holds (``GET /v1/peer/holdings``, signed), and the answers
   that came within ``[peers] restore_wait_seconds`` (at most 30 s) are all there is:
   a dead node or a cut link costs that wait once, then the store;
2. a file is routed to a peer only when a holding there names the same path, size and
   CRC-32C (and digest) as the manifest (``ckptd.peers.model.routes``): a replica of
   another save or an older step serves nothing;
3. the restore runs through ``PeerFirstStorage`` as a tier of its own, named ``peers``,
   ahead of the store's tiers (``ckptd.store.tiers.restore_from_tiers``): a ranged read
   of a routed object goes to its peer, and to the next holder, then the store, when that
   peer fails it (a peer that failed once is not asked again); every other request goes
   to the store;
4. a file that does not verify (a peer's bytes damaged, truncated, stale) fails the
   ``peers`` tier, and the store's tier restores it; what verified is kept in the staging
   dir and not fetched again. So a fault costs time, never a wrong byte.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ckptd.config import Settings
from ckptd.config.peers import read_peer_token
from ckptd.core.manifest import Manifest, ManifestError
from ckptd.layouts.base import step_of
from ckptd.peers import auth
from ckptd.peers.discovery import read_announcements
from ckptd.peers.model import Holding, Route, routes
from ckptd.peers.placement import stale_after
from ckptd.repository import Repository, object_key
from ckptd.storage.base import STREAM_PIECE, RangeSink, Storage, StorageError
from ckptd.storage.wrapper import StorageWrapper
from ckptd.store.restore.procedure import part_manifest
from ckptd.store.tiers import TierStore

PEERS_TIER = "peers"
CONNECT_SECONDS = 3.0
READ_SECONDS = 10.0


class PeerReadError(Exception):
    """A peer that did not serve a range as asked (unreachable, refused, cut short)."""


@dataclass
class PeerReader:
    """Signed, blocking reads from peers, one keep-alive connection per peer and thread."""

    token: bytes
    _local: threading.local = field(default_factory=threading.local)

    def _connection(self, address: str, timeout: float) -> http.client.HTTPConnection:
        pool: dict[str, http.client.HTTPConnection] = getattr(self._local, "pool", None) or {}
        self._local.pool = pool
        conn = pool.get(address)
        if conn is None:
            host, _, port = address.rpartition(":")
            conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
            pool[address] = conn
        conn.timeout = timeout
        return conn

    def _drop(self, address: str) -> None:
        pool = getattr(self._local, "pool", {})
        conn = pool.pop(address, None)
        if conn is not None:
            conn.close()

    def request(
        self,
        address: str,
        target: str,
        headers: Mapping[str, str] | None = None,
        timeout: float = READ_SECONDS,
    ) -> http.client.HTTPResponse:
        signed, _ = auth.sign(self.token, "GET", target, time.time())
        conn = self._connection(address, timeout)
        try:
            conn.request("GET", target, headers={"Authorization": signed, **(headers or {})})
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            self._drop(address)
            raise PeerReadError(f"{address}: {exc!r}") from exc

    def holdings(self, address: str, run: str, timeout: float) -> list[Holding]:
        response = self.request(address, f"/v1/peer/holdings?run={run}", timeout=timeout)
        try:
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self._drop(address)
            raise PeerReadError(f"{address}: {exc!r}") from exc
        if response.status != 200:
            raise PeerReadError(f"{address} answered {response.status}")
        try:
            doc = json.loads(body)
            return [Holding.model_validate(h) for h in doc["holdings"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise PeerReadError(f"{address} answered no holdings: {exc}") from exc

    def read_range(self, route: Route, start: int, length: int, sink: RangeSink) -> None:
        address, hid, index = route
        target = f"/v1/peer/holdings/{hid}/files/{index}"
        response = self.request(address, target, {"Range": f"bytes={start}-{start + length - 1}"})
        try:
            if response.status not in (200, 206):
                response.read()
                raise PeerReadError(f"{address} answered {response.status} for {target}")
            pos = 0
            while pos < length:
                piece = response.read(min(STREAM_PIECE, length - pos))
                if not piece:
                    raise PeerReadError(f"{address} ended {target} at {pos} of {length} bytes")
                sink(pos, piece)
                pos += len(piece)
            response.read()  # the connection is reused: nothing may be left unread
        except (OSError, http.client.HTTPException) as exc:
            self._drop(address)
            raise PeerReadError(f"{address}: {exc!r}") from exc
        except PeerReadError:
            self._drop(address)
            raise


class PeerFirstStorage(StorageWrapper):
    """The store, but a routed object's ranged reads go to its peers first (module doc)."""

    def __init__(
        self, inner: Storage, routed: dict[str, list[Route]], reader: PeerReader, log: Any
    ) -> None:
        super().__init__(inner)
        self.url = f"peers+{inner.url}"
        self.routed = routed
        self.reader = reader
        self.log = log
        self.dead: set[str] = set()
        self.from_peers = 0
        self.from_store = 0
        self._lock = threading.Lock()

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        for route in self.routed.get(key, []):
            if route[0] in self.dead:
                continue
            try:
                self.reader.read_range(route, start, length, sink)
            except PeerReadError as exc:
                with self._lock:
                    self.dead.add(route[0])
                self.log.warning("restore_peer_failed", peer=route[0], error=str(exc))
                continue
            with self._lock:
                self.from_peers += length
            return
        self.inner.stream_range(key, start, length, sink)
        with self._lock:
            self.from_store += length


def ask_peers(
    repo: Repository, reader: PeerReader, run: str, *, wait_seconds: float, stale_after: float
) -> dict[str, list[Holding]]:
    """What every announced peer of ``run`` holds, as answered within ``wait_seconds``."""
    now = time.time()
    addresses = sorted(
        {
            a.address
            for a in read_announcements(repo, run)
            if a.address and now - a.updated_at <= stale_after
        }
    )
    if not addresses:
        return {}
    pool = ThreadPoolExecutor(max_workers=min(32, len(addresses)), thread_name_prefix="ckptd-ask")
    futures = {
        address: pool.submit(reader.holdings, address, run, min(wait_seconds, CONNECT_SECONDS * 3))
        for address in addresses
    }
    wait(futures.values(), timeout=wait_seconds)
    pool.shutdown(wait=False, cancel_futures=True)
    found: dict[str, list[Holding]] = {}
    for address, future in futures.items():
        if future.done() and future.exception() is None:
            found[address] = future.result()
    return found


@dataclass
class PeersTier:
    """The ``peers`` tier a restore puts first, and what it read from where."""

    tier: TierStore
    storage: PeerFirstStorage
    peers: int
    files_routed: int


def peers_tier(
    settings: Settings,
    tiers: Sequence[TierStore],
    run: str,
    checkpoint: str | None,
    part: int | None,
    log: Any,
) -> tuple[PeersTier | None, str | None]:
    """The ``peers`` tier for restoring ``run``'s ``checkpoint`` (None: the newest in the
    first tier), and the slot it pins; ``(None, None)`` when no peer holds any of its
    files (or the store cannot say what is committed: the tiers' own restore says why)."""
    if not settings.peers.enabled or not tiers:
        return None, None
    first = tiers[0]
    repo = Repository(first.storage)
    started = time.monotonic()
    try:
        manifest: Manifest = repo.resolve(run, checkpoint)
        if part is not None:
            manifest = part_manifest(repo, manifest, part)
        reader = PeerReader(read_peer_token(settings.peers))
        offers = ask_peers(
            repo,
            reader,
            run,
            wait_seconds=settings.peers.restore_wait_seconds,
            stale_after=stale_after(settings.peers.announce_interval_seconds),
        )
    except (StorageError, ManifestError) as exc:
        log.warning("restore_peers_skipped", error=str(exc))
        return None, None
    newer = sorted(
        {
            h.name
            for held in offers.values()
            for h in held
            if h.kind == "replica" and (step_of(h.name) or -1) > (manifest.step or -1)
        }
    )
    if newer:
        # A node died after its newer part was safe on a peer: until the peer's hand-off
        # commits it, the newest committed checkpoint is older (ckptd status on the
        # holder shows the hand-off).
        log.warning(
            "restore_newer_on_peers",
            committed=manifest.checkpoint,
            on_peers=newer,
            hint="a hand-off may be under way; restore again once it has committed",
        )
    found = routes(manifest.files, offers)
    routed = {object_key(run, manifest.checkpoint, p): r for p, r in found.items()}
    log.info(
        "restore_peers_asked",
        checkpoint=manifest.checkpoint,
        peers_answered=len(offers),
        files=len(manifest.files),
        files_on_peers=len(routed),
        seconds=round(time.monotonic() - started, 3),
    )
    if not routed:
        return None, manifest.checkpoint
    storage = PeerFirstStorage(first.storage, routed, reader, log)
    tier = TierStore(PEERS_TIER, storage, first.config)
    return PeersTier(tier, storage, len(offers), len(routed)), manifest.checkpoint


def with_peers(
    settings: Settings, tiers: Sequence[TierStore], manifest: Manifest, log: Any
) -> list[TierStore]:
    """``tiers`` with the ``peers`` tier first for restoring ``manifest``'s checkpoint (its
    slot), when peers hold any of it (``ckptd exec``'s restore); else ``tiers``."""
    peers, _ = peers_tier(settings, tiers, manifest.run_id, manifest.checkpoint, None, log)
    return [peers.tier, *tiers] if peers is not None else list(tiers)


__all__ = [
    "PEERS_TIER",
    "PeerFirstStorage",
    "PeerReadError",
    "PeerReader",
    "PeersTier",
    "ask_peers",
    "peers_tier",
    "with_peers",
]
