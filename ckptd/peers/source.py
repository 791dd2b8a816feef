"""A restore that reads from peers first, verified, and from the store for the rest.

The store stays the authority on what is committed: the manifest (signed, when
authenticated) is the store's, read first, and peers only supply bytes, each file held to
that manifest's size and CRC-32C (and digest) as it is written, exactly as bytes from the
store are (``ckptd.store.restore``). So:

1. the announcements in the store name the run's peers (``ckptd.peers.discovery``); every
   fresh one is asked at once what it holds (``GET /v1/peer/holdings``, signed), each from
   a daemon thread of its own, before the manifest is read, and the restore starts
   without waiting for the answers;
2. a file is routed to a peer only when a holding there names the same path, size and
   CRC-32C (and digest) as the manifest (``ckptd.peers.model.routes``): a replica of
   another save or an older step serves nothing;
3. the routes fill in as the answers come (``PeerAnswers``): a ranged read of a file no
   peer has named yet waits only while some peer is still to answer, and never past
   ``HOLDINGS_GRACE_SECONDS`` after the asking began; then it goes to the store. An
   answer that comes later (within ``[peers] restore_wait_seconds``) still routes every
   range not started yet. So no peer answering costs at most the grace, whether the
   peers' hosts are gone or their packets dropped, and a slow peer still serves the rest;
4. the restore runs through ``PeerFirstStorage`` as a tier of its own, named ``peers``,
   ahead of the store's tiers (``ckptd.store.tiers.restore_from_tiers``): a ranged read
   of a routed object goes to its peer, and to the next holder, then the store, when that
   peer fails it (a peer that failed once is not asked again); every other request goes
   to the store. It counts the bytes read from each; ``credited`` puts them in the
   restore's result and names the tier by where the bytes came from (``peers`` only when
   some did);
5. a file that does not verify (a peer's bytes damaged, truncated, stale) fails the
   ``peers`` tier, and the store's tier restores it; what verified is kept in the staging
   dir and not fetched again. So a fault costs time, never a wrong byte.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from ckptd.config import Settings
from ckptd.config.peers import read_peer_token
from ckptd.core.manifest import Manifest, ManifestError
from ckptd.layouts.base import step_of
from ckptd.peers import auth
from ckptd.peers.discovery import ANNOUNCEMENT_MAX_BYTES
from ckptd.peers.model import Holding, Route, parse_peer_announcement, routes
from ckptd.peers.placement import stale_after
from ckptd.peers.sending import PeerError
from ckptd.peers.stream_client import NotStreamed, StreamReader
from ckptd.repository import Repository, object_key, peer_key
from ckptd.runtime.clock import SYSTEM_CLOCK
from ckptd.storage.base import STREAM_PIECE, RangeSink, Storage, StorageError
from ckptd.storage.wrapper import StorageWrapper
from ckptd.store.restore.procedure import part_manifest
from ckptd.store.tiers import TierRestore, TierStore

PEERS_TIER = "peers"
READ_SECONDS = 10.0
#: How long after the asking began a range of a file no peer has named yet may wait for
#: the peers still to answer, before it goes to the store (module doc, 3). A peer on the
#: cluster network answers in milliseconds; one that has not in half a second is gone, cut
#: off or slow, and a slow one still serves what has not been started by its answer.
HOLDINGS_GRACE_SECONDS = 0.5
#: Peers asked at once (a run's other nodes: hundreds, with a large job); the rest are
#: asked as the first answer or fail.
ASKING_THREADS = 64


class PeerReadError(Exception):
    """A peer that did not serve a range as asked (unreachable, refused, cut short)."""


@dataclass
class PeerReader:
    """Signed, blocking reads from peers, one keep-alive connection per peer and thread."""

    token: bytes
    _local: threading.local = field(default_factory=threading.local)
    # Over the peer port's streams (ckptd.peers.stream_client), but HTTP to a peer that
    # did not answer the stream preamble (an older one).
    _http_only: set[str] = field(default_factory=set)

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

    def drop(self, address: str) -> None:
        """Close this thread's connection to ``address`` (after an error on it)."""
        self._drop(address)

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
        if address not in self._http_only:
            streams: StreamReader | None = getattr(self._local, "streams", None)
            if streams is None:
                streams = StreamReader(self.token, SYSTEM_CLOCK, READ_SECONDS)
                self._local.streams = streams
            try:
                streams.read_range(address, hid, index, start, length, sink)
                return
            except NotStreamed:
                self._http_only.add(address)
            except (OSError, ValueError, PeerError) as exc:
                raise PeerReadError(f"{address}: {exc!r}") from exc
        self.get_range(address, f"/v1/peer/holdings/{hid}/files/{index}", start, length, sink)

    def get_range(
        self, address: str, target: str, start: int, length: int, sink: RangeSink
    ) -> None:
        """``length`` bytes from ``start`` of what ``target`` serves, by a signed ranged
        GET on the kept-alive connection; PeerReadError when ``address`` does not serve
        them all."""
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


