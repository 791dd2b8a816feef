"""Pushing a part to a peer, and asking a peer what it holds (the sending side of
``ckptd.peers.server``).

A push (``push``) is an offer, the chunks, and a seal:

- each chunk is read from the local file in a thread, checksummed (CRC-32C, and with
  digests each 1 MiB block's BLAKE3) from the buffer it is sent from, paced, and sent
  with its CRC-32C in ``X-Ckptd-Crc32c``; ``concurrency`` chunks are in flight at once;
- a chunk whose connection dropped, timed out or came back 5xx, or that arrived damaged
  (422), is read and sent again, with a backoff, until ``deadline``: the holder keeps
  what it received, so a dropped connection costs one chunk, never the push (resumable);
- a holder that no longer knows the transfer (404: it restarted, and discarded what
  was incoming) fails the push (``PeerRestartedError``); the caller begins again or
  moves to another peer;
- every file must keep its identity (size, mtime, ctime, inode) from its first read to
  the seal: a file the trainer rewrote meanwhile fails the push, never seals a mixture;
- the seal sends the replica (each file's CRC-32C folded from its chunks', and digest);
  the push counts only if the answer names ``replica_id`` of exactly that replica with
  a valid acknowledgement for this request (``ckptd.peers.auth.ack``);
- the whole push is watched (``ckptd.peers.liveness``): the holder is asked
  ``/v1/peer/hello`` every ``PROBE_SECONDS`` beside it, and a holder that answered
  nothing for ``STALL_SECONDS``, took no chunk for that long while chunks were in flight,
  or has a notice (its hello says so, or it refuses with 503 ``notice``), is
  **abandoned** there and then (``PeerAbandonedError``): the push ends at once, whatever
  request was hanging on it (a dead host's socket can block a write for minutes), and
  the transfer is dropped on the holder in the background. The deadline still bounds
  every retry.

What goes wrong is a ``PeerError`` whose ``reason`` is the metric's label.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from ckptd.core import checksum, digest
from ckptd.core.manifest import ManifestFile
from ckptd.peers import auth
from ckptd.peers.frames import STREAM_VERSION
from ckptd.peers.liveness import (
    CONNECT_SECONDS,
    PROBE_SECONDS,
    STALL_SECONDS,
    WATCH_TICK_SECONDS,
    Liveness,
)
from ckptd.peers.model import Offer, Replica, SizedFile, chunk_spans, replica_id
from ckptd.peers.own import Identity, identity_of
from ckptd.peers.pacing import Pace
from ckptd.peers.sending import (
    DAMAGED_SENDS,
    FileState,
    LocalFile,
    PeerAbandonedError,
    PeerError,
    PeerRestartedError,
    chunk_refusal,
    read_chunk,
    reason_of,
    said,
)
from ckptd.peers.server import ACK_HEADER, CRC_HEADER
from ckptd.peers.stream_client import STREAMS, StreamSender
from ckptd.runtime.clock import Clock

#: Chunks in flight per push.
CONCURRENCY = 4
READ_SECONDS = 30.0


@dataclass
class PushResult:
    replica: Replica
    replica_id: str
    identities: list[Identity]  # each file as it was read
    seconds: float
    bytes_sent: int


class PeerClient:
    """Speaks to peers with the cluster's token; one aiohttp session, made on first use."""

    def __init__(self, token: bytes, clock: Clock, streams: int = STREAMS) -> None:
        self.token = token
        self.clock = clock
        self.streams = streams  # connections per push over streams; 0: HTTP PUTs only
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[None]] = set()

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=CONNECT_SECONDS, sock_read=READ_SECONDS
                ),
                connector=aiohttp.TCPConnector(limit=64, limit_per_host=16),
            )
        return self._session

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, method: str, target: str, body: str = "") -> tuple[dict[str, str], str]:
        value, nonce = auth.sign(self.token, method, target, self.clock.time(), body)
        return {"Authorization": value}, nonce

    async def _json(
        self,
        method: str,
        address: str,
        target: str,
        document: Any = None,
        *,
        timeout: float | None = None,
    ) -> tuple[int, Any, dict[str, str], str]:
        """One signed JSON request: ``(status, document, headers, nonce)``."""
        body = b"" if document is None else json.dumps(document).encode()
        tag = auth.body_sha256(body) if document is not None else ""
        headers, nonce = self._headers(method, target, tag)
        if document is not None:
            headers["Content-Type"] = "application/json"
        limit = (
            aiohttp.ClientTimeout(total=timeout)
            if timeout is not None
            else aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_SECONDS, sock_read=READ_SECONDS
            )
        )
        async with self.session().request(
            method,
            f"http://{address}{target}",
            data=body if document is not None else None,
            headers=headers,
            timeout=limit,
        ) as response:
            raw = await response.read()
            try:
                doc = json.loads(raw) if raw else None
            except ValueError:
                doc = None
            return response.status, doc, dict(response.headers), nonce

    # -- questions -----------------------------------------------------------------------

    async def hello(self, address: str, timeout: float = 3.0) -> dict[str, Any]:
        """Who answers at ``address``; PeerError when nobody does, or not as a peer."""
        try:
            status, doc, _, _ = await self._json("GET", address, "/v1/peer/hello", timeout=timeout)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PeerError(f"{address} does not answer: {exc!r}", "unreachable") from exc
        if status != 200 or not isinstance(doc, dict):
            raise PeerError(f"{address} answered {status}", reason_of(status, doc))
        return doc

    async def delivered(self, address: str, rid: str) -> None:
        """Tell the holder of ``rid`` that its origin's part is in the store."""
        await self._json("POST", address, f"/v1/peer/replicas/{rid}/delivered", {}, timeout=5.0)

    # -- a push --------------------------------------------------------------------------

    async def push(
        self,
        address: str,
        header: Replica,
        files: list[LocalFile],
        *,
        pace: Pace,
        deadline: float,
        digests: bool,
        on_bytes: Callable[[int], None] = lambda n: None,
        concurrency: int = CONCURRENCY,
        stall: float = STALL_SECONDS,
    ) -> PushResult:
        """Send ``files`` as the part ``header`` describes (its ``files`` are filled in
        here) to the holder at ``address``, by ``deadline`` (monotonic), abandoning a
        holder that stops answering for ``stall`` seconds or has a notice; module doc."""
        started = self.clock.monotonic()
        watch = Liveness(started, stall)
        work = asyncio.ensure_future(
            self._push(
                address, header, files, pace, deadline, digests, on_bytes, concurrency, watch
            )
        )
        probe = asyncio.ensure_future(self._probe(address, watch))
        try:
            while True:
                await asyncio.wait({work}, timeout=WATCH_TICK_SECONDS)
                why = watch.stalled(self.clock.monotonic())
                if work.done():
                    exc = work.exception()
                    if isinstance(exc, PeerError) and exc.reason == "notice":
                        why = "notice"
                    else:
                        return work.result()
                if why is not None:
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    after = self.clock.monotonic() - started
                    raise PeerAbandonedError(
                        f"{address} abandoned after {after:.1f} s: "
                        + {
                            "notice": "it has a notice",
                            "silent": f"it answered nothing for {stall:g} s",
                            "stalled": f"it took no chunk for {stall:g} s",
                        }[why],
                        why,
                        after,
                    )
        finally:
            probe.cancel()
            work.cancel()
            await asyncio.gather(probe, work, return_exceptions=True)

    async def _probe(self, address: str, watch: Liveness) -> None:
        """``/v1/peer/hello`` every ``PROBE_SECONDS`` beside a push: whether the holder is
        there, and whether it has a notice."""
        while True:
            try:
                doc = await self.hello(address, timeout=CONNECT_SECONDS)
            except PeerError:
                pass
            else:
                watch.heard(self.clock.monotonic(), notice=doc.get("notice") is True)
            await asyncio.sleep(PROBE_SECONDS)

    async def _push(
        self,
        address: str,
        header: Replica,
        files: list[LocalFile],
        pace: Pace,
        deadline: float,
        digests: bool,
        on_bytes: Callable[[int], None],
        concurrency: int,
        watch: Liveness,
    ) -> PushResult:
        started = self.clock.monotonic()
        tid, streamed = await self._offer(address, header, files, digests)
        watch.heard(self.clock.monotonic())
        states = [FileState(chunk_spans(f.size)) for f in files]
        try:
            sent: int | None = None
            if streamed and self.streams:
                sent = await StreamSender(
                    self.token, self.clock, address, tid, files, states, pace=pace,
                    deadline=deadline, digests=digests, on_bytes=on_bytes, watch=watch,
                    streams=self.streams,
                ).run()  # fmt: skip
            if sent is None:  # the holder, or what is between, does not speak streams
                sent = await self._send_all(
                    address, tid, files, states, pace, deadline, digests, on_bytes,
                    concurrency, watch,
                )  # fmt: skip
            for f, state in zip(files, states, strict=True):
                await asyncio.to_thread(_same_as_first_read, f, state)
            replica = _replica(header, files, states, digests)
            rid = replica_id(replica)
            status, doc, headers, nonce = await self._seal(address, tid, replica, deadline)
            watch.heard(self.clock.monotonic())
        except BaseException:
            self._forget(address, tid)
            raise
        if status != 200 or not isinstance(doc, dict):
            raise PeerError(
                f"{address} refused the seal: {said(doc, status)}", reason_of(status, doc)
            )
        if doc.get("replica") != rid:
            raise PeerError(f"{address} acknowledged {doc.get('replica')!r}, not {rid}", "stale")
        if not auth.ack_holds(self.token, nonce, rid, headers.get(ACK_HEADER, "")):
            raise PeerError(f"{address}'s acknowledgement of {rid} does not hold", "ack")
        identities = [s.identity for s in states if s.identity is not None]
        return PushResult(replica, rid, identities, self.clock.monotonic() - started, sent)

    async def _offer(
        self, address: str, header: Replica, files: list[LocalFile], digests: bool
    ) -> tuple[str, bool]:
        """The offer: every file's path and size; the transfer's id, and whether the
        holder takes its chunks over streams (``ckptd.peers.frames``)."""
        offer = Offer.model_validate(
            {
                **header.model_dump(mode="json", exclude={"files", "environment"}),
                "files": [SizedFile(path=f.path, size=f.size).model_dump() for f in files],
                "total_bytes": sum(f.size for f in files),
                "digest": digest.ALGORITHM if digests else None,
            }
        )
        try:
            status, doc, _, _ = await self._json(
                "POST", address, "/v1/peer/transfers", json.loads(offer.to_bytes())
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PeerError(f"{address} does not answer: {exc!r}", "unreachable") from exc
        if status != 201 or not isinstance(doc, dict) or not isinstance(doc.get("transfer"), str):
            raise PeerError(
                f"{address} refused the offer: {said(doc, status)}", reason_of(status, doc)
            )
        return str(doc["transfer"]), doc.get("stream") == STREAM_VERSION

    async def _send_all(
        self,
        address: str,
        tid: str,
        files: list[LocalFile],
        states: list[FileState],
        pace: Pace,
        deadline: float,
        digests: bool,
        on_bytes: Callable[[int], None],
        concurrency: int,
        watch: Liveness,
    ) -> int:
        """Every chunk of every file, ``concurrency`` at a time; the bytes sent."""
        jobs = [
            (index, offset, length)
            for index, state in enumerate(states)
            for offset, length in state.spans
        ]
        jobs.reverse()
        sent = 0

        async def worker() -> None:
            nonlocal sent
            while jobs:
                index, offset, length = jobs.pop()
                await self._send_chunk(
                    address, tid, index, offset, length, files[index], states[index],
                    pace=pace, deadline=deadline, digests=digests, watch=watch,
                )  # fmt: skip
                sent += length
                on_bytes(length)

        workers = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        return sent

    async def _seal(
        self, address: str, tid: str, replica: Replica, deadline: float
    ) -> tuple[int, Any, dict[str, str], str]:
        """The seal, sent again after a dropped connection until ``deadline``."""
        delay = 0.2
        while True:
            try:
                return await self._json(
                    "POST",
                    address,
                    f"/v1/peer/transfers/{tid}/seal",
                    json.loads(replica.to_bytes()),
                )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                if self.clock.monotonic() + delay > deadline:
                    raise PeerError(
                        f"{address}: seal not answered: {exc!r}", "unreachable"
                    ) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _forget(self, address: str, tid: str) -> None:
        """Tell the holder to drop the transfer, in the background (best effort: it
        expires anyway): a push given up on never waits for a holder that is gone."""
        task = asyncio.get_running_loop().create_task(self._give_up(address, tid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _give_up(self, address: str, tid: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            await self._json(
                "DELETE", address, f"/v1/peer/transfers/{tid}", timeout=CONNECT_SECONDS + 1
            )

    async def _send_chunk(
        self,
        address: str,
        tid: str,
        index: int,
        offset: int,
        length: int,
        local: LocalFile,
        state: FileState,
        *,
        pace: Pace,
        deadline: float,
        digests: bool,
        watch: Liveness,
    ) -> None:
        delay, damaged = 0.2, 0
        target = f"/v1/peer/transfers/{tid}/files/{index}/{offset}"
        while True:
            data, crc, blocks, ident = await asyncio.to_thread(
                read_chunk, local, offset, length, digests
            )
            if state.identity is None:
                state.identity = ident
            elif ident != state.identity:
                raise PeerError(f"{local.path} changed while it was sent", "changed")
            await pace.take(length)
            crc_hex = checksum.to_hex(crc)
            headers, _ = self._headers("PUT", target, auth.body_crc32c(crc_hex))
            headers[CRC_HEADER] = crc_hex
            watch.chunk_sent(self.clock.monotonic())
            status, doc = 0, None
            try:
                async with self.session().put(
                    f"http://{address}{target}", data=data, headers=headers
                ) as response:
                    status = response.status
                    doc = await _json_of(response)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                status, doc = 0, {"error": repr(exc)}
            finally:
                watch.chunk_ended(self.clock.monotonic(), taken=status == 200)
            if status:
                watch.heard(self.clock.monotonic())
            if status == 200:
                state.crcs[offset] = crc
                state.blocks[offset] = blocks
                return
            damaged += status == 422
            if (refusal := chunk_refusal(address, local, offset, status, doc, damaged)) is not None:
                raise refusal
            if self.clock.monotonic() + delay > deadline:
                raise PeerError(
                    f"{address}: {local.path} at {offset} not taken by the deadline: "
                    f"{said(doc, status)}",
                    "unreachable",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def _same_as_first_read(local: LocalFile, state: FileState) -> None:
    """An empty file was never read: take its identity now; any other must be as first read."""
    try:
        st = os.stat(local.local)
    except OSError as exc:
        raise PeerError(f"{local.path} vanished while it was sent", "changed") from exc
    if st.st_size != local.size or st.st_mtime_ns != local.mtime_ns:
        raise PeerError(f"{local.path} changed while it was sent", "changed")
    if state.identity is None:
        state.identity = identity_of(st)
    elif identity_of(st) != state.identity:
        raise PeerError(f"{local.path} changed while it was sent", "changed")


def _replica(
    header: Replica, files: list[LocalFile], states: list[FileState], digests: bool
) -> Replica:
    entries = []
    for f, state in zip(files, states, strict=True):
        crc = checksum.combine_parts((state.crcs[o], n) for o, n in state.spans)
        file_digest = (
            digest.file_digest(f.size, (b for o, _ in state.spans for b in state.blocks[o]))
            if digests
            else None
        )
        entries.append(
            ManifestFile(path=f.path, size=f.size, crc32c=checksum.to_hex(crc), digest=file_digest)
        )
    return header.model_copy(
        update={
            "files": entries,
            "total_bytes": sum(f.size for f in files),
            "digest": digest.ALGORITHM if digests else None,
        }
    )


async def _json_of(response: aiohttp.ClientResponse) -> Any:
    raw = await response.read()
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


__all__ = [
    "CONCURRENCY",
    "DAMAGED_SENDS",
    "LocalFile",
    "PeerAbandonedError",
    "PeerClient",
    "PeerError",
    "PeerRestartedError",
    "PushResult",
]
