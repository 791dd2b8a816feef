"""A fault-injecting loopback HTTP/1.1 proxy that sits in front of a real S3 server.

``FaultProxy`` forwards every request byte for byte (request line, headers in their
original order and case, ``Host`` included, so SigV4 signatures made for the proxy's
address still verify upstream) and streams bodies both ways in bounded chunks. A fault
plan, changeable at run time from any thread, answers a share of the requests itself
instead: an S3 error document, an abrupt reset, or a stall. Except for
``"reset-after-upstream"`` and ``"reset-mid-response"``, a faulted request never reaches upstream, so an injected 503
can never leave a half-written object behind.

``ignore_create_only`` makes it a store that does not honour conditional creates: it
drops ``If-None-Match`` from each request and signs the request again (SigV4, with the
credentials it is given, ``tests.support.sigv4``), so a create-only PUT reaches upstream
as a plain PUT that replaces, and the client hears a success as from such a store.

It runs its own event loop in a daemon thread, so synchronous tests and tests that
point a separate process at ``proxy.url`` use it the same way::

    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.set_faults(rate=0.3, kinds=("503-slowdown",), methods={"PUT"})
        ...  # point the client at proxy.url
        proxy.wait_for(lambda p: p.bytes_up >= 10 << 20, timeout=30)

It uses raw asyncio streams rather than an HTTP framework because a framework
re-frames messages (it rewrites headers, answers ``Expect: 100-continue`` on its own
and re-chunks bodies) and cannot cut a connection half-way through a request body.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

from tests.support.sigv4 import resign_without

Match = Callable[[str, str], bool]
"""``match(method, path) -> bool``: whether a fault rule applies to a request."""
HoldMatch = Callable[[str, str, str], bool]
"""``match(method, path, query) -> bool``: whether ``hold`` delays a request."""

# S3 error documents the proxy can answer with: kind -> (status, reason, Code, Message).
ERROR_KINDS: dict[str, tuple[int, str, str, str]] = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    "503-slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "503-unavailable": (
        503,
        "Service Unavailable",
        "ServiceUnavailable",
        "Service is unable to handle request.",
    ),
    "400-requesttimeout": (
        400,
        "Bad Request",
        "RequestTimeout",
        "Your socket connection to the server was not read from or written to"
        " within the timeout period.",
    ),
    "403-accessdenied": (403, "Forbidden", "AccessDenied", "Access Denied"),
    "404-nosuchbucket": (404, "Not Found", "NoSuchBucket", "The specified bucket does not exist"),
}
# Faults that are not an S3 answer: "reset" cuts the connection after part of the body,
# "timeout" holds it unanswered for stall_seconds, "reset-after-upstream" lets the request
# succeed upstream and then cuts the connection before the client sees the response,
# "reset-mid-response" passes the response head and half its body, then cuts it.
CONNECTION_KINDS = ("reset", "timeout", "reset-after-upstream", "reset-mid-response")
# Faults in the bytes themselves: "flip-bit" forwards the request with one bit of its body
# inverted (a link or NIC that damages data, which TCP's checksum missed).
BODY_KINDS = ("flip-bit",)
_UPSTREAM_FAULTS = ("reset-after-upstream", "reset-mid-response", *BODY_KINDS)
FAULT_KINDS = (*ERROR_KINDS, *CONNECTION_KINDS, *BODY_KINDS)

_CHUNK = 1 << 20  # bytes per read while streaming a body; bounds memory per connection
_HEAD_LIMIT = 1 << 20  # longest request or response head accepted
# How long to wait for upstream's "100 Continue" before sending the body anyway; the
# same grace botocore and curl give a server (RFC 9110 lets a client stop waiting).
_EXPECT_WAIT = 1.0
_LINGER = 1.0  # seconds to drain a client after a final error, so close sends FIN not RST


@dataclass(frozen=True)
class RequestRecord:
    """One request the proxy saw: ``status`` is 0 when the client got no response."""

    method: str
    path: str
    query: str
    status: int
    fault: str | None
    bytes_up: int
    # The request's headers as sent (names lower-cased, in order), to check on the wire
    # what a client asked of the store (server-side encryption, say).
    headers: tuple[tuple[str, str], ...] = ()

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        name = name.lower()
        return next((v for k, v in self.headers if k == name), None)


@dataclass(frozen=True)
class _Rule:
    kind: str
    methods: frozenset[str] | None
    match: Match | None

    def applies(self, method: str, path: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        return self.match is None or self.match(method, path)


@dataclass(frozen=True)
class _Head:
    """A parsed HTTP message head; ``raw`` is what is forwarded, unchanged."""

    raw: bytes
    start: tuple[str, str, str]
    headers: tuple[tuple[str, str], ...]  # names lower-cased

    def get(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def tokens(self, name: str) -> set[str]:
        """Lower-cased comma-separated tokens of every ``name`` header."""
        return {
            token.strip().lower()
            for key, value in self.headers
            if key == name
            for token in value.split(",")
            if token.strip()
        }


class _ProtocolError(Exception):
    """A message the proxy cannot frame; the connection is dropped."""


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    """Read one message head, or None on a clean EOF before its first byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    lines = raw[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2:
        raise _ProtocolError(f"bad start line {lines[0]!r}")
    start = (parts[0], parts[1], parts[2] if len(parts) > 2 else "")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise _ProtocolError(f"bad header line {line!r}")
        headers.append((name.strip().lower(), value.strip()))
    return _Head(raw, start, tuple(headers))


def _body_framing(head: _Head) -> tuple[str, int]:
    """("chunked", 0), ("length", n) or ("none", 0) from a head's framing headers."""
    if "chunked" in head.tokens("transfer-encoding"):
        return "chunked", 0
    length = head.get("content-length")
    if length is not None:
        try:
            return "length", int(length)
        except ValueError as exc:
            raise _ProtocolError(f"bad Content-Length {length!r}") from exc
    return "none", 0


def _response_framing(method: str, status: int, head: _Head) -> tuple[str, int]:
    # RFC 9112 6.3: these responses never have a body whatever their headers say, and
    # a response with no framing headers runs until the server closes.
    if method == "HEAD" or 100 <= status < 200 or status in (204, 304):
        return "none", 0
    framing = _body_framing(head)
    return ("eof", 0) if framing[0] == "none" else framing


def _closes(head: _Head) -> bool:
    """Whether the sender of ``head`` will close the connection after this message."""
    # A request's version is its third field, a response's its first.
    version = head.start[0] if head.start[0].startswith("HTTP/") else head.start[2]
    connection = head.tokens("connection")
    if "close" in connection:
        return True
    return version == "HTTP/1.0" and "keep-alive" not in connection


async def _relay_body(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter | None,
    framing: tuple[str, int],
    on_bytes: Callable[[int], None],
    limit: int | None = None,
    tamper: Callable[[bytes], bytes] | None = None,
    pace: Callable[[int], Awaitable[None]] | None = None,
) -> bool:
    """Copy one body from ``src`` to ``dst`` (None discards it), reporting payload bytes.

    Chunked bodies are relayed in their wire form; only payload bytes are reported.
    With ``limit`` it stops after about that many payload bytes and returns False;
    it returns True once the whole body has been copied. ``tamper`` rewrites the first
    piece of a body of known length (the same length back).
    """
    kind, length = framing
    seen = 0

    async def copy(n: int) -> None:
        nonlocal seen, tamper
        while n > 0:
            data = await src.read(min(n, _CHUNK))
            if not data:
                raise asyncio.IncompleteReadError(b"", n)
            if tamper is not None:
                data, tamper = tamper(data), None
            n -= len(data)
            seen += len(data)
            if pace is not None:
                await pace(len(data))
            if dst is not None:
                dst.write(data)
                await dst.drain()
            on_bytes(len(data))

    if kind == "length":
        if limit is not None and limit < length:
            await copy(limit)
            return False
        await copy(length)
    elif kind == "chunked":
        while True:
            line = await src.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise _ProtocolError(f"bad chunk size line {line!r}") from exc
            if dst is not None:
                dst.write(line)
            if size == 0:
                break
            if limit is not None and seen + size > limit:
                await copy(max(0, limit - seen))
                return False
            await copy(size)
            crlf = await src.readexactly(2)
            if dst is not None:
                dst.write(crlf)
        while True:  # trailer section, ended by an empty line
            line = await src.readuntil(b"\r\n")
            if dst is not None:
                dst.write(line)
            if line == b"\r\n":
                break
        if dst is not None:
            await dst.drain()
    elif kind == "eof":
        while data := await src.read(_CHUNK):
            if limit is not None and seen >= limit:
                return False
            seen += len(data)
            if dst is not None:
                dst.write(data)
                await dst.drain()
            on_bytes(len(data))
    return True


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close abruptly: SO_LINGER 0 makes the kernel send RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _close_gracefully(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # Closing a socket with unread input makes the kernel send RST, which can destroy a
    # response the client has not read yet; so half-close and drain for a moment first.
    with contextlib.suppress(ConnectionError, OSError, TimeoutError):
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(_LINGER):
            while await reader.read(_CHUNK):
                pass
    writer.close()


class _Upstream:
    """One client connection's connection to upstream, reopened when upstream closes it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = self.reader, self.writer
        # An idle keep-alive connection upstream closed is seen as EOF already buffered.
        if reader is None or writer is None or reader.at_eof() or writer.is_closing():
            self.close()
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=_HEAD_LIMIT)
            self.reader, self.writer = reader, writer
        return reader, writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class FaultProxy:
    """A loopback HTTP/1.1 proxy to ``upstream`` that fails requests on a plan.

    Faults are chosen per request, first match wins: a ``deny`` rule, then queued
    ``fail_next`` faults, then the random plan of ``set_faults``.
    """

    def __init__(self, upstream: str, stall_seconds: float = 30.0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"upstream must be an http:// URL, not {upstream!r}")
        self.upstream = upstream
        self.stall_seconds = stall_seconds
        self._upstream_addr = (parts.hostname, parts.port or 80)
        self._lock = threading.Lock()
        # Fault plan.
        self._rate = 0.0
        self._kinds: tuple[str, ...] = ()
        self._random_rule: _Rule | None = None
        self._rng = random.Random(0)
        self._queued: list[_Rule] = []
        self._deny: _Rule | None = None
        self._hold: tuple[float, HoldMatch] | None = None
        self._gate: HoldMatch | None = None
        self._held = 0
        # ignore_create_only: the credentials requests are signed again with.
        self._no_create_only: tuple[str, str] | None = None
        self._create_only_dropped = 0
        # Counters.
        self._arrivals: list[tuple[str, str]] = []
        self._bytes_up: Counter[str] = Counter()
        self._bytes_down = 0
        self._down_rate = 0.0  # bytes/s of every response body together; 0: unlimited
        self._down_free_at = 0.0
        self._records: list[RequestRecord] = []
        self._faults = 0
        # Event loop thread.
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._port = 0
        self._startup_error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The proxy's base URL, ``http://127.0.0.1:PORT``."""
        if not self._port:
            raise RuntimeError("FaultProxy is not started")
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> FaultProxy:
        """Bind a free loopback port and serve from a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("FaultProxy already started")
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="faultproxy", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError("FaultProxy failed to start") from self._startup_error
        return self

    def stop(self) -> None:
        """Drop every connection (stalled ones included) and stop the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        self._thread = self._loop = None
        self._port = 0

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._serve_client, "127.0.0.1", 0, limit=_HEAD_LIMIT)
            )
            self._port = int(self._server.sockets[0].getsockname()[1])
        except BaseException as exc:  # noqa: BLE001 - handed to start() to re-raise
            self._startup_error = exc
            loop.close()
            ready.set()
            return
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    # -- fault plan (any thread) -----------------------------------------------------

    def set_faults(
        self,
        rate: float = 0.0,
        kinds: Sequence[str] = ("500", "503-slowdown", "reset"),
        methods: set[str] | None = None,
        seed: int = 0,
        match: Match | None = None,
    ) -> None:
        """Fail each matching request with probability ``rate``, with a kind drawn from
        ``kinds``; the draws are reproducible for a given ``seed`` and request order."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], not {rate}")
        for kind in kinds:
            _check_kind(kind)
        if rate > 0 and not kinds:
            raise ValueError("kinds must not be empty when rate > 0")
        with self._lock:
            self._rate = rate
            self._kinds = tuple(kinds)
            self._random_rule = _Rule("", _methods(methods), match)
            self._rng = random.Random(seed)

    def fail_next(
        self,
        n: int = 1,
        kind: str = "500",
        methods: set[str] | None = None,
        match: Match | None = None,
    ) -> None:
        """Fail the next ``n`` matching requests with ``kind``, after any already queued."""
        _check_kind(kind)
        rule = _Rule(kind, _methods(methods), match)
        with self._lock:
            self._queued.extend([rule] * n)

    def deny(
        self,
        kind: str = "403-accessdenied",
        methods: set[str] | None = None,
        match: Match | None = None,
    ) -> None:
        """Fail every matching request with ``kind`` until ``clear_faults``."""
        _check_kind(kind)
        with self._lock:
            self._deny = _Rule(kind, _methods(methods), match)

    def hold(self, seconds: float, match: HoldMatch | None = None) -> None:
        """Delay each request ``match`` accepts (all when None) by ``seconds`` before it is
        forwarded unchanged; ``hold(0)`` stops. Not a fault: it widens a window (a commit,
        a deletion) so that a kill at a random instant can land inside it."""
        with self._lock:
            self._hold = (seconds, match or (lambda m, p, q: True)) if seconds > 0 else None

    def ignore_create_only(self, access_key: str, secret_key: str) -> None:
        """Until ``clear_faults``: drop ``If-None-Match`` from every request and sign it
        again as ``access_key`` (module doc), as a store that ignores create-only writes."""
        with self._lock:
            self._no_create_only = (access_key, secret_key)

    @property
    def create_only_dropped(self) -> int:
        """How many requests ``ignore_create_only`` took ``If-None-Match`` from."""
        with self._lock:
            return self._create_only_dropped

    def _without_create_only(self, head: _Head) -> _Head:
        with self._lock:
            credentials = self._no_create_only
            if credentials is None or head.get("if-none-match") is None:
                return head
            self._create_only_dropped += 1
        method, target, version = head.start
        headers = resign_without(
            method,
            target,
            head.headers,
            "if-none-match",
            access_key=credentials[0],
            secret_key=credentials[1],
        )
        raw = f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
        return _Head((raw + "\r\n").encode("latin-1"), head.start, tuple(headers))

    @property
    def arrivals(self) -> list[tuple[str, str]]:
        """(method, target) of every request, in the order their heads arrived: unlike
        ``requests``, it holds a request still held, in flight or never answered."""
        with self._lock:
            return list(self._arrivals)

    def close_gate(self, match: HoldMatch) -> None:
        """Hold each request ``match`` accepts until ``open_gate`` (a start line for clients
        that must begin together, whatever the machine's load)."""
        with self._lock:
            self._gate = match

    def open_gate(self) -> None:
        with self._lock:
            self._gate = None

    def _gated(self, method: str, target: str) -> bool:
        path, _, query = target.partition("?")
        with self._lock:
            return self._gate is not None and self._gate(method, path, query)

    @property
    def held(self) -> int:
        """How many requests ``hold`` has delayed so far."""
        with self._lock:
            return self._held

    def _hold_for(self, method: str, target: str) -> float:
        path, _, query = target.partition("?")
        with self._lock:
            if self._hold is None or not self._hold[1](method, path, query):
                return 0.0
            self._held += 1
            return self._hold[0]

    def clear_faults(self) -> None:
        """Forward everything again: drop the random plan, queued faults, ``deny`` and
        ``ignore_create_only``."""
        with self._lock:
            self._no_create_only = None
            self._rate = 0.0
            self._random_rule = None
            self._queued.clear()
            self._deny = None

    def _choose_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            if self._deny is not None and self._deny.applies(method, path):
                return self._deny.kind
            for i, rule in enumerate(self._queued):
                if rule.applies(method, path):
                    del self._queued[i]
                    return rule.kind
            plan = self._random_rule
            # Draw only for matching requests, so unrelated traffic (a HEAD from
            # another component, say) does not shift which requests fail.
            if self._rate == 0 or plan is None or not plan.applies(method, path):
                return None
            if self._rng.random() < self._rate:
                return self._rng.choice(self._kinds)
            return None

    # -- counters (any thread) -------------------------------------------------------

    @property
    def bytes_up(self) -> int:
        """Request body bytes forwarded to upstream, all methods."""
        with self._lock:
            return sum(self._bytes_up.values())

    def bytes_up_by(self, method: str) -> int:
        """Request body bytes forwarded to upstream for ``method`` requests."""
        with self._lock:
            return self._bytes_up[method]

    @property
    def bytes_down(self) -> int:
        """Response body bytes relayed from upstream to clients."""
        with self._lock:
            return self._bytes_down

    @property
    def requests(self) -> list[RequestRecord]:
        """A copy of the request records, each added before its client sees any response."""
        with self._lock:
            return list(self._records)

    def count(self, method: str | None = None, *, faulted: bool | None = None) -> int:
        """How many recorded requests match ``method`` and, if given, ``faulted``."""
        with self._lock:
            return sum(
                1
                for r in self._records
                if (method is None or r.method == method)
                and (faulted is None or (r.fault is not None) == faulted)
            )

    @property
    def faults_injected(self) -> int:
        """How many requests the proxy has faulted."""
        with self._lock:
            return self._faults

    def reset_counters(self) -> None:
        """Zero the byte counters, request records and fault count."""
        with self._lock:
            self._bytes_up.clear()
            self._bytes_down = 0
            self._records.clear()
            self._arrivals.clear()
            self._faults = 0

    def wait_for(
        self, predicate: Callable[[FaultProxy], bool], timeout: float, interval: float = 0.01
    ) -> None:
        """Poll ``predicate(self)`` until true; raise TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"condition not met within {timeout}s")
            time.sleep(interval)

    def _count_up(self, method: str) -> Callable[[int], None]:
        def add(n: int) -> None:
            with self._lock:
                self._bytes_up[method] += n

        return add

    def set_down_rate(self, bytes_per_second: float) -> None:
        """Pace every response body together at this rate (0: unlimited): the store's
        link, shared by every client, as a slow uplink from a store would be."""
        with self._lock:
            self._down_rate = bytes_per_second

    async def _pace(self, n: int) -> None:
        rate = self._down_rate
        if rate <= 0:
            return
        now = time.monotonic()
        start = max(now, self._down_free_at)
        self._down_free_at = start + n / rate
        await asyncio.sleep(self._down_free_at - now)

    def _count_down(self, n: int) -> None:
        with self._lock:
            self._bytes_down += n

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)
            if record.fault is not None:
                self._faults += 1

    # -- serving (event loop thread) -------------------------------------------------

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream = _Upstream(*self._upstream_addr)
        try:
            keep_alive = True
            while keep_alive:
                head = await _read_head(reader)
                if head is None:
                    break
                with self._lock:
                    self._arrivals.append((head.start[0], head.start[1]))
                fault = self._choose_fault(head.start[0], head.start[1].partition("?")[0])
                if fault is None and (delay := self._hold_for(head.start[0], head.start[1])):
                    await asyncio.sleep(delay)
                while self._gated(head.start[0], head.start[1]):
                    await asyncio.sleep(0.02)
                if fault is None or fault in _UPSTREAM_FAULTS:
                    head = self._without_create_only(head)
                    keep_alive = await self._forward(head, reader, writer, upstream, fault)
                else:
                    keep_alive = await self._inject(fault, head, reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, _ProtocolError):
            _reset(writer)  # the client sees the failure as a dropped connection
        except asyncio.CancelledError:
            # stop() cancels connections; end quietly, because Python 3.11's stream
            # server logs a traceback for a client task that ends cancelled.
            _reset(writer)
        finally:
            upstream.close()
            writer.close()
            self._tasks.discard(task)

    async def _forward(
        self,
        head: _Head,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: _Upstream,
        fault: str | None,
    ) -> bool:
        """Relay one request and its response; True if the client connection stays open."""
        method, target = head.start[0], head.start[1]
        path, _, query = target.partition("?")
        count_up = self._count_up(method)
        sent = 0

        def on_up(n: int) -> None:
            nonlocal sent
            sent += n
            count_up(n)

        try:
            up_reader, up_writer = await upstream.open()
        except OSError:
            self._record(RequestRecord(method, path, query, 0, fault, 0, head.headers))
            raise
        up_writer.write(head.raw)
        await up_writer.drain()
        framing = _body_framing(head)
        has_body = framing != ("length", 0) and framing[0] != "none"
        response: _Head | None = None
        body_skipped = False
        if has_body and "100-continue" in head.tokens("expect"):
            # Pass the client's Expect through and let upstream decide: it may refuse
            # (a bad signature, say) before a large body is sent.
            with contextlib.suppress(TimeoutError):
                response = await asyncio.wait_for(_read_head(up_reader), _EXPECT_WAIT)
            if response is not None and response.start[1] == "100":
                writer.write(response.raw)
                await writer.drain()
                response = None
            elif response is not None:
                body_skipped = True  # a final answer before the body: the client may not send it
        if not body_skipped:
            await _relay_body(
                reader, up_writer, framing, on_up, tamper=_flip_bit if fault == "flip-bit" else None
            )
        while response is None or response.start[1].startswith("1"):
            if response is not None:
                writer.write(response.raw)  # interim responses (a late 100) go through
            response = await _read_head(up_reader)
            if response is None:
                raise asyncio.IncompleteReadError(b"", None)
        status = int(response.start[1])
        resp_framing = _response_framing(method, status, response)
        if fault == "reset-after-upstream":
            # The request took effect upstream; the client never learns of it.
            await _relay_body(up_reader, None, resp_framing, lambda n: None)
            self._record(RequestRecord(method, path, query, 0, fault, sent, head.headers))
            _reset(writer)
            if resp_framing[0] == "eof" or _closes(response):
                upstream.close()
            return False
        if fault == "reset-mid-response" and resp_framing[0] == "length" and resp_framing[1] > 1:
            # A server or network that dies half-way through a download.
            self._record(RequestRecord(method, path, query, 0, fault, sent, head.headers))
            writer.write(response.raw)
            await _relay_body(
                up_reader, writer, resp_framing, self._count_down, limit=resp_framing[1] // 2
            )
            await writer.drain()
            _reset(writer)
            upstream.close()  # the rest of the body is still in flight from upstream
            return False
        # Record before the client can see the response, so a client that has its answer
        # always finds the record (tests read counters right after a call returns).
        body_fault = fault if fault in BODY_KINDS else None
        self._record(RequestRecord(method, path, query, status, body_fault, sent, head.headers))
        writer.write(response.raw)
        await _relay_body(up_reader, writer, resp_framing, self._count_down, pace=self._pace)
        await writer.drain()
        upstream_closes = resp_framing[0] == "eof" or _closes(response)
        if upstream_closes:
            upstream.close()
        if body_skipped:
            await _close_gracefully(reader, writer)
            return False
        return not (upstream_closes or _closes(head))

    async def _inject(
        self,
        fault: str,
        head: _Head,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer one request with ``fault`` without contacting upstream."""
        method, target = head.start[0], head.start[1]
        path, _, query = target.partition("?")
        framing = _body_framing(head)
        expects = "100-continue" in head.tokens("expect") and framing not in (
            ("length", 0),
            ("none", 0),
        )
        if fault == "timeout":
            self._record(RequestRecord(method, path, query, 0, fault, 0, head.headers))
            await asyncio.sleep(self.stall_seconds)
            _reset(writer)
            return False
        if fault == "reset":
            if expects:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
            # Take part of the body first, as a server that dies mid-upload would.
            part = min(framing[1] // 2, _CHUNK) if framing[0] == "length" else _CHUNK
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await _relay_body(reader, None, framing, lambda n: None, limit=part)
            self._record(RequestRecord(method, path, query, 0, fault, 0, head.headers))
            _reset(writer)
            return False
        status, reason, code, message = ERROR_KINDS[fault]
        # With Expect the client waits for our answer instead of sending the body, so
        # answer now and close; otherwise read the body so the connection stays usable.
        close = expects or _closes(head)
        if not expects:
            await _relay_body(reader, None, framing, lambda n: None)
        request_id = f"faultproxy-{id(head):x}"
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
            f"<Resource>{escape(path)}</Resource><RequestId>{request_id}</RequestId></Error>"
        ).encode()
        lines = [
            f"HTTP/1.1 {status} {reason}",
            "Content-Type: application/xml",
            f"Content-Length: {len(body)}",
            f"x-amz-request-id: {request_id}",
            *(["Connection: close"] if close else []),
        ]
        self._record(RequestRecord(method, path, query, status, fault, 0, head.headers))
        writer.write("\r\n".join(lines).encode() + b"\r\n\r\n")
        if method != "HEAD":
            writer.write(body)
        await writer.drain()
        if close:
            await _close_gracefully(reader, writer)
            return False
        return True


def _flip_bit(data: bytes) -> bytes:
    """``data`` with one bit inverted (the middle byte's lowest)."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :]


def _check_kind(kind: str) -> None:
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")


def _methods(methods: set[str] | None) -> frozenset[str] | None:
    return None if methods is None else frozenset(m.upper() for m in methods)


__all__ = ["ERROR_KINDS", "FAULT_KINDS", "FaultProxy", "HoldMatch", "Match", "RequestRecord"]