class PeerAnswers:
    """The routes the peers' answers gave so far, filled in as they come (module doc, 3).

    The peers are asked before the store's manifest is read (the grace runs meanwhile);
    answers that come before it is (``expect``) are routed then. Thread-safe: the
    asking threads add answers, the restore's threads read routes."""

    def __init__(
        self,
        asked: Sequence[str],
        log: Any,
        *,
        wait_seconds: float,
        grace: float = HOLDINGS_GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.asked = tuple(asked)
        self.log = log
        self.wait_seconds = wait_seconds
        self.clock = clock
        self.started = clock()
        self._grace_ends = self.started + grace
        self._pending = set(asked)
        self._early: list[tuple[str, list[Holding], float]] = []  # before ``expect``
        self.manifest: Manifest | None = None
        self._keys: Mapping[str, str] = {}  # a file's path -> its object's key
        self._routes: dict[str, list[Route]] = {}
        self.answered: list[str] = []
        self._cond = threading.Condition()

    def expect(self, manifest: Manifest, keys: Mapping[str, str]) -> None:
        """The restore is of ``manifest`` (``keys``: each file's object): the answers so
        far are routed, and each one from now on as it comes."""
        with self._cond:
            self.manifest, self._keys = manifest, keys
            early, self._early = self._early, []
        for address, held, seconds in early:
            self._route(address, held, seconds)

    def routes_for(self, key: str) -> list[Route]:
        """The peers holding ``key``'s object, as answered by now; while it has none and a
        peer is still to answer, waits for that, until the grace ends."""
        with self._cond:
            while key not in self._routes and self._pending:
                left = self._grace_ends - self.clock()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self._routes.get(key, ()))

    @property
    def files_routed(self) -> int:
        with self._cond:
            return len(self._routes)

    def settled(self) -> bool:
        """Every peer asked has answered or failed."""
        with self._cond:
            return not self._pending

    def answer(self, address: str, held: list[Holding]) -> None:
        """``address`` answered ``held``: the files it holds are routed to it from now on
        (an answer later than ``wait_seconds`` is not used)."""
        seconds = self.clock() - self.started
        if seconds > self.wait_seconds:
            self.no_answer(address, f"answered after {seconds:.1f} s")
            return
        with self._cond:
            if self.manifest is None:
                self._early.append((address, held, seconds))
                return
        self._route(address, held, seconds)

    def _route(self, address: str, held: list[Holding], seconds: float) -> None:
        manifest = self.manifest
        assert manifest is not None
        found = routes(manifest.files, {address: held})
        with self._cond:
            for path, via in found.items():
                self._routes.setdefault(self._keys[path], []).extend(via)
            self.answered.append(address)
            self._pending.discard(address)
            self._cond.notify_all()
        self.log.info(
            "restore_peer_answered",
            peer=address,
            checkpoint=manifest.checkpoint,
            files=len(manifest.files),
            files_on_peer=len(found),
            seconds=round(seconds, 3),
        )
        newer = sorted(
            {
                h.name
                for h in held
                if h.kind == "replica" and (step_of(h.name) or -1) > (manifest.step or -1)
            }
        )
        if newer:
            # A node died after its newer part was safe on a peer: until the peer's
            # hand-off commits it, the newest committed checkpoint is older (ckptd status
            # on the holder shows the hand-off).
            self.log.warning(
                "restore_newer_on_peers",
                committed=manifest.checkpoint,
                on_peers=newer,
                peer=address,
                hint="a hand-off may be under way; restore again once it has committed",
            )

    def no_answer(self, address: str, error: str) -> None:
        with self._cond:
            self._pending.discard(address)
            self._cond.notify_all()
        self.log.warning(
            "restore_peer_unanswered",
            peer=address,
            error=error,
            seconds=round(self.clock() - self.started, 3),
        )


class PeerFirstStorage(StorageWrapper):
    """The store, but a routed object's ranged reads go to its peers first (module doc)."""

    def __init__(self, inner: Storage, answers: PeerAnswers, reader: PeerReader, log: Any) -> None:
        super().__init__(inner)
        self.url = f"peers+{inner.url}"
        self.answers = answers
        self.reader = reader
        self.log = log
        self.dead: set[str] = set()
        self.from_peers = 0
        self.from_store = 0
        self._lock = threading.Lock()

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        for route in self.answers.routes_for(key):
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


