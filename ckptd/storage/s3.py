"""S3 (and S3-compatible) backend on boto3's low-level client.

Multipart is driven here part by part, not through ``upload_file``, because ckptd needs
what s3transfer does not offer: each part's CRC-32C computed from the bytes it already
read (so each byte is read from disk once), and uploads that resume after a restart
from a journal of finished parts. boto3's own retries are off: ``RetryingStorage``
retries, so every retry is counted and logged in one place. The requests made once per
file (a whole small file's PUT, a file's or a range's GET) go by the direct path
(``s3_direct``) once a first one through botocore taught it where and how: botocore
spends about 1.1 ms of CPU on each, more than a 64 KiB file's bytes cost.

Capabilities: all of them (ConditionalWrite, ServerSideCopy, MultipartUpload,
PartListing, StoreChecksums).

Server-side encryption (``sse``, ``sse_kms_key_id``): every request that makes an object
carries it: PutObject (the conditional manifest and LATEST writes too), CreateMultipartUpload
and CopyObject. A part (UploadPart, UploadPartCopy) is encrypted as its upload was
created; S3 takes no SSE-S3/KMS header on a part. Reads need no header.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

# awscrt is installed for its native CRC-32C, and its mere presence switches botocore to
# the CRT signer, which hashes a streamed body through Python callbacks: 1.22 vs 0.79
# CPU-s/GiB for the classic signer (bench/bench_upload.py). Before botocore loads;
# an explicit setting in the environment wins.
os.environ.setdefault("BOTO_DISABLE_CRT", "true")

import botocore.session
from botocore.config import Config

from ckptd.core import checksum
from ckptd.core.errors import EXIT_USAGE, CkptdError
from ckptd.core.url import is_google_storage_host
from ckptd.storage import s3_direct
from ckptd.storage.base import (
    FileRange,
    NotFoundError,
    ObjectInfo,
    PartBody,
    PartInfo,
    RangeSink,
    ShortObjectError,
    StorageError,
    stream_body,
)
from ckptd.storage.s3_errors import (
    CHECK_CREDENTIALS,
    FIX_BUCKET,
    TRANSIENT_CODES,
    UNUSABLE_CODES,
    classify,
)


class GoogleThroughS3Error(CkptdError):
    """An s3:// destination whose endpoint is Google Cloud Storage's (exit 2)."""

    exit_code = EXIT_USAGE


def _refuse_google(client: Any) -> None:
    """botocore also takes an endpoint from AWS_ENDPOINT_URL(_S3) or the profile's
    endpoint_url: Google Cloud Storage's S3 API is refused whatever its source."""
    resolved = urlsplit(str(client.meta.endpoint_url)).hostname or ""
    if is_google_storage_host(resolved):
        raise GoogleThroughS3Error(
            f"the s3:// destination resolves to Google Cloud Storage ({resolved}, from "
            "endpoint_url, AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or the AWS profile's "
            "endpoint_url), whose S3 API ignores the conditional write ckptd commits "
            "with: use url = gs://bucket[/prefix] and no S3 endpoint"
        )


def _object_info(key: str, size: int, resp: dict[str, Any]) -> ObjectInfo:
    """What a response that made or read an object says of it (``LastModified`` only a
    HEAD's carries)."""
    modified = resp.get("LastModified")
    return ObjectInfo(
        key,
        size,
        resp.get("ChecksumCRC32C", ""),
        resp.get("ETag", ""),
        modified.timestamp() if modified is not None else 0.0,
    )


# How long one request waits for the store's answer (botocore's read timeout, and the
# direct path's): long enough for a large part on a slow link.
READ_TIMEOUT_SECONDS = 60.0


