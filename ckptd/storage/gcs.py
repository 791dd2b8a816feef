"""Google Cloud Storage backend: ``gs://bucket[/prefix]``, on GCS's JSON API.

Credentials and the HTTP session come from ``google-auth`` (the library
``google-cloud-storage`` is built on): Application Default Credentials, i.e.
``GOOGLE_APPLICATION_CREDENTIALS``, workload identity, the metadata server. ckptd drives
the JSON API request by request, as it drives boto3's low-level client for S3, because
it needs what the SDK's ``Blob`` does not offer: a part streamed from a range of an open
file, its CRC-32C computed once by ckptd and checked against the store's, and parts
that survive a restart. An emulator (``STORAGE_EMULATOR_HOST``, or a plain-HTTP
``endpoint_url``) is spoken to without credentials, as the SDK does.

Guarantees, and the request that carries each:

- Commit once: ``put_if_absent`` is a ``uploadType=multipart`` upload with
  ``ifGenerationMatch=0``; GCS answers 412 when the object exists.
- Every upload carries ckptd's CRC-32C (in the object's metadata, which GCS checks the
  body against), and the CRC-32C GCS reports back is compared with it: a mismatch is a
  transient BadDigest, so the bytes are sent again.
- Large files: each part is an object of its own under ``.ckptd-uploads/<key>/<id>/``
  beside a marker object ``upload`` that makes the upload exist (``list_uploads``,
  ``list_parts``); ``complete_upload`` composes the parts (at most 32 per compose, so
  in a tree) and deletes them. GCS keeps a CRC-32C of the whole object for composites
  too, so ``expected_checksum`` is the file's own CRC-32C, which the manifest records.
  The ``.ckptd-uploads/`` tree is hidden from listings.
- Server-side copy is ``rewriteTo``, repeated with its token until done.
- ``kms_key_name`` (a customer-managed key) is carried on every request that makes an
  object: uploads, compose and rewrite.

Capabilities: all of them (ConditionalWrite, ServerSideCopy, MultipartUpload,
PartListing, StoreChecksums). Retries are ``RetryingStorage``'s; none happen here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any
from urllib.parse import quote

from ckptd.core import checksum
from ckptd.storage.base import (
    NotFoundError,
    ObjectInfo,
    PartBody,
    PartInfo,
    RangeSink,
    ShortObjectError,
    StorageError,
    stream_body,
)
from ckptd.storage.gcs_api import JsonApi, classify, missing_extra
from ckptd.storage.parallel import in_parallel

UPLOADS = ".ckptd-uploads"  # the tree of unfinished uploads, hidden from listings
_MARKER = "upload"
_COMPOSE_MAX = 32  # source objects per compose request (GCS limit)


class GCSStorage:
    """Objects under ``gs://bucket/prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str = "",
        max_connections: int = 10,
        kms_key_name: str = "",
    ) -> None:
        try:
            import google.auth  # noqa: F401  (the [gcs] extra; used by gcs_api)
        except ImportError:
            raise missing_extra() from None
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"gs://{bucket}/{self.prefix}".rstrip("/")
        self._api = JsonApi(
            bucket, endpoint_url=endpoint_url, max_connections=max_connections, kms=kms_key_name
        )
        self._request = self._api.request
        self._object_url = self._api.object_url

    # -- plumbing -----------------------------------------------------------------

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def _info(self, key: str, item: dict[str, Any]) -> ObjectInfo:
        updated = item.get("updated")
        return ObjectInfo(
            key,
            int(item.get("size", 0)),
            str(item.get("crc32c", "")),
            str(item.get("generation", "")),
            datetime.fromisoformat(updated.replace("Z", "+00:00")).timestamp()
            if isinstance(updated, str) and updated
            else 0.0,
        )

    def put_bytes(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        return self._info(key, self._api.upload(f"put {key}", self._name(key), data, crc32c))

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        item = self._api.upload(
            f"conditional put {key}", self._name(key), data, crc32c, if_absent=True
        )
        return self._info(key, item)

    def get_bytes(self, key: str) -> bytes:
        resp = self._request(
            f"get {key}", "GET", self._object_url(self._name(key)), params={"alt": "media"}
        )
        return bytes(resp.content)

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        if length <= 0:
            return
        what = f"get {key}"
        try:
            resp = self._request(
                what,
                "GET",
                self._object_url(self._name(key)),
                ok=(200, 206),
                params={"alt": "media"},
                headers={
                    "Range": f"bytes={start}-{start + length - 1}",
                    "Accept-Encoding": "identity",
                },
                stream=True,
            )
        except StorageError as exc:
            if exc.code == "416":
                raise ShortObjectError(f"{what}: nothing at {start}") from exc
            raise
        try:
            got = int(resp.headers.get("Content-Length", -1))
            # A range that covers the whole object may come back as a 200 of all of it.
            whole = resp.status_code == 200
            if (whole and (start != 0 or got < length)) or (not whole and got != length):
                raise ShortObjectError(
                    f"{what}: asked {length} bytes at {start}, the store sent {got}"
                )
            stream_body(resp.raw.read, sink, length, start, what)
        except StorageError:
            raise
        except Exception as exc:
            raise classify(exc, what) from exc
        finally:
            resp.close()

    def head(self, key: str) -> ObjectInfo | None:
        try:
            resp = self._request(
                f"head {key}",
                "GET",
                self._object_url(self._name(key)),
                params={"fields": "size,crc32c,generation,updated"},
            )
        except NotFoundError:
            return None
        return self._info(key, resp.json())

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        hidden = self._name(UPLOADS + "/")
        for page in self._api.list(self._name(prefix)):
            for item in page.get("items", []):
                if not str(item["name"]).startswith(hidden):
                    yield self._info(self._rel(item["name"]), item)

    def list_children(self, prefix: str) -> list[str]:
        full = self._name(prefix)
        names: list[str] = []
        for page in self._api.list(full, delimiter="/"):
            names += [p[len(full) :].rstrip("/") for p in page.get("prefixes", [])]
        return [n for n in names if not (prefix == "" and n == UPLOADS)]

    def delete(self, keys: list[str]) -> None:
        # One DELETE per object (the JSON API has no multi-object delete outside its
        # batch endpoint), several at once; order among ``keys`` is not kept (nor on S3).
        in_parallel(self._api.delete_name, [self._name(k) for k in keys])

    def copy(self, src_key: str, dst_key: str) -> ObjectInfo:
        source = self.head(src_key)
        if source is None:
            raise NotFoundError(f"copy {src_key}: source missing")
        what = f"copy {src_key} -> {dst_key}"
        url = f"{self._object_url(self._name(src_key))}/rewriteTo/b/{self.bucket}/o/{quote(self._name(dst_key), safe='')}"
        params = {"fields": "done,rewriteToken,resource(size,crc32c,generation)"}
        if self._api.kms:
            params["destinationKmsKeyName"] = self._api.kms
        while True:
            result: dict[str, Any] = self._request(what, "POST", url, params=params).json()
            if result.get("done"):
                break
            params["rewriteToken"] = str(result["rewriteToken"])
        copied = self._info(dst_key, result.get("resource") or {})
        if copied.size != source.size or (
            copied.checksum and source.checksum and copied.checksum != source.checksum
        ):
            raise StorageError(
                f"{what} verified wrong: size {copied.size}, checksum {copied.checksum!r} "
                f"(source {source.size}, {source.checksum!r})",
                transient=True,
                code="VerifyFailed",
            )
        return copied

    def check(self) -> None:
        # A listing, not a bucket GET: roles/storage.objectUser grants objects.list but
        # not buckets.get, and it is all ckptd needs.
        try:
            self._request(
                f"bucket {self.bucket}",
                "GET",
                f"{self._api.base}/storage/v1/b/{self.bucket}/o",
                bucket_level=True,
                params={"prefix": self._name(""), "maxResults": "1", "fields": "kind"},
            )
        except StorageError as exc:
            if exc.code in ("NotFound", "NoSuchBucket"):
                raise StorageError(
                    f"bucket {self.bucket!r} does not exist (at {self._api.base})",
                    transient=False,
                    code="NoSuchBucket",
                    destination_unusable=True,
                ) from exc
            if exc.code == "AccessDenied":
                raise StorageError(
                    f"access to bucket {self.bucket!r} denied: check the credentials ADC found "
                    "and that they hold roles/storage.objectUser on it",
                    transient=False,
                    code="AccessDenied",
                    destination_unusable=True,
                ) from exc
            raise

    # -- multipart: parts as objects, composed --------------------------------------

    def _upload_dir(self, key: str, upload_id: str) -> str:
        return self._name(f"{UPLOADS}/{key}/{upload_id}/")

    def create_upload(self, key: str) -> str:
        upload_id = uuid.uuid4().hex
        marker = self._upload_dir(key, upload_id) + _MARKER
        self._api.upload(f"create upload {key}", marker, b"", checksum.crc32c(b""))
        return upload_id

    def _require_upload(self, key: str, upload_id: str) -> None:
        try:
            self._request(
                f"upload {upload_id} of {key}",
                "GET",
                self._object_url(self._upload_dir(key, upload_id) + _MARKER),
                params={"fields": "name"},
            )
        except NotFoundError as exc:
            raise NotFoundError(f"upload {upload_id} of {key} gone", code="NoSuchUpload") from exc

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: PartBody, *, crc32c: int
    ) -> PartInfo:
        self._require_upload(key, upload_id)
        name = f"{self._upload_dir(key, upload_id)}{number:05d}"
        item = self._api.upload(f"upload part {number} of {key}", name, data, crc32c)
        return PartInfo(number, len(data), str(item.get("generation", "")), crc32c)

    def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        self._require_upload(key, upload_id)
        folder = self._upload_dir(key, upload_id)
        found: dict[int, tuple[int, str]] = {}
        for page in self._api.list(folder):
            for item in page.get("items", []):
                tail = str(item["name"])[len(folder) :]
                if tail.isdigit():
                    found[int(tail)] = (int(item["size"]), str(item.get("generation", "")))
        return found

    def _compose(self, what: str, sources: list[str], target: str) -> dict[str, Any]:
        params = {"fields": "size,crc32c,generation"}
        if self._api.kms:
            params["kmsKeyName"] = self._api.kms
        body = {"sourceObjects": [{"name": s} for s in sources], "destination": {}}
        resp = self._request(
            what, "POST", f"{self._object_url(target)}/compose", params=params, json=body
        )
        result: dict[str, Any] = resp.json()
        return result

    def complete_upload(self, key: str, upload_id: str, parts: list[PartInfo]) -> ObjectInfo:
        folder = self._upload_dir(key, upload_id)
        what = f"complete {key}"
        sources = [f"{folder}{p.number:05d}" for p in sorted(parts, key=lambda p: p.number)]
        level = 0
        # Compose takes 32 sources: larger uploads are composed in a tree, each level's
        # intermediates kept inside the upload's folder (deleted with it).
        while len(sources) > _COMPOSE_MAX:
            level += 1
            groups = [sources[i : i + _COMPOSE_MAX] for i in range(0, len(sources), _COMPOSE_MAX)]
            sources = []
            for index, group in enumerate(groups):
                target = f"{folder}tree-{level}-{index:05d}"
                self._compose(what, group, target)
                sources.append(target)
        item = self._compose(what, sources, self._name(key))
        size = sum(p.size for p in parts)
        whole = checksum.combine_parts(
            (p.crc32c, p.size) for p in sorted(parts, key=lambda p: p.number)
        )
        stored = str(item.get("crc32c", ""))
        if int(item.get("size", -1)) != size or (stored and checksum.from_base64(stored) != whole):
            raise StorageError(
                f"{what}: composed {item.get('size')} bytes, CRC-32C {stored}; expected {size}, "
                f"{checksum.to_base64(whole)}",
                transient=True,
                code="VerifyFailed",
            )
        self.abort_upload(key, upload_id)
        return self._info(key, item)

    def abort_upload(self, key: str, upload_id: str) -> None:
        folder = self._upload_dir(key, upload_id)
        names = [
            str(item["name"]) for page in self._api.list(folder) for item in page.get("items", [])
        ]
        marker = folder + _MARKER
        # The marker last: while it exists the upload is listed, so an interrupted abort
        # is found and finished again.
        in_parallel(self._api.delete_name, [n for n in names if n != marker])
        self._api.delete_name(marker)

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        root = self._name(UPLOADS + "/")
        found: list[tuple[str, str]] = []
        for page in self._api.list(root + prefix):
            for item in page.get("items", []):
                name = str(item["name"])
                if not name.endswith("/" + _MARKER):
                    continue
                key, _, upload_id = name[len(root) : -len(_MARKER) - 1].rpartition("/")
                found.append((key, upload_id))
        return found

    def expected_checksum(self, parts: list[PartInfo], whole_crc32c: int) -> str:
        # GCS's crc32c of a composite object is that of its whole content.
        return checksum.to_base64(whole_crc32c)
