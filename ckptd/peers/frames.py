"""The peer port's data stream: the bytes of chunks and held files, outside HTTP.

Pure: the wire format only (preamble, frame heads, answers); no sockets, no clock.

A connection to the peer port that begins with ``PREAMBLE`` (not an HTTP method) is a
*stream*; the holder answers the same ``PREAMBLE`` and then reads frames until the
connection ends. Anything else on the port is HTTP (``ckptd.peers.listener``). A holder
that speaks streams says so in its offer's answer (``"stream": STREAM_VERSION``); a
client that hears anything but the preamble back (an older holder, an HTTP-only proxy)
sends that push's chunks as HTTP PUTs instead.

Every frame, either way, is a head and then a body::

    frame = u32 big-endian N | N bytes of a JSON object (the head) | body

A request's head (``Request``), from the client:

    {"method": "PUT", "target": "/v1/peer/transfers/T/files/I/OFFSET",
     "authorization": "ckptd-peer 1:...", "crc32c": HEX, "length": L}   then L bytes
    {"method": "GET", "target": "/v1/peer/holdings/H/files/I",
     "authorization": "ckptd-peer 1:...", "start": A, "length": L}     no body

signed exactly as the HTTP request of the same method and target (``ckptd.peers.auth``)
with the body tag ``crc32c:HEX`` for a chunk (as its HTTP PUT) and ``range:A-L`` for a
read (start and length: the range is under the mac). An answer's head, from the holder:

    {"status": S, ...}   200 a chunk written; 206 a read, then "length" bytes follow;
                         else "reason" and "error" as the HTTP route's JSON refusal

The holder checks a request's signature before it reads a byte of its body; a refusal
before the body (401, 503 ``notice``, a length out of bounds) ends the connection after
its answer, since the body that follows was never read. Every other answer keeps it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

#: The first bytes of a stream, both ways: never the start of an HTTP request, and a
#: complete (bad) request head to an HTTP server, which answers or closes at once.
PREAMBLE = b"CKPTD-STREAM/1\r\n\r\n"
STREAM_VERSION = 1
#: The status each refusal's ``reason`` is answered with, on a stream as over HTTP.
REFUSAL_STATUS = {
    "bad_request": 400,
    "unauthorized": 401,
    "unknown": 404,
    "changed": 409,
    "corrupt": 422,
    "notice": 503,
    "quota": 507,
}
#: Largest head either way (a target, a signature, an error message).
MAX_HEAD_BYTES = 64 * 1024
_LENGTH = struct.Struct(">I")
LENGTH_BYTES = _LENGTH.size


class FrameError(ValueError):
    """Bytes that are not a frame of this protocol."""


def read_tag(start: int, length: int) -> str:
    """The body tag a read's signature covers: its range."""
    return f"range:{start}-{length}"


@dataclass(frozen=True)
class Request:
    """A request's head (module doc)."""

    method: str
    target: str
    authorization: str
    length: int
    crc32c: str = ""  # PUT
    start: int = 0  # GET

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "method": self.method,
            "target": self.target,
            "authorization": self.authorization,
            "length": self.length,
        }
        if self.method == "PUT":
            doc["crc32c"] = self.crc32c
        else:
            doc["start"] = self.start
        return encode_head(doc)

    @classmethod
    def decode(cls, head: bytes) -> Request:
        doc = decode_head(head)
        try:
            method = doc["method"]
            request = cls(
                method=method,
                target=doc["target"],
                authorization=doc["authorization"],
                length=doc["length"],
                crc32c=doc.get("crc32c", "") if method == "PUT" else "",
                start=doc.get("start", 0) if method == "GET" else 0,
            )
        except KeyError as exc:
            raise FrameError(f"a request head without {exc}") from exc
        if method not in ("PUT", "GET"):
            raise FrameError(f"no method {method!r} on a stream")
        texts = (request.target, request.authorization, request.crc32c)
        if not all(isinstance(t, str) for t in texts):
            raise FrameError("a request head's fields are not strings")
        numbers = (request.length, request.start)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise FrameError("a request head's length and start are not counts")
        return request


def encode_head(doc: dict[str, Any]) -> bytes:
    """``doc`` as a frame's head, its length first."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    if len(body) > MAX_HEAD_BYTES:
        raise FrameError(f"a head of {len(body)} bytes")
    return _LENGTH.pack(len(body)) + body


def head_length(prefix: bytes) -> int:
    """The head's length from its ``LENGTH_BYTES`` prefix; FrameError past the bound."""
    (n,) = _LENGTH.unpack(prefix)
    if n > MAX_HEAD_BYTES:
        raise FrameError(f"a head of {n} bytes (at most {MAX_HEAD_BYTES})")
    return int(n)


def decode_head(head: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(head)
    except ValueError as exc:
        raise FrameError(f"a head that is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise FrameError("a head that is not a JSON object")
    return doc


def answer(status: int, **fields: Any) -> bytes:
    """An answer's head: ``{"status": status, **fields}``, its length first."""
    return encode_head({"status": status, **fields})


__all__ = [
    "LENGTH_BYTES",
    "MAX_HEAD_BYTES",
    "PREAMBLE",
    "REFUSAL_STATUS",
    "STREAM_VERSION",
    "FrameError",
    "Request",
    "answer",
    "decode_head",
    "encode_head",
    "head_length",
    "read_tag",
]
