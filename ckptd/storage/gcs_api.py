"""The JSON API of Google Cloud Storage as ckptd speaks it (``ckptd.storage.gcs``): the
authorized session (made on first use, so a missing credential is the first
operation's StorageError), one request with its errors classified, the multipart upload
that carries CRC-32C and preconditions, paged listing and deletion. No retries here."""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

from ckptd.core import checksum
from ckptd.core.extras import install_hint
from ckptd.storage.base import (
    FileRange,
    NotFoundError,
    PartBody,
    PreconditionFailedError,
    StorageError,
)

GCS_ENDPOINT = "https://storage.googleapis.com"
_SCOPES = ["https://www.googleapis.com/auth/devstorage.read_write"]
_TIMEOUT = (10.0, 60.0)  # connect, read


def missing_extra() -> StorageError:
    return StorageError(
        f"gs:// destinations need the GCS client, {install_hint('gcs')}",
        transient=False,
        code="MissingExtra",
        destination_unusable=True,
    )


def _http_error(resp: Any, what: str, *, bucket_level: bool = False) -> StorageError:
    """A StorageError for a non-2xx response of the JSON API."""
    status = int(resp.status_code)
    try:
        message = str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):  # not the JSON API's error body
        message = (resp.text or "")[:200]
    text = f"{what}: {status} {message}".strip()
    if status == 412:
        return PreconditionFailedError(text)
    if status == 404:
        # An upload or a listing names no object that could be missing: its 404 is the
        # bucket's (GCS says so in the message; an emulator may not).
        if bucket_level or "bucket" in message.lower():
            return StorageError(
                text, transient=False, code="NoSuchBucket", destination_unusable=True
            )
        return NotFoundError(text)
    if status in (401, 403):
        return StorageError(text, transient=False, code="AccessDenied", destination_unusable=True)
    if status == 400 and "crc32c" in message.lower():
        return StorageError(text, transient=True, code="BadDigest")
    transient = status >= 500 or status in (408, 429)
    return StorageError(text, transient=transient, code=str(status))


def classify(exc: Exception, what: str) -> StorageError:
    """Turn a transport or credential failure into a StorageError."""
    if isinstance(exc, StorageError):
        return exc
    from google.auth import exceptions as auth_errors

    if isinstance(exc, auth_errors.DefaultCredentialsError):
        return StorageError(
            f"{what}: no Google credentials found; Application Default Credentials look in "
            "GOOGLE_APPLICATION_CREDENTIALS, then gcloud's ~/.config/gcloud, then the "
            "metadata server (workload identity, the node's service account): set one of those",
            transient=False,
            code="NoCredentials",
            destination_unusable=True,
        )
    if isinstance(exc, auth_errors.RefreshError):
        return StorageError(
            f"{what}: the Google credential was refused: {exc}",
            transient=bool(getattr(exc, "retryable", False)),
            code="NoCredentials",
            destination_unusable=not getattr(exc, "retryable", False),
        )
    if isinstance(exc, auth_errors.TransportError | ConnectionError | TimeoutError | OSError):
        return StorageError(f"{what}: {exc}", transient=True, code=type(exc).__name__)
    import requests

    if isinstance(exc, requests.RequestException):
        return StorageError(f"{what}: {exc}", transient=True, code=type(exc).__name__)
    return StorageError(f"{what}: {exc!r}", transient=False, code=type(exc).__name__)


class _Body:
    """A multipart/related upload body (metadata, then the bytes) read as a file, so a
    part streams from its file range with a known Content-Length."""

    def __init__(self, metadata: dict[str, str], data: PartBody, boundary: str) -> None:
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps(metadata)}\r\n--{boundary}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        body: Any = data.reader() if isinstance(data, FileRange) else io.BytesIO(data)
        # Readers in order; a BytesIO of bytes shares their buffer (no copy of the body).
        self._pieces: list[Any] = [io.BytesIO(head), body, io.BytesIO(tail)]
        self._length = len(head) + len(data) + len(tail)

    def __len__(self) -> int:
        return self._length

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return b"".join(p.read() for p in self._pieces[:])
        while self._pieces:
            chunk = self._pieces[0].read(size)
            if chunk:
                return bytes(chunk)
            self._pieces.pop(0)
        return b""