def fresh_peers(repo: Repository, run: str, *, stale_after: float) -> list[str]:
    """The addresses of ``run``'s peers whose announcements are fresh, sorted. The
    announcements are read 16 at a time: a large job's hundreds, one after the other,
    would take seconds before a peer is asked (``read_announcements``' rules: one that
    is too large, does not parse or names another run is left out)."""
    listed = [
        info.key
        for info in repo.storage.list_objects(peer_key(run))
        if info.size <= ANNOUNCEMENT_MAX_BYTES
    ]
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(listed)))) as pool:
        bodies = list(pool.map(repo.get_or_none, listed))
    now = time.time()
    found = (parse_peer_announcement(body) for body in bodies if body is not None)
    return sorted(
        {
            a.address
            for a in found
            if a is not None and a.run_id == run and a.address and now - a.updated_at <= stale_after
        }
    )


def ask_peers(reader: PeerReader, run: str, answers: PeerAnswers) -> None:
    """Ask every peer in ``answers.asked`` what it holds of ``run``, from daemon threads
    (``ASKING_THREADS`` at most, each taking the next peer; a peer that never answers
    holds no process open), and return at once: the answers fill ``answers`` in as they
    come."""
    todo = list(reversed(answers.asked))
    lock = threading.Lock()

    def ask_each() -> None:
        while True:
            with lock:
                if not todo:
                    return
                address = todo.pop()
            try:
                held = reader.holdings(address, run, answers.wait_seconds)
            except PeerReadError as exc:
                answers.no_answer(address, str(exc))
            except Exception as exc:  # noqa: BLE001 - a peer's failure is never the restore's
                answers.no_answer(address, repr(exc))
            else:
                answers.answer(address, held)

    for _ in range(min(ASKING_THREADS, len(todo))):
        threading.Thread(target=ask_each, name="ckptd-ask", daemon=True).start()


@dataclass
class PeersTier:
    """The ``peers`` tier a restore puts first, and what it read from where."""

    tier: TierStore
    storage: PeerFirstStorage
    store_tier: str  # the name of the store's tier it reads the rest from

    @property
    def peers(self) -> int:
        return len(self.storage.answers.asked)

    @property
    def files_routed(self) -> int:
        return self.storage.answers.files_routed


def peers_tier(
    settings: Settings,
    tiers: Sequence[TierStore],
    run: str,
    checkpoint: str | None,
    part: int | None,
    log: Any,
) -> tuple[PeersTier | None, str | None]:
    """The ``peers`` tier for restoring ``run``'s ``checkpoint`` (None: the newest in the
    first tier), and the slot it pins, with its peers being asked (module doc);
    ``(None, None)`` when no fresh peer is announced (or the store cannot say what is
    committed: the tiers' own restore says why)."""
    if not settings.peers.enabled or not tiers:
        return None, None
    first = tiers[0]
    repo = Repository(first.storage)
    try:
        addresses = fresh_peers(
            repo, run, stale_after=stale_after(settings.peers.announce_interval_seconds)
        )
        if not addresses:
            return None, None
        reader = PeerReader(read_peer_token(settings.peers))
        # Asked first: the store's manifest is read while they answer.
        answers = PeerAnswers(addresses, log, wait_seconds=settings.peers.restore_wait_seconds)
        ask_peers(reader, run, answers)
        manifest: Manifest = repo.resolve(run, checkpoint)
        if part is not None:
            manifest = part_manifest(repo, manifest, part)
    except (StorageError, ManifestError) as exc:
        log.warning("restore_peers_skipped", error=str(exc))
        return None, None
    log.info(
        "restore_peers_asked",
        checkpoint=manifest.checkpoint,
        peers=len(addresses),
        files=len(manifest.files),
    )
    answers.expect(
        manifest, {f.path: object_key(run, manifest.checkpoint, f.path) for f in manifest.files}
    )
    storage = PeerFirstStorage(first.storage, answers, reader, log)
    tier = TierStore(PEERS_TIER, storage, first.config)
    return PeersTier(tier, storage, first.name), manifest.checkpoint


def credited(done: TierRestore, peers: PeersTier | None) -> TierRestore:
    """``done`` with its bytes by source (``peer_bytes``; ``store_bytes``: what the
    ``peers`` tier read from the store, and what a later tier downloaded), and named by
    where they came from: a ``peers`` tier that read nothing from a peer is the store's."""
    if peers is None:
        return done
    storage = peers.storage
    later = 0 if done.tier == PEERS_TIER else done.result.downloaded_bytes
    tier = peers.store_tier if done.tier == PEERS_TIER and not storage.from_peers else done.tier
    return replace(
        done, tier=tier, peer_bytes=storage.from_peers, store_bytes=storage.from_store + later
    )


__all__ = [
    "HOLDINGS_GRACE_SECONDS",
    "PEERS_TIER",
    "PeerAnswers",
    "PeerFirstStorage",
    "PeerReadError",
    "PeerReader",
    "PeersTier",
    "ask_peers",
    "credited",
    "fresh_peers",
    "peers_tier",
]
