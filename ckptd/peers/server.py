"""The peer port: other nodes push their parts here, and a restore reads what is held.

Every route needs a request signed with the cluster's token (``ckptd.peers.auth``),
checked before anything else is done or read beyond a JSON body; without it the answer
is ``401`` and nothing is written or disclosed. The routes (docs/design.md, "Peer
replication"):

    GET    /v1/peer/hello                              who answers here (and since when)
    POST   /v1/peer/transfers                          an offer: reserve, make the files
    PUT    /v1/peer/transfers/{t}/files/{i}/{offset}   one chunk, X-Ckptd-Crc32c: its CRC
    GET    /v1/peer/transfers/{t}                      the chunks received (to resume)
    POST   /v1/peer/transfers/{t}/seal                 the replica: check all, fsync, keep
    DELETE /v1/peer/transfers/{t}                      give a transfer up
    POST   /v1/peer/replicas/{r}/delivered             the origin's part is in the store
    GET    /v1/peer/holdings?run=RUN                   what a restore can read here
    GET    /v1/peer/holdings/{h}/files/{i}             one file (Range: bytes=A-B)

Refusals are JSON ``{"error", "reason"}`` with the status a client acts on: 400 a bad
request, 401 unauthorized, 404 no such transfer or holding (the holder restarted: begin
again), 409 a file changed or damaged at rest (read it elsewhere), 422 bytes that do not
match their checksum (never written, never acknowledged: send again), 507 no room within
the quota, 503 ``notice``: this node has a notice of its own and takes no part (an offer,
a chunk, a seal) while it lasts, since the replica would go with the node; the origin
moves to its next candidate. Blocking file work runs in threads; the event loop only
moves bytes.

The same port also speaks streams (``ckptd.peers.frames``, ``ckptd.peers.listener``):
a connection that begins with the stream preamble carries chunks and reads as frames,
each signed like its HTTP request, in a thread with one reused buffer
(``ckptd.peers.stream_holder``). An offer's answer says so (``"stream": 1``); the HTTP
chunk and file routes stay for clients that do not speak streams.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ckptd.core.manifest import ManifestError
from ckptd.peers import auth
from ckptd.peers.frames import REFUSAL_STATUS, STREAM_VERSION
from ckptd.peers.listener import PeerListener
from ckptd.peers.model import (
    CHUNK_BYTES,
    MAX_DOCUMENT_BYTES,
    parse_offer,
    parse_replica,
)
from ckptd.peers.own import OwnParts
from ckptd.peers.receiving import Receiver
from ckptd.peers.replicas import (
    CorruptError,
    ReplicaError,
    ReplicaStore,
)
from ckptd.peers.stream_holder import StreamHolder
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CRC_HEADER = "X-Ckptd-Crc32c"
ACK_HEADER = "X-Ckptd-Ack"
_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
_PIECE = 4 * 1024 * 1024  # bytes per read while serving a range
_STATUS = REFUSAL_STATUS


def _refuse(reason: str, error: str) -> web.Response:
    return web.json_response({"error": error, "reason": reason}, status=_STATUS[reason])


class PeerServer:
    """The peer port of one daemon (module doc)."""

    def __init__(
        self,
        store: ReplicaStore,
        own: OwnParts,
        token: bytes,
        metrics: Metrics,
        clock: Clock,
        log: Any,
        *,
        hello: Callable[[], dict[str, Any]],
        notice: Callable[[], bool] = lambda: False,
        streams: bool = True,
    ) -> None:
        self.store = store
        self.receiver = Receiver(store)
        self.own = own
        self.checker = auth.RequestChecker(token, lock=threading.Lock())
        self.token = token
        self.metrics = metrics
        self.clock = clock
        self.log = log
        self._hello = hello
        self._notice = notice  # whether this node has a notice of its own now
        self.streams = streams  # whether offers' answers say this port speaks streams
        self.stream_holder = StreamHolder(
            self.receiver,
            store.open_file,
            own.open_file,
            self.checker,
            metrics,
            clock,
            log,
            notice,
        )
        self._runner: web.AppRunner | None = None
        self._listener: PeerListener | None = None
        self.port = 0

    def app(self) -> web.Application:
        # A chunk, or an offer/replica document, is the largest body a client may send.
        app = web.Application(client_max_size=max(CHUNK_BYTES, MAX_DOCUMENT_BYTES) + 4096)
        r = app.router
        r.add_get("/v1/peer/hello", self._get_hello)
        r.add_post("/v1/peer/transfers", self._post_offer)
        r.add_put("/v1/peer/transfers/{t}/files/{i}/{offset}", self._put_chunk)
        r.add_get("/v1/peer/transfers/{t}", self._get_transfer)
        r.add_post("/v1/peer/transfers/{t}/seal", self._post_seal)
        r.add_delete("/v1/peer/transfers/{t}", self._delete_transfer)
        r.add_post("/v1/peer/replicas/{r}/delivered", self._post_delivered)
        r.add_get("/v1/peer/holdings", self._get_holdings)
        r.add_get("/v1/peer/holdings/{h}/files/{i}", self._get_file)
        return app

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None  # made by setup()
        self._listener = PeerListener(lambda: server(), self.stream_holder.serve)
        self.port = await self._listener.start(host, port)
        return self.port

    async def stop(self) -> None:
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- the guard ---------------------------------------------------------------------

    def _unauthorized(self, request: web.Request, body: str = "") -> web.Response | None:
        """None when the request is signed with the token; else the 401 to answer."""
        why, _ = self.checker.check(
            request.headers.get("Authorization"),
            request.method,
            request.path_qs,
            self.clock.time(),
            body,
        )
        if why is None:
            return None
        self.metrics.peer_refused.labels(reason="unauthorized").inc()
        self.log.warning("peer_request_refused", remote=request.remote, path=request.path, why=why)
        return _refuse("unauthorized", f"unauthorized: {why}")

    def _error(self, exc: ReplicaError | ManifestError | ValueError) -> web.Response:
        reason = exc.reason if isinstance(exc, ReplicaError) else "bad_request"
        self.metrics.peer_refused.labels(reason=reason).inc()
        return _refuse(reason, str(exc))

    async def _document(self, request: web.Request) -> tuple[bytes, web.Response | None]:
        body = await request.read()
        return body, self._unauthorized(request, auth.body_sha256(body))

    def _noticed(self, request: web.Request) -> web.Response | None:
        """The 503 to answer while this node has a notice (module doc), else None."""
        if not self._notice():
            return None
        self.metrics.peer_refused.labels(reason="notice").inc()
        self.log.info("peer_part_refused", remote=request.remote, path=request.path, why="notice")
        return _refuse("notice", "this node has a notice: it holds no part of another node")

    # -- routes ------------------------------------------------------------------------

    async def _get_hello(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return web.json_response(self._hello())

    async def _post_offer(self, request: web.Request) -> web.Response:
        body, denied = await self._document(request)
        if denied is not None:
            return denied
        if (noticed := self._noticed(request)) is not None:
            return noticed
        try:
            offer = parse_offer(body)
            tid = await asyncio.to_thread(self.receiver.begin, offer, self.clock.time())
        except (ReplicaError, ManifestError) as exc:
            self.log.warning("peer_offer_refused", remote=request.remote, error=str(exc))
            return self._error(exc)
        except OSError as exc:  # ENOSPC, EACCES under peers.dir: no room here
            self.metrics.peer_refused.labels(reason="quota").inc()
            return _refuse("quota", f"cannot make the part's files here: {exc}")
        self.log.info(
            "peer_transfer_begun",
            transfer=tid,
            run=offer.run_id,
            checkpoint=offer.checkpoint,
            node=offer.node_rank,
            host=offer.host,
            bytes=offer.total_bytes,
            files=len(offer.files),
            emergency=offer.emergency,
        )
        answer: dict[str, Any] = {"transfer": tid}
        if self.streams:
            answer["stream"] = STREAM_VERSION
        return web.json_response(answer, status=201)

    async def _put_chunk(self, request: web.Request) -> web.Response:
        crc = request.headers.get(CRC_HEADER, "")
        if (denied := self._unauthorized(request, auth.body_crc32c(crc))) is not None:
            return denied
        if (noticed := self._noticed(request)) is not None:
            # Read to its end (one chunk at most), so the refusal does not leave the
            # connection lingering on an unread body for aiohttp's 10 s.
            drained = 0
            async for piece in request.content.iter_any():
                drained += len(piece)
                if drained > CHUNK_BYTES:
                    break
            return noticed
        try:
            index = int(request.match_info["i"])
            offset = int(request.match_info["offset"])
        except ValueError:
            return self._error(ValueError("file index and offset must be integers"))
        # The body as it arrived, in pieces: checksummed and written piece by piece in a
        # thread, never joined into one buffer (a copy per chunk saved).
        data: list[bytes] = []
        received = 0
        async for piece in request.content.iter_any():
            received += len(piece)
            if received > CHUNK_BYTES:
                return self._error(ValueError(f"a chunk is at most {CHUNK_BYTES} bytes"))
            data.append(piece)
        try:
            await asyncio.to_thread(
                self.receiver.write_chunk,
                request.match_info["t"],
                index,
                offset,
                data,
                crc,
                self.clock.time(),
            )
        except ReplicaError as exc:
            if isinstance(exc, CorruptError):
                self.log.warning("peer_chunk_refused", remote=request.remote, error=str(exc))
            return self._error(exc)
        except OSError as exc:
            self.metrics.peer_refused.labels(reason="quota").inc()
            return _refuse("quota", f"cannot write the chunk here: {exc}")
        self.metrics.peer_received_bytes.inc(received)
        return web.json_response({"ok": True})

    async def _get_transfer(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            received = self.receiver.received(request.match_info["t"])
        except ReplicaError as exc:
            return self._error(exc)
        return web.json_response({"received": {str(k): v for k, v in received.items()}})

    async def _post_seal(self, request: web.Request) -> web.Response:
        body, denied = await self._document(request)
        if denied is not None:
            return denied
        if (noticed := self._noticed(request)) is not None:
            return noticed
        nonce = _nonce_of(request)  # the acknowledgement answers this request
        tid = request.match_info["t"]
        try:
            replica = parse_replica(body)
            rid = await asyncio.to_thread(self.receiver.seal, tid, replica, self.clock.time())
        except (ReplicaError, ManifestError) as exc:
            self.log.warning("peer_seal_refused", transfer=tid, error=str(exc))
            if isinstance(exc, CorruptError):
                await asyncio.to_thread(self.receiver.abort, tid)  # never kept, never served
            return self._error(exc)
        except OSError as exc:
            self.metrics.peer_refused.labels(reason="quota").inc()
            return _refuse("quota", f"cannot keep the part here: {exc}")
        self.metrics.peer_replicas_sealed.inc()
        self.export_held()
        self.log.info(
            "peer_replica_sealed",
            replica=rid,
            run=replica.run_id,
            checkpoint=replica.checkpoint,
            node=replica.node_rank,
            host=replica.host,
            bytes=replica.total_bytes,
            emergency=replica.emergency,
        )
        return web.json_response(
            {"replica": rid}, headers={ACK_HEADER: auth.ack(self.token, nonce, rid)}
        )

    async def _delete_transfer(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        await asyncio.to_thread(self.receiver.abort, request.match_info["t"])
        return web.json_response({"ok": True})

    async def _post_delivered(self, request: web.Request) -> web.Response:
        _body, denied = await self._document(request)
        if denied is not None:
            return denied
        await asyncio.to_thread(self.store.mark, request.match_info["r"], delivered=True)
        return web.json_response({"ok": True})

    async def _get_holdings(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        run = request.query.get("run")
        found = [*self.store.holdings(run), *self.own.holdings(run)]
        return web.json_response(
            {"holdings": [json.loads(h.to_bytes()) for h in found]},
        )

    async def _get_file(self, request: web.Request) -> web.StreamResponse:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        hid = request.match_info["h"]
        try:
            index = int(request.match_info["i"])
        except ValueError:
            return self._error(ValueError("the file index must be an integer"))
        opener = self.own.open_file if hid.startswith("own-") else self.store.open_file
        try:
            fd, size = await asyncio.to_thread(opener, hid, index)
        except CorruptError as exc:
            self.metrics.peer_refused.labels(reason="changed").inc()
            self.log.warning("peer_file_not_served", holding=hid, error=str(exc))
            return _refuse("changed", str(exc))
        except ReplicaError as exc:
            return self._error(exc)
        try:
            start, end = 0, size - 1
            wanted = request.headers.get("Range")
            if wanted is not None:
                m = _RANGE.match(wanted)
                if m is None or int(m.group(1)) > int(m.group(2)) or int(m.group(2)) >= size:
                    return self._error(ValueError(f"Range {wanted!r} is not within {size} bytes"))
                start, end = int(m.group(1)), int(m.group(2))
            response = web.StreamResponse(status=206 if wanted else 200)
            response.content_length = end - start + 1 if size else 0
            response.content_type = "application/octet-stream"
            await response.prepare(request)
            pos = start
            while pos <= end and size:
                piece = await asyncio.to_thread(os.pread, fd, min(_PIECE, end + 1 - pos), pos)
                if not piece:
                    break  # shortened under us: the client's length check refuses it
                await response.write(piece)
                pos += len(piece)
            self.metrics.peer_served_bytes.inc(pos - start)
            await response.write_eof()
            return response
        finally:
            os.close(fd)

    def export_held(self) -> None:
        held = self.store.held()
        self.metrics.peer_replicas_held.set(len(held))
        self.metrics.peer_replica_bytes.set(sum(h.replica.total_bytes for h in held))


def _nonce_of(request: web.Request) -> str:
    """The nonce of a request whose signature was checked already."""
    header = request.headers.get("Authorization", "")
    fields = header.partition(" ")[2].split(":")
    return fields[2] if len(fields) == 4 else ""


__all__ = ["ACK_HEADER", "CRC_HEADER", "PeerServer"]
