"""The client's side of streams (``ckptd.peers.frames``): a push's chunks, and reads.

``StreamSender`` sends one push's chunks over ``streams`` connections to the holder's
peer port, each in a thread of its own with one reused chunk buffer: the chunk is read
into it (``preadv``), CRC-32C'd (and its blocks BLAKE3'd, authenticated) there, paced,
signed as its HTTP PUT would be, and sent from it (``sendall``); the holder's answer says
whether it was written. The rules are the HTTP path's (``ckptd.peers.sending``): a
dropped connection or a 5xx costs that chunk, sent again on a new connection after a
backoff until the deadline; 5 damaged sends fail the push; a 404 or a refusal fails it.
The push's ``Liveness`` hears of every chunk (through the event loop), so a holder that
stops taking chunks is abandoned as over HTTP: the loop cancels ``run``, which shuts
every connection down, so no thread stays blocked on a vanished host; each blocking
call also has a timeout.

``StreamReader.read_range`` reads one range of a held file: the holder sends it with
``sendfile``, the reader receives it into one reused buffer per thread and hands it on
in ``STREAM_PIECE`` pieces. Both say "not here" (``NotStreamed``) when the holder did not
answer the preamble, so the caller can use HTTP instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

from ckptd.core import checksum
from ckptd.peers import auth
from ckptd.peers.frames import FrameError, Request, read_tag
from ckptd.peers.liveness import CONNECT_SECONDS, Liveness
from ckptd.peers.model import CHUNK_BYTES
from ckptd.peers.own import identity_of
from ckptd.peers.pacing import Pace
from ckptd.peers.sending import (
    FileState,
    LocalFile,
    PeerError,
    chunk_refusal,
    open_as_listed,
    read_chunk_into,
    said,
)
from ckptd.peers.stream_io import greet, read_answer, recv_exactly
from ckptd.runtime.clock import Clock

#: Connections (and threads) per push.
STREAMS = 2
#: Chunks a stream sends ahead of their answers: the holder writes one while the next
#: arrives, so the link does not idle for each chunk's write and answer.
PIPELINE = 2
#: A blocking send or receive on a stream that makes no progress for this long fails
#: (the push's liveness watch abandons a silent holder well before).
IO_SECONDS = 30.0
#: Bytes a read receives at a time (one buffer per thread) and hands to its sink: while
#: the sink checks and writes one piece, the next arrives in the socket's buffer. With
#: 8 MiB pieces a read on a 1 Gbit/s link ran at 0.64-0.75x a bare stream (the socket's
#: buffer could not hold what arrived meanwhile); one 8 MiB write into the page cache
#: also costs more than eight 1 MiB ones here.
READ_PIECE = 1024 * 1024


class NotStreamed(OSError):
    """The holder did not answer the stream preamble: it does not speak streams here."""


def connect(address: str, timeout: float = IO_SECONDS) -> socket.socket:
    """A greeted stream connection to ``address`` (``host:port``); NotStreamed, OSError."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            # Connected: whatever answers, if not the preamble (a reset, an HTTP error,
            # silence), is not a stream holder.
            if not greet(sock):
                raise NotStreamed(f"{address} does not speak streams")
        except NotStreamed:
            raise
        except OSError as exc:
            raise NotStreamed(f"{address} does not speak streams: {exc!r}") from exc
        sock.settimeout(timeout)
    except BaseException:
        sock.close()
        raise
    return sock


_Job = tuple[int, int, int]  # file index, offset, length


@dataclass(frozen=True)
class _Sent:
    """A chunk sent, its answer not yet read: what to record once it is taken."""

    job: _Job
    crc: int
    blocks: list[bytes]


