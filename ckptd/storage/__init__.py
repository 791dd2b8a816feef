"""Where checkpoints go: one small interface with optional capabilities, S3, GCS, Azure
Blob and filesystem backends, and the wrappers (retry, bandwidth cap) stacked in ``open_storage``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ckptd.core.concurrency import lanes_for
from ckptd.core.url import DestinationURL, parse_destination
from ckptd.storage.base import (
    ConditionalWrite,
    MultipartUpload,
    NotFoundError,
    ObjectInfo,
    PartInfo,
    PartListing,
    PreconditionFailedError,
    ServerSideCopy,
    ShortObjectError,
    Storage,
    StorageError,
    StoreChecksums,
    capability,
    require_capability,
)
from ckptd.storage.limited import LimitedStorage, RateLimiter
from ckptd.storage.retrying import RetryHook, RetryingStorage
from ckptd.storage.wrapper import StorageWrapper

if TYPE_CHECKING:  # only for a type: the settings models pull in far more than storage needs
    from ckptd.config import DestinationConfig

__all__ = [
    "ConditionalWrite",
    "DestinationURL",
    "LimitedStorage",
    "MultipartUpload",
    "NotFoundError",
    "ObjectInfo",
    "PartInfo",
    "PartListing",
    "PreconditionFailedError",
    "RateLimiter",
    "RetryingStorage",
    "ServerSideCopy",
    "ShortObjectError",
    "Storage",
    "StorageError",
    "StorageWrapper",
    "StoreChecksums",
    "capability",
    "open_backend",
    "open_destination",
    "open_storage",
    "parse_destination",
    "require_capability",
]


def open_backend(
    url: str,
    *,
    endpoint_url: str = "",
    region: str = "",
    max_connections: int = 10,
    sse: str = "",
    sse_kms_key_id: str = "",
    read_timeout: float | None = None,
) -> Storage:
    """The bare backend for ``s3://bucket/prefix``, ``gs://bucket/prefix``,
    ``az://container/prefix`` or ``file:///path``; ValueError for a URL that configuration
    would refuse (or server-side encryption asked of file://). For gs://,
    ``sse_kms_key_id`` is the Cloud KMS key (``kmsKeyName``), for az:// the encryption
    scope, and ``sse`` must be empty. ``read_timeout`` (seconds; s3:// only, None = the
    client's 60 s) is how long one request waits for the store's answer: ``ckptd doctor``
    shortens it, so a store that accepts connections and never answers costs it seconds."""
    try:
        parsed = parse_destination(url)
    except ValueError as exc:
        raise ValueError(f"unsupported destination {url!r}: {exc}") from None
    if parsed.root is not None:
        from ckptd.storage.fs import FileStorage

        if sse or sse_kms_key_id:
            raise ValueError(f"server-side encryption applies to s3:// only, not {url!r}")
        return FileStorage(parsed.root)
    if parsed.kind == "gs":
        from ckptd.storage.gcs import GCSStorage

        if sse:
            raise ValueError(
                f"sse applies to s3:// only; for {url!r} set sse_kms_key_id to a Cloud KMS key"
            )
        return GCSStorage(
            parsed.bucket,
            parsed.prefix,
            endpoint_url=endpoint_url,
            max_connections=max_connections,
            kms_key_name=sse_kms_key_id,
        )
    if parsed.kind == "az":
        from ckptd.storage.azure import AzureBlobStorage

        if sse:
            raise ValueError(
                f"sse applies to s3:// only; for {url!r} set sse_kms_key_id to an encryption scope"
            )
        return AzureBlobStorage(
            parsed.bucket,
            parsed.prefix,
            endpoint_url=endpoint_url,
            max_connections=max_connections,
            encryption_scope=sse_kms_key_id,
        )
    from ckptd.storage.s3 import READ_TIMEOUT_SECONDS, S3Storage

    return S3Storage(
        parsed.bucket,
        parsed.prefix,
        endpoint_url=endpoint_url,
        region=region,
        max_connections=max_connections,
        timeout_seconds=READ_TIMEOUT_SECONDS if read_timeout is None else read_timeout,
        sse=sse,
        sse_kms_key_id=sse_kms_key_id,
    )


def open_storage(
    url: str,
    *,
    endpoint_url: str = "",
    region: str = "",
    concurrency: int = 8,
    max_upload_bytes_per_s: float = 0,
    max_attempts: int = 8,
    on_retry: RetryHook | None = None,
    stop: threading.Event | None = None,
    limiter: RateLimiter | None = None,
    sse: str = "",
    sse_kms_key_id: str = "",
    read_timeout: float | None = None,
) -> RetryingStorage:
    """The backend with the node-wide bandwidth cap inside and retries outside, so a
    retried part pays for its bandwidth again (``read_timeout``: ``open_backend``)."""
    backend = open_backend(
        url,
        endpoint_url=endpoint_url,
        region=region,
        # The large files' threads and the small files' lanes (``ckptd.core.concurrency``)
        # each hold a connection; a pool smaller than that drops and reopens them.
        max_connections=concurrency + lanes_for(concurrency) + 4,
        sse=sse,
        sse_kms_key_id=sse_kms_key_id,
        read_timeout=read_timeout,
    )
    limited: Storage = LimitedStorage(backend, limiter or RateLimiter(max_upload_bytes_per_s))
    return RetryingStorage(limited, max_attempts=max_attempts, on_retry=on_retry, stop=stop)


def open_destination(
    dest: DestinationConfig,
    *,
    concurrency: int | None = None,
    limit_uploads: bool = False,
    on_retry: RetryHook | None = None,
    stop: threading.Event | None = None,
    read_timeout: float | None = None,
) -> RetryingStorage:
    """The storage stack for a configured destination (its url must be set).
    ``concurrency`` overrides the configured one; ``limit_uploads`` applies the node-wide
    ``max_upload_mib_per_s``, which the daemon does and the CLI's commands do not;
    ``read_timeout`` shortens an s3:// request's wait for an answer (``open_backend``)."""
    return open_storage(
        dest.url,
        endpoint_url=dest.endpoint_url,
        region=dest.region,
        concurrency=dest.concurrency if concurrency is None else concurrency,
        max_upload_bytes_per_s=dest.max_upload_mib_per_s * 1024 * 1024 if limit_uploads else 0,
        max_attempts=dest.max_attempts,
        on_retry=on_retry,
        stop=stop,
        sse=dest.sse,
        sse_kms_key_id=dest.sse_kms_key_id,
        read_timeout=read_timeout,
    )
