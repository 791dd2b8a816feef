"""Blocking reads and writes of ``ckptd.peers.frames`` on a socket, for threads.

Every call here blocks its thread (never the event loop) and ends with ``OSError`` when
the connection does (a timeout, a reset, the loop closing the socket to abandon it), or
with ``FrameError`` when the peer sent bytes that are not a frame.
"""

from __future__ import annotations

import socket
from typing import Any

from ckptd.peers.frames import LENGTH_BYTES, PREAMBLE, FrameError, decode_head, head_length


class ConnectionEnded(OSError):
    """The peer closed the connection (where a frame boundary would have been, or not)."""


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionEnded if the peer closes first."""
    got, want = 0, len(view)
    while got < want:
        n = sock.recv_into(view[got:], want - got)
        if n == 0:
            raise ConnectionEnded(f"the connection ended {want - got} bytes short")
        got += n


def read_head(sock: socket.socket) -> bytes | None:
    """One frame's head; None when the connection ended cleanly before it."""
    prefix = bytearray(LENGTH_BYTES)
    n = sock.recv_into(prefix, LENGTH_BYTES)
    if n == 0:
        return None
    if n < LENGTH_BYTES:
        recv_exactly(sock, memoryview(prefix)[n:])
    head = bytearray(head_length(bytes(prefix)))
    recv_exactly(sock, memoryview(head))
    return bytes(head)


def read_answer(sock: socket.socket) -> dict[str, Any]:
    """The holder's answer head (a client's side)."""
    head = read_head(sock)
    if head is None:
        raise ConnectionEnded("the holder closed the stream without an answer")
    doc = decode_head(head)
    if not isinstance(doc.get("status"), int):
        raise FrameError("an answer without a status")
    return doc


def greet(sock: socket.socket) -> bool:
    """Send the preamble and read the holder's; False when it answered anything else
    (it does not speak streams: an older holder, or an HTTP proxy between)."""
    sock.sendall(PREAMBLE)
    heard = bytearray(len(PREAMBLE))
    got = 0
    while got < len(heard):
        n = sock.recv_into(memoryview(heard)[got:])
        if n == 0:
            return False
        got += n
        if heard[:got] != PREAMBLE[:got]:
            return False
    return True


__all__ = ["ConnectionEnded", "greet", "read_answer", "read_head", "recv_exactly"]