class JsonApi:
    """Requests to one bucket at one endpoint."""

    def __init__(
        self, bucket: str, *, endpoint_url: str = "", max_connections: int = 10, kms: str = ""
    ) -> None:
        self.bucket = bucket
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator and "://" not in emulator:
            emulator = f"http://{emulator}"
        self.base = (endpoint_url or emulator or GCS_ENDPOINT).rstrip("/")
        # Real GCS is HTTPS only: a plain-HTTP endpoint is an emulator, which wants none.
        self._anonymous = self.base.startswith("http://")
        self.kms = kms
        self._max_connections = max_connections
        self._session: Any = None
        self._lock = threading.Lock()

    def session(self) -> Any:
        """The authorized session, made on first use (so a missing credential is a
        StorageError of the first operation, as with S3)."""
        with self._lock:
            if self._session is None:
                try:
                    import requests.adapters
                    from google.auth.credentials import AnonymousCredentials
                    from google.auth.transport.requests import AuthorizedSession
                except ImportError:
                    raise missing_extra() from None
                import google.auth

                if self._anonymous:
                    credentials: Any = AnonymousCredentials()  # type: ignore[no-untyped-call]
                else:
                    try:
                        credentials, _ = google.auth.default(scopes=_SCOPES)
                    except Exception as exc:
                        raise classify(exc, f"bucket {self.bucket}") from exc
                session = AuthorizedSession(credentials)  # type: ignore[no-untyped-call]
                adapter = requests.adapters.HTTPAdapter(
                    pool_connections=2, pool_maxsize=self._max_connections, max_retries=0
                )
                session.mount("https://", adapter)
                session.mount("http://", adapter)
                self._session = session
            return self._session

    def object_url(self, name: str) -> str:
        return f"{self.base}/storage/v1/b/{self.bucket}/o/{quote(name, safe='')}"

    def request(
        self,
        what: str,
        method: str,
        url: str,
        *,
        ok: tuple[int, ...] = (200,),
        bucket_level: bool = False,
        **kwargs: Any,
    ) -> Any:
        try:
            resp = self.session().request(method, url, timeout=_TIMEOUT, **kwargs)
        except Exception as exc:
            raise classify(exc, what) from exc
        if resp.status_code not in ok:
            error = _http_error(resp, what, bucket_level=bucket_level)
            resp.close()
            raise error
        return resp

    def upload(
        self, what: str, name: str, data: PartBody, crc32c: int, *, if_absent: bool = False
    ) -> dict[str, Any]:
        """One multipart upload of ``data`` to ``name``, its CRC-32C checked both ways."""
        params = {"uploadType": "multipart", "fields": "name,size,crc32c,generation"}
        if if_absent:
            params["ifGenerationMatch"] = "0"
        if self.kms:
            params["kmsKeyName"] = self.kms
        metadata = {"name": name, "crc32c": checksum.to_base64(crc32c)}
        boundary = f"ckptd-{uuid.uuid4().hex}"
        body = _Body(metadata, data, boundary)
        resp = self.request(
            what,
            "POST",
            f"{self.base}/upload/storage/v1/b/{self.bucket}/o",
            bucket_level=True,
            params=params,
            data=body,
            headers={
                "Content-Type": f'multipart/related; boundary="{boundary}"',
                "Content-Length": str(len(body)),
            },
        )
        item: dict[str, Any] = resp.json()
        stored = str(item.get("crc32c", ""))
        if stored and checksum.from_base64(stored) != crc32c:
            # GCS refuses such a body itself (400); a store that kept it (an emulator)
            # loses exactly the generation written here, never a later writer's.
            self.delete_name(name, generation=str(item.get("generation", "")))
            raise StorageError(
                f"{what}: store computed CRC-32C {stored}, ckptd {checksum.to_base64(crc32c)}",
                transient=True,
                code="BadDigest",
            )
        return item

    def list(self, full_prefix: str, *, delimiter: str = "") -> Iterator[dict[str, Any]]:
        """Pages of the bucket's listing under ``full_prefix``."""
        token = ""
        while True:
            params = {
                "prefix": full_prefix,
                "fields": "items(name,size,crc32c,generation),prefixes,nextPageToken",
            }
            if delimiter:
                params["delimiter"] = delimiter
            if token:
                params["pageToken"] = token
            page: dict[str, Any] = self.request(
                f"list {full_prefix}",
                "GET",
                f"{self.base}/storage/v1/b/{self.bucket}/o",
                bucket_level=True,
                params=params,
            ).json()
            yield page
            token = str(page.get("nextPageToken", ""))
            if not token:
                return

    def delete_name(self, name: str, *, generation: str = "") -> None:
        params = {"ifGenerationMatch": generation} if generation else {}
        with contextlib.suppress(NotFoundError, PreconditionFailedError):
            self.request(
                f"delete {name}", "DELETE", self.object_url(name), ok=(200, 204), params=params
            )

    # -- objects ------------------------------------------------------------------
