"""S3 object PUTs and GETs signed and sent here, on a socket, beside botocore.

botocore spends about 1.1 ms of CPU on every request (its event hooks, parameter
validation, serialisation, endpoint rules, urllib3); a checkpoint of 3,000 shards of
64 KiB pays that 3,000 times, more than the bytes cost. The requests that are made once
per file (``PutObject`` of a whole small file, ``GetObject`` of a file or a range of one)
are therefore sent by ``DirectS3``: SigV4 computed here (the body unsigned,
``UNSIGNED-PAYLOAD``, as botocore sends it for ckptd: the signed
``x-amz-checksum-crc32c`` header protects the bytes), one HTTP/1.1 keep-alive connection
per thread, the request head and a small body in one write; about 0.12 ms of CPU per
request (bench/bench_manyfiles.py).

It never guesses where or how to send: ``learn`` takes the URL prefix (endpoint,
addressing style, bucket), the signing region and the scheme from a request botocore
itself sent and that succeeded (its endpoint rules and any region redirect already
applied), and the credentials from botocore's own provider chain, asked per request (so
they refresh as botocore's do). It declines, and botocore keeps sending everything,
wherever it could not do exactly what botocore does: a proxy, a signature other than
SigV4 with a credential scope, S3 Express session tokens, a URL it cannot reproduce.
An error reply, a broken connection (never reused) or a reply that cannot be read
(``http1.ReplyError``) becomes the StorageError botocore's would (``s3_errors``), so
``RetryingStorage`` retries what it would retry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import re
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import quote, unquote_plus, urlsplit
from xml.etree import ElementTree

from botocore.httpsession import get_cert_path
from botocore.utils import get_environ_proxies

from ckptd import __version__
from ckptd.core import checksum
from ckptd.storage import http1
from ckptd.storage.base import STREAM_PIECE, ObjectInfo, ShortObjectError
from ckptd.storage.s3_errors import classify, classify_reply

# An error reply's body is read up to this (S3's error documents are a few hundred bytes).
_ERROR_BODY_MAX = 64 * 1024
# A listing page (1,000 keys) is a few hundred KiB.
_LIST_BODY_MAX = 64 * 1024 * 1024
# The credential scope of a SigV4 Authorization header: AK/DATE/REGION/SERVICE/aws4_request.
_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/([^/]+)/([^/]+)/aws4_request")
_XML_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_XML_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")
# botocore's PutObject arguments for server-side encryption -> the headers they become.
_SSE_HEADERS = {
    "ServerSideEncryption": "x-amz-server-side-encryption",
    "SSEKMSKeyId": "x-amz-server-side-encryption-aws-kms-key-id",
}


class FrozenCredentials(Protocol):
    """botocore's ReadOnlyCredentials."""

    @property
    def access_key(self) -> str | None: ...
    @property
    def secret_key(self) -> str | None: ...
    @property
    def token(self) -> str | None: ...


class CredentialSource(Protocol):
    def get_frozen_credentials(self) -> FrozenCredentials: ...


@dataclass(frozen=True)
class Reply:
    """What the store answered: the status, the headers ckptd reads, and for an error
    its S3 code and message ("" when the body carried none, as a HEAD's)."""

    status: int
    headers: Mapping[str, str]
    code: str = ""
    message: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True)
class Endpoint:
    """Where and how botocore sent a request for an object, learned from it."""

    scheme: str
    host: str  # the Host header (with a port that is not the scheme's default)
    address: tuple[str, int]
    prefix: str  # the path before the object key: "/bucket/" or "/"
    key_prefix: str  # what the storage adds before every key ("prefix/" or "")
    region: str
    service: str


