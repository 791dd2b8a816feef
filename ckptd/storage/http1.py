"""One HTTP/1.1 keep-alive connection, as little of HTTP as S3's object requests need.

A request is written whole (its head and, up to ``_JOIN_BODY_MAX``, its body in one
write); a reply is read as status, headers and a body framed by Content-Length, chunks,
or the end of the connection, 1xx interim replies skipped. A connection is used by one
thread at a time, and its socket is closed by ``close`` or, at the latest, when the
connection is dropped. Anything it cannot read as HTTP/1.1 (cut short, malformed, a line or
a head too long) raises ``ReplyError`` and leaves the connection not ``reusable``; a
reply that asks to close, or whose end only the closing marks, does the same.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Mapping
from typing import BinaryIO, cast

# A body up to this size is sent in the same write as the request head.
_JOIN_BODY_MAX = 256 * 1024
_LINE_MAX = 64 * 1024
_HEADERS_MAX = 200
# A connection used this recently is not checked for a close by the server first: one
# syscall less per request.
_FRESH_SECONDS = 1.0


class ReplyError(OSError):
    """The server's reply could not be read as HTTP/1.1 (cut short, malformed)."""


class Connection:
    """One HTTP/1.1 connection, used by one thread at a time."""

    def __init__(
        self, address: tuple[str, int], tls: ssl.SSLContext | None, timeouts: tuple[float, float]
    ) -> None:
        connect_timeout, read_timeout = timeouts
        sock = socket.create_connection(address, timeout=connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=address[0])
            sock.settimeout(read_timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.reader = cast(BinaryIO, sock.makefile("rb", buffering=65536))
        self.reusable = True
        self.last_used = time.monotonic()  # when its last reply ended (``stale``)

    def stale(self) -> bool:
        """Whether the server may have closed it while idle: idle for a while (no server
        closes a kept-alive connection within ``_FRESH_SECONDS``), and readable with
        nothing asked (the EOF of its close)."""
        if time.monotonic() - self.last_used < _FRESH_SECONDS:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def close(self) -> None:
        self.reusable = False
        try:
            self.reader.close()
        finally:
            self.sock.close()

    def __del__(self) -> None:
        # A connection dropped unclosed (its thread ended: ``s3_direct`` keeps one per
        # thread) is closed here rather than left to the socket's own finalizer, which
        # would say ResourceWarning. Closing twice is harmless.
        with contextlib.suppress(Exception):
            self.close()

    def send(self, head: bytes, body: bytes | memoryview | None) -> None:
        if body is not None and len(body) <= _JOIN_BODY_MAX:
            self.sock.sendall(head + bytes(body))
        else:
            self.sock.sendall(head)
            if body is not None:
                self.sock.sendall(body)

    def _line(self) -> bytes:
        line = self.reader.readline(_LINE_MAX + 1)
        if not line:
            raise ReplyError("connection closed before the reply")
        if len(line) > _LINE_MAX:
            raise ReplyError("reply line too long")
        return line

    def read_head(self, method: str) -> tuple[int, dict[str, str]]:
        """The status and headers of the final reply (1xx interim replies skipped)."""
        while True:
            status_line = self._line()
            try:
                version, code, *_ = status_line.split(None, 2)
                status = int(code)
            except ValueError:
                raise ReplyError(f"not an HTTP status line: {status_line[:80]!r}") from None
            if not version.startswith(b"HTTP/1."):
                raise ReplyError(f"not HTTP/1.x: {status_line[:80]!r}")
            headers: dict[str, str] = {}
            for _ in range(_HEADERS_MAX):
                line = self._line()
                if line in (b"\r\n", b"\n"):
                    break
                name, sep, value = line.partition(b":")
                if not sep:
                    raise ReplyError(f"malformed header line: {line[:80]!r}")
                headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
            else:
                raise ReplyError("too many reply headers")
            if 100 <= status < 200:
                continue
            if version == b"HTTP/1.0" or "close" in headers.get("connection", "").lower():
                self.reusable = False
            return status, headers

    def body_length(self, method: str, status: int, headers: Mapping[str, str]) -> int | None:
        """Bytes of body that follow (None: chunked, or until the connection closes)."""
        if method == "HEAD" or status in (204, 304):
            return 0
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return None
        length = headers.get("content-length")
        if length is None:
            self.reusable = False
            return None
        try:
            return int(length)
        except ValueError:
            raise ReplyError(f"bad Content-Length {length!r}") from None

    def read_exactly(self, n: int) -> bytes:
        data = self.reader.read(n)
        if len(data) != n:
            self.reusable = False
            raise ReplyError(f"reply body ended after {len(data)} of {n} bytes")
        return data

    def read_body(self, method: str, status: int, headers: Mapping[str, str], limit: int) -> bytes:
        """The whole body (at most ``limit`` bytes kept; the rest read and dropped)."""
        length = self.body_length(method, status, headers)
        if length is not None:
            kept = self.read_exactly(min(length, limit))
            left = length - len(kept)
            while left > 0:
                left -= len(self.read_exactly(min(left, 1 << 20)))
            return kept
        if "chunked" not in headers.get("transfer-encoding", "").lower():
            self.reusable = False
            return self.reader.read(limit)
        out = bytearray()
        while True:
            size_line = self._line().split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise ReplyError(f"bad chunk size {size_line[:20]!r}") from None
            if size == 0:
                while self._line() not in (b"\r\n", b"\n"):
                    pass  # trailers
                return bytes(out[:limit])
            chunk = self.read_exactly(size)
            if len(out) < limit:
                out += chunk
            self._line()  # the CRLF after the chunk


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Certificate and host checks on, against ``ca_file`` (the CA bundle botocore
    would verify with)."""
    return ssl.create_default_context(cafile=ca_file)