class StreamSender:
    """One push's chunks over streams (module doc). ``run`` once."""

    def __init__(
        self,
        token: bytes,
        clock: Clock,
        address: str,
        tid: str,
        files: list[LocalFile],
        states: list[FileState],
        *,
        pace: Pace,
        deadline: float,
        digests: bool,
        on_bytes: Callable[[int], None],
        watch: Liveness,
        streams: int = STREAMS,
    ) -> None:
        self.token = token
        self.clock = clock
        self.address = address
        self.tid = tid
        self.files = files
        self.states = states
        self.pace = pace
        self.deadline = deadline
        self.digests = digests
        self.on_bytes = on_bytes
        self.watch = watch
        self.streams = max(1, streams)
        self._jobs: collections.deque[_Job] = collections.deque(
            (i, offset, length) for i, s in enumerate(states) for offset, length in s.spans
        )
        self._retries: dict[_Job, tuple[int, float]] = {}  # damaged sends, next backoff
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sent = 0

    async def run(self) -> int | None:
        """Every chunk sent and taken: the bytes sent; None when the holder does not speak
        streams (nothing was sent: use HTTP). PeerError as the HTTP path's."""
        self._loop = asyncio.get_running_loop()
        if not self._jobs:
            return 0
        try:
            first = await asyncio.to_thread(connect, self.address)
        except NotStreamed:
            return None
        except OSError:
            first = None  # the workers connect again, with a backoff, until the deadline
        if first is not None:
            self._keep(first)
        futures = []
        for n in range(min(self.streams, len(self._jobs))):
            done: Future[None] = Future()
            thread = threading.Thread(
                target=self._worker,
                args=(first if n == 0 else None, done),
                name="ckptd-peer-push",
                daemon=True,
            )
            thread.start()
            waited = asyncio.wrap_future(done)
            waited.add_done_callback(_retrieved)
            futures.append(waited)
        try:
            finished, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            for f in finished:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            await asyncio.gather(*futures)
        finally:
            self._stop()
        return self.sent

    def _stop(self) -> None:
        """Every thread's blocking call ends at once (a vanished holder included)."""
        self._stopping.set()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
        if self._stopping.is_set():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _drop(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._sockets.discard(sock)
        sock.close()

    def _tell(self, fn: Callable[..., object], *args: object) -> None:
        """``fn(*args)`` on the event loop (the watch and ``on_bytes`` are the loop's)."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is watching
            self._loop.call_soon_threadsafe(fn, *args)

    def _worker(self, sock: socket.socket | None, done: Future[None]) -> None:
        """Send chunks, up to ``PIPELINE`` ahead of their answers on this connection (an
        answer is a few bytes, so a send never waits on an unread answer), until none is
        left; each answer decides as ``chunk_refusal`` says."""
        buffer = memoryview(bytearray(CHUNK_BYTES))
        pending: collections.deque[_Sent] = collections.deque()
        try:
            while True:
                if self._stopping.is_set():
                    raise PeerError(f"{self.address}: the push was ended", "abandoned")
                job = None
                if len(pending) < PIPELINE:
                    with self._lock:
                        job = self._jobs.popleft() if self._jobs else None
                if job is None and not pending:
                    break
                if job is not None:
                    sock, sent = self._send(sock, job, buffer)
                    if sent is None:  # the connection failed: this and every pending again
                        sock = self._again(sock, [*pending, _Sent(job, 0, [])], 0, None)
                        pending.clear()
                        continue
                    pending.append(sent)
                    if len(pending) < PIPELINE:
                        continue
                sock = self._answer(sock, pending)
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to run() to raise
            done.set_exception(exc)
        finally:
            self._drop(sock)

    def _send(
        self, sock: socket.socket | None, job: _Job, buffer: memoryview
    ) -> tuple[socket.socket | None, _Sent | None]:
        """Read, check, pace, sign and send one chunk: the connection, and what was sent
        (None when the connection failed)."""
        index, offset, length = job
        local, state = self.files[index], self.states[index]
        body = buffer[:length]
        fd, st = open_as_listed(local)
        try:
            crc, blocks = read_chunk_into(fd, local, offset, body, self.digests)
        finally:
            os.close(fd)
        with self._lock:
            if state.identity is None:
                state.identity = identity_of(st)
            elif identity_of(st) != state.identity:
                raise PeerError(f"{local.path} changed while it was sent", "changed")
        self._take_pace(length)
        target = f"/v1/peer/transfers/{self.tid}/files/{index}/{offset}"
        crc_hex = checksum.to_hex(crc)
        signed, _ = auth.sign(
            self.token, "PUT", target, self.clock.time(), auth.body_crc32c(crc_hex)
        )
        head = Request("PUT", target, signed, length, crc32c=crc_hex).encode()
        self._tell(self.watch.chunk_sent, self.clock.monotonic())
        try:
            if sock is None:
                sock = connect(self.address)
                self._keep(sock)
            sock.sendall(head)
            # From the buffer its CRC-32C was computed from (measured: sendfile from the
            # page cache after that read cost the sender more, not less; design.md).
            sock.sendall(body)
        except OSError:
            return sock, None
        return sock, _Sent(job, crc, blocks)

    def _answer(
        self, sock: socket.socket | None, pending: collections.deque[_Sent]
    ) -> socket.socket | None:
        """Read the answer to the oldest chunk in flight, and act on it."""
        sent = pending.popleft()
        status, doc = 0, None
        try:
            assert sock is not None
            answer = read_answer(sock)
            status, doc = int(answer["status"]), answer
        except (OSError, FrameError) as exc:
            doc = {"error": repr(exc)}
        if status:
            self._tell(self.watch.heard, self.clock.monotonic())
        if status == 200:
            self._tell(self.watch.chunk_ended, self.clock.monotonic(), True)
            index, offset, length = sent.job
            with self._lock:
                self.states[index].crcs[offset] = sent.crc
                self.states[index].blocks[offset] = sent.blocks
                self.sent += length
            self._tell(self.on_bytes, length)
            return sock
        if status == 422:  # the connection goes on: only this chunk again
            return self._again(sock, [sent], status, doc, keep=pending)
        # The holder ended the connection, or it failed: this and every pending again.
        again = [sent, *pending]
        pending.clear()
        return self._again(sock, again, status, doc)

    def _again(
        self,
        sock: socket.socket | None,
        jobs: list[_Sent],
        status: int,
        doc: Any,
        keep: collections.deque[_Sent] | None = None,
    ) -> socket.socket | None:
        """``jobs`` (each sent, none taken: no longer in flight) to be sent again after
        their backoff, or the error that ends the push (``chunk_refusal``, the deadline).
        ``keep``: answers still due on ``sock``; without it the connection is dropped (the
        holder may have ended it)."""
        for _ in jobs:
            self._tell(self.watch.chunk_ended, self.clock.monotonic(), False)
        if keep is None:
            self._drop(sock)
            sock = None
        delay = 5.0
        for sent in jobs:
            index, offset, _ = sent.job
            local = self.files[index]
            with self._lock:
                damaged, wait = self._retries.get(sent.job, (0, 0.2))
                damaged += status == 422
                self._retries[sent.job] = (damaged, min(wait * 2, 5.0))
            refusal = chunk_refusal(self.address, local, offset, status, doc, damaged)
            if refusal is not None:
                raise refusal
            if self.clock.monotonic() + wait > self.deadline:
                raise PeerError(
                    f"{self.address}: {local.path} at {offset} not taken by the deadline: "
                    f"{said(doc, status)}",
                    "unreachable",
                )
            delay = min(delay, wait)
        self._stopping.wait(delay)
        with self._lock:
            self._jobs.extendleft(s.job for s in reversed(jobs))
        return sock

    def _take_pace(self, length: int) -> None:
        """Wait this chunk's turn on the push's shared pace (the loop's)."""
        if self.pace.rate <= 0:
            return
        assert self._loop is not None
        turn = asyncio.run_coroutine_threadsafe(self.pace.take(length), self._loop)
        while True:
            try:
                turn.result(timeout=0.5)
                return
            except TimeoutError:
                if self._stopping.is_set():
                    turn.cancel()
                    raise PeerError(f"{self.address}: the push was ended", "abandoned") from None


def _retrieved(future: asyncio.Future[None]) -> None:
    """Each thread's end is looked at, though ``run`` raised the first error only."""
    if not future.cancelled():
        future.exception()


class StreamReader:
    """Signed range reads of held files over streams, one connection per peer and thread."""

    def __init__(self, token: bytes, clock: Clock, timeout: float = IO_SECONDS) -> None:
        self.token = token
        self.clock = clock
        self.timeout = timeout
        self._local = threading.local()

    def _connection(self, address: str) -> socket.socket:
        pool: dict[str, socket.socket] = getattr(self._local, "pool", None) or {}
        self._local.pool = pool
        if address not in pool:
            pool[address] = connect(address, self.timeout)
        return pool[address]

    def _buffer(self) -> memoryview:
        buffer: memoryview | None = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = memoryview(bytearray(READ_PIECE))
        return buffer

    def drop(self, address: str) -> None:
        pool: dict[str, socket.socket] = getattr(self._local, "pool", {})
        sock = pool.pop(address, None)
        if sock is not None:
            sock.close()

    def read_range(
        self,
        address: str,
        hid: str,
        index: int,
        start: int,
        length: int,
        sink: Callable[[int, bytes], None],
    ) -> None:
        """``length`` bytes of file ``index`` of holding ``hid`` from ``start``, handed to
        ``sink(pos, piece)``: ``piece`` is a view of a reused buffer, valid only during
        the call (every sink of a restore writes and checksums it there). NotStreamed,
        PeerError("refused", ...) naming the status, or OSError when cut short."""
        target = f"/v1/peer/holdings/{hid}/files/{index}"
        signed, _ = auth.sign(self.token, "GET", target, self.clock.time(), read_tag(start, length))
        try:
            sock = self._connection(address)
            sock.sendall(Request("GET", target, signed, length, start=start).encode())
            answer = read_answer(sock)
            status = int(answer["status"])
            if status != 206 or answer.get("length") != length:
                raise PeerError(
                    f"{address} answered {said(answer, status)} for {target}", "refused"
                )
            buffer, pos = self._buffer(), 0
            while pos < length:
                piece = buffer[: min(len(buffer), length - pos)]
                recv_exactly(sock, piece)
                sink(pos, cast(bytes, piece))
                pos += len(piece)
        except (OSError, FrameError, PeerError):
            self.drop(address)
            raise


__all__ = ["IO_SECONDS", "STREAMS", "NotStreamed", "StreamReader", "StreamSender", "connect"]
