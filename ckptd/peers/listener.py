"""One peer port, two protocols: HTTP for control, streams (``ckptd.peers.frames``) for bytes.

The listener accepts each connection itself and looks at its first bytes without
consuming them (``MSG_PEEK``): the stream preamble hands the socket, blocking, to a
thread of its own (``on_stream``); anything else is given to aiohttp's server as if it
had accepted it (``loop.connect_accepted_socket``). So a deployment opens one port, and
an HTTP client, load balancer or proxy in front of it sees plain HTTP.

A connection that sends nothing for ``SNIFF_SECONDS`` is closed, and so is a stream
beyond ``MAX_STREAMS`` at once (its client retries, as after any dropped connection;
a client that hears no preamble at a push's start uses HTTP). ``close`` ends the
accept loop, and shuts every stream connection down (its thread's blocking call returns
at once) before it joins their threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

from ckptd.peers.frames import PREAMBLE

SNIFF_SECONDS = 10.0
#: Stream connections served at once (a thread each, and a chunk buffer once signed);
#: one more is closed at once. A push opens 2 per holder, a restore 1 per thread.
MAX_STREAMS = 128
_POLL_SECONDS = 0.01
StreamHandler = Callable[[socket.socket, str], None]


class PeerListener:
    """The peer port's socket (module doc)."""

    def __init__(self, http_factory: Callable[[], Any], on_stream: StreamHandler) -> None:
        self.http_factory = http_factory
        self.on_stream = on_stream
        self.port = 0
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._sniffing: set[asyncio.Task[None]] = set()
        self._streams: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()

    async def start(self, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=128)
        sock.setblocking(False)
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock))
        return self.port

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        for task in list(self._sniffing):
            task.cancel()
        await asyncio.gather(*self._sniffing, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with self._lock:
            streams = list(self._streams.items())
        for conn, _ in streams:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in streams:
            await asyncio.to_thread(thread.join, 5.0)

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError:
                await asyncio.sleep(0.1)  # EMFILE and the like: try again, never busy-loop
                continue
            task = loop.create_task(self._route(conn, f"{addr[0]}:{addr[1]}"))
            self._sniffing.add(task)
            task.add_done_callback(self._sniffing.discard)

    async def _route(self, conn: socket.socket, remote: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            first = await _peek(conn, len(PREAMBLE), SNIFF_SECONDS)
        except (OSError, TimeoutError):
            conn.close()
            return
        if not first:
            conn.close()
            return
        if first == PREAMBLE:
            with self._lock:
                full = len(self._streams) >= MAX_STREAMS
            if full:
                conn.close()
                return
            conn.setblocking(True)
            thread = threading.Thread(
                target=self._stream, args=(conn, remote), name="ckptd-peer-stream", daemon=True
            )
            with self._lock:
                self._streams[conn] = thread
            thread.start()
            return
        try:
            await loop.connect_accepted_socket(self.http_factory, conn)
        except OSError:
            conn.close()

    def _stream(self, conn: socket.socket, remote: str) -> None:
        try:
            self.on_stream(conn, remote)
        finally:
            with self._lock:
                self._streams.pop(conn, None)


async def _peek(conn: socket.socket, n: int, timeout: float) -> bytes:
    """Up to ``n`` first bytes of ``conn``, left unread: as soon as they cannot be the
    stream preamble any more, or all ``n`` are there; b"" when it closed first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            data = conn.recv(n, socket.MSG_PEEK)
        except BlockingIOError:
            data = None
        if data is not None and (len(data) >= n or not data or not PREAMBLE.startswith(data)):
            return data
        if loop.time() > deadline:
            raise TimeoutError("nothing sent")
        if data:  # a prefix of the preamble: the rest is on its way
            await asyncio.sleep(_POLL_SECONDS)
            continue
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(conn.fileno(), _settle, ready)
        try:
            await asyncio.wait_for(ready, max(0.0, deadline - loop.time()))
        finally:
            loop.remove_reader(conn.fileno())


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


__all__ = ["MAX_STREAMS", "SNIFF_SECONDS", "PeerListener"]
