"""The holder's side of a stream (``ckptd.peers.frames``): chunks in, held files out.

One thread per stream connection, blocking, with one reused chunk buffer:

- a chunk (``PUT``): its head's signature is checked (``auth.RequestChecker``, the one
  the HTTP routes use: a nonce replayed on either is refused) before a byte of its body
  is read; then the body is read into the buffer (``recv_into``), and
  ``Receiver.write_chunk`` CRC-32Cs it there and writes it only if it matches: the same
  rules, answers and guarantees as the HTTP PUT (quota, fd-relative ``O_NOFOLLOW``
  paths, notice refusal);
- a read (``GET``): one held file's range, sent from the page cache with
  ``os.sendfile``; the reader checks it against the manifest as it would the store's.

A refusal before the body (unauthorized, a notice, a head that is not a chunk's) is
answered and ends the connection; every other answer keeps it for the next frame.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import socket
from collections.abc import Callable
from typing import Any

from ckptd.peers import auth, frames
from ckptd.peers.frames import REFUSAL_STATUS, FrameError, Request
from ckptd.peers.model import CHUNK_BYTES
from ckptd.peers.receiving import Receiver
from ckptd.peers.replicas import CorruptError, ReplicaError
from ckptd.peers.stream_io import ConnectionEnded, read_head, recv_exactly
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics

#: A stream with no frame for this long is closed (a client's pushes reconnect).
IDLE_SECONDS = 60.0
#: How long a refused body is read (and dropped) before its connection is closed.
DISCARD_SECONDS = 1.0
_CHUNK = re.compile(r"^/v1/peer/transfers/([0-9a-f]{1,64})/files/(\d{1,9})/(\d{1,18})$")
_FILE = re.compile(r"^/v1/peer/holdings/([A-Za-z0-9_.-]{1,128})/files/(\d{1,9})$")
Opener = Callable[[str, int], tuple[int, int]]


class _Refused(Exception):
    def __init__(self, reason: str, error: str, *, close: bool = False) -> None:
        super().__init__(error)
        self.reason = reason
        self.close = close


class StreamHolder:
    """Serves stream connections (module doc); ``serve`` runs in a thread of its own."""

    def __init__(
        self,
        receiver: Receiver,
        open_held: Opener,
        open_own: Opener,
        checker: auth.RequestChecker,
        metrics: Metrics,
        clock: Clock,
        log: Any,
        notice: Callable[[], bool],
    ) -> None:
        self.receiver = receiver
        self.open_held = open_held
        self.open_own = open_own
        self.checker = checker
        self.metrics = metrics
        self.clock = clock
        self.log = log
        self.notice = notice

    def serve(self, sock: socket.socket, remote: str) -> None:
        """Answer the preamble, then frames until the connection ends."""
        buffer = _LazyBuffer()
        try:
            sock.settimeout(IDLE_SECONDS)
            recv_exactly(sock, memoryview(bytearray(len(frames.PREAMBLE))))
            sock.sendall(frames.PREAMBLE)
            while (head := read_head(sock)) is not None:
                if not self._frame(sock, Request.decode(head), buffer, remote):
                    return
        except (OSError, FrameError) as exc:
            if not isinstance(exc, ConnectionEnded | TimeoutError):
                self.log.info("peer_stream_ended", remote=remote, error=repr(exc))
        finally:
            sock.close()

    def _frame(
        self, sock: socket.socket, request: Request, buffer: _LazyBuffer, remote: str
    ) -> bool:
        """One request answered; whether the connection goes on."""
        tag = (
            auth.body_crc32c(request.crc32c)
            if request.method == "PUT"
            else frames.read_tag(request.start, request.length)
        )
        why, _ = self.checker.check(
            request.authorization, request.method, request.target, self.clock.time(), tag
        )
        try:
            if why is not None:
                self.log.warning(
                    "peer_request_refused", remote=remote, path=request.target, why=why
                )
                raise _Refused("unauthorized", f"unauthorized: {why}", close=True)
            if request.method == "PUT":
                self._chunk(sock, request, buffer.view(), remote)
            else:
                self._read(sock, request)
        except _Refused as refused:
            self.metrics.peer_refused.labels(reason=refused.reason).inc()
            status = REFUSAL_STATUS[refused.reason]
            sock.sendall(frames.answer(status, reason=refused.reason, error=str(refused)))
            if refused.close:
                _discard(sock, request.length if request.method == "PUT" else 0)
            return not refused.close
        return True

    def _chunk(
        self, sock: socket.socket, request: Request, buffer: memoryview, remote: str
    ) -> None:
        m = _CHUNK.match(request.target)
        if m is None or request.length > CHUNK_BYTES:
            raise _Refused("bad_request", f"not a chunk: {request.target}", close=True)
        if self.notice():
            self.log.info("peer_part_refused", remote=remote, path=request.target, why="notice")
            raise _Refused(
                "notice", "this node has a notice: it holds no part of another node", close=True
            )
        body = buffer[: request.length]
        recv_exactly(sock, body)
        try:
            self.receiver.write_chunk(
                m.group(1),
                int(m.group(2)),
                int(m.group(3)),
                body,
                request.crc32c,
                self.clock.time(),
                aligned=True,
            )
        except CorruptError as exc:
            self.log.warning("peer_chunk_refused", remote=remote, error=str(exc))
            raise _Refused("corrupt", str(exc)) from exc
        except ReplicaError as exc:
            raise _Refused(exc.reason, str(exc)) from exc
        except OSError as exc:  # ENOSPC, EACCES under peers.dir
            raise _Refused("quota", f"cannot write the chunk here: {exc}") from exc
        self.metrics.peer_received_bytes.inc(request.length)
        sock.sendall(frames.answer(200))

    def _read(self, sock: socket.socket, request: Request) -> None:
        m = _FILE.match(request.target)
        if m is None:
            raise _Refused("bad_request", f"not a held file: {request.target}")
        hid, index = m.group(1), int(m.group(2))
        opener = self.open_own if hid.startswith("own-") else self.open_held
        try:
            fd, size = opener(hid, index)
        except CorruptError as exc:
            self.log.warning("peer_file_not_served", holding=hid, error=str(exc))
            raise _Refused("changed", str(exc)) from exc
        except ReplicaError as exc:
            raise _Refused(exc.reason, str(exc)) from exc
        try:
            if request.start + request.length > size:
                raise _Refused(
                    "bad_request",
                    f"{request.length} bytes at {request.start} are not within {size} bytes",
                )
            sock.sendall(frames.answer(206, length=request.length))
            if request.length:
                # socket.sendfile: os.sendfile from the page cache, waiting out the
                # socket's timeout between pieces.
                with open(fd, "rb", buffering=0, closefd=False) as file:
                    sent = sock.sendfile(file, request.start, request.length)
                if sent != request.length:  # shortened under us: the reader refuses it
                    raise ConnectionEnded(f"{hid}/{index}: {sent} of {request.length} sent")
            self.metrics.peer_served_bytes.inc(request.length)
        finally:
            os.close(fd)


class _LazyBuffer:
    """A stream's chunk buffer, made at its first signed chunk: a connection that never
    sends one (a stranger's) costs no 8 MiB."""

    def __init__(self) -> None:
        self._view: memoryview | None = None

    def view(self) -> memoryview:
        if self._view is None:
            # Anonymous memory: page-aligned, so a whole chunk may go out with O_DIRECT.
            self._view = memoryview(mmap.mmap(-1, CHUNK_BYTES))
        return self._view


def _discard(sock: socket.socket, length: int) -> None:
    """Before closing after a refusal: say so (FIN), and read what the client had sent
    of the refused body, unread and unwritten, for a moment: a socket closed with bytes
    unread resets the connection, and the reset can overtake the answer."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(DISCARD_SECONDS)
        scratch = bytearray(64 * 1024)
        left = min(length, CHUNK_BYTES)
        while left > 0 and (n := sock.recv_into(scratch, min(left, len(scratch)))):
            left -= n


__all__ = ["IDLE_SECONDS", "StreamHolder"]
