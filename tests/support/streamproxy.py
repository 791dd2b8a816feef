"""A fault-injecting loopback TCP proxy that understands the peer port's stream frames.

``StreamProxy(upstream)`` forwards every connection to ``upstream`` (``host:port``) byte
for byte, in threads. A connection that begins with the stream preamble
(``ckptd.peers.frames``) is read frame by frame on its way up, so faults hit a chunk's
body exactly: ``flip`` flips one bit in the next ``n`` chunk bodies, ``cut`` ends the
connection half-way through the next ``n`` chunk bodies, ``go_silent`` stops forwarding
anything, both ways, on every connection (a holder that vanished without a close).
Other connections (HTTP: hellos, offers, seals) are copied as they are, and go silent
too. ``chunks`` counts the chunk frames forwarded whole.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from types import TracebackType

from ckptd.peers.frames import PREAMBLE


class StreamProxy:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._lock = threading.Lock()
        self._flips = 0
        self._cuts = 0
        self.silent = threading.Event()
        self.closed = threading.Event()
        self.chunks = 0
        self.flipped = 0
        self.cut = 0
        self.streams = 0
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def flip(self, n: int = 1) -> None:
        with self._lock:
            self._flips = n

    def cut_next(self, n: int = 1) -> None:
        with self._lock:
            self._cuts = n

    def go_silent(self) -> None:
        self.silent.set()

    def __enter__(self) -> StreamProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.closed.set()
        self._server.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                down, _ = self._server.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=5)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            with self._lock:
                self._sockets += [down, up]
            threading.Thread(target=self._upward, args=(down, up), daemon=True).start()
            threading.Thread(target=self._copy, args=(up, down), daemon=True).start()

    def _hold_if_silent(self) -> bool:
        """Once silent, nothing more is forwarded: the thread waits for the close."""
        if self.silent.is_set():
            self.closed.wait()
            return True
        return False

    def _copy(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                if self._hold_if_silent():
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _end(src, dst)

    def _upward(self, down: socket.socket, up: socket.socket) -> None:
        try:
            first = _recv_exactly(down, len(PREAMBLE), partial=True)
            if self._hold_if_silent():
                return
            up.sendall(first)
            if first != PREAMBLE:
                self._copy(down, up)
                return
            with self._lock:
                self.streams += 1
            while True:
                prefix = _recv_exactly(down, 4, partial=True)
                if len(prefix) < 4:
                    return
                head = _recv_exactly(down, struct.unpack(">I", prefix)[0])
                doc = json.loads(head)
                body = (
                    bytearray(_recv_exactly(down, doc["length"]))
                    if doc["method"] == "PUT"
                    else bytearray()
                )
                if self._hold_if_silent():
                    return
                if doc["method"] == "PUT" and body:
                    with self._lock:
                        flip, self._flips = self._flips > 0, max(0, self._flips - 1)
                        cut, self._cuts = (
                            (self._cuts > 0, self._cuts - 1) if not flip else (False, self._cuts)
                        )
                    if flip:
                        body[len(body) // 2] ^= 0x10
                        with self._lock:
                            self.flipped += 1
                    if cut:
                        up.sendall(prefix + head + body[: len(body) // 2])
                        with self._lock:
                            self.cut += 1
                        return
                up.sendall(prefix + head + body)
                if doc["method"] == "PUT":
                    with self._lock:
                        self.chunks += 1
        except (OSError, ValueError, KeyError):
            pass
        finally:
            _end(down, up)


def _recv_exactly(sock: socket.socket, n: int, *, partial: bool = False) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = sock.recv(n - len(out))
        if not data:
            if partial:
                return bytes(out)
            raise OSError("ended")
        out += data
    return bytes(out)


def _end(*sockets: socket.socket) -> None:
    """Both ends closed, as a process that ends them does: what the client sends after
    is answered with a reset, not left unread."""
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


__all__ = ["StreamProxy"]
