"""Azure Blob Storage backend: ``az://container[/prefix]``, on ``azure-storage-blob``.

The account: ``endpoint_url`` (``https://ACCOUNT.blob.core.windows.net``, or Azurite's
``http://127.0.0.1:10000/devstoreaccount1``), else ``AZURE_STORAGE_ACCOUNT_NAME``, else
the account of ``AZURE_STORAGE_CONNECTION_STRING`` (the names adlfs and object_store
read). Credentials: the connection string when set and no ``endpoint_url`` is (it then
names the endpoint too), else ``AZURE_STORAGE_ACCOUNT_KEY``,
else Azurite's published development key for its ``devstoreaccount1`` on plain HTTP,
else ``DefaultAzureCredential`` (environment, workload identity, managed identity, the
Azure CLI's login).

Guarantees, and the request that carries each:

- Commit once: ``put_if_absent`` is a Put Blob with ``If-None-Match: *``; Azure answers
  409 BlobAlreadyExists when the blob exists.
- Large files: each part is a block staged on the target blob (Put Block), its block id
  ``base64("<upload id>-<number:05d>")``; ``complete_upload`` is Put Block List, which
  makes the blob in one step and discards every uncommitted block not named. A marker
  blob ``.ckptd-uploads/<key>/<upload id>`` makes the upload exist (``list_uploads``);
  ``list_parts`` reads the blob's uncommitted block list, so a restart finds its staged
  blocks again. Azure has no abort: ``abort_upload`` deletes the marker, and the staged
  blocks expire with Azure's 7-day garbage collection of uncommitted blocks (or go at
  the next commit of that blob). ``.ckptd-uploads/`` is hidden from listings.
- Checksums: Azure keeps no checksum of a blob made from blocks and none in CRC-32C, so
  this backend declares no StoreChecksums and an object is verified by its size, as on
  ``file://``. Every object's CRC-32C is in the manifest, and restore checks every byte
  it reads against it. Every whole-object write (``put_bytes``/``put_if_absent``: the
  manifest, LATEST, announcements, files up to 8 MiB) is checked against its CRC-32C
  before it is sent and carries a Content-MD5 that Azure checks on receipt.
- Server-side copy is synchronous: Copy Blob with ``x-ms-requires-sync`` up to 256 MiB,
  beyond that Put Block From URL per 1 GiB block and Put Block List (which Azurite does
  not implement: tested by the requests it is sent); the source is read with a 1-hour
  read-only SAS (account key) or this identity's bearer token. Verified by size.
- ``encryption_scope`` (customer-managed keys) is carried on every request that makes an
  object or a block: Put Blob, Put Block, Put Block List, and the copies' From URL
  requests.

Capabilities: ConditionalWrite, ServerSideCopy, MultipartUpload, PartListing. Retries are
``RetryingStorage``'s: the SDK's own are off.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptd.core import checksum
from ckptd.storage.azure_errors import classify, missing_extra
from ckptd.storage.base import (
    STREAM_PIECE,
    FileRange,
    NotFoundError,
    ObjectInfo,
    PartBody,
    PartInfo,
    PreconditionFailedError,
    RangeSink,
    ShortObjectError,
    StorageError,
)
from ckptd.storage.parallel import in_parallel

UPLOADS = ".ckptd-uploads"  # markers of unfinished uploads, hidden from listings
# Azurite's well-known development account (published in Azurite's README).
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# A synchronous Copy Blob copies up to 256 MiB; beyond, Put Block From URL takes up to
# 4000 MiB a block.
COPY_WHOLE_MAX = 256 * 1024 * 1024
COPY_BLOCK = 1024 * 1024 * 1024


def _block_id(upload_id: str, number: int) -> str:
    return base64.b64encode(f"{upload_id}-{number:05d}".encode()).decode()


def _number_of(block_id: str, upload_id: str) -> int | None:
    try:
        text = base64.b64decode(block_id).decode()
    except ValueError:
        return None
    head, _, tail = text.rpartition("-")
    return int(tail) if head == upload_id and tail.isdigit() else None


class AzureBlobStorage:
    """Objects under ``az://container/prefix``."""

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        endpoint_url: str = "",
        max_connections: int = 10,
        encryption_scope: str = "",
    ) -> None:
        try:
            from azure.storage.blob import BlobServiceClient
        except ImportError:
            raise missing_extra() from None
        self.bucket = container
        self.prefix = prefix.strip("/")
        self.url = f"az://{container}/{self.prefix}".rstrip("/")
        self._scope: dict[str, str] = (
            {"encryption_scope": encryption_scope} if encryption_scope else {}
        )
        options: dict[str, Any] = {
            "retry_total": 0,  # RetryingStorage retries
            # A ranged read is fetched in GETs of this size, each held whole by the SDK:
            # 4 MiB took 2-3x the wall of 8 MiB for restore's 16 MiB ranges on Azurite
            # (one initial GET, then the rest in turn); 8 MiB x concurrency stays small.
            "max_single_get_size": 8 * STREAM_PIECE,
            "max_chunk_get_size": 8 * STREAM_PIECE,
            "max_single_put_size": 256 * 1024 * 1024,
            "connection_timeout": 10,
            "read_timeout": 60,
        }
        connection_string = os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "")
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "")
        account_url = endpoint_url.rstrip("/") or (
            f"https://{account}.blob.core.windows.net" if account else ""
        )
        self._pool = max_connections
        if connection_string and not endpoint_url:
            service = BlobServiceClient.from_connection_string(connection_string, **options)
        elif account_url:
            service = BlobServiceClient(
                account_url, credential=self._credential(account_url), **options
            )
        else:
            raise StorageError(
                f"{self.url}: no Azure storage account: set [destination] endpoint_url to "
                "https://ACCOUNT.blob.core.windows.net, or AZURE_STORAGE_ACCOUNT_NAME",
                transient=False,
                code="NoCredentials",
                destination_unusable=True,
            )
        self._endpoint = service.url
        self._container = service.get_container_client(container)

    @staticmethod
    def _credential(account_url: str) -> Any:
        key = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY", "")
        if key:
            return key
        if account_url.startswith("http://") and account_url.endswith("/" + DEV_ACCOUNT):
            return {"account_name": DEV_ACCOUNT, "account_key": DEV_KEY}
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError:
            raise missing_extra() from None
        return DefaultAzureCredential()

    # -- plumbing -----------------------------------------------------------------

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def _blob(self, key: str) -> Any:
        return self._container.get_blob_client(self._name(key))

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise classify(exc, what) from exc

    def _info(self, key: str, props: Any) -> ObjectInfo:
        modified = getattr(props, "last_modified", None)
        return ObjectInfo(
            key,
            int(props.size),
            "",
            str(props.etag or ""),
            modified.timestamp() if modified is not None else 0.0,
        )

    def _put(self, what: str, key: str, data: bytes, crc32c: int, **conditions: Any) -> ObjectInfo:
        # Azure checks no CRC-32C: the body is checked against it here (as file:// does),
        # and Azure checks the transactional MD5 of the same bytes on receipt.
        if checksum.crc32c(data) != crc32c:
            raise StorageError(f"{what}: CRC-32C mismatch", transient=True, code="BadDigest")
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        self._call(
            what,
            self._blob(key).upload_blob,
            data,
            length=len(data),
            overwrite=not conditions,
            headers={"Content-MD5": md5},
            **self._scope,
            **conditions,
        )
        return ObjectInfo(key, len(data))

    # -- objects ------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        return self._put(f"put {key}", key, data, crc32c)

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        # overwrite=False is Put Blob with If-None-Match: *.
        try:
            return self._put(f"conditional put {key}", key, data, crc32c, if_none_match="*")
        except StorageError as exc:
            if exc.code in ("BlobAlreadyExists", "ConditionNotMet", "409"):
                raise PreconditionFailedError(str(exc)) from exc
            raise

    def get_bytes(self, key: str) -> bytes:
        downloader = self._call(f"get {key}", self._blob(key).download_blob, max_concurrency=1)
        return bytes(self._call(f"get {key}", downloader.readall))

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        if length <= 0:
            return
        what = f"get {key}"
        downloader = self._call(
            what, self._blob(key).download_blob, offset=start, length=length, max_concurrency=1
        )
        if int(downloader.size) != length:
            raise ShortObjectError(
                f"{what}: asked {length} bytes at {start}, the store has {downloader.size}"
            )
        pos = 0
        try:
            for chunk in downloader.chunks():
                view = memoryview(chunk)
                for at in range(0, len(view), STREAM_PIECE):
                    piece = bytes(view[at : at + STREAM_PIECE])
                    sink(pos, piece)
                    pos += len(piece)
        except StorageError:
            raise
        except Exception as exc:
            raise classify(exc, what) from exc
        if pos != length:
            raise StorageError(
                f"{what}: {pos} of {length} bytes at {start}, then the body ended",
                transient=True,
                code="IncompleteBody",
            )

    def head(self, key: str) -> ObjectInfo | None:
        try:
            props = self._call(f"head {key}", self._blob(key).get_blob_properties)
        except NotFoundError:
            return None
        return self._info(key, props)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        hidden = self._name(UPLOADS + "/")
        try:
            for props in self._container.list_blobs(name_starts_with=self._name(prefix)):
                if not props.name.startswith(hidden):
                    yield self._info(self._rel(props.name), props)
        except Exception as exc:
            raise classify(exc, f"list {prefix}") from exc

    def list_children(self, prefix: str) -> list[str]:
        full = self._name(prefix)
        try:
            names = [
                item.name[len(full) :].rstrip("/")
                for item in self._container.walk_blobs(name_starts_with=full, delimiter="/")
                if item.name.endswith("/")
            ]
        except Exception as exc:
            raise classify(exc, f"list {prefix}") from exc
        return [n for n in names if not (prefix == "" and n == UPLOADS)]

    def _delete_name(self, name: str) -> None:
        with contextlib.suppress(NotFoundError):
            self._call(f"delete {name}", self._container.delete_blob, name)

    def delete(self, keys: list[str]) -> None:
        # One Delete Blob per object, several at once (Blob Batch is not in Azurite);
        # order among ``keys`` is not kept (nor on S3).
        in_parallel(self._delete_name, [self._name(k) for k in keys])

    def _source(self, key: str) -> tuple[str, dict[str, str]]:
        """The URL a copy reads ``key`` from, and how it is authorized: a 1-hour
        read-only SAS made with the account key, or this identity's bearer token."""
        url = str(self._blob(key).url)
        credential = self._container.credential
        account_key = getattr(credential, "account_key", None)
        if account_key:
            from azure.storage.blob import generate_blob_sas

            sas = generate_blob_sas(
                credential.account_name,
                self.bucket,
                self._name(key),
                account_key=account_key,
                permission="r",
                expiry=datetime.now(UTC) + timedelta(hours=1),
            )
            return f"{url}?{sas}", {}
        token = credential.get_token("https://storage.azure.com/.default").token
        return url, {"source_authorization": f"Bearer {token}"}

    def copy(self, src_key: str, dst_key: str) -> ObjectInfo:
        source = self.head(src_key)
        if source is None:
            raise NotFoundError(f"copy {src_key}: source missing")
        what = f"copy {src_key} -> {dst_key}"
        target = self._blob(dst_key)
        url, auth = self._call(what, self._source, src_key)
        # Synchronous copies only (an asynchronous Copy Blob takes no encryption scope
        # and must be polled): Copy Blob with x-ms-requires-sync up to its limit, else
        # Put Block From URL per block and Put Block List.
        if source.size <= COPY_WHOLE_MAX:
            self._call(
                what, target.start_copy_from_url, url, requires_sync=True, **auth, **self._scope
            )
        else:
            copy_id = uuid.uuid4().hex
            blocks = []
            for number, start in enumerate(range(0, source.size, COPY_BLOCK), start=1):
                block_id = _block_id(copy_id, number)
                self._call(
                    what,
                    target.stage_block_from_url,
                    block_id,
                    url,
                    source_offset=start,
                    source_length=min(COPY_BLOCK, source.size - start),
                    **auth,
                    **self._scope,
                )
                blocks.append(block_id)
            self._commit(what, dst_key, blocks)
        copied = self.head(dst_key)
        if copied is None or copied.size != source.size:
            raise StorageError(
                f"{what} verified wrong: size {copied.size if copied else None} "
                f"(source {source.size})",
                transient=True,
                code="VerifyFailed",
            )
        return copied

    def check(self) -> None:
        try:
            pages = self._container.list_blobs(name_starts_with=self._name(""), results_per_page=1)
            next(iter(pages.by_page()), None)
        except Exception as exc:
            error = classify(exc, f"container {self.bucket}")
            if error.code == "ContainerNotFound":
                raise StorageError(
                    f"container {self.bucket!r} does not exist (at {self._endpoint})",
                    transient=False,
                    code="NoSuchBucket",
                    destination_unusable=True,
                ) from exc
            raise error from exc

    # -- multipart: blocks staged on the blob, a marker blob per upload --------------

    def _marker(self, key: str, upload_id: str) -> str:
        return self._name(f"{UPLOADS}/{key}/{upload_id}")

    def create_upload(self, key: str) -> str:
        upload_id = uuid.uuid4().hex
        blob = self._container.get_blob_client(self._marker(key, upload_id))
        self._call(f"create upload {key}", blob.upload_blob, b"", overwrite=True, **self._scope)
        return upload_id

    def _require_upload(self, key: str, upload_id: str) -> None:
        blob = self._container.get_blob_client(self._marker(key, upload_id))
        try:
            self._call(f"upload {upload_id} of {key}", blob.get_blob_properties)
        except NotFoundError as exc:
            raise NotFoundError(f"upload {upload_id} of {key} gone", code="NoSuchUpload") from exc

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: PartBody, *, crc32c: int
    ) -> PartInfo:
        self._require_upload(key, upload_id)
        body = data.reader() if isinstance(data, FileRange) else data
        block_id = _block_id(upload_id, number)
        self._call(
            f"upload part {number} of {key}",
            self._blob(key).stage_block,
            block_id,
            body,
            length=len(data),
            **self._scope,
        )
        return PartInfo(number, len(data), block_id, crc32c)

    def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        self._require_upload(key, upload_id)
        try:
            _, uncommitted = self._call(
                f"list parts of {key}", self._blob(key).get_block_list, "uncommitted"
            )
        except NotFoundError:
            return {}  # no block staged yet: Azure knows no such blob
        found: dict[int, tuple[int, str]] = {}
        for block in uncommitted:
            number = _number_of(block.id, upload_id)
            if number is not None:
                found[number] = (int(block.size), str(block.id))
        return found

    def _commit(self, what: str, key: str, block_ids: list[str]) -> None:
        """Put Block List: the blob becomes these blocks, in order, in one step."""
        from azure.storage.blob import BlobBlock

        blocks = [BlobBlock(block_id=b) for b in block_ids]
        self._call(what, self._blob(key).commit_block_list, blocks, **self._scope)

    def complete_upload(self, key: str, upload_id: str, parts: list[PartInfo]) -> ObjectInfo:
        what = f"complete {key}"
        self._commit(what, key, [p.etag for p in sorted(parts, key=lambda p: p.number)])
        size = sum(p.size for p in parts)
        info = self.head(key)
        if info is None or info.size != size:
            raise StorageError(
                f"{what}: committed {info.size if info else 'nothing'}, expected {size} bytes",
                transient=True,
                code="VerifyFailed",
            )
        self._delete_name(self._marker(key, upload_id))
        return info

    def abort_upload(self, key: str, upload_id: str) -> None:
        # Azure cannot discard staged blocks: they expire after 7 days (module doc).
        self._delete_name(self._marker(key, upload_id))

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        root = self._name(UPLOADS + "/")
        found: list[tuple[str, str]] = []
        try:
            for props in self._container.list_blobs(name_starts_with=root + prefix):
                key, _, upload_id = props.name[len(root) :].rpartition("/")
                found.append((key, upload_id))
        except Exception as exc:
            raise classify(exc, f"list uploads {prefix}") from exc
        return found