class S3Storage:
    """Objects under ``s3://bucket/prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str = "",
        region: str = "",
        max_connections: int = 10,
        timeout_seconds: float = READ_TIMEOUT_SECONDS,
        sse: str = "",
        sse_kms_key_id: str = "",
    ) -> None:
        self.bucket = bucket
        # The arguments of every request that makes an object (module doc).
        self._sse: dict[str, str] = {}
        if sse:
            self._sse["ServerSideEncryption"] = sse
        if sse_kms_key_id:
            self._sse["SSEKMSKeyId"] = sse_kms_key_id
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=max_connections,
            connect_timeout=10,
            read_timeout=timeout_seconds,
            # ckptd sends its own CRC-32C; without these botocore would checksum every
            # body a second time (CRC32) and validate every download a second time.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # The body's integrity is carried by the CRC-32C header ckptd always sends,
            # which is itself signed; hashing every body again with SHA-256 for the
            # signature (botocore's default over plain HTTP) costs CPU on both ends.
            s3={
                "payload_signing_enabled": False,
                **({"addressing_style": "path"} if endpoint_url else {}),
            },
        )
        # botocore's session, not boto3's: the same client and credential chain, without
        # importing boto3's resources and s3transfer (~0.1 s of every CLI call's start-up).
        session = botocore.session.get_session()
        self._client: Any = session.create_client(
            "s3",
            endpoint_url=endpoint_url or None,
            region_name=region or None,
            config=config,
        )
        self._endpoint = endpoint_url or "AWS S3"
        # The direct path for per-file PUTs and GETs (``s3_direct``), set up from the
        # first such request botocore sends and that succeeds; until then, or where it
        # declines, botocore sends them.
        self._direct = s3_direct.DirectPath(
            self._client, session, self.prefix, timeouts=(10.0, timeout_seconds), sse=self._sse
        )
        _refuse_google(self._client)

    def close(self) -> None:
        """Close the connections kept open between requests (the daemon is stopping)."""
        self._direct.close()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, prefix: str) -> str:
        """``prefix`` as a user reads it in an error: the whole URL (the destination's
        own root is otherwise an empty field)."""
        return f"s3://{self.bucket}/{self._key(prefix)}"

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as exc:
            raise classify(exc, what) from exc

    # -- objects ------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        sent = self._direct.put(key, data, crc32c)
        if sent is not None:
            return sent
        resp = self._call(
            f"put {key}",
            self._client.put_object,
            Bucket=self.bucket,
            Key=self._key(key),
            Body=data,
            ChecksumCRC32C=checksum.to_base64(crc32c),
            **self._sse,
        )
        self._direct.learn(key)
        return _object_info(key, len(data), resp)

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int) -> ObjectInfo:
        resp = self._call(
            f"conditional put {key}",
            self._client.put_object,
            Bucket=self.bucket,
            Key=self._key(key),
            Body=data,
            ChecksumCRC32C=checksum.to_base64(crc32c),
            IfNoneMatch="*",
            **self._sse,
        )
        self._direct.learn(key)
        return _object_info(key, len(data), resp)

    def get_bytes(self, key: str) -> bytes:
        found = self._direct.get(key)
        if found is not None:
            return found
        resp = self._call(
            f"get {key}", self._client.get_object, Bucket=self.bucket, Key=self._key(key)
        )
        try:
            data = bytes(resp["Body"].read())
        except Exception as exc:
            raise classify(exc, f"get {key}") from exc
        self._direct.learn(key)
        return data

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        if length <= 0 or self._direct.get_range(key, start, length, sink):
            return
        resp = self._call(
            f"get {key}",
            self._client.get_object,
            Bucket=self.bucket,
            Key=self._key(key),
            Range=f"bytes={start}-{start + length - 1}",
        )
        body = resp["Body"]
        if int(resp.get("ContentLength", length)) != length:
            body.close()
            # The store clipped the range: the object is shorter than asked.
            raise ShortObjectError(
                f"get {key}: asked {length} bytes at {start}, the store has "
                f"{resp.get('ContentLength')}"
            )
        try:
            stream_body(body.read, sink, length, start, f"get {key}")
        except StorageError:
            raise
        except Exception as exc:
            raise classify(exc, f"get {key}") from exc
        finally:
            body.close()
        self._direct.learn(key)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            resp = self._call(
                f"head {key}",
                self._client.head_object,
                Bucket=self.bucket,
                Key=self._key(key),
                ChecksumMode="ENABLED",
            )
        except NotFoundError:
            return None
        return _object_info(key, int(resp["ContentLength"]), resp)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        direct = self._direct.list_objects(self._key(prefix))
        if direct is not None:
            return (ObjectInfo(self._rel(i.key), i.size, "", i.etag) for i in direct)
        return self._list_objects(prefix)

    def _list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for item in page.get("Contents", []):
                    yield ObjectInfo(
                        self._rel(item["Key"]), int(item["Size"]), "", item.get("ETag", "")
                    )
        except Exception as exc:
            raise classify(exc, f"list {self._where(prefix)}") from exc

    def list_children(self, prefix: str) -> list[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        full = self._key(prefix)
        names: list[str] = []
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"):
                for cp in page.get("CommonPrefixes", []):
                    names.append(cp["Prefix"][len(full) :].rstrip("/"))
        except Exception as exc:
            raise classify(exc, f"list {self._where(prefix)}") from exc
        return names

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[start : start + 1000]
            resp = self._call(
                "delete",
                self._client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self._key(k)} for k in batch], "Quiet": True},
            )
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise StorageError(
                    f"delete {first.get('Key')}: {first.get('Code')} {first.get('Message', '')}",
                    transient=first.get("Code") in TRANSIENT_CODES,
                    code=str(first.get("Code", "")),
                    destination_unusable=first.get("Code") in UNUSABLE_CODES,
                )

    def copy(self, src_key: str, dst_key: str) -> ObjectInfo:
        # copy_object handles up to 5 GiB in one request; larger sources need part copies.
        info = self.head(src_key)
        if info is None:
            raise NotFoundError(f"copy {src_key}: source missing")
        whole = info.size <= 5 * 1024**3
        if whole:
            self._call(
                f"copy {src_key} -> {dst_key}",
                self._client.copy_object,
                Bucket=self.bucket,
                Key=self._key(dst_key),
                CopySource={"Bucket": self.bucket, "Key": self._key(src_key)},
                **self._sse,
            )
        else:
            self._copy_multipart(src_key, dst_key, info.size)
        copied = self.head(dst_key)
        if copied is None:
            raise StorageError(
                f"copy {src_key} -> {dst_key}: target missing after copy", transient=True
            )
        # A whole-object copy keeps the source's checksum; a part copy gets a new
        # composite of its own parts, so only its size can be compared.
        if copied.size != info.size or (
            whole
            and info.checksum
            and copied.checksum
            and not checksum.s3_checksums_match(copied.checksum, info.checksum)
        ):
            raise StorageError(
                f"copy {src_key} -> {dst_key} verified wrong: size {copied.size}, "
                f"checksum {copied.checksum!r} (source {info.size}, {info.checksum!r})",
                transient=True,
                code="VerifyFailed",
            )
        return copied

    def _copy_multipart(self, src_key: str, dst_key: str, size: int) -> None:
        part = 1024**3
        upload_id = self.create_upload(dst_key)
        try:
            parts = []
            for number, start in enumerate(range(0, size, part), start=1):
                end = min(size, start + part) - 1
                resp = self._call(
                    f"copy part {number} of {dst_key}",
                    self._client.upload_part_copy,
                    Bucket=self.bucket,
                    Key=self._key(dst_key),
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource={"Bucket": self.bucket, "Key": self._key(src_key)},
                    CopySourceRange=f"bytes={start}-{end}",
                )
                parts.append({"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]})
            self._call(
                f"complete {dst_key}",
                self._client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=self._key(dst_key),
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            self.abort_upload(dst_key, upload_id)
            raise

    def check(self) -> None:
        try:
            self._call(f"bucket {self.bucket}", self._client.head_bucket, Bucket=self.bucket)
        except StorageError as exc:
            # HEAD responses carry no error body: name the two common causes plainly.
            if exc.code in ("404", "NotFound", "NoSuchBucket"):
                raise StorageError(
                    f"bucket {self.bucket!r} does not exist (at {self._endpoint}); {FIX_BUCKET}",
                    transient=False,
                    code="NoSuchBucket",
                    destination_unusable=True,
                ) from exc
            if exc.code in ("403", "AccessDenied", "Forbidden"):
                raise StorageError(
                    f"access to bucket {self.bucket!r} denied: {CHECK_CREDENTIALS}",
                    transient=False,
                    code="AccessDenied",
                    destination_unusable=True,
                ) from exc
            raise

    # -- multipart ----------------------------------------------------------------

    def create_upload(self, key: str) -> str:
        resp = self._call(
            f"create upload {key}",
            self._client.create_multipart_upload,
            Bucket=self.bucket,
            Key=self._key(key),
            ChecksumAlgorithm="CRC32C",
            **self._sse,
        )
        return str(resp["UploadId"])

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: PartBody, *, crc32c: int
    ) -> PartInfo:
        resp = self._call(
            f"upload part {number} of {key}",
            self._client.upload_part,
            Bucket=self.bucket,
            Key=self._key(key),
            UploadId=upload_id,
            PartNumber=number,
            Body=data.reader() if isinstance(data, FileRange) else data,
            ContentLength=len(data),
            ChecksumCRC32C=checksum.to_base64(crc32c),
        )
        echoed = resp.get("ChecksumCRC32C")
        if echoed and checksum.from_base64(echoed) != crc32c:
            raise StorageError(
                f"upload part {number} of {key}: store computed CRC-32C {echoed}, "
                f"ckptd {checksum.to_base64(crc32c)}",
                transient=True,
                code="BadDigest",
            )
        return PartInfo(number, len(data), str(resp.get("ETag", "")), crc32c)

    def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        paginator = self._client.get_paginator("list_parts")
        found: dict[int, tuple[int, str]] = {}
        try:
            for page in paginator.paginate(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload_id
            ):
                for p in page.get("Parts", []):
                    found[int(p["PartNumber"])] = (int(p["Size"]), str(p.get("ETag", "")))
        except Exception as exc:
            raise classify(exc, f"list parts of {key}") from exc
        return found

    def complete_upload(self, key: str, upload_id: str, parts: list[PartInfo]) -> ObjectInfo:
        resp = self._call(
            f"complete {key}",
            self._client.complete_multipart_upload,
            Bucket=self.bucket,
            Key=self._key(key),
            UploadId=upload_id,
            MultipartUpload={
                "Parts": [
                    {
                        "PartNumber": p.number,
                        "ETag": p.etag,
                        "ChecksumCRC32C": checksum.to_base64(p.crc32c),
                    }
                    for p in sorted(parts, key=lambda p: p.number)
                ]
            },
        )
        return _object_info(key, sum(p.size for p in parts), resp)

    def abort_upload(self, key: str, upload_id: str) -> None:
        with contextlib.suppress(NotFoundError):
            self._call(
                f"abort upload {key}",
                self._client.abort_multipart_upload,
                Bucket=self.bucket,
                Key=self._key(key),
                UploadId=upload_id,
            )

    def list_uploads(self, prefix: str) -> list[tuple[str, str]]:
        paginator = self._client.get_paginator("list_multipart_uploads")
        found: list[tuple[str, str]] = []
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for u in page.get("Uploads", []):
                    found.append((self._rel(u["Key"]), str(u["UploadId"])))
        except Exception as exc:
            raise classify(exc, f"list uploads {self._where(prefix)}") from exc
        return found

    def expected_checksum(self, parts: list[PartInfo], whole_crc32c: int) -> str:
        if not parts:
            return checksum.to_base64(whole_crc32c)
        return checksum.s3_composite(p.crc32c for p in sorted(parts, key=lambda p: p.number))