def endpoint_from(url: str, authorization: str, full_key: str, key_prefix: str) -> Endpoint | None:
    """The endpoint of a request botocore sent for ``full_key`` to ``url`` with
    ``authorization``; None if it is not one ``DirectS3`` can reproduce exactly."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.query or parts.fragment:
        return None
    if not authorization.startswith("AWS4-HMAC-SHA256 "):
        return None
    scope = _SCOPE.search(authorization)
    if scope is None:
        return None
    quoted = object_path(full_key)
    if not parts.path.endswith(quoted):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if not host:
        return None
    return Endpoint(
        scheme=parts.scheme,
        host=parts.netloc.rsplit("@", 1)[-1],
        address=(host, port),
        prefix=parts.path[: len(parts.path) - len(quoted)],
        key_prefix=key_prefix,
        region=scope.group(1),
        service=scope.group(2),
    )


def canonical_query(params: Mapping[str, str]) -> str:
    """A query string as SigV4 signs it, and as it is then sent: sorted by name, every
    name and value percent-encoded but for unreserved characters."""
    return "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items())
    )


def object_path(key: str) -> str:
    """A key as it stands in a request path: percent-encoded as botocore encodes it
    (every byte but unreserved characters and '/')."""
    return quote(key, safe="/~")


# -- SigV4 ----------------------------------------------------------------------------------


class SigV4:
    """AWS Signature Version 4 for S3 requests with an unsigned payload."""

    def __init__(self, region: str, service: str) -> None:
        self.region = region
        self.service = service
        self._keys: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def _signing_key(self, secret: str, date: str) -> bytes:
        found = self._keys.get((secret, date))
        if found is None:
            key = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
            for part in (self.region, self.service, "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            with self._lock:
                # One key a day per secret: drop the old ones as the date moves on.
                self._keys = {k: v for k, v in self._keys.items() if k[1] == date}
                self._keys[(secret, date)] = key
            found = key
        return found

    def sign(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        credentials: FrozenCredentials,
        now: float,
        query: str = "",
    ) -> None:
        """Add x-amz-date, x-amz-content-sha256, the session token and Authorization to
        ``headers`` (lower-case names, host among them), signing every one of them, as
        botocore signs its own (Content-Length and User-Agent are sent unsigned)."""
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        date = amz_date[:8]
        headers["x-amz-date"] = amz_date
        headers["x-amz-content-sha256"] = "UNSIGNED-PAYLOAD"
        if credentials.token:
            headers["x-amz-security-token"] = credentials.token
        names = sorted(headers)
        canonical = "\n".join(
            (
                method,
                path,
                query,  # ``canonical_query``
                "".join(f"{n}:{' '.join(headers[n].split())}\n" for n in names),
                ";".join(names),
                "UNSIGNED-PAYLOAD",
            )
        )
        scope = f"{date}/{self.region}/{self.service}/aws4_request"
        to_sign = "\n".join(
            ("AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest())
        )
        signature = hmac.new(
            self._signing_key(credentials.secret_key or "", date), to_sign.encode(), hashlib.sha256
        ).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )


# -- the client ---------------------------------------------------------------------------------

Sink = Callable[[int, bytes], None]


class DirectS3:
    """Signed object requests on per-thread keep-alive connections (module doc)."""

    def __init__(
        self,
        endpoint: Endpoint,
        credentials: CredentialSource,
        *,
        tls: ssl.SSLContext | None,
        connect_timeout: float,
        read_timeout: float,
        user_agent: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.endpoint = endpoint
        self._credentials = credentials
        self._signer = SigV4(endpoint.region, endpoint.service)
        self._tls = tls
        self._timeouts = (connect_timeout, read_timeout)
        self._user_agent = user_agent
        self._clock = clock
        self._local = threading.local()
        # Every thread's connection, so ``close`` reaches them all (weak: one whose thread
        # ended is closed as it goes, ``http1.Connection.__del__``).
        self._open: weakref.WeakSet[http1.Connection] = weakref.WeakSet()
        self._open_lock = threading.Lock()

    def _connection(self) -> http1.Connection:
        conn: http1.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and (not conn.reusable or conn.stale()):
            conn.close()
            conn = None
        if conn is None:
            conn = http1.Connection(self.endpoint.address, self._tls, self._timeouts)
            self._local.conn = conn
            with self._open_lock:
                self._open.add(conn)
        return conn

    def close(self) -> None:
        """Close every thread's connection (the storage is being closed); a request
        after this opens a new one."""
        with self._open_lock:
            conns = list(self._open)
        for conn in conns:
            conn.close()

    @contextlib.contextmanager
    def _exchange(self) -> Iterator[http1.Connection]:
        """This thread's connection for one request and its reply: dropped when the
        exchange fails or leaves it unfit for another request."""
        conn = self._connection()
        try:
            yield conn
        except BaseException:
            self._drop(conn)
            raise
        finally:
            if not conn.reusable:
                self._drop(conn)

    def _drop(self, conn: http1.Connection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def _head(
        self, method: str, key: str, headers: dict[str, str], body: int | None, query: str = ""
    ) -> bytes:
        """The request head for ``key`` (None: the bucket itself), signed."""
        path = self.endpoint.prefix + object_path(self.endpoint.key_prefix + key)
        headers["host"] = self.endpoint.host
        self._signer.sign(
            method, path, headers, self._credentials.get_frozen_credentials(), self._clock(), query
        )
        target = f"{path}?{query}" if query else path
        lines = [f"{method} {target} HTTP/1.1", f"user-agent: {self._user_agent}"]
        lines.extend(f"{k}: {v}" for k, v in headers.items())
        if body is not None:
            lines.append(f"content-length: {body}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _error(
        self, conn: http1.Connection, method: str, status: int, headers: dict[str, str]
    ) -> Reply:
        body = conn.read_body(method, status, headers, _ERROR_BODY_MAX)
        code = _XML_CODE.search(body)
        message = _XML_MESSAGE.search(body)
        return Reply(
            status,
            headers,
            code.group(1).decode("utf-8", "replace") if code else "",
            message.group(1).decode("utf-8", "replace") if message else "",
        )

    def put(self, key: str, body: bytes, headers: dict[str, str]) -> Reply:
        """PUT ``body`` at ``key`` with ``headers`` (lower-case names, all signed)."""
        head = self._head("PUT", key, dict(headers), len(body))
        with self._exchange() as conn:
            conn.send(head, body)
            status, reply = conn.read_head("PUT")
            if not 200 <= status < 300:
                return self._error(conn, "PUT", status, reply)
            conn.read_body("PUT", status, reply, 0)
            conn.last_used = time.monotonic()
            return Reply(status, reply)

    def get(
        self, key: str, sink: Sink, piece: int, *, start: int = 0, length: int | None = None
    ) -> Reply:
        """GET ``key`` (or ``length`` bytes of it from ``start``), the body handed to
        ``sink(pos, bytes)`` in pieces of at most ``piece`` bytes. A 2xx reply's
        ``content-length`` header says how long the body was; a reply whose body the
        sink refuses (raises) leaves the connection closed."""
        headers: dict[str, str] = {}
        if length is not None:
            headers["range"] = f"bytes={start}-{start + length - 1}"
        head = self._head("GET", key, headers, None)
        with self._exchange() as conn:
            conn.send(head, None)
            status, reply = conn.read_head("GET")
            if not 200 <= status < 300:
                return self._error(conn, "GET", status, reply)
            size = conn.body_length("GET", status, reply)
            if size is None:
                data = conn.read_body("GET", status, reply, 1 << 62)
                reply["content-length"] = str(len(data))
                for pos in range(0, len(data), piece):
                    sink(pos, data[pos : pos + piece])
                return Reply(status, reply)
            reply["content-length"] = str(size)
            if length is not None and size != length:
                # The store clipped the range (a shorter object): the caller says so; the
                # body is not wanted, and is not read.
                conn.reusable = False
                return Reply(status, reply)
            pos = 0
            while pos < size:
                chunk = conn.reader.read(min(piece, size - pos))
                if not chunk:
                    conn.reusable = False
                    raise http1.ReplyError(f"reply body ended after {pos} of {size} bytes")
                sink(pos, chunk)
                pos += len(chunk)
            conn.last_used = time.monotonic()
            return Reply(status, reply)

    def list_page(self, params: Mapping[str, str]) -> tuple[Reply, bytes]:
        """One ListObjectsV2 page of the bucket (``params``: its query), and its body."""
        head = self._bucket_head(canonical_query(params))
        with self._exchange() as conn:
            conn.send(head, None)
            status, reply = conn.read_head("GET")
            if not 200 <= status < 300:
                return self._error(conn, "GET", status, reply), b""
            body = conn.read_body("GET", status, reply, _LIST_BODY_MAX)
            conn.last_used = time.monotonic()
            return Reply(status, reply), body

    def _bucket_head(self, query: str) -> bytes:
        """A GET of the bucket itself (its path is the endpoint's, without any key)."""
        headers = {"host": self.endpoint.host}
        path = self.endpoint.prefix
        self._signer.sign(
            "GET", path, headers, self._credentials.get_frozen_credentials(), self._clock(), query
        )
        lines = [f"GET {path}?{query} HTTP/1.1", f"user-agent: {self._user_agent}"]
        lines.extend(f"{k}: {v}" for k, v in headers.items())
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# -- when to go direct ----------------------------------------------------------------------


class DirectPath:
    """Learns, from botocore's own requests, whether and how to send object PUTs and
    GETs directly (module doc); ``client`` is the ``DirectS3`` once learned, else None."""

    def __init__(
        self,
        botocore_client: Any,
        session: Any,
        prefix: str,
        *,
        timeouts: tuple[float, float],
        sse: Mapping[str, str],
    ) -> None:
        self.client: DirectS3 | None = None
        # What every PUT carries besides its checksum: the SSE that ``S3Storage`` gives
        # botocore's PutObject, as its headers.
        self._put_headers = {_SSE_HEADERS[name]: value for name, value in sse.items()}
        self._session = session
        self._key_prefix = f"{prefix}/" if prefix else ""
        self._timeouts = timeouts
        self._declined = False
        self._sent = threading.local()
        for operation in ("PutObject", "GetObject"):
            botocore_client.meta.events.register(f"before-send.s3.{operation}", self._note_sent)

    def close(self) -> None:
        """Close the direct path's connections, if it was learned."""
        if self.client is not None:
            self.client.close()

    def _note_sent(self, request: Any, **_: Any) -> None:
        """botocore's before-send hook: what it is sending, in case it succeeds."""
        if self.client is None and not self._declined:
            headers = {str(k).lower(): _text(v) for k, v in request.headers.items()}
            self._sent.request = (str(request.url), headers)

    def learn(self, key: str) -> None:
        """botocore's request for ``key`` just succeeded: go direct from now on if such
        requests can be sent exactly as botocore sent it, else never."""
        sent = getattr(self._sent, "request", None)
        self._sent.request = None
        if sent is None or self.client is not None or self._declined:
            return
        url, headers = sent
        endpoint = endpoint_from(
            url, headers.get("authorization", ""), self._key_prefix + key, self._key_prefix
        )
        credentials = self._session.get_credentials()
        scheme = urlsplit(url).scheme
        if (
            endpoint is None
            or credentials is None
            or "x-amz-s3session-token" in headers  # S3 Express: its own session auth
            or get_environ_proxies(url).get(scheme)
        ):
            self._declined = True
            return
        tls = None
        if scheme == "https":
            # What botocore verifies with: ca_bundle (AWS_CA_BUNDLE), REQUESTS_CA_BUNDLE,
            # else certifi's bundle.
            verify = self._session.get_config_variable("ca_bundle")
            verify = verify or os.environ.get("REQUESTS_CA_BUNDLE") or True
            tls = http1.tls_context(get_cert_path(cast(Any, verify)))
        self.client = DirectS3(
            endpoint,
            credentials,
            tls=tls,
            connect_timeout=self._timeouts[0],
            read_timeout=self._timeouts[1],
            user_agent=f"ckptd/{__version__} {headers.get('user-agent', '')}".strip(),
        )

    # -- the requests, once learned (None / False: not learned, botocore sends it) -------

    def put(self, key: str, data: bytes, crc32c: int) -> ObjectInfo | None:
        """``Storage.put_bytes`` sent directly."""
        client = self.client
        if client is None:
            return None
        headers = {"x-amz-checksum-crc32c": checksum.to_base64(crc32c), **self._put_headers}
        reply = _checked(f"put {key}", lambda: client.put(key, data, headers))
        return ObjectInfo(
            key,
            len(data),
            reply.headers.get("x-amz-checksum-crc32c", ""),
            reply.headers.get("etag", ""),
        )

    def get(self, key: str) -> bytes | None:
        """``Storage.get_bytes`` sent directly."""
        client = self.client
        if client is None:
            return None
        pieces: list[bytes] = []
        _checked(f"get {key}", lambda: client.get(key, lambda _, b: pieces.append(b), STREAM_PIECE))
        return b"".join(pieces)

    def list_objects(self, full_prefix: str) -> Iterator[ObjectInfo] | None:
        """``Storage.list_objects`` of ``full_prefix`` (the bucket's key, with the
        storage's prefix) sent directly, as botocore's paginator asks (keys url-encoded,
        decoded here); its keys are the bucket's. None: not learned yet."""
        client = self.client
        if client is None:
            return None
        return self._pages(client, full_prefix)

    def _pages(self, client: DirectS3, full_prefix: str) -> Iterator[ObjectInfo]:
        token: str | None = None
        while True:
            params = {"list-type": "2", "prefix": full_prefix, "encoding-type": "url"}
            if token is not None:
                params["continuation-token"] = token
            what = f"list {full_prefix}"
            page = _checked_page(what, functools.partial(client.list_page, params))
            try:
                infos, token = parse_listing(page)
            except http1.ReplyError as exc:  # a page that is not a listing: as a reset
                raise classify(exc, what) from exc
            yield from infos
            if token is None:
                return

    def get_range(self, key: str, start: int, length: int, sink: Sink) -> bool:
        """``Storage.stream_range`` sent directly; False: not learned yet."""
        client = self.client
        if client is None:
            return False
        reply = _checked(
            f"get {key}",
            lambda: client.get(key, sink, STREAM_PIECE, start=start, length=length),
        )
        found = int(reply.headers.get("content-length", length))
        if found != length:
            raise ShortObjectError(
                f"get {key}: asked {length} bytes at {start}, the store has {found}"
            )
        return True


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _checked(what: str, request: Callable[[], Reply]) -> Reply:
    """The reply of a 2xx; anything else as the StorageError botocore's would be."""
    try:
        reply = request()
    except Exception as exc:
        raise classify(exc, what) from exc
    if not reply.ok:
        raise classify_reply(reply.status, reply.code, reply.message, what)
    return reply


def _checked_page(what: str, request: Callable[[], tuple[Reply, bytes]]) -> bytes:
    """The body of a 2xx listing page; anything else as botocore's error would be."""
    try:
        reply, body = request()
    except Exception as exc:
        raise classify(exc, what) from exc
    if not reply.ok:
        raise classify_reply(reply.status, reply.code, reply.message, what)
    return body


_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def parse_listing(body: bytes) -> tuple[list[ObjectInfo], str | None]:
    """A ListObjectsV2 page (keys url-encoded): its objects, and the token of the next
    page (None: the last)."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:
        raise http1.ReplyError(f"listing is not XML: {exc}") from None
    ns = _S3_NS if root.tag.startswith(_S3_NS) else ""
    infos = [
        ObjectInfo(
            unquote_plus(item.findtext(f"{ns}Key", "")),
            int(item.findtext(f"{ns}Size", "0")),
            "",
            item.findtext(f"{ns}ETag", ""),
        )
        for item in root.iterfind(f"{ns}Contents")
    ]
    truncated = root.findtext(f"{ns}IsTruncated", "false").strip().lower() == "true"
    token = root.findtext(f"{ns}NextContinuationToken") if truncated else None
    if truncated and not token:
        raise http1.ReplyError("a truncated listing without a continuation token")
    return infos, token
